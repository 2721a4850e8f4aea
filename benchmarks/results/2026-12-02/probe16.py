"""Issue 16 probe (2026-12-02): per-kernel traces at small N, and cheap variants of the per-call work.

Run from the repo root: PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02/probe16.py
Variants (device µs chained, tokens compared with the default):
  hidden=pad16   : the hidden input's mean(h) @ down_g as a GEMM of 16 padded rows (XLA turns the N=1
                   GEMV into a multiply + reduce over a materialised f32 [4096, 256]);
  hidden=split   : pad16 and xh = hh @ Wih[:r] + hg @ Wih[r:] (no concatenate; hg's part once per block);
  nosplitk       : compile option xla_gpu_experimental_force_split_k=1;
  latent=split   : the split latent kernel (trace only: why it was slower).
"""
import collections, dataclasses, functools, glob, gzip, json, os, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
import xpress_jax as xj
import xpress_jax.refine as xr
from xpress_jax import head as xh_mod
from xpress_jax.head import _dot, acc_dtype, round_to, hidden_input
from benchmarks.bench_refine import SERVING, make_problem, chained
from benchmarks.timing import time_jitted
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with
from xpress_jax.kernels import latent as klat

OUT = os.environ.get("OUT", "/tmp/out")
SMALL = jax.default_backend() != "gpu"
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=4099, hidden_size=128, rank=64, mlp_hidden=128, topc=64) if SMALL else SERVING))
OPS = Ops.pallas(SMALL)
T0 = time.time()
res = {}


def hidden_pad16(params, h):
    cd = params["w1"].dtype
    acc = acc_dtype(cd)
    n = h.shape[0]
    hh = round_to(_dot(h, params["down_h"], acc), cd)
    g = round_to(jnp.mean(h.astype(acc), axis=1), cd)
    pad = (-n) % 16
    gp = jnp.pad(g, ((0, pad), (0, 0))) if pad else g
    hg = round_to(_dot(gp, params["down_g"], acc), cd)[:n]
    cat = jnp.concatenate([hh, jnp.broadcast_to(hg[:, None, :], hh.shape)], axis=-1)
    return round_to(_dot(cat, params["in_proj_hidden"], acc), cd)


def hidden_split(params, h):
    cd = params["w1"].dtype
    acc = acc_dtype(cd)
    n = h.shape[0]
    r = params["down_h"].shape[1]
    hh = round_to(_dot(h, params["down_h"], acc), cd)
    g = round_to(jnp.mean(h.astype(acc), axis=1), cd)
    pad = (-n) % 16
    gp = jnp.pad(g, ((0, pad), (0, 0))) if pad else g
    hg = round_to(_dot(gp, params["down_g"], acc), cd)
    w = params["in_proj_hidden"]
    top = _dot(hh, w[:r], acc)
    bot = _dot(hg, w[r:], acc)[:n]
    return round_to(top + bot[:, None, :], cd)


HIDDEN = {"default": hidden_input, "pad16": hidden_pad16, "split": hidden_split}
SPLIT_OPS = dataclasses.replace(OPS, latent=lambda p, x, b, pi: klat.latent_pass(p, x, b, pi, variant="split", interpret=SMALL))


def parse(path):
    d = json.load(gzip.open(path)); ev = d["traceEvents"] if isinstance(d, dict) else d
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    tname = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
    X = [e for e in ev if e.get("ph") == "X"]
    calls = sorted([e for e in X if e["name"].startswith("PjitFunction") and "python" in tname.get((e["pid"], e["tid"]), "")],
                   key=lambda e: e["ts"])
    outer = []
    for e in calls:
        if outer and e["ts"] < outer[-1]["ts"] + outer[-1]["dur"]: continue
        outer.append(e)
    gpu = [e for e in X if "gpu" in pname.get(e["pid"], "").lower()]
    i = len(outer) // 2
    t0 = outer[i]["ts"]; t1 = outer[i + 1]["ts"] if i + 1 < len(outer) else 1e30
    ks = sorted([e for e in gpu if t0 <= e["ts"] < t1], key=lambda e: e["ts"])
    if not ks:
        return None
    s0 = ks[0]["ts"]
    span = max(e["ts"] + e["dur"] for e in ks) - s0
    return dict(span=round(span, 1), n=len(ks), kernels=[(e["name"][:40], round(e["ts"] - s0, 1), round(e["dur"], 2)) for e in ks])


