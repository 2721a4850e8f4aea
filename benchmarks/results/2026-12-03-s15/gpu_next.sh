#!/bin/bash
# Prepared in session 15 for the next device session (not run yet). One device call each:
#   bash benchmarks/results/2026-12-03-s15/gpu_next.sh skip|skip2|tests|xla
export PYTHONPATH=$PWD
case "$1" in
  skip) timeout 560 python3 benchmarks/results/2026-12-03-s15/probe_skip.py $OUT/skip.jsonl 16,64 2>&1 \
          | grep -v -i warn | tail -20 ;;
  skip2) timeout 560 python3 benchmarks/results/2026-12-03-s15/probe_skip.py $OUT/skip2.jsonl 256,128 2>&1 \
          | grep -v -i warn | tail -20 ;;
  tests) XPRESS_SLOW=1 timeout 560 python3 -m pytest -q -n 8 tests/test_kernel_full_vocab.py tests/test_dispatch.py \
           tests/test_refine.py tests/test_early_exit.py tests/test_backends.py tests/test_exact.py \
           tests/test_kernel_topc_pick.py tests/test_kernel_shapes.py \
           > $OUT/gpu_tests_next.log 2>&1; tail -3 $OUT/gpu_tests_next.log ;;
  xla) bash benchmarks/results/2026-12-03-s14/gpu_next.sh xla ;;
  *) echo "usage: gpu_next.sh skip|skip2|tests|xla" >&2; exit 2 ;;
esac
