"""One served call's wall time with and without `xpress_jax.compiler_options()` (eighteenth session).

`RefineServer` now compiles with the options by default (on a GPU: the CUDA graph's scheduling mode
CONCURRENT). The seventeenth session's probe measured one AOT call of a served refine (154.9 vs 169.8 µs at
N=1 top-512); this measures the server itself: ``server(logits, h, anchors, prev_ids)`` + block_until_ready
(inputs placed beforehand, as a server with persistent buffers has them), median of 200 calls, 3 interleaved
rounds, servers with compiler_options=None (the default) and {} (XLA's defaults), buckets 1 and 16, top-512 and
full vocabulary. Also each server's tokens against the other's (0 must differ). Prediction: the wall falls
with the device time (-8..-11 µs at N=1 top-512, -20..-26 at N=16), full vocab unchanged.
JSON lines to argv[1].  Run: PYTHONPATH=$PWD python3 benchmarks/results/2026-12-04-s18/probe_server_walls.py F
"""
import contextlib, io, json, statistics, sys, time

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem

import os
# XPRESS_PROBE_SMALL=1: tiny shapes, to check the script on a CPU.
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=4099, hidden_size=128, rank=64, mlp_hidden=128)
                       if os.environ.get("XPRESS_PROBE_SMALL") else SERVING))
head = xj.init_head(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.02)
out = open(sys.argv[1], "w")
buckets = (1, 16)
servers = {}
for topc in (512, 0):
    for name, opts in (("options", None), ("xla-default", {})):
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):
            servers[topc, name] = xj.RefineServer(head, buckets=buckets, topc=topc, compiler_options=opts)
        print(f"topc={topc} {name}: {servers[topc, name].compiler_options} compiled in {time.perf_counter() - t0:.1f} s",
              flush=True)
inputs = {}
for n in buckets:
    _, logits, h, anchors = make_problem(cfg, n, seed=n)
    spec = servers[512, "options"].input_specs(n)
    inputs[n] = tuple(jax.device_put(x, spec[k].sharding) for x, k in
                      ((logits, "logits"), (h, "h"), (anchors, "anchors"), (anchors, "prev_ids")))
res = {}
for rnd in range(3):
    for (topc, name), s in servers.items():
        for n in buckets:
            x = inputs[n]
            for _ in range(20):
                s(*x).block_until_ready()
            ts = []
            for _ in range(200):
                t0 = time.perf_counter()
                s(*x).block_until_ready()
                ts.append(time.perf_counter() - t0)
            res.setdefault((topc, n, name), []).append(statistics.median(ts) * 1e6)
rows = []
for topc in (512, 0):
    for n in buckets:
        a = np.asarray(servers[topc, "options"](*inputs[n]))
        b = np.asarray(servers[topc, "xla-default"](*inputs[n]))
        r = dict(topc=topc, N=n, wall_options_us=res[topc, n, "options"], wall_default_us=res[topc, n, "xla-default"],
                 differ=int(np.sum(a != b)))
        out.write(json.dumps(r) + "\n"); out.flush()
        rows.append(r)
print("| mode | N | server wall µs, options (3 rounds) | XLA defaults | tokens differ |")
for r in rows:
    f = lambda v: " / ".join(f"{x:.1f}" for x in v)
    print(f"| {'top-512' if r['topc'] else 'full'} | {r['N']} | {f(r['wall_options_us'])} | {f(r['wall_default_us'])} | {r['differ']} |")
