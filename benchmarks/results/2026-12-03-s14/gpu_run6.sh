#!/bin/bash
# Session 14, sixth device call: full-vocab pick configs inside refine at N = 1 and 4.
export PYTHONPATH=$PWD
timeout 200 python3 benchmarks/results/2026-12-03-s14/probe_fv_configs.py $OUT/fv_configs.jsonl 2>&1 | grep -v -i warn | tail -30
