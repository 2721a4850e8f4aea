#!/bin/bash
# Session 24's device calls: bash benchmarks/results/2026-12-06-s24/gpu.sh cert|tests
export PYTHONPATH=$PWD
S24=benchmarks/results/2026-12-06-s24
T0=$SECONDS
left() { echo $((585 - (SECONDS - T0))); }
case "$1" in
  cert) nvidia-smi --query-gpu=name --format=csv,noheader  # gpu.sh cert STD N,N,... [SECONDS] then the tests if time is left
        timeout ${4:-400} python3 $S24/probe_cert.py $OUT/cert_std$2.jsonl $3 $2 2>&1 | grep -v -i warn | tail -14
        echo "probe took $((SECONDS - T0)) s"
        [ $(left) -gt 120 ] || exit 0
        # the changed kernels and modes compiled
        timeout $(left) python3 -m pytest -q -n 8 -k "not Interpret" tests/test_certified.py tests/test_kernel_full_vocab.py \
          tests/test_exact.py > $OUT/gpu_tests.log 2>&1
        tail -3 $OUT/gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -20 ;;
  tests) nvidia-smi --query-gpu=name --format=csv,noheader
        XPRESS_SLOW=1 timeout $(left) python3 -m pytest -q -n 8 -k "not Interpret" tests/test_certified.py \
          tests/test_kernel_full_vocab.py tests/test_exact.py tests/test_dispatch.py tests/test_serving.py \
          tests/test_refine.py > $OUT/gpu_tests_all.log 2>&1
        tail -3 $OUT/gpu_tests_all.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_all.log | head -20 ;;
  *) echo "usage: gpu.sh cert|tests" >&2; exit 2 ;;
esac
