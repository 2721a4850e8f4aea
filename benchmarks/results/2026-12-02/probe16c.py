"""Issue 16 probe 3 (2026-12-02): XLA spellings of the hidden input that avoid its slow fusions.

At N=1 XLA turns ``g @ down_g`` ([1, 4096] x [4096, 256]) into a multiply over a materialised f32
[4096, 256] plus a reduction (8.6 µs), and at N=16 it fuses the reduction of the split-K partials of
``xh`` into pass 1's add (a 10.9 µs loop_add_reduce fusion). Variants (values unchanged: padding rows and
optimization barriers change no output element):
  gbar : g padded to 16 rows behind an optimization barrier (XLA cannot turn it back into a GEMV);
  xbar : xh behind an optimization barrier (materialised once, not recomputed inside pass 1);
  both : gbar + xbar.
Run from the repo root: PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02/probe16c.py
"""
import dataclasses, glob, gzip, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem, chained
from benchmarks.timing import time_jitted
from xpress_jax.head import _dot, acc_dtype, round_to, hidden_input
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_util import trace  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out")
SMALL = jax.default_backend() != "gpu"
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=4099, hidden_size=128, rank=64, mlp_hidden=128, topc=64) if SMALL else SERVING))
BASE = Ops.pallas(SMALL)
T0 = time.time()
res = {}


def hidden_variant(params, h, gbar=False, xbar=False):
    cd = params["w1"].dtype
    acc = acc_dtype(cd)
    n = h.shape[0]
    hh = round_to(_dot(h, params["down_h"], acc), cd)
    g = round_to(jnp.mean(h.astype(acc), axis=1), cd)
    if gbar:
        pad = (-n) % 16
        gp = jax.lax.optimization_barrier(jnp.pad(g, ((0, pad), (0, 0))) if pad else g)
        hg = round_to(_dot(gp, params["down_g"], acc), cd)[:n]
    else:
        hg = round_to(_dot(g, params["down_g"], acc), cd)
    cat = jnp.concatenate([hh, jnp.broadcast_to(hg[:, None, :], hh.shape)], axis=-1)
    xh = round_to(_dot(cat, params["in_proj_hidden"], acc), cd)
    return jax.lax.optimization_barrier(xh) if xbar else xh


VARS = {"default": None, "gbar": dict(gbar=True), "xbar": dict(xbar=True), "both": dict(gbar=True, xbar=True)}


def ops_of(v):
    kw = VARS[v]
    return BASE if kw is None else dataclasses.replace(BASE, hidden=lambda p, h, kw=kw: hidden_variant(p, h, **kw))


def fn_of(ops, topc):
    return lambda p, l, h, a: refine_with(ops, p, l, h, a, config=cfg, topc=topc)


def device(fn, args, m):
    ch = jax.jit(chained(cfg, m, refine_fn=fn)).lower(*args).compile()
    return round(time_jitted(ch, args, 5)[1] / m * 1e6, 1)


CASES = [(1, cfg.topc), (4, cfg.topc), (16, cfg.topc), (1, 0), (4, 0), (16, 0), (64, cfg.topc), (256, cfg.topc)]
if SMALL:
    CASES = CASES[:1]
for n, topc in CASES:
    args = make_problem(cfg, n)
    m = 2 if SMALL else (100 if n <= 4 else 50 if n <= 16 else 10)
    key = f"N={n} topc={topc}"
    r = res[key] = {}
    want = np.asarray(jax.jit(fn_of(BASE, topc))(*args))
    for rep in range(2):  # two interleaved rounds
        for v in VARS:
            ops = ops_of(v)
            if rep == 0:
                got = np.asarray(jax.jit(fn_of(ops, topc))(*args))
                r[f"diff {v}"] = int((got != want).sum())
            r.setdefault(v, []).append(device(fn_of(ops, topc), args, m))
    print(key, json.dumps(r), round(time.time() - T0), flush=True)
    json.dump(res, open(f"{OUT}/probe16c.json", "w"), indent=1)

if not SMALL:
    for n, topc in ((1, cfg.topc), (16, cfg.topc), (1, 0)):
        args = make_problem(cfg, n)
        res[f"trace N={n} topc={topc} both"] = t = trace(fn_of(ops_of("both"), topc), args, f"c_{n}_{topc}")
        print("trace", n, topc, json.dumps(t)[:1500], flush=True)
    json.dump(res, open(f"{OUT}/probe16c.json", "w"), indent=1)

print("\n| case | " + " | ".join(VARS) + " |")
for n, topc in CASES:
    r = res[f"N={n} topc={topc}"]
    print(f"| N={n} {'top' if topc else 'full'} | " + " | ".join(f"{min(r[v])} ({r['diff ' + v]})" for v in VARS) + " |")
