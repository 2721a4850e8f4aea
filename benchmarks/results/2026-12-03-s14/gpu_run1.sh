#!/bin/bash
# Session 14, first device call: the counted top-C pick compiled (its tests, the race stress), then the
# shipped dispatch (counted) against the combine launch in one bench_refine run, then the trace probe.
export PYTHONPATH=$PWD
R=benchmarks/results/2026-12-03-s14
XPRESS_SLOW=1 timeout 150 python3 -m pytest -q -n 8 tests/test_counted_pick.py > $OUT/t_counted.log 2>&1
tail -3 $OUT/t_counted.log
timeout 200 python3 -m benchmarks.bench_refine --backends pallas-combine@table,pallas@table,pallas-combine,pallas \
  --n 1,4,16,64 --topc 512 --walls 20 --reps 3 --no-select --out $OUT/bench 2>&1 | grep -v -i warn | tail -1
tail -10 $OUT/bench/bench.md
timeout 150 python3 $R/probe_counted.py $OUT/probe.jsonl 2>&1 | grep -v -i warn | tail -30
