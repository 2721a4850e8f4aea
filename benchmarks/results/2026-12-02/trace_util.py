"""Trace helpers of the 2026-12-02 issue-16 probes: one jitted call's GPU kernels from a perfetto trace."""
import glob, gzip, json

import jax


def parse(path):
    d = json.load(gzip.open(path)); ev = d["traceEvents"] if isinstance(d, dict) else d
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    tname = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
    X = [e for e in ev if e.get("ph") == "X"]
    calls = sorted([e for e in X if e["name"].startswith("PjitFunction") and "python" in tname.get((e["pid"], e["tid"]), "")], key=lambda e: e["ts"])
    outer = []
    for e in calls:
        if outer and e["ts"] < outer[-1]["ts"] + outer[-1]["dur"]: continue
        outer.append(e)
    gpu = [e for e in X if "gpu" in pname.get(e["pid"], "").lower()]
    i = len(outer) // 2
    t0 = outer[i]["ts"]; t1 = outer[i + 1]["ts"] if i + 1 < len(outer) else 1e30
    ks = sorted([e for e in gpu if t0 <= e["ts"] < t1], key=lambda e: e["ts"])
    s0 = ks[0]["ts"]
    return dict(span=round(max(e["ts"] + e["dur"] for e in ks) - s0, 1), n=len(ks),
                kernels=[(e["name"][:24], round(e["dur"], 2)) for e in ks[:40]])


def trace(fn, args, tag):
    f = jax.jit(fn)
    for _ in range(5): f(*args).block_until_ready()
    d = f"/tmp/tr16_{tag}"
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(9): f(*args).block_until_ready()
    try:
        return parse(glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)[0])
    except Exception as ex:
        return repr(ex)
