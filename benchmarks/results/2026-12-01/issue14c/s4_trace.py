import sys; sys.path.insert(0, ".")
"""Issue 14: per-kernel device time of one certified refine vs top-512 and scan (perfetto trace)."""
import collections, glob, gzip, json, os, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem
OUT = os.environ.get("OUT", "/tmp/out")
cfg = xj.HeadConfig(**SERVING)
res = {}
TOP = 22  # kernels kept per call (a later session sets more)

def parse(path, tag):
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
    api = [e for e in X if "gpu" not in pname.get(e["pid"], "").lower() and (e["name"].startswith("cu") or "Memcpy" in e["name"] or "Sync" in e["name"])]
    per = []
    for i, c in enumerate(outer[2:-1], 2):
        t0 = c["ts"]; t1 = outer[i + 1]["ts"]
        g = [e for e in gpu if t0 <= e["ts"] < t1]
        if not g: continue
        agg = collections.defaultdict(float); cnt = collections.Counter()
        for e in g:
            k = e["name"][:48]; agg[k] += e["dur"]; cnt[k] += 1
        a = collections.Counter(e["name"][:40] for e in api if t0 <= e["ts"] < t1)
        per.append(dict(span=max(e["ts"] + e["dur"] for e in g) - min(e["ts"] for e in g), busy=sum(e["dur"] for e in g),
                        n=len(g), host=c["dur"], agg=agg, cnt=cnt, api=a))
    m = per[len(per) // 2]
    top = sorted(m["agg"].items(), key=lambda kv: -kv[1])[:TOP]
    return dict(span=m["span"], busy=m["busy"], n=m["n"], host=m["host"], kernels=[(k, round(v, 1), m["cnt"][k]) for k, v in top],
                api=m["api"].most_common(8), spans=[round(p["span"]) for p in per])

def trace_refine(n, tag, std=0.02, prepared=False, **kw):
    """Trace 8 calls of one jitted Pallas refine (after 5 warm-ups) and parse the median call.
    ``prepared``: pass the certified mode's weight data (as a server does)."""
    p, l, h, a = make_problem(cfg, n, std=std)
    if prepared:
        from xpress_jax.exact import prepare_certified
        kw["certified_prepared"] = prepare_certified(p["w2"])
    f = jax.jit(lambda p, l, h, a: xj.refine(p, l, h, a, config=cfg, backend="pallas", **kw))
    for _ in range(5): f(p, l, h, a).block_until_ready()
    d = f"/tmp/tr_{n}_{tag}"
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(8): f(p, l, h, a).block_until_ready()
    path = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)[0]
    try:
        return parse(path, tag)
    except Exception as ex:
        return repr(ex)


if __name__ == "__main__":
    for n in (4, 16, 64):
        for tag, kw in (("cert", dict(topc=0, full_vocab="certified")),):
            r = trace_refine(n, tag, **kw)
            res[f"{n} {tag}"] = r
            print(f"== N={n} {tag}", json.dumps(r, indent=None)[:3000], flush=True)
    json.dump(res, open(f"{OUT}/trace_cert.json", "w"), indent=1)
