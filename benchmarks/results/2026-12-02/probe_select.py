"""Issue 16, 2026-12-02: the top-C selection's launch shape at small N (programs per row, block size).
Selection alone, chained (each call's first candidate feeds the next call's logits through a barrier),
device µs per call; candidate sets compared with the served config. Then refine (top-512) at the best.
Run from the repo root: PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02/probe_select.py
"""
import dataclasses, json, os, time
import jax, jax.numpy as jnp, numpy as np
import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem, chained
from benchmarks.timing import time_jitted
from xpress_jax import dispatch
from xpress_jax.kernels import select

OUT = os.environ.get("OUT", "/tmp/out")
SMALL = jax.default_backend() != "gpu"
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=4099, hidden_size=128, rank=64, mlp_hidden=128, topc=64) if SMALL else SERVING))
C = cfg.topc
T0 = time.time()
res = []


def served(n):
    row = dispatch._row(n * (cfg.block_size - 1))
    return dispatch.select_config(row, C)


def sel_time(logits, kw, m):
    n, b, v = logits.shape

    def run(logits):
        def body(i, carry):
            lg, acc = carry
            cand, vals, am = select.select_candidates(lg.reshape(n * b, v), C, slot_stride=b, interpret=SMALL, **kw)
            lg, cand = jax.lax.optimization_barrier((lg, cand))
            return lg, acc + am.sum() + cand[0, 0]
        return jax.lax.fori_loop(0, m, body, (logits, jnp.int32(0)))[1]

    return time_jitted(jax.jit(run), (logits,), 5)[1] / m * 1e6


for n in ((1,) if SMALL else (1, 4, 16)):
    _, logits, _, _ = make_problem(cfg, n)
    b, v = cfg.block_size, cfg.vocab_size
    base_kw = served(n)
    ref = select.select_candidates(logits.reshape(n * b, v), C, slot_stride=b, interpret=SMALL, **base_kw)
    ref_sets = np.sort(np.asarray(ref[0]), axis=1)
    m = 2 if SMALL else 50
    for tp in (512, 1024, 2048, 4096):
        for blk in (16, 32):
            kw = dict(base_kw, block=blk, target_programs=tp)
            out = select.select_candidates(logits.reshape(n * b, v), C, slot_stride=b, interpret=SMALL, **kw)
            same = bool((np.sort(np.asarray(out[0]), axis=1) == ref_sets).all() and (np.asarray(out[2]) == np.asarray(ref[2])).all())
            t = sel_time(logits, kw, m)
            row = dict(n=n, target_programs=tp, block=blk, us=round(t, 1), same=same, served=kw == dict(base_kw, target_programs=512) and blk == base_kw.get("block", 32), t=round(time.time() - T0))
            res.append(row)
            print(json.dumps(row), flush=True)
    with open(f"{OUT}/probe_select.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in res) + "\n")

print("\n| N | target_programs | block 16 | block 32 |")
for n in sorted({r["n"] for r in res}):
    for tp in (512, 1024, 2048, 4096):
        cells = {r["block"]: f"{r['us']}{'' if r['same'] else ' DIFF'}{' (served)' if r['served'] else ''}" for r in res if r["n"] == n and r["target_programs"] == tp}
        print(f"| {n} | {tp} | {cells.get(16)} | {cells.get(32)} |")
