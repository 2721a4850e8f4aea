#!/bin/bash
# Session 13, first device call: the residual inside the picks (split latent) against XLA's residual
# kernel, same run, with the token table (RefineServer's default); N=128 checks the table's dispatch rule.
export PYTHONPATH=$PWD
timeout 560 python3 -m benchmarks.bench_refine --backends pallas-xlares@table,pallas@table --n 1,4,16,64,128 \
  --topc 512,0 --walls 20 --reps 3 --no-select --out $OUT/bench 2>&1 | grep -v -i warn | tail -2
cat $OUT/bench/bench.md | tail -11
