"""Session 13 probe: where the split latent (the residual inside the picks) wins and loses.

For each case, refine with the token table through `refine_with`, the Pallas steps with
``split_latent`` True ("split") and False ("xlares"): chained device time (3 interleaved rounds,
min) and one call's GPU kernels from a profiler trace (count, span, and the summed time per kernel
name). Writes one JSON line per (case, variant) to argv[1].
"""
import dataclasses, json, os, sys

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem, time_device
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import kernel_trace  # noqa: E402  (the trace helper this probe first wrote out; moved there unchanged)

cfg = xj.HeadConfig(**SERVING)
P = Ops.pallas()
VARIANTS = {"xlares": dataclasses.replace(P, name="xlares", split_latent=False), "split": P}
CASES = [(1, 512), (16, 512), (1, 0), (4, 0), (16, 0)]
out = open(sys.argv[1], "w")


for n, topc in CASES:
    params, logits, h, anchors = make_problem(cfg, n, std=0.02)
    T = jax.jit(xj.token_table)(params)
    args = ((params, T), logits, h, anchors)
    m = chain_length(n, topc, "pallas")
    res = {}
    for v, ops in VARIANTS.items():
        def fn(pt, l, hh, a, ops=ops):
            return refine_with(ops, pt[0], l, hh, a, config=cfg, topc=topc, token_table=pt[1])
        res[v] = dict(fn=fn, tok=np.asarray(jax.jit(fn)(*args)), chain=chained(cfg, m, refine_fn=fn), dev=[])
    for _ in range(3):
        for v, r in res.items():
            r["dev"].append(time_device(r["chain"], args, 5) / m * 1e6)
    for v, r in res.items():
        tr = kernel_trace(r["fn"], args, f"tr13_{v}_{n}_{topc}")
        row = dict(N=n, topc=topc, variant=v, device_us=[round(x, 1) for x in r["dev"]],
                   differ=int((r["tok"] != res["xlares"]["tok"]).sum()), trace=tr)
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"N={n:3d} topc={topc:3d} {v:7s} dev {min(r['dev']):7.1f} differ {row['differ']} kernels {tr['n']} "
              f"busy {tr['busy']} span {tr['span']}", flush=True)
        for k, c, t in tr["top"][:6]:
            print(f"      {c:3d} x {k:40s} {t:8.1f}", flush=True)
