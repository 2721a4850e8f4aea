"""Session 28 (issue 16: full vocab N=1 <= 200 µs): the residual inside the full-vocab pick, with a held latent.

Session 13 put the residual ``round(u + d)`` into the full-vocab pick (the kernel's ``lat_add``) and lost at every N:
its N <= 4 configs are ``flat`` (the latent chunk reloaded with every vocab tile), so the two float32 terms were loaded
and added inside the pipelined loop (N=1 231 -> 237). A config that holds the latent (``hold_lat``) adds them once per
program. Nobody measured a held-latent config at N=1 (session 14's sweep had flat ones only).

Variants (each the served Pallas steps with TABLE's N=1 row given one full-vocab config; alternating order as served;
"+s": the full-vocab pass split (`dispatch.FULL_VOCAB_SPLIT_MAX_ROWS`): XLA hands the pick (u, d), its residual
kernel is gone; "/k": the hold config with the served loop split ``keep="split"``, else none):
  served (flat (16,128,3,64,4,4) at N=1), served+s, and held configs (HELD at N=1, HELD4 at N=4), each plain, +s
  and /k+s. ONLY=a,b,... keeps those (and served, served+s).

Prediction (before any run): the residual kernel is ~2.5 µs per pass (trace, session 21), so -10 to -15 µs per refine
at N=1 if a held config streams w2 as fast as the flat one; the held configs without the split within +-5 of served;
flat + split +5 (as in session 13). N=1 would then be ~190 µs (goal <= 200).

Usage: probe_fvsplit.py OUT.jsonl [N,N]. Device µs per refine, chained with a token table, min of 3 interleaved
rounds; tokens compared with the served variant's.

Ran against commit 5a36822, whose full-vocab kernel took ``lat_add`` and whose dispatch had
``FULL_VOCAB_SPLIT_MAX_ROWS`` (both removed after these runs: the split gained nothing); kept as the record of
what ran.
"""
import dataclasses, json, os, sys, time

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem, time_device
from xpress_jax import dispatch
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

CFG = xj.HeadConfig(**SERVING)
out = open(sys.argv[1], "w")
NS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1]
OPS = Ops.pallas(False)
LAZY = dict(prefetch_base=True, lazy=True)
HELD = {  # name -> FullVocabConfig fields
    "h128x3k64s3": dict(row_tile=16, v_tile=128, v_steps=3, k_tile=64, num_warps=4, num_stages=3, hold_lat=True, **LAZY),
    "h128x3k64s4": dict(row_tile=16, v_tile=128, v_steps=3, k_tile=64, num_warps=4, num_stages=4, hold_lat=True, **LAZY),
    "h128x3k0s2": dict(row_tile=16, v_tile=128, v_steps=3, k_tile=0, num_warps=4, num_stages=2, hold_lat=True, **LAZY),
    "h64x6k0s3": dict(row_tile=16, v_tile=64, v_steps=6, k_tile=0, num_warps=4, num_stages=3, hold_lat=True, **LAZY),
    "h64x6k64s4": dict(row_tile=16, v_tile=64, v_steps=6, k_tile=64, num_warps=4, num_stages=4, hold_lat=True, **LAZY),
    "h128x4k64s3": dict(row_tile=16, v_tile=128, v_steps=4, k_tile=64, num_warps=4, num_stages=3, hold_lat=True, **LAZY),
}


#: N=4 (60 draft rows, served flat (64, 64, 6, 64, 4, 4)): the same question with 64-row tiles.
HELD4 = {
    "h64x6k64s3": dict(row_tile=64, v_tile=64, v_steps=6, k_tile=64, num_warps=4, num_stages=3, hold_lat=True, **LAZY),
    "h64x6k0s2": dict(row_tile=64, v_tile=64, v_steps=6, k_tile=0, num_warps=4, num_stages=2, hold_lat=True, **LAZY),
    "h64x6k64s3w8": dict(row_tile=64, v_tile=64, v_steps=6, k_tile=64, num_warps=8, num_stages=3, hold_lat=True, **LAZY),
}


def variant(fv=None, split=False, keep=None):
    def fn(pt, l, h, a):
        saved = (dispatch.TABLE, dispatch.FULL_VOCAB_SPLIT_MAX_ROWS, dispatch.FULL_VOCAB_KEEP)
        if fv is not None:  # the TABLE row that serves these draft rows gets the config
            rows = l.shape[0] * (l.shape[1] - 1)
            at = next(i for i, r in enumerate(dispatch.TABLE) if r.max_rows is None or rows <= r.max_rows)
            dispatch.TABLE = tuple(dataclasses.replace(r, full_vocab=fv) if i == at else r
                                   for i, r in enumerate(dispatch.TABLE))
        dispatch.FULL_VOCAB_SPLIT_MAX_ROWS = 10 ** 6 if split else 0
        dispatch.FULL_VOCAB_KEEP = keep
        try:
            return refine_with(OPS, pt[0], l, h, a, config=CFG, topc=0, token_table=pt[1])
        finally:
            dispatch.TABLE, dispatch.FULL_VOCAB_SPLIT_MAX_ROWS, dispatch.FULL_VOCAB_KEEP = saved
    return fn


for spec in filter(None, os.environ.get("EXTRA", "").split(";")):  # EXTRA="h32x6k0s3=16,32,6,0,4,3;...": held configs
    name, fields = spec.split("=")
    rt, vt, vs_, kt, w, st = (int(x) for x in fields.split(","))
    (HELD if rt <= 16 else HELD4)[name] = dict(row_tile=rt, v_tile=vt, v_steps=vs_, k_tile=kt, num_warps=w,
                                             num_stages=st, hold_lat=True, **LAZY)


def variants_at(n):
    vs = {"served": variant(), "served+s": variant(split=True)}
    for name, fv in (HELD if n == 1 else HELD4).items():
        vs[name] = variant(fv)
        vs[name + "+s"] = variant(fv, split=True)
        vs[name + "/k+s"] = variant(fv, split=True, keep="split")
    only = os.environ.get("ONLY")
    if only:
        vs = {k: v for k, v in vs.items() if k in ("served", "served+s") or k in only.split(",")}
    return vs


t0 = time.time()
for n in NS:
    VARIANTS = variants_at(n)
    params, logits, h, anchors = make_problem(CFG, n)
    pt = (params, jax.jit(xj.token_table)(params))
    args = (pt, logits, h, anchors)
    m = chain_length(n, 0, "pallas")
    res = {}
    for v, fn in VARIANTS.items():
        try:
            tok = np.asarray(jax.jit(fn)(*args))
            res[v] = dict(tok=tok, chain=chained(CFG, m, refine_fn=fn, compiler_options=xj.compiler_options()), dev=[])
        except Exception as e:  # a config the kernel refuses or Triton cannot compile
            print(f"N={n} {v}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            out.write(json.dumps(dict(N=n, variant=v, error=f"{type(e).__name__}: {str(e)[:500]}")) + "\n")
    for _ in range(3):
        for v, r in res.items():
            r["dev"].append(time_device(r["chain"], args, 5) / m * 1e6)
    for v, r in res.items():
        row = dict(N=n, variant=v, device_us=[round(x, 1) for x in r["dev"]],
                   differ=int((r["tok"] != res["served"]["tok"]).sum()))
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"N={n} {v:18s} {min(r['dev']):7.1f}  differ {row['differ']}", flush=True)
    print(f"({time.time() - t0:.0f} s)", flush=True)
