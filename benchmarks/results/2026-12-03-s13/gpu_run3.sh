#!/bin/bash
# Session 13, third device call: the shipped dispatch (split latent in top-C passes up to 60 draft rows)
# against the XLA residual, same run; then the changed kernels' and refine's tests compiled on the GPU.
export PYTHONPATH=$PWD
timeout 200 python3 -m benchmarks.bench_refine --backends pallas-xlares@table,pallas@table,pallas-xlares,pallas \
  --n 1,4,16 --topc 512 --walls 20 --reps 3 --no-select --out $OUT/bench 2>&1 | grep -v -i warn | tail -1
tail -4 $OUT/bench/bench.md
timeout 330 python3 -m pytest -q -n 8 tests/test_latent_sum.py tests/test_kernel_topc_pick.py \
  tests/test_token_table.py tests/test_kernel_shapes.py tests/test_refine.py > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
