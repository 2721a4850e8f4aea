"""Issue 16, 2026-12-02: refine (top-512) with the selection's 16-element blocks at N = 1..4 (TABLE rows 15, 60)
against the served 32, interleaved rounds in one process; tokens compared.
Run from the repo root: PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02/refine_select16.py
"""
import dataclasses, json, os
import jax, numpy as np
import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem, chained
from benchmarks.timing import time_jitted
from xpress_jax import dispatch

OUT = os.environ.get("OUT", "/tmp/out")
cfg = xj.HeadConfig(**SERVING)
SERVED = dispatch.TABLE
B16 = tuple(dataclasses.replace(r, select_block=16) if r.max_rows is not None and r.max_rows <= 60 else r for r in SERVED)
res = []
for n in (1, 2, 4):
    args = make_problem(cfg, n)
    row = dict(n=n)
    toks = {}
    for rep in range(3):
        for tag, table in (("bs32", SERVED), ("bs16", B16)):
            dispatch.TABLE = table
            fn = lambda p, l, h, a: xj.refine(p, l, h, a, config=cfg, backend="pallas")
            if rep == 0:
                toks[tag] = np.asarray(jax.jit(fn)(*args))
            ch = jax.jit(chained(cfg, 100, refine_fn=fn)).lower(*args).compile()
            row.setdefault(tag, []).append(round(time_jitted(ch, args, 5)[1] / 100 * 1e6, 1))
    dispatch.TABLE = SERVED
    row["tokens_differ"] = int((toks["bs16"] != toks["bs32"]).sum())
    res.append(row)
    print(json.dumps(row), flush=True)
with open(f"{OUT}/refine_select16.jsonl", "w") as f:
    f.write("\n".join(json.dumps(r) for r in res) + "\n")
