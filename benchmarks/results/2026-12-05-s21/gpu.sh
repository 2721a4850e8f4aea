#!/bin/bash
# Session 21's device calls: bash benchmarks/results/2026-12-05-s21/gpu.sh keep|...
export PYTHONPATH=$PWD
D=benchmarks/results/2026-12-05-s21
CONC="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
case "$1" in
  keep) XLA_FLAGS=$CONC timeout 560 python3 $D/probe_keep.py $OUT/keep.jsonl 2>&1 | grep -v -i warn | tail -40
        cp $OUT/keep.jsonl.trace $OUT/keep_trace.jsonl 2>/dev/null ;;
  keep2) XLA_FLAGS=$CONC timeout 560 python3 $D/probe_keep2.py $OUT/keep2.jsonl 2>&1 | grep -v -i warn | tail -40 ;;
  tests) XLA_FLAGS=$CONC XPRESS_SLOW=1 timeout 570 python3 -m pytest -q -n 8 -k "not Interpret" tests/test_kernel_full_vocab.py \
           tests/test_kernel_topc_pick.py tests/test_latent_sum.py tests/test_dispatch.py tests/test_token_table.py \
           tests/test_refine.py tests/test_backends.py > $OUT/gpu_tests.log 2>&1
         tail -3 $OUT/gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -20 ;;
  bench) timeout 560 python3 -m benchmarks.bench_refine --backends pallas@table --n 1,4,16,64 --topc 512,0 \
           --walls 50 --no-select --out $OUT 2>&1 | grep -v -i warn | tail -14 ;;
  *) echo "usage: gpu.sh keep|keep2|tests|bench" >&2; exit 2 ;;
esac
