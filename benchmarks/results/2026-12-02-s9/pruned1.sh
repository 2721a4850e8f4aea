#!/bin/bash
# Session 9 (2026-12-02), first look at full_vocab="pruned" on the H200: std 0.04 (strong refinement, the
# issue's regime) and 0.02, N = 1 / 16 / 256, against the scan, top-512 and the certified mode.
set -x
for std in 0.04 0.02; do
  python3 -m benchmarks.bench_refine --n 1,16,256 --topc 512,0 --std $std --reps 3 --walls 20 --no-select \
    --backends pallas,pallas@pruned,pallas@pruned-prev,pallas@certified --out $OUT/std$std 2>&1 | grep -v "^{" | tail -12
done
