"""For the next session with an H200 (issue 16: full vocab N=1 <= 200 µs): the N=1 full-vocab configs on an H200.

The twenty-eighth session chose N=1's held config (16, 64, 12, 0, 4, 3) on an H100 (236.4 -> 229.0 µs per refine
against the flat (16, 128, 3, 64, 4, 4)); no H200 was lent that day. This probe runs the shipped config, the old flat
one and the held neighbours that measured within 2 µs on the H100, in one process, so the choice can be checked
where issue 16's goal is set. The certified mode runs its N=1 pick in the same config: "cert" variants (std 0.06,
where every call falls back and that pick scans every row) show what the change does there.

Prediction (before any H200 run): the held config -5 to -9 µs against the flat one on the H200 (202.7 in the
twenty-seventh session -> ~195); its neighbours within +-2; the certified fallback at N=1 -5 to -9 as well.

Usage: probe_n1_configs.py OUT.jsonl. Device µs per refine, chained with a token table, min of 3 interleaved rounds;
tokens compared with the shipped config's (scan) or the scan's (cert).
"""
import dataclasses, json, sys, time

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem, time_device
from xpress_jax import dispatch, exact
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

CFG = xj.HeadConfig(**SERVING)
out = open(sys.argv[1], "w")
OPS = Ops.pallas(False)
LAZY = dict(prefetch_base=True, lazy=True)
CONFIGS = {  # name -> TABLE's N=1 full_vocab (None: as shipped)
    "shipped": None,
    "flat_s14": dict(row_tile=16, v_tile=128, v_steps=3, k_tile=64, num_warps=4, num_stages=4, hold_lat=False,
                     flat=True, **LAZY),
    "h64x6k0s3": dict(row_tile=16, v_tile=64, v_steps=6, k_tile=0, num_warps=4, num_stages=3, hold_lat=True, **LAZY),
    "h32x12k0s3": dict(row_tile=16, v_tile=32, v_steps=12, k_tile=0, num_warps=4, num_stages=3, hold_lat=True, **LAZY),
    "h64x24k0s3": dict(row_tile=16, v_tile=64, v_steps=24, k_tile=0, num_warps=4, num_stages=3, hold_lat=True, **LAZY),
}


def variant(fv, cert=False, prepared=None):
    def fn(pt, l, h, a):
        saved = dispatch.TABLE
        if fv is not None:
            dispatch.TABLE = (dataclasses.replace(dispatch.TABLE[0], full_vocab=fv),) + dispatch.TABLE[1:]
        try:
            return refine_with(OPS, pt[0], l, h, a, config=CFG, topc=0, token_table=pt[1],
                               full_vocab="certified" if cert else "scan", certified_prepared=pt[2] if cert else None)
        finally:
            dispatch.TABLE = saved
    return fn


t0 = time.time()
for std, cert in ((0.02, False), (0.06, True)):
    params, logits, h, anchors = make_problem(CFG, 1, std=std)
    pt = (params, jax.jit(xj.token_table)(params), exact.prepare_certified(params["w2"]) if cert else None)
    args = (pt, logits, h, anchors)
    m = chain_length(1, 0, "pallas")
    names = ["shipped", "flat_s14"] if cert else list(CONFIGS)
    fns = {("cert_" if cert else "") + k: variant(CONFIGS[k], cert) for k in names}
    if cert:
        fns["scan"] = variant(None)
    res = {v: dict(tok=np.asarray(jax.jit(fn)(*args)),
                   chain=chained(CFG, m, refine_fn=fn, compiler_options=xj.compiler_options()), dev=[])
           for v, fn in fns.items()}
    ref_tok = res["scan" if cert else "shipped"]["tok"]
    for _ in range(3):
        for v, r in res.items():
            r["dev"].append(time_device(r["chain"], args, 5) / m * 1e6)
    for v, r in res.items():
        row = dict(N=1, std=std, variant=v, device_us=[round(x, 1) for x in r["dev"]],
                   differ=int((r["tok"] != ref_tok).sum()))
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"std {std} N=1 {v:16s} {min(r['dev']):7.1f}  differ {row['differ']}", flush=True)
    print(f"({time.time() - t0:.0f} s)", flush=True)
