#!/bin/bash
# Session 15: the test files the changes touch, compiled on the H200 (XPRESS_SLOW=1: the slow cases too).
export PYTHONPATH=$PWD
XPRESS_SLOW=1 timeout 540 python3 -m pytest -q -n 8 tests/test_kernel_full_vocab.py tests/test_dispatch.py \
  tests/test_refine.py tests/test_kernel_select.py tests/test_backends.py tests/test_early_exit.py \
  tests/test_serving.py > $OUT/gpu_tests.log 2>&1
tail -4 $OUT/gpu_tests.log
