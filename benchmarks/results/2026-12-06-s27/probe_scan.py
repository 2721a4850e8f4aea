"""Session 27 (issue 14): the counted one-launch scan (`dispatch.CERTIFIED_COUNTED_SCAN`) at N = 16..64.

Variants: top512, scan (the plain full scan), cert (the shipped certified mode: the packing writes the row-tile
counters, the pick's last program of a row tile combines and writes through the packed order: two launches, none
writing where no row fails), cert_combine (the same with the flag off: packing, pick, combine: three launches).

Prediction (in `dispatch.py`, before the run; H100 session 26: cert 354.1 / 823.5 at N = 16 / 64, the scan step 36.7 /
87.6 µs per refine where every row certifies): -10 to -15 µs per refine at N = 16 and 64 where every row certifies;
within +-5 µs where pruning fails (std 0.06).

Usage: probe_scan.py OUT.jsonl [N,N,...] [std,std]. Device µs per refine, chained with a token table, min of 3
interleaved rounds; tokens compared with the scan's.
"""
import dataclasses, json, os, sys, time

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem, time_device
from xpress_jax import dispatch, exact
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

CFG = xj.HeadConfig(**SERVING)
out = open(sys.argv[1], "w")
NS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 4, 16, 64]
STDS = [float(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [0.01]
OPS = Ops.pallas(False)


def variant(ops, topc, cert, counted=True):
    def fn(pt, l, h, a):
        old = dispatch.CERTIFIED_COUNTED_SCAN
        dispatch.CERTIFIED_COUNTED_SCAN = counted  # read while tracing
        try:
            return refine_with(ops, pt[0], l, h, a, config=CFG, topc=topc, full_vocab="certified" if cert else "scan",
                               certified_prepared=pt[2] if cert else None, token_table=pt[1])
        finally:
            dispatch.CERTIFIED_COUNTED_SCAN = old
    return fn


VARIANTS = {"top512": variant(OPS, 512, False), "scan": variant(OPS, 0, False), "cert": variant(OPS, 0, True),
            "cert_combine": variant(OPS, 0, True, counted=False)}
t0 = time.time()
for std in STDS:
    for n in NS:
        params, logits, h, anchors = make_problem(CFG, n, std=std)
        pt = (params, jax.jit(xj.token_table)(params), exact.prepare_certified(params["w2"]))
        args = (pt, logits, h, anchors)
        stats = jax.jit(lambda p, l, hh, a: refine_with(OPS, p[0], l, hh, a, config=CFG, topc=0, full_vocab="certified",
                                                        return_stats=True, certified_prepared=p[2],
                                                        token_table=p[1])[1])(*args)
        m = chain_length(n, 0, "pallas")
        res = {}
        for v, fn in VARIANTS.items():
            tok = None if v == "top512" else np.asarray(jax.jit(fn)(*args))  # top-512's tokens are not the scan's
            res[v] = dict(tok=tok, chain=chained(CFG, m, refine_fn=fn, compiler_options=xj.compiler_options()), dev=[])
        for _ in range(3):
            for v, r in res.items():
                r["dev"].append(time_device(r["chain"], args, 5) / m * 1e6)
        st = {k: round(float(x), 4) for k, x in stats._asdict().items()}
        for v, r in res.items():
            row = dict(std=std, N=n, variant=v, device_us=[round(x, 1) for x in r["dev"]],
                       differ_scan=None if r["tok"] is None else int((r["tok"] != res["scan"]["tok"]).sum()), stats=st)
            out.write(json.dumps(row) + "\n"); out.flush()
        line = "  ".join(f"{v} {min(r['dev']):7.1f}" for v, r in res.items())
        diff = {v: int((r["tok"] != res["scan"]["tok"]).sum()) for v, r in res.items() if v.startswith("cert")}
        print(f"std {std} N={n:3d} {line}  differ {diff} certified {st['rows_certified']:.3f} "
              f"full {st['passes_full_scan']:.2f} ({time.time() - t0:.0f} s)", flush=True)
