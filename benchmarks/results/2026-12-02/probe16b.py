"""Issue 16 probe 2 (2026-12-02): the hidden-input kernels and the two-launch 'front' latent inside refine.

Run from the repo root: PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02/probe16b.py
Device µs per refine (chained, barrier harness), tokens compared with the served plan.
"""
import dataclasses, glob, gzip, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem, chained
from benchmarks.timing import time_jitted
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with
from xpress_jax.kernels import latent as klat, hidden as khid
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_util import trace  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out")
SMALL = jax.default_backend() != "gpu"
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=4099, hidden_size=128, rank=64, mlp_hidden=128, topc=64) if SMALL else SERVING))
BASE = Ops.pallas(SMALL)
T0 = time.time()
res = {}

HID = {
    "h16": khid.HiddenConfig(),
    "h32": khid.HiddenConfig(col_block=32),
    "h16k256": khid.HiddenConfig(k_block=256),
    "h32w8": khid.HiddenConfig(col_block=32, num_warps=8, k_block=256),
    "h16bpp4": khid.HiddenConfig(blocks_per_program=4, col_block=32, row_block=64, proj_col_block=32),
}
LAT = {
    "front": klat.LatentConfig(variant="front", h_block=32, col_block=32, k_block=128, num_warps=4),
    "front_h16": klat.LatentConfig(variant="front", h_block=16, col_block=32, k_block=128, num_warps=4),
    "front_h64": klat.LatentConfig(variant="front", h_block=64, col_block=32, k_block=128, num_warps=4),
    "front_c64": klat.LatentConfig(variant="front", h_block=32, col_block=64, k_block=128, num_warps=4),
    "front_w8": klat.LatentConfig(variant="front", h_block=32, col_block=32, k_block=128, num_warps=8),
    "front_c16": klat.LatentConfig(variant="front", h_block=32, col_block=16, k_block=128, num_warps=4),
}


def make_ops(hid=None, lat=None):
    ops = BASE
    if hid:
        ops = dataclasses.replace(ops, hidden=lambda p, h, c=HID[hid]: khid.hidden_input(p, h, config=c, interpret=SMALL))
    if lat:
        ops = dataclasses.replace(ops, latent=lambda p, x, b, q, c=LAT[lat]: klat.latent_pass(p, x, b, q, config=c, interpret=SMALL))
    return ops


def fn_of(ops, topc):
    return lambda p, l, h, a: refine_with(ops, p, l, h, a, config=cfg, topc=topc)


def device(fn, args, m):
    ch = jax.jit(chained(cfg, m, refine_fn=fn)).lower(*args).compile()
    return round(time_jitted(ch, args, 5)[1] / m * 1e6, 1)


CASES = [(1, cfg.topc), (4, cfg.topc), (16, cfg.topc), (1, 0), (4, 0), (16, 0)]
if os.environ.get("CASES"):
    CASES = [CASES[int(i)] for i in os.environ["CASES"].split(",")]
VARS = [(None, None)] + [(h, None) for h in HID] + [(None, l) for l in LAT] + [("h16", "front"), ("h32", "front_h16")]
if SMALL:
    CASES, VARS = CASES[:1], VARS[:2] + [("h16", "front")]
for n, topc in CASES:
    args = make_problem(cfg, n)
    m = 2 if SMALL else (100 if n <= 4 else 50)
    key = f"N={n} topc={topc}"
    r = res[key] = {}
    want = np.asarray(jax.jit(fn_of(BASE, topc))(*args))
    for hid, lat in VARS:
        name = f"{hid or '-'}/{lat or '-'}"
        if n >= 16 and hid in ("h16", "h32", "h16k256", "h32w8") and lat is None:
            pass
        try:
            ops = make_ops(hid, lat)
            got = np.asarray(jax.jit(fn_of(ops, topc))(*args))
            r[name] = (device(fn_of(ops, topc), args, m), int((got != want).sum()))
        except Exception as ex:
            r[name] = repr(ex)[:200]
        print(key, name, r[name], round(time.time() - T0), flush=True)
    json.dump(res, open(f"{OUT}/probe16b.json", "w"), indent=1)

if not SMALL and os.environ.get("TRACE", "1") == "1":
    args = make_problem(cfg, 1)
    for hid, lat in (("h16", "front"),):
        res[f"trace N=1 top {hid}/{lat}"] = t = trace(fn_of(make_ops(hid, lat), cfg.topc), args, f"{hid}_{lat}")
        print("trace", hid, lat, json.dumps(t)[:3000], flush=True)
    json.dump(res, open(f"{OUT}/probe16b.json", "w"), indent=1)

print("\n| variant (hidden/latent) | " + " | ".join(f"N={n} {'top' if t else 'full'}" for n, t in CASES) + " |")
for hid, lat in VARS:
    name = f"{hid or '-'}/{lat or '-'}"
    print(f"| {name} | " + " | ".join(str(res[f'N={n} topc={t}'].get(name)) for n, t in CASES) + " |")
