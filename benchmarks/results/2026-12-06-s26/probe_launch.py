"""Session 26 (issues 14 and 16): what the certified mode's scan launches cost where every row certifies (run 1),
and the counted pick that replaces them at N <= 4 (run 3: ``COUNTED=1``).

Where every row certifies (std 0.01), a certified pass still launches the full-vocab pick (N <= 4: one launch with no
active row, whose programs return at once, and its combine, which writes the candidates' tokens) or the one-launch
scan (packing, pick, combine). Variant ``cert_nopick`` drops them: the pass takes the candidates' token (the certify
launch's ``best_id``) and runs no scan. Its tokens are the scan's only while every row certifies (checked: 0 differ),
so it is a measurement, not a mode. The difference cert - cert_nopick is what a scan step that costs nothing when no
row fails could save at most.

Prediction (written before the run, H100, session 25's cert 107.4 / 357.9 / 828.2 at N = 1 / 16 / 64, top-512
78.9 / 269.0 / 662.3): the empty pick and its combine cost 2-3 µs each per pass behind PDL, so cert - cert_nopick =
20-30 µs at N=1 and N=4 (6 passes x 2 launches; the rest of the 28 µs over top-512 is the certify launch replacing
the top-C combine), 25-40 µs at N=16 and 64 (three launches per pass plus the XLA ops of the packing).

Run 3 (``COUNTED=1``): variant ``cert`` is the shipped mode with `dispatch.CERTIFIED_COUNTED_PICK` (one counted
launch per pass, nothing written where no row is active), ``cert_combine`` the same with it off (the pick and its
combine, as in run 1's ``cert``); no ``cert_nopick``. Prediction in `dispatch.py` (before the run): -7 to -10 µs per
refine at N = 1..4 where every row certifies, within +-3 µs where pruning fails (std 0.06).

Usage: [COUNTED=1] probe_launch.py OUT.jsonl [N,N,...] [std,std]. Device µs per refine, chained with a token table, min of 3
interleaved rounds. Variants: top512, scan, cert (shipped), cert_nopick.
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
# No scan: the candidates' token for every row (the certify launch's best_id); flags as given.
NOPICK = dataclasses.replace(
    OPS, full_vocab_pick=lambda logits, lat, fprep, active=None, fallback=None, **kw: fallback,
    scan_failing=lambda logits, lat, fprep, fail, flags, best_id, limit, **kw: (best_id, flags))


def variant(ops, topc, cert, counted=True):
    def fn(pt, l, h, a):
        old = dispatch.CERTIFIED_COUNTED_PICK
        dispatch.CERTIFIED_COUNTED_PICK = counted  # read while tracing
        try:
            return refine_with(ops, pt[0], l, h, a, config=CFG, topc=topc, full_vocab="certified" if cert else "scan",
                               certified_prepared=pt[2] if cert else None, token_table=pt[1])
        finally:
            dispatch.CERTIFIED_COUNTED_PICK = old
    return fn


VARIANTS = {"top512": variant(OPS, 512, False), "scan": variant(OPS, 0, False), "cert": variant(OPS, 0, True)}
if os.environ.get("COUNTED"):
    VARIANTS["cert_combine"] = variant(OPS, 0, True, counted=False)
else:  # run 1 (before the counted pick existed: "cert" was the pick and its combine)
    VARIANTS["cert_nopick"] = variant(NOPICK, 0, True)
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
