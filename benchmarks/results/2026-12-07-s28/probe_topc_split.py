"""Session 28 (issue 16: top-512 N=16 <= 250 µs): the split latent in top-C passes at N=16, measured again.

Session 13 measured the residual inside the top-C pick (`dispatch.SPLIT_LATENT_MAX_ROWS`) at N=16: 298 -> 314 µs, and
shipped it up to N=4 only; why N=16 lost was never traced. Since then the top-C pick's configs (one candidate tile per
program), its L2 hints at N = 13..25 and the CONCURRENT scheduling mode changed what runs around it.

Variants: served (XLA's residual kernel at N=16) and split (the pick adds the terms: SPLIT_LATENT_MAX_ROWS raised).
Prediction (before the run): -5 to -15 µs per refine (the residual kernel, ~2.5 µs per pass in the N=1 trace; larger at
N=16), or a loss as in session 13 if that loss was the pick's, not its neighbours'.

Usage: probe_topc_split.py OUT.jsonl [N,N]. Device µs per refine, chained with a token table, min of 3 interleaved
rounds; tokens compared with the served variant's.
"""
import json, sys, time

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem, time_device
from xpress_jax import dispatch
from xpress_jax import ops as ops_mod
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

CFG = xj.HeadConfig(**SERVING)
out = open(sys.argv[1], "w")
NS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16]
OPS = Ops.pallas(False)


def variant(split_rows):
    def fn(pt, l, h, a):
        saved = ops_mod.SPLIT_LATENT_MAX_ROWS  # ops reads its own import of the bound
        ops_mod.SPLIT_LATENT_MAX_ROWS = split_rows
        try:
            return refine_with(OPS, pt[0], l, h, a, config=CFG, topc=512, token_table=pt[1])
        finally:
            ops_mod.SPLIT_LATENT_MAX_ROWS = saved
    return fn


VARIANTS = {"served": variant(dispatch.SPLIT_LATENT_MAX_ROWS), "split": variant(10 ** 6)}
t0 = time.time()
for n in NS:
    params, logits, h, anchors = make_problem(CFG, n)
    pt = (params, jax.jit(xj.token_table)(params))
    args = (pt, logits, h, anchors)
    m = chain_length(n, 512, "pallas")
    res = {v: dict(tok=np.asarray(jax.jit(fn)(*args)),
                   chain=chained(CFG, m, refine_fn=fn, compiler_options=xj.compiler_options()), dev=[])
           for v, fn in VARIANTS.items()}
    for _ in range(3):
        for v, r in res.items():
            r["dev"].append(time_device(r["chain"], args, 5) / m * 1e6)
    for v, r in res.items():
        row = dict(N=n, topc=512, variant=v, device_us=[round(x, 1) for x in r["dev"]],
                   differ=int((r["tok"] != res["served"]["tok"]).sum()))
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"top-512 N={n} {v:8s} {min(r['dev']):7.1f}  differ {row['differ']}", flush=True)
    print(f"({time.time() - t0:.0f} s)", flush=True)
