"""Issue 16, 2026-12-02: the shipped GPU spelling of the hidden input (`reference.hidden_input_gpu`) against
the plain one (`head.hidden_input`), both backends, in one run: device µs per refine (chained, barrier
harness; two interleaved rounds, min shown) and one call's wall time (median of 100), tokens compared.
Run from the repo root: PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02/final16.py
"""
import dataclasses, json, os, statistics, time
import jax, numpy as np
import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem, chained
from benchmarks.timing import time_jitted
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

OUT = os.environ.get("OUT", "/tmp/out")
SMALL = jax.default_backend() != "gpu"
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=4099, hidden_size=128, rank=64, mlp_hidden=128, topc=64) if SMALL else SERVING))
NEW = {"pallas": Ops.pallas(SMALL), "xla": Ops.xla("gpu")}
OLD = {k: dataclasses.replace(v, hidden=None) for k, v in NEW.items()}
T0 = time.time()
res = []


def fn_of(ops, topc):
    return lambda p, l, h, a: refine_with(ops, p, l, h, a, config=cfg, topc=topc)


def device(fn, args, m):
    ch = jax.jit(chained(cfg, m, refine_fn=fn)).lower(*args).compile()
    return time_jitted(ch, args, 5)[1] / m * 1e6


def wall(fn, args, calls=100):
    c = jax.jit(fn).lower(*args).compile()
    for _ in range(10): c(*args).block_until_ready()
    w = []
    for _ in range(calls):
        t = time.perf_counter(); c(*args).block_until_ready(); w.append(time.perf_counter() - t)
    return statistics.median(w) * 1e6


CASES = [("pallas", n, cfg.topc) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)] + \
        [("pallas", n, 0) for n in (1, 4, 16, 64)] + [("xla", 1, 0), ("xla", 16, 0), ("xla", 1, cfg.topc)]
if SMALL:
    CASES = CASES[:1]
for be, n, topc in CASES:
    args = make_problem(cfg, n)
    m = 2 if SMALL else (100 if n <= 4 else 50 if n <= 16 else 20 if n <= 64 else 6)
    if be == "xla" and topc:
        m = 10
    row = dict(backend=be, n=n, topc=topc)
    want = np.asarray(jax.jit(fn_of(OLD[be], topc))(*args))
    row["tokens_differ"] = int((np.asarray(jax.jit(fn_of(NEW[be], topc))(*args)) != want).sum())
    for rep in range(2):
        for tag, ops in (("old", OLD[be]), ("new", NEW[be])):
            row.setdefault(f"device_{tag}", []).append(round(device(fn_of(ops, topc), args, m), 1))
    if n <= 16:
        for tag, ops in (("old", OLD[be]), ("new", NEW[be])):
            row[f"wall_{tag}"] = round(wall(fn_of(ops, topc), args), 1)
    row["t"] = round(time.time() - T0)
    res.append(row)
    print(json.dumps(row), flush=True)
    with open(f"{OUT}/final16.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in res) + "\n")

print("\n| backend | mode | N | device plain | device gpu spelling | change | wall plain | wall gpu spelling | tokens differ |")
for r in res:
    o, nw = min(r["device_old"]), min(r["device_new"])
    print(f"| {r['backend']} | {'top-%d' % r['topc'] if r['topc'] else 'full'} | {r['n']} | {o} | {nw} | {nw - o:+.1f} | "
          f"{r.get('wall_old', '-')} | {r.get('wall_new', '-')} | {r['tokens_differ']} |")
