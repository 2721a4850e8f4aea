#!/bin/bash
# Session 13, second device call: the trace probe (split vs XLA residual), then the lat_add kernels'
# tests and the refine tests compiled on the GPU.
export PYTHONPATH=$PWD
timeout 330 python3 benchmarks/results/2026-12-03-s13/probe_split.py $OUT/split.jsonl 2>&1 | grep -v -i warn
timeout 230 python3 -m pytest -q -n 8 tests/test_latent_sum.py tests/test_kernel_topc_pick.py \
  tests/test_kernel_full_vocab.py tests/test_token_table.py > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