def trace(fn, args, tag):
    for _ in range(5): fn(*args).block_until_ready()
    d = f"/tmp/tr16_{tag}"
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(9): fn(*args).block_until_ready()
    path = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)[0]
    try:
        return parse(path)
    except Exception as ex:
        return repr(ex)


def make_fn(ops, topc, hidden="default"):
    def fn(p, l, h, a):
        xr.hidden_input = HIDDEN[hidden]
        try:
            return refine_with(ops, p, l, h, a, config=cfg, topc=topc)
        finally:
            xr.hidden_input = hidden_input
    return fn


def device(fn, args, m, opts=None):
    ch = jax.jit(chained(cfg, m, refine_fn=fn)).lower(*args).compile(compiler_options=opts or {})
    return round(time_jitted(ch, args, 5)[1] / m * 1e6, 1)


def save():
    json.dump(res, open(f"{OUT}/probe16.json", "w"), indent=1)


CASES = [(1, cfg.topc), (16, cfg.topc), (1, 0), (4, cfg.topc), (16, 0)][: 2 if SMALL else None]
if os.environ.get('CASES'):
    CASES = [CASES[int(i)] for i in os.environ['CASES'].split(',')]
for n, topc in CASES:
    args = make_problem(cfg, n)
    m = 2 if SMALL else (100 if n <= 4 else 50)
    key = f"N={n} topc={topc}"
    r = res[key] = {}
    base = jax.jit(make_fn(OPS, topc))
    want = np.asarray(base(*args))
    r["device default"] = device(make_fn(OPS, topc), args, m)
    for hid in ("pad16", "split"):
        f = jax.jit(make_fn(OPS, topc, hid))
        r[f"same {hid}"] = int((np.asarray(f(*args)) != want).sum())
        r[f"device {hid}"] = device(make_fn(OPS, topc, hid), args, m)
    try:
        opts = {"xla_gpu_experimental_force_split_k": 1}
        c = jax.jit(make_fn(OPS, topc)).lower(*args).compile(compiler_options=opts)
        r["same nosplitk"] = int((np.asarray(c(*args)) != want).sum())
        r["device nosplitk"] = device(make_fn(OPS, topc), args, m, opts)
    except Exception as ex:
        r["nosplitk error"] = repr(ex)[:300]
    if n == 1 or (n == 16 and topc):
        r["trace default"] = trace(base, args, f"{n}_{topc}_default")
    if n == 1 and topc:
        r["trace pad16"] = trace(jax.jit(make_fn(OPS, topc, "pad16")), args, f"{n}_{topc}_pad16")
        fs = jax.jit(make_fn(SPLIT_OPS, topc))
        r["same latent=split"] = int((np.asarray(fs(*args)) != want).sum())
        r["device latent=split"] = device(make_fn(SPLIT_OPS, topc), args, m)
        r["trace latent=split"] = trace(fs, args, f"{n}_{topc}_split")
    r["t"] = round(time.time() - T0)
    print(key, json.dumps({k: v for k, v in r.items() if not k.startswith("trace")}), flush=True)
    save()

print("\n| case | default | pad16 | split | nosplitk |")
for n, topc in CASES:
    r = res[f"N={n} topc={topc}"]
    print(f"| N={n} {'top-%d' % topc if topc else 'full'} | {r.get('device default')} | {r.get('device pad16')} ({r.get('same pad16')}) "
          f"| {r.get('device split')} ({r.get('same split')}) | {r.get('device nosplitk')} ({r.get('same nosplitk')}) |")
for key, r in res.items():
    for k, v in r.items():
        if k.startswith("trace") and isinstance(v, dict):
            print(f"== {key} {k}: span {v['span']} n {v['n']}")
            print("   " + " ".join(f"{nm[:22]}:{d}" for nm, _, d in v["kernels"]))
