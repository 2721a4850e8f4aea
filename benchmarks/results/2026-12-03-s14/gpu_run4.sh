#!/bin/bash
# Session 14, fourth device call: after the dispatch change (one candidate tile per top-C program up to
# 960 draft rows), the new served configs against the old one from N=32 up; then compiled tests.
export PYTHONPATH=$PWD
R=benchmarks/results/2026-12-03-s14
timeout 200 python3 $R/probe_pick_configs.py $OUT/pick_configs3.jsonl 32,64,128,256 sweep3 2>&1 | grep -v -i warn | tail -24
timeout 340 python3 -m pytest -q -n 8 tests/test_dispatch.py tests/test_kernel_topc_pick.py tests/test_refine.py \
  tests/test_certified.py tests/test_kernel_shapes.py tests/test_latent_sum.py tests/test_token_table.py > $OUT/gpu_tests_a.log 2>&1
tail -3 $OUT/gpu_tests_a.log
