#!/bin/bash
# Session 29's device calls: bash benchmarks/results/2026-12-07-s29/gpu.sh MODE
# h200: the twenty-eighth session's "confirm", leaner (device starts failed for most of this session): the N=1
#   full-vocab configs (s28's probe_n1_configs.py), then bench_refine at N = 1, 16 (served Pallas, token table,
#   top-512 and full vocab), then test_train + test_bench_kernels_smoke compiled while time is left.
# tests_a / tests_b: the whole suite compiled in two halves (session 27's script, the same commands).
case "$1" in
  tests_a|tests_b) exec bash benchmarks/results/2026-12-06-s27/gpu.sh "$1" ;;
esac
export PYTHONPATH=$PWD
S28=benchmarks/results/2026-12-07-s28
CONC="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
T0=$SECONDS
left() { echo $((${CAP:-585} - (SECONDS - T0))); }  # CAP: seconds this call may take
nvidia-smi --query-gpu=name --format=csv,noheader
case "$1" in
  h200) timeout 160 python3 $S28/probe_n1_configs.py $OUT/n1_configs.jsonl 2>&1 | grep -v -i warn | tail -10
        echo "probe took $((SECONDS - T0)) s"
        timeout 200 python3 -m benchmarks.bench_refine --backends pallas@table --n 1,16 --topc 512,0 --walls 5 \
          --no-select --out $OUT/bench 2>&1 | grep -v -i warn | tail -6
        echo "bench done at $((SECONDS - T0)) s"
        [ $(left) -gt 60 ] && XLA_FLAGS=$CONC XPRESS_SLOW=1 timeout $(left) python3 -m pytest -q -n 8 -p no:cacheprovider \
          tests/test_train.py tests/test_bench_kernels_smoke.py > $OUT/gpu_tests_rest.log 2>&1
        tail -2 $OUT/gpu_tests_rest.log 2>/dev/null ;;
  *) echo "usage: gpu.sh h200|tests_a|tests_b" >&2; exit 2 ;;
esac
