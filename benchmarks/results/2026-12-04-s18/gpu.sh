#!/bin/bash
# Eighteenth session's device calls, one each:
#   bash benchmarks/results/2026-12-04-s18/gpu.sh tests_b|tests_a|bench|start
# tests_a / tests_b: the suite compiled on the GPU in two halves (XPRESS_SLOW=1) with the scheduling mode
#   CONCURRENT for every executable (XLA_FLAGS; the library passes it only where it compiles itself).
# bench: bench_refine of the shipped code, each backend with xpress_jax.compiler_options() and XLA's defaults.
# start: session 16's probe_start.py (not run before).
export PYTHONPATH=$PWD
S16=benchmarks/results/2026-12-03-s16
A="tests/test_kernel_full_vocab.py tests/test_kernel_select.py tests/test_kernel_topc_pick.py tests/test_kernel_latent.py
   tests/test_kernel_shapes.py tests/test_dispatch.py tests/test_pruned.py tests/test_certified.py tests/test_latent_sum.py"
CONC="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
case "$1" in
  tests_a) XLA_FLAGS=$CONC XPRESS_SLOW=1 timeout 560 python3 -m pytest -q -n 8 $A > $OUT/gpu_tests_a.log 2>&1
           tail -3 $OUT/gpu_tests_a.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_a.log | head -20 ;;
  tests_b) XLA_FLAGS=$CONC XPRESS_SLOW=1 timeout 570 python3 -m pytest -q -n 8 tests $(for f in $A; do echo --ignore=$f; done) \
             > $OUT/gpu_tests_b.log 2>&1
           tail -3 $OUT/gpu_tests_b.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_b.log | head -20 ;;
  bench) timeout 580 python3 -m benchmarks.bench_refine --backends pallas@table --xla-options both \
           --n 1,4,16,64,256 --topc 512,0 --walls 50 --no-select --out $OUT 2>&1 | grep -v -i warn | tail -14 ;;
  start) timeout 560 python3 $S16/probe_start.py $OUT/start.jsonl 2>&1 | grep -v -i warn | tail -30 ;;
  walls3|start2|bench2|mixer) ;;
  *) echo "usage: gpu.sh tests_a|tests_b|bench|start|walls3" >&2; exit 2 ;;
esac
# Added: walls = probe_server_walls.py, then start, then test_serving + test_compile_options again (after a fix).
if [ "$1" = walls3 ]; then
  timeout 200 python3 benchmarks/results/2026-12-04-s18/probe_server_walls.py $OUT/server_walls.jsonl 2>&1 | grep -v -i warn | tail -8
  timeout 200 python3 $S16/probe_start.py $OUT/start.jsonl 2>&1 | grep -v -i warn | tail -24
  XLA_FLAGS=$CONC timeout 150 python3 -m pytest -q -n 4 tests/test_serving.py tests/test_compile_options.py > $OUT/gpu_tests_serving.log 2>&1
  tail -2 $OUT/gpu_tests_serving.log
fi
if [ "$1" = start2 ]; then
  XLA_FLAGS=$CONC timeout 400 python3 benchmarks/results/2026-12-04-s18/probe_start2.py $OUT/start2.jsonl 2>&1 | grep -v -i warn | tail -12
fi
if [ "$1" = bench2 ]; then  # the shipped code after the full-vocab start change: what the README quotes
  timeout 400 python3 -m benchmarks.bench_refine --backends pallas@table,pallas --n 1,4,16,64,128,256 --topc 512,0 \
    --walls 50 --no-select --out $OUT 2>&1 | grep -v -i warn | tail -16
fi
if [ "$1" = mixer ]; then  # the sixteenth session's mixer barrier probe, again under the shipped scheduling mode
  XLA_FLAGS=$CONC timeout 300 python3 $S16/probe_mixer.py $OUT/mixer.jsonl 2>&1 | grep -v -i warn | tail -14
fi
