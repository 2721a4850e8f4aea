#!/bin/bash
# Session 23's device calls: bash benchmarks/results/2026-12-05-s23/gpu.sh keep3|tests|bench|cert
export PYTHONPATH=$PWD
S23=benchmarks/results/2026-12-05-s23
CONC="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
T0=$SECONDS
left() { echo $((585 - (SECONDS - T0))); }
case "$1" in
  keep3) nvidia-smi --query-gpu=name --format=csv,noheader
         XLA_FLAGS=$CONC timeout 330 python3 $S23/probe_keep3.py $OUT/keep3.jsonl 2>&1 | grep -v -i warn | tail -40
         echo "keep3 took $((SECONDS - T0)) s"
         # the kernels' hint paths compiled (they never ran compiled: session 21's device starts failed)
         XLA_FLAGS=$CONC timeout $(left) python3 -m pytest -q -n 8 -k "not Interpret" tests/test_kernel_full_vocab.py \
           tests/test_kernel_topc_pick.py > $OUT/gpu_tests_kernels.log 2>&1
         tail -3 $OUT/gpu_tests_kernels.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_kernels.log | head -20 ;;
  tests) nvidia-smi --query-gpu=name --format=csv,noheader
         XLA_FLAGS=$CONC timeout 150 python3 $S23/probe_keep3.py $OUT/keep3short.jsonl short 2>&1 | grep -v -i warn | tail -12
         XLA_FLAGS=$CONC XPRESS_SLOW=1 timeout 240 python3 -m pytest -q -n 8 -k "not Interpret" tests/test_latent_sum.py \
           tests/test_dispatch.py tests/test_token_table.py tests/test_refine.py tests/test_backends.py > $OUT/gpu_tests.log 2>&1
         tail -3 $OUT/gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -20
         timeout $(left) python3 -m benchmarks.bench_refine --backends pallas@table --n 1,4,8,16,64 --topc 512,0 \
           --walls 50 --no-select --out $OUT/bench 2>&1 | grep -v -i warn | tail -14 ;;
  cert) for std in 0.06 0.01; do  # issue 14: the certified mode against the scan and top-512, today's code
          [ $(left) -gt 60 ] || break
          timeout $(left) python3 -m benchmarks.bench_refine --backends pallas@table,pallas@certified-table \
            --n 1,16,64,256 --topc 512,0 --std $std --walls 5 --no-select --out $OUT/cert_std$std 2>&1 \
            | grep -v -i warn | tail -14
        done ;;
  *) echo "usage: gpu.sh keep3|tests|cert" >&2; exit 2 ;;
esac
