"""Session 24 (issue 14): certified passes that know their number (`dispatch.CERTIFIED_PASS_NUMBERS`) against the
same mode without (the loop's behaviour unrolled), the scan and top-512, in one process, interleaved rounds.

Run 1-2 (H200) measured the first version (final slots also left out of the decisions: +9 µs at N=1 where every row
certifies; since then they are decided, and the one-launch scan takes the loop split over its run-time split).
Prediction for that (before the run): the loop split -20 to -30 µs at N=16 (as the scan's), less at N=64.

Prediction (written before the run, H100; session 23's fallback/scan 1.28 / 1.20 / 1.29 / 1.25x at N = 1 / 16 /
64 / 256): where pruning fails (std 0.06) the new passes scan fewer rows from pass 2 (the final slots: 15 + 14 +
13 + 12 + 11 of 15 x 6 rows, -17% of the scanned rows) and alternate w2's order at N <= 4: -15 to -25 µs at N=1,
-8 to -12% of the fallback's time from N=16; where every row certifies (std 0.01) nothing (no scan runs; within
noise). 0 tokens differ between the certified variants and the scan.

Usage: probe_cert.py OUT.jsonl [N,N,...] [std,std]. Device µs per refine, chained with a token table, min of 3 rounds.
"""
import json, os, sys, time

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem, time_device
from xpress_jax import dispatch, exact
from xpress_jax import ops as ops_mod
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

CFG = xj.HeadConfig(**SERVING)
out = open(sys.argv[1], "w")
NS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 4, 16, 64, 256]
STDS = [float(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [0.06, 0.01]
OPS = Ops.pallas(False)


def variant(topc, cert, numbers, keep=True):
    def fn(pt, l, h, a):
        old, order = dispatch.CERTIFIED_PASS_NUMBERS, ops_mod._pass_order
        dispatch.CERTIFIED_PASS_NUMBERS = numbers  # read while tracing
        if not keep:  # the pass order without the L2 hint / loop split
            ops_mod._pass_order = lambda rows, q, config: (order(rows, q, config)[0], None)
        try:
            return refine_with(OPS, pt[0], l, h, a, config=CFG, topc=topc, full_vocab="certified" if cert else "scan",
                               certified_prepared=pt[2] if cert else None, token_table=pt[1])
        finally:
            dispatch.CERTIFIED_PASS_NUMBERS, ops_mod._pass_order = old, order
    return fn


VARIANTS = {"top512": variant(512, False, True), "scan": variant(0, False, True),
            "cert_old": variant(0, True, False), "cert_new": variant(0, True, True)}
if os.environ.get("NOKEEP"):  # the new passes without the loop split (its share of the change)
    VARIANTS["cert_nokeep"] = variant(0, True, True, keep=False)
if os.environ.get("SCANKEEP"):  # the one-launch scan's loop split (dispatch.CERTIFIED_SCAN_KEEP, off by default)
    def scan_keep(fn):
        def g(*a):
            old = dispatch.CERTIFIED_SCAN_KEEP
            dispatch.CERTIFIED_SCAN_KEEP = True
            try:
                return fn(*a)
            finally:
                dispatch.CERTIFIED_SCAN_KEEP = old
        return g
    VARIANTS["cert_scankeep"] = scan_keep(variant(0, True, True))
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
