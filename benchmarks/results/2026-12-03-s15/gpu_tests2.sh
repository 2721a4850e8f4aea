#!/bin/bash
# Session 15, second compiled test run: test_early_exit again (after the passes_to_fixed_point fix), then the files
# whose paths the selection's finish warps reach (certified, exact, sharded, top-C rule, pruned ...).
export PYTHONPATH=$PWD
timeout 450 python3 -m pytest -q -n 8 tests/test_early_exit.py tests/test_certified.py tests/test_exact.py \
  tests/test_sharded.py tests/test_topc_rule.py tests/test_token_table.py tests/test_kernel_shapes.py \
  tests/test_pruned.py tests/test_latent_sum.py > $OUT/gpu_tests2.log 2>&1
tail -4 $OUT/gpu_tests2.log
