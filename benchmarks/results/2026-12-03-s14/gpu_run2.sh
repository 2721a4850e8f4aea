#!/bin/bash
# Session 14, second device call: top-C pick configs inside refine at N = 1, 4, 16 (probe_pick_configs.py).
export PYTHONPATH=$PWD
R=benchmarks/results/2026-12-03-s14
timeout 540 python3 $R/probe_pick_configs.py $OUT/pick_configs.jsonl 1,4,16 2>&1 | grep -v -i warn | tail -45
