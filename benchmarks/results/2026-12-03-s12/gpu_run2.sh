#!/bin/bash
# Session 12, last device call: with a table the latent is XLA's up to 1920 draft rows (N=128): bench at
# N=128; the token-table, serving and dispatch tests compiled on the GPU; benchmarks.serving_loop.
export PYTHONPATH=$PWD
python3 -m benchmarks.bench_refine --backends pallas,pallas@table --n 128 --topc 512,0 --walls 20 \
  --no-select --reps 3 --out $OUT/bench 2>&1 | grep -v -i warn | tail -2
python3 -m pytest -q -n 8 tests/test_token_table.py tests/test_serving.py tests/test_dispatch.py > $OUT/gpu_tests.log 2>&1
tail -2 $OUT/gpu_tests.log
python3 -m benchmarks.serving_loop --n 1,16 --topc 512 --steps 40 --rounds 2 --out $OUT/loop 2>&1 | grep -v -i warn | tail -7
tail -3 $OUT/bench/bench.md
