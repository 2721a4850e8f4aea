#!/bin/bash
# Session 28's device calls: bash benchmarks/results/2026-12-07-s28/gpu.sh MODE
# fvsplit: probe_fvsplit.py at N=1 (the residual inside a held-latent full-vocab pick; issue 16).
# tests_a / tests_b: the whole suite compiled on the GPU in two halves (XPRESS_SLOW=1, CONCURRENT), as session 27.
# bench: bench_refine, the served Pallas backend with a token table, full vocab and top-512, N = 1, 4, 16.
# one: the N=1 probe, compiled kernel tests, top-512 N=16 split, N=4 (run 1); ship: bench + 7 test files (run 5);
# confirm: not run this session (no H200); run in session 29, which got an H100 again (results in ../2026-12-07-s29/):
#   the N=1 full-vocab configs (probe_n1_configs.py), bench_refine at N = 1, 16, then test_train +
#   test_bench_kernels_smoke compiled while time is left.
case "$1" in  # the two halves of the suite: session 27's modes, the same commands
  tests_a|tests_b) exec bash benchmarks/results/2026-12-06-s27/gpu.sh "$1" ;;
esac
export PYTHONPATH=$PWD
S28=benchmarks/results/2026-12-07-s28
CONC="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
T0=$SECONDS
left() { echo $((${CAP:-585} - (SECONDS - T0))); }  # CAP: seconds this call may take
nvidia-smi --query-gpu=name --format=csv,noheader
case "$1" in
  fvsplit) timeout $(left) python3 $S28/probe_fvsplit.py $OUT/fvsplit.jsonl ${NS:-1} 2>&1 | grep -v -i warn | tail -40 ;;
  bench) timeout $(left) python3 -m benchmarks.bench_refine --backends pallas@table --n ${NS:-1,4,16} --topc 512,0 \
           --walls 5 --no-select --out $OUT/bench 2>&1 | grep -v -i warn | tail -12 ;;
  one) # everything in one call (machines were scarce): the N=1 probe (7 variants), the kernel's compiled tests,
       # then top-512 N=16 split (probe_topc_split.py) and N=4 while time is left
       ONLY=h128x3k64s3,h128x3k64s3+s,h128x3k0s2+s,h64x6k64s4+s,h128x3k64s3/k+s timeout $(( $(left) - 200 )) \
         python3 $S28/probe_fvsplit.py $OUT/fvsplit_n1.jsonl 1 2>&1 | grep -v -i warn | tail -12
       echo "probe took $((SECONDS - T0)) s"
       timeout $(( $(left) - 60 )) python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_latent_sum.py \
         tests/test_kernel_full_vocab.py > $OUT/gpu_tests_fv.log 2>&1
       tail -2 $OUT/gpu_tests_fv.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_fv.log | head -10
       echo "tests done at $((SECONDS - T0)) s"
       [ $(left) -gt 80 ] && timeout $(left) python3 $S28/probe_topc_split.py $OUT/topc_split.jsonl 16 2>&1 \
         | grep -v -i warn | tail -3
       [ $(left) -gt 100 ] && ONLY=h64x6k64s3+s,h64x6k0s2+s timeout $(left) python3 $S28/probe_fvsplit.py \
         $OUT/fvsplit_n4.jsonl 4 2>&1 | grep -v -i warn | tail -6 ;;
  ship) # the N=1 held config as served: bench_refine at N = 1, 4, 16, then the compiled tests of the files it touches
       timeout 200 python3 -m benchmarks.bench_refine --backends pallas@table --n ${NS:-1,4,16} --topc 512,0 \
         --walls 5 --no-select --out $OUT/bench 2>&1 | grep -v -i warn | tail -8
       echo "bench took $((SECONDS - T0)) s"
       XLA_FLAGS=$CONC timeout $(left) python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_dispatch.py \
         tests/test_kernel_full_vocab.py tests/test_refine.py tests/test_certified.py tests/test_token_table.py \
         tests/test_latent_sum.py tests/test_backends.py > $OUT/gpu_tests_ship.log 2>&1
       tail -2 $OUT/gpu_tests_ship.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_ship.log | head -10 ;;
  confirm) timeout 160 python3 $S28/probe_n1_configs.py $OUT/n1_configs.jsonl 2>&1 | grep -v -i warn | tail -10
           echo "probe took $((SECONDS - T0)) s"
           timeout 200 python3 -m benchmarks.bench_refine --backends pallas@table --n 1,16 --topc 512,0 --walls 5 \
             --no-select --out $OUT/bench 2>&1 | grep -v -i warn | tail -6
           echo "bench done at $((SECONDS - T0)) s"
           [ $(left) -gt 60 ] && XLA_FLAGS=$CONC XPRESS_SLOW=1 timeout $(left) python3 -m pytest -q -n 8 \
             -p no:cacheprovider tests/test_train.py tests/test_bench_kernels_smoke.py > $OUT/gpu_tests_rest.log 2>&1
           tail -2 $OUT/gpu_tests_rest.log 2>/dev/null ;;
  *) echo "usage: gpu.sh fvsplit|tests_a|tests_b|bench|one|ship|confirm" >&2; exit 2 ;;
esac
