"""What this session's probes share. `time_variants` (`probe_pick_configs.py`, `probe_fv_configs.py`,
`probe_select_configs.py`): refine with each variant's `Ops` on one problem, chained device time per refine
with a token table (interleaved rounds), and the tokens against the "served" variant. `kernel_trace`
(`probe_counted.py`): one call's kernels from a profiler trace. (The probes that ran did so with this code
written out in each; it moved here unchanged afterwards.)"""
import collections, glob, gzip, json

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


def kernel_trace(fn, args, tag):
    """One call's GPU kernels from a profiler trace of ``jit(fn)(*args)`` (9 calls; the middle one, calls split at
    gaps > 30 µs): kernel count, span and summed time (µs), and the 14 kernel names with the most time. Trace
    files go under /tmp/<tag>. (Moved here from `probe_counted.py`, unchanged but for the folder name.)"""
    f = jax.jit(fn)
    for _ in range(5):
        f(*args).block_until_ready()
    d = f"/tmp/{tag}"
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
