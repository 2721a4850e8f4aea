"""Session 14, prepared for the next session (not run yet): selection configs inside refine (issue 16).

Section "Top-C pick configs inside refine" found the pick's configs, chosen by timing the kernel alone, 12-18%
slower inside refine from N=32. The selection's configs were chosen the same way (dev_select, kernel alone,
except the block size at N = 1..16, measured inside refine on 2026-12-02). Each variant here is the served
Pallas steps with the selection given one set of `SelectConfig` overrides on top of the plan's; chained
device time per refine with a token table, top-512 (3 interleaved rounds), and the tokens against the served
selection (every config gives the same candidate sets, so 0 must differ). A config the kernel refuses is
reported and skipped. Writes JSON lines to argv[1]; argv[2]: the N list (default 1,16,64,256).
"""
import dataclasses, json, sys

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem, time_device
from xpress_jax import dispatch
from xpress_jax.kernels import select
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

cfg = xj.HeadConfig(**SERVING)
P = Ops.pallas()
out = open(sys.argv[1], "w")
NS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 16, 64, 256]
VARIANTS = [dict(num_warps=4), dict(num_warps=16), dict(gather_warps=8), dict(gather_warps=2),
            dict(finish_warps=8), dict(finish_warps=32), dict(target_programs=256), dict(target_programs=1024),
            dict(stats_blocks=256), dict(stats_blocks=1024), dict(stats_unroll=2), dict(scan_blocks=512),
            dict(scan_blocks=2048), dict(gather_blocks=32), dict(gather_blocks=128)]


def with_select(over):
    def sel(logits, c):
        n, b, v = logits.shape
        kw = {**dispatch.plan(n, b, v, 1, c, logits.dtype).select, **over}
        return select.select_candidates(logits.reshape(n * b, v), c, slot_stride=b, **kw)

    return dataclasses.replace(P, name=str(over), select=sel)


for n in NS:
    params, logits, h, anchors = make_problem(cfg, n, std=0.02)
    T = jax.jit(xj.token_table)(params)
    args = ((params, T), logits, h, anchors)
    m = chain_length(n, 512, "pallas")
    served = dispatch.plan(n, cfg.block_size, cfg.vocab_size, cfg.rank, 512, params["w2"].dtype).select
    res = {}
    for v, ops in {"served": P, **{str(o): with_select(o) for o in VARIANTS}}.items():
        def fn(pt, l, hh, a, ops=ops):
            return refine_with(ops, pt[0], l, hh, a, config=cfg, topc=512, token_table=pt[1])
        try:
            res[v] = dict(tok=np.asarray(jax.jit(fn)(*args)), chain=chained(cfg, m, refine_fn=fn), dev=[])
        except Exception as e:  # a config the kernel refuses at these shapes
            print(f"N={n} {v} refused: {type(e).__name__}: {str(e)[:120]}", flush=True)
    for _ in range(3):
        for v, r in res.items():
            r["dev"].append(time_device(r["chain"], args, 5) / m * 1e6)
    for v, r in sorted(res.items(), key=lambda kv: min(kv[1]["dev"])):
        row = dict(N=n, variant=v, served_select=str(served), device_us=[round(x, 1) for x in r["dev"]],
                   differ=int((r["tok"] != res["served"]["tok"]).sum()))
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"N={n:3d} {v:28s} dev {min(r['dev']):7.1f} differ {row['differ']}", flush=True)
