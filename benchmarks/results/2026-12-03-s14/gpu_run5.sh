#!/bin/bash
# Session 14, fifth device call: the shipped dispatch (one candidate tile per top-C program at every N)
# through bench_refine with its agreement check, then more compiled test files.
export PYTHONPATH=$PWD
timeout 170 python3 -m benchmarks.bench_refine --backends pallas@table,pallas --n 1,4,16,64,256 --topc 512 \
  --walls 10 --reps 3 --out $OUT/bench 2>&1 | grep -v -i warn | tail -1
tail -7 $OUT/bench/bench.md
timeout 250 python3 -m pytest -q -n 8 tests/test_dispatch.py tests/test_backends.py tests/test_serving.py \
  tests/test_early_exit.py tests/test_sharded.py tests/test_topc_rule.py tests/test_exact.py > $OUT/gpu_tests_b.log 2>&1
tail -3 $OUT/gpu_tests_b.log
