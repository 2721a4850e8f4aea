#!/bin/bash
# Session 27's device calls: bash benchmarks/results/2026-12-06-s27/gpu.sh tests_a|tests_b|...
# tests_a / tests_b: the whole suite compiled on the GPU in two halves (XPRESS_SLOW=1), with the scheduling mode
#   CONCURRENT for every executable, as the eighteenth session ran it; the first such run since the counted pick.
# scan: the counted one-launch scan (probe_scan.py) at N = 16, 64 where every row certifies (std 0.01), then
#   tests_a; scan2: the same where pruning fails (std 0.06), then tests_b.
# bench14: issue 14's run, bench_refine: top-512, the scan and the certified mode at N = 1..256 where every row
#   certifies (std 0.01) and at N = 1, 16, 256 where pruning fails (std 0.06).
export PYTHONPATH=$PWD
S27=benchmarks/results/2026-12-06-s27
A="tests/test_kernel_full_vocab.py tests/test_kernel_select.py tests/test_kernel_topc_pick.py tests/test_kernel_latent.py
   tests/test_kernel_shapes.py tests/test_dispatch.py tests/test_pruned.py tests/test_certified.py tests/test_latent_sum.py"
CONC="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
T0=$SECONDS
left() { echo $((${CAP:-585} - (SECONDS - T0))); }  # CAP: seconds this call may take
nvidia-smi --query-gpu=name --format=csv,noheader
case "$1" in
  tests_a) XLA_FLAGS=$CONC XPRESS_SLOW=1 timeout $(left) python3 -m pytest -q -n 8 -p no:cacheprovider $A \
             > $OUT/gpu_tests_a.log 2>&1
           tail -3 $OUT/gpu_tests_a.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_a.log | head -20 ;;
  tests_b) XLA_FLAGS=$CONC XPRESS_SLOW=1 timeout $(left) python3 -m pytest -q -n 8 -p no:cacheprovider tests \
             $(for f in $A; do echo --ignore=$f; done) > $OUT/gpu_tests_b.log 2>&1
           tail -3 $OUT/gpu_tests_b.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_b.log | head -20 ;;
  scan) timeout 200 python3 $S27/probe_scan.py $OUT/scan_std0.01.jsonl 16,64 0.01 2>&1 | grep -v -i warn | tail -2
        echo "probe took $((SECONDS - T0)) s"
        XLA_FLAGS=$CONC XPRESS_SLOW=1 timeout $(left) python3 -m pytest -q -n 8 -p no:cacheprovider $A \
          > $OUT/gpu_tests_a.log 2>&1
        tail -2 $OUT/gpu_tests_a.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_a.log | head -20 ;;
  scan2) timeout 150 python3 $S27/probe_scan.py $OUT/scan_std0.06.jsonl 16,64 0.06 2>&1 | grep -v -i warn | tail -2
         echo "probe took $((SECONDS - T0)) s"
         XLA_FLAGS=$CONC XPRESS_SLOW=1 timeout $(left) python3 -m pytest -q -n 8 -p no:cacheprovider tests \
           $(for f in $A; do echo --ignore=$f; done) > $OUT/gpu_tests_b.log 2>&1
         tail -2 $OUT/gpu_tests_b.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_b.log | head -20 ;;
  bench14) for spec in "0.01 1,4,16,64,256" "0.06 1,16,256"; do  # issue 14's run: certified vs scan vs top-512
             set -- $spec
             [ $(left) -gt 90 ] || break
             timeout $(left) python3 -m benchmarks.bench_refine --backends pallas@table,pallas@certified-table \
               --n $2 --topc 512,0 --std $1 --walls 5 --no-select --out $OUT/bench14_std$1 2>&1 | grep -v -i warn | tail -12
           done ;;
  *) echo "usage: gpu.sh tests_a|tests_b|scan|scan2|bench14" >&2; exit 2 ;;
esac
