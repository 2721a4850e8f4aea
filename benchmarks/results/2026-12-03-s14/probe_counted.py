"""Session 14 probe: the counted top-C pick (no combine launch) against the combine launch.

For each case, refine with the token table through `refine_with`, the Pallas steps with
``topc_counter`` True ("counted", shipped) and False ("combine"): chained device time (3 interleaved
rounds, min) and one call's GPU kernels from a profiler trace (count, span, and the summed time per
kernel name). Writes one JSON line per (case, variant) to argv[1]. Ran against commit 4b7d289 (the
counted pick), reverted in 1478fba: it was not faster (RESULTS.md, fourteenth session).
"""
import dataclasses, json, os, sys

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem, time_device
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import kernel_trace  # noqa: E402

cfg = xj.HeadConfig(**SERVING)
P = Ops.pallas()
VARIANTS = {"combine": dataclasses.replace(P, name="combine", topc_counter=False), "counted": P}
CASES = [(1, 512), (4, 512), (16, 512)]
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
        tr = kernel_trace(r["fn"], args, f"tr14_{v}_{n}_{topc}")
        row = dict(N=n, topc=topc, variant=v, device_us=[round(x, 1) for x in r["dev"]],
                   differ=int((r["tok"] != res["combine"]["tok"]).sum()), trace=tr)
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"N={n:3d} topc={topc:3d} {v:7s} dev {min(r['dev']):7.1f} differ {row['differ']} kernels {tr['n']} "
              f"busy {tr['busy']} span {tr['span']}", flush=True)
        for k, c, t in tr["top"][:6]:
            print(f"      {c:3d} x {k:40s} {t:8.1f}", flush=True)
