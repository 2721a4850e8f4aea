#!/bin/bash
# Session 12, second device call: the latent variants (v2), bench_refine with and without the token
# table, the token-table and serving tests compiled on the GPU.
export PYTHONPATH=$PWD
D=benchmarks/results/2026-12-03-s12
PROBE_V2=1 python3 $D/probe_latent.py $OUT/latent2.jsonl 2>&1 | grep -v -i warn | tail -8
python3 -m benchmarks.bench_refine --backends pallas,pallas@table --n 1,4,16,64,256 --topc 512,0 --walls 50 \
  --no-select --out $OUT/bench 2>&1 | grep -v -i warn | tail -3
python3 -m pytest -q -n 4 tests/test_token_table.py tests/test_serving.py tests/test_bench_smoke.py > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
cat $OUT/bench/bench.md
