"""Session 14 probe: the counted top-C pick (no combine launch) against the combine launch.

For each case, refine with the token table through `refine_with`, the Pallas steps with
``topc_counter`` True ("counted", shipped) and False ("combine"): chained device time (3 interleaved
rounds, min) and one call's GPU kernels from a profiler trace (count, span, and the summed time per
kernel name). Writes one JSON line per (case, variant) to argv[1]. Ran against commit 4b7d289 (the
counted pick), reverted in 1478fba: it was not faster (RESULTS.md, fourteenth session).
"""
import collections, dataclasses, glob, gzip, json, os, sys

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem, time_device
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

cfg = xj.HeadConfig(**SERVING)
P = Ops.pallas()
VARIANTS = {"combine": dataclasses.replace(P, name="combine", topc_counter=False), "counted": P}
CASES = [(1, 512), (4, 512), (16, 512)]
out = open(sys.argv[1], "w")


def trace(fn, args, tag):
    f = jax.jit(fn)
    for _ in range(5):
        f(*args).block_until_ready()
    d = f"/tmp/tr14_{tag}"
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(9):
            f(*args).block_until_ready()
    path = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)[0]
    dd = json.load(gzip.open(path)); ev = dd["traceEvents"] if isinstance(dd, dict) else dd
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    X = [e for e in ev if e.get("ph") == "X"]
    gpu = sorted([e for e in X if "gpu" in pname.get(e["pid"], "").lower()], key=lambda e: e["ts"])
    # one call = the kernels between two gaps > 30 µs; take the middle call
    calls, cur = [], [gpu[0]]
    for a, b in zip(gpu, gpu[1:]):
        if b["ts"] - (a["ts"] + a["dur"]) > 30:
            calls.append(cur); cur = []
        cur.append(b)
    calls.append(cur)
    ks = calls[len(calls) // 2]
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in ks:
        by[e["name"][:40]][0] += 1; by[e["name"][:40]][1] += e["dur"]
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:14]
    return dict(n=len(ks), span=round(ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"], 1), calls=len(calls),
                busy=round(sum(e["dur"] for e in ks), 1), top=[(k, c, round(t, 1)) for k, (c, t) in top])


for n, topc in CASES:
    params, logits, h, anchors = make_problem(cfg, n, std=0.02)
    T = jax.jit(xj.token_table)(params)
    args = ((params, T), logits, h, anchors)
    m = chain_length(n, topc, "pallas")
    res = {}
    for v, ops in VARIANTS.items():
        def fn(pt, l, hh, a, ops=ops):
            return refine_with(ops, pt[0], l, hh, a, config=cfg, topc=topc, token_table=pt[1])
        res[v] = dict(fn=fn, tok=np.asarray(jax.jit(fn)(*args)), chain=chained(cfg, m, refine_fn=fn), dev=[])
    for _ in range(3):
        for v, r in res.items():
            r["dev"].append(time_device(r["chain"], args, 5) / m * 1e6)
    for v, r in res.items():
        tr = trace(r["fn"], args, f"{v}_{n}_{topc}")
        row = dict(N=n, topc=topc, variant=v, device_us=[round(x, 1) for x in r["dev"]],
                   differ=int((r["tok"] != res["combine"]["tok"]).sum()), trace=tr)
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"N={n:3d} topc={topc:3d} {v:7s} dev {min(r['dev']):7.1f} differ {row['differ']} kernels {tr['n']} "
              f"busy {tr['busy']} span {tr['span']}", flush=True)
        for k, c, t in tr["top"][:6]:
            print(f"      {c:3d} x {k:40s} {t:8.1f}", flush=True)
