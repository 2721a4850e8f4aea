#!/bin/bash
# Session 16: the files with the pass-pick paths, compiled on the H200 with skipping on from 240 draft rows
# (XPRESS_SLOW=1: the slow cases too).
export PYTHONPATH=$PWD
XPRESS_SLOW=1 timeout 560 python3 -m pytest -q -n 8 tests/test_kernel_full_vocab.py tests/test_dispatch.py \
  tests/test_refine.py tests/test_early_exit.py tests/test_backends.py tests/test_exact.py \
  tests/test_kernel_topc_pick.py tests/test_kernel_shapes.py tests/test_serving.py > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -20
