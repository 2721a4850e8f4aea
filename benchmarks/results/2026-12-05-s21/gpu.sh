#!/bin/bash
# Session 21's device calls: bash benchmarks/results/2026-12-05-s21/gpu.sh keep|...
export PYTHONPATH=$PWD
D=benchmarks/results/2026-12-05-s21
CONC="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
case "$1" in
  keep) XLA_FLAGS=$CONC timeout 560 python3 $D/probe_keep.py $OUT/keep.jsonl 2>&1 | grep -v -i warn | tail -40
        cp $OUT/keep.jsonl.trace $OUT/keep_trace.jsonl 2>/dev/null ;;
  keep2) XLA_FLAGS=$CONC timeout 560 python3 $D/probe_keep2.py $OUT/keep2.jsonl 2>&1 | grep -v -i warn | tail -40 ;;
  *) echo "usage: gpu.sh keep|keep2" >&2; exit 2 ;;
esac
