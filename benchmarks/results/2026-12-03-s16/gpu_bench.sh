#!/bin/bash
# Session 16: the shipped state with the final draft slots skipped from 240 draft rows (both modes);
# through bench_refine with its agreement check, both modes, with and without a token table.
export PYTHONPATH=$PWD
timeout 280 python3 -m benchmarks.bench_refine --backends pallas@table,pallas --n 1,4,16,64,128,256 --topc 512 \
  --walls 10 --reps 3 --out $OUT/bench_topc 2>&1 | grep -v -i warn | tail -1
tail -8 $OUT/bench_topc/bench.md
timeout 280 python3 -m benchmarks.bench_refine --backends pallas@table,pallas --n 1,4,16,64,128,256 --topc 0 \
  --walls 10 --reps 3 --no-select --out $OUT/bench_full 2>&1 | grep -v -i warn | tail -1
tail -8 $OUT/bench_full/bench.md
