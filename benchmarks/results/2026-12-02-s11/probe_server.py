"""Issue 16, session 11: RefineServer.tokens() with output="device" vs output="host" on the H200.

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02-s11/probe_server.py OUT.jsonl

Serving shapes, bf16, K=6, synthetic head (std 0.02), buckets (1, 16), top-512 and full vocab. Per
server and bucket: one tokens() call's wall (median of 100, 3 interleaved rounds; bucket-sized device
inputs placed once), and whether both servers give the same tokens.
"""
import json, statistics, sys, time

import jax, numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem

out = open(sys.argv[1], "a")
cfg = xj.HeadConfig(**SERVING)
params = make_problem(cfg, 1)[0]
for topc in (512, 0):
    servers = {o: xj.RefineServer(xj.Head(cfg, params), buckets=(1, 16), topc=topc, output=o, progress=False)
               for o in ("device", "host")}
    for n in (1, 16):
        _, logits, h, anchors = make_problem(cfg, n, seed=1)
        toks = {o: s.tokens(logits, h, anchors) for o, s in servers.items()}
        same = bool((toks["device"] == toks["host"]).all())
        res = {o: [] for o in servers}
        for _ in range(3):
            for o, s in servers.items():
                ts = []
                for _ in range(100):
                    t0 = time.perf_counter(); s.tokens(logits, h, anchors); ts.append(time.perf_counter() - t0)
                res[o].append(statistics.median(ts) * 1e6)
        row = dict(N=n, topc=topc, same_tokens=same, **{f"tokens_{o}_us": [round(x, 1) for x in v] for o, v in res.items()})
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"server tokens() N={n:3d} topc={topc:3d} same {same} device {min(res['device']):7.1f} "
              f"host {min(res['host']):7.1f}", flush=True)
