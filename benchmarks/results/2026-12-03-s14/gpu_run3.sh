#!/bin/bash
# Session 14, third device call: the first sweep's winning pick configs at N = 1..64, 5 rounds.
export PYTHONPATH=$PWD
R=benchmarks/results/2026-12-03-s14
timeout 560 python3 $R/probe_pick_configs.py $OUT/pick_configs2.jsonl 1,2,4,8,16,32,64 sweep2 2>&1 | grep -v -i warn | tail -60
