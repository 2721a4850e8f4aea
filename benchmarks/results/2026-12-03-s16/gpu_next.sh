#!/bin/bash
# Prepared in session 16 for the next device session (not run yet). One device call each:
#   bash benchmarks/results/2026-12-03-s16/gpu_next.sh start|tests_a|tests_b
# start: probe_start.py (the full-vocab start through the Pallas selection; traces at N=64, 256).
# tests_a / tests_b: the whole suite compiled on the GPU in two halves (XPRESS_SLOW=1), which this session ran
# only in parts (h200_run4, h200_run10).
export PYTHONPATH=$PWD
R=benchmarks/results/2026-12-03-s16
A="tests/test_kernel_full_vocab.py tests/test_kernel_select.py tests/test_kernel_topc_pick.py tests/test_kernel_latent.py
   tests/test_kernel_shapes.py tests/test_dispatch.py tests/test_pruned.py tests/test_certified.py tests/test_latent_sum.py"
case "$1" in
  start) timeout 560 python3 $R/probe_start.py $OUT/start.jsonl 2>&1 | grep -v -i warn | tail -30 ;;
  tests_a) XPRESS_SLOW=1 timeout 560 python3 -m pytest -q -n 8 $A > $OUT/gpu_tests_a.log 2>&1
           tail -3 $OUT/gpu_tests_a.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_a.log | head -20 ;;
  tests_b) XPRESS_SLOW=1 timeout 560 python3 -m pytest -q -n 8 tests $(for f in $A; do echo --ignore=$f; done) \
             > $OUT/gpu_tests_b.log 2>&1
           tail -3 $OUT/gpu_tests_b.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_b.log | head -20 ;;
  *) echo "usage: gpu_next.sh start|tests_a|tests_b" >&2; exit 2 ;;
esac
