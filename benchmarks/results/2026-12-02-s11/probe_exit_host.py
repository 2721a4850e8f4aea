"""Issue 16, session 11: early exit and pinned-host output together, on the H200.

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02-s11/probe_exit_host.py OUT.jsonl

Serving shapes, bf16, K=6, Pallas, synthetic head std 0.02. Per (N, mode, early_exit): device µs per
refine (chained), one call's wall to the tokens in numpy with the output in pinned host memory (median of
100, best of 3 rounds), tokens that differ from early_exit=False.
"""
import json, os, statistics, sys, time

import jax, numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chain_length, chained, make_problem, time_device

SMALL = os.environ.get("PROBE_SMALL")
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=1001, hidden_size=64, rank=24, mlp_hidden=40, topc=17)
                       if SMALL else SERVING))
backend = "xla" if SMALL else "pallas"
out = open(sys.argv[1], "a")
host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
for n in (1, 16):
    prob = make_problem(cfg, n, std=0.02)
    for topc in (cfg.topc, 0):
        first = None
        for ee in (False, True):
            def fn(p, l, h, a, topc=topc, ee=ee):
                return xj.refine(p, l, h, a, config=cfg, topc=topc, backend=backend, early_exit=ee)
            exe = jax.jit(fn, out_shardings=host)
            tok = np.asarray(exe(*prob))
            first = tok if first is None else first
            rounds = []
            for _ in range(3):
                ts = []
                for _ in range(5 if SMALL else 100):
                    t0 = time.perf_counter(); np.asarray(exe(*prob)); ts.append(time.perf_counter() - t0)
                rounds.append(statistics.median(ts) * 1e6)
            m = 2 if SMALL else chain_length(n, topc, "pallas")
            dev = time_device(chained(cfg, m, refine_fn=fn), prob, 5) / m * 1e6
            row = dict(N=n, topc=topc, early_exit=ee, device_us=round(dev, 1), wall_host_us=[round(r, 1) for r in rounds],
                       differ=int((tok != first).sum()))
            out.write(json.dumps(row) + "\n"); out.flush()
            print(f"N={n:3d} topc={topc:3d} early_exit={ee!s:5s} device {dev:7.1f} wall to numpy (host out) "
                  f"{min(rounds):7.1f} differ {row['differ']}", flush=True)
