"""Shared loop of this session's config probes (`probe_pick_configs.py`, `probe_fv_configs.py`,
`probe_select_configs.py`): refine with each variant's `Ops` on one problem, chained device time per refine
with a token table (interleaved rounds), and the tokens against the "served" variant. (The pick and
full-vocab probes ran with this loop written out in each; it moved here unchanged afterwards.)"""
import json

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem, time_device
from xpress_jax.refine import refine_with

CFG = xj.HeadConfig(**SERVING)


def time_variants(n, topc, variants, rounds, out, extra=None, width=26):
    """``variants``: name -> `Ops`, "served" among them. Prints and writes (to the open file ``out``) one JSON
    line per variant, fastest first: N, topc, variant, device_us (one per round), differ (tokens unlike
    "served's"), plus ``extra``. A variant whose refine does not build (a config the kernel refuses) is
    reported and skipped."""
    params, logits, h, anchors = make_problem(CFG, n, std=0.02)
    T = jax.jit(xj.token_table)(params)
    args = ((params, T), logits, h, anchors)
    m = chain_length(n, topc, "pallas")
    res = {}
    for v, ops in variants.items():
        def fn(pt, l, hh, a, ops=ops):
            return refine_with(ops, pt[0], l, hh, a, config=CFG, topc=topc, token_table=pt[1])
        try:
            res[v] = dict(tok=np.asarray(jax.jit(fn)(*args)), chain=chained(CFG, m, refine_fn=fn), dev=[])
        except Exception as e:  # a config the kernel refuses at these shapes
            print(f"N={n} {v} refused: {type(e).__name__}: {str(e)[:120]}", flush=True)
    for _ in range(rounds):
        for v, r in res.items():
            r["dev"].append(time_device(r["chain"], args, 5) / m * 1e6)
    for v, r in sorted(res.items(), key=lambda kv: min(kv[1]["dev"])):
        row = dict(N=n, topc=topc, variant=v, **(extra or {}), device_us=[round(x, 1) for x in r["dev"]],
                   differ=int((r["tok"] != res["served"]["tok"]).sum()))
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"N={n:3d} {v:{width}s} dev {min(r['dev']):7.1f} differ {row['differ']}", flush=True)
