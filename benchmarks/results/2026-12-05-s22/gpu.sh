#!/bin/bash
# Session 22's device calls: bash benchmarks/results/2026-12-05-s22/gpu.sh keep2bench|tests|bench|cert
export PYTHONPATH=$PWD
S21=benchmarks/results/2026-12-05-s21
CONC="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
T0=$SECONDS
bench() {  # the served state, both modes, with a token table; bounded by what is left of the call
  left=$((585 - (SECONDS - T0)))
  [ $left -gt 60 ] || { echo "no time left for bench"; return; }
  timeout $left python3 -m benchmarks.bench_refine --backends pallas@table --n 1,4,16,64 --topc 512,0 \
    --walls 50 --no-select --out $OUT/bench 2>&1 | grep -v -i warn | tail -14
}
case "$1" in
  keep2bench) XLA_FLAGS=$CONC timeout 420 python3 $S21/probe_keep2.py $OUT/keep2.jsonl 2>&1 | grep -v -i warn | tail -30
              echo "keep2 took $((SECONDS - T0)) s"; bench ;;
  tests) XLA_FLAGS=$CONC XPRESS_SLOW=1 timeout 570 python3 -m pytest -q -n 8 -k "not Interpret" tests/test_kernel_full_vocab.py \
           tests/test_kernel_topc_pick.py tests/test_latent_sum.py tests/test_dispatch.py tests/test_token_table.py \
           tests/test_refine.py tests/test_backends.py > $OUT/gpu_tests.log 2>&1
         tail -3 $OUT/gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -20 ;;
  bench) bench ;;
  cert) for std in 0.06 0.01; do  # issue 14: the certified mode against the scan and top-512, today's code
          left=$((585 - (SECONDS - T0))); [ $left -gt 60 ] || break
          timeout $left python3 -m benchmarks.bench_refine --backends pallas@table,pallas@certified-table \
            --n 1,16,64,256 --topc 512,0 --std $std --walls 5 --no-select --out $OUT/cert_std$std 2>&1 \
            | grep -v -i warn | tail -14
        done ;;
  *) echo "usage: gpu.sh keep2bench|tests|bench|cert" >&2; exit 2 ;;
esac
