"""Issue 16: where one call's wall time goes (traces + in-process variants via compiler_options)."""
import collections, glob, gzip, json, os, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem, chained
from benchmarks.timing import time_jitted
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

OUT = os.environ.get("OUT", "/tmp/out")
SMALL = jax.default_backend() != "gpu"
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=4099, hidden_size=128, rank=64, mlp_hidden=128, topc=64) if SMALL else SERVING))
OPS = Ops.xla("cpu") if SMALL else Ops.pallas()
ALL = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
OPTS = {"default": {}, "cmdbuf": {"xla_gpu_enable_command_buffer": ALL, "xla_gpu_graph_min_graph_size": 1},
        "nocmdbuf": {"xla_gpu_enable_command_buffer": ""}}
res = {}

def walls(fn, args, calls=150):
    w, e = [], []
    for _ in range(calls):
        t = time.perf_counter(); o = fn(*args); t1 = time.perf_counter(); o.block_until_ready(); t2 = time.perf_counter()
        w.append(t2 - t); e.append(t1 - t)
    return statistics.median(w) * 1e6, statistics.median(e) * 1e6

def parse(path, tag):
    d = json.load(gzip.open(path)); ev = d["traceEvents"] if isinstance(d, dict) else d
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    tname = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
    X = [e for e in ev if e.get("ph") == "X"]
    calls = sorted([e for e in X if e["name"].startswith("PjitFunction") and "python" in tname.get((e["pid"], e["tid"]), "")],
                   key=lambda e: e["ts"])
    # keep outermost
    outer = []
    for e in calls:
        if outer and e["ts"] < outer[-1]["ts"] + outer[-1]["dur"]: continue
        outer.append(e)
    gpu = [e for e in X if "GPU" in pname.get(e["pid"], "") or "gpu" in pname.get(e["pid"], "").lower()]
    api = [e for e in X if e["name"].startswith("cu") and "GPU" not in pname.get(e["pid"], "")]
    out = []
    for i, c in enumerate(outer):
        t0 = c["ts"]; t1 = outer[i + 1]["ts"] if i + 1 < len(outer) else 1e30
        g = [e for e in gpu if t0 <= e["ts"] < t1]
        a = [e for e in api if t0 <= e["ts"] < t1]
        if not g: continue
        gs = min(e["ts"] for e in g); ge = max(e["ts"] + e["dur"] for e in g)
        busy = sum(e["dur"] for e in g)
        out.append(dict(host_call=c["dur"], first_gpu=gs - t0, gpu_span=ge - gs, gpu_busy=busy, n_gpu=len(g),
                        end_after_call=ge - (t0 + c["dur"]),
                        api=collections.Counter(e["name"] for e in a).most_common(6)))
    mid = out[len(out) // 2] if out else None
    # kernel list of a middle call
    if out:
        c = outer[len(outer) // 2]; t1 = outer[len(outer) // 2 + 1]["ts"] if len(outer) // 2 + 1 < len(outer) else 1e30
        ks = sorted([e for e in gpu if c["ts"] <= e["ts"] < t1], key=lambda e: e["ts"])
        with open(f"{OUT}/kernels_{tag}.json", "w") as f:
            json.dump([dict(name=e["name"][:80], ts=round(e["ts"] - c["ts"], 1), dur=e["dur"],
                            thread=tname.get((e["pid"], e["tid"]), "")) for e in ks], f, indent=0)
    med = {k: statistics.median(o[k] for o in out) for k in ("host_call", "first_gpu", "gpu_span", "gpu_busy", "n_gpu", "end_after_call")} if out else {}
    return dict(calls=len(out), median=med, api_example=mid["api"] if mid else None,
                pnames=sorted(set(pname.values())))

# trivial calls: argument count cost
p, l, h, a = make_problem(cfg, 1)
leaves = jax.tree.leaves(p)
for k in (1, 4, 17):
    args = ([a] + leaves + [l, h])[:k]
    f = jax.jit(lambda *xs: xs[0] + 1)
    for _ in range(20): f(*args).block_until_ready()
    res[f"trivial {k} args"] = [round(x, 1) for x in walls(f, args, 300)]
print(json.dumps(res), flush=True)

for n, topc in ((1, cfg.topc), (1, 0), (16, cfg.topc), (16, 0)):
    p, l, h, a = make_problem(cfg, n)
    fn = lambda p, l, h, a, topc=topc: refine_with(OPS, p, l, h, a, config=cfg, topc=topc)
    comps = {}
    for oname, opts in OPTS.items():
        comps[oname] = jax.jit(fn).lower(p, l, h, a).compile(compiler_options=opts)
        for _ in range(10): comps[oname](p, l, h, a).block_until_ready()
    toks = {k: np.asarray(c(p, l, h, a)) for k, c in comps.items()}
    same = all((v == toks["default"]).all() for v in toks.values())
    m = 100
    devs = {}
    for oname, opts in OPTS.items():
        ch = jax.jit(chained(cfg, m, refine_fn=fn)).lower(p, l, h, a).compile(compiler_options=opts)
        devs[oname] = round(time_jitted(ch, (p, l, h, a), 3)[1] / m * 1e6, 1)
    rounds = collections.defaultdict(list); enq = collections.defaultdict(list)
    for r in range(4):
        for oname in OPTS:
            w, e = walls(comps[oname], (p, l, h, a), 100)
            rounds[oname].append(round(w)); enq[oname].append(round(e))
    key = f"N={n} topc={topc}"
    res[key] = dict(same_tokens=same, device=devs, wall_rounds=dict(rounds), enqueue=dict(enq))
    print(json.dumps({key: res[key]}), flush=True)
    if n == 1 or topc:
        for oname in ("default", "cmdbuf"):
            d = f"/tmp/trace_{n}_{topc}_{oname}"
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(12): comps[oname](p, l, h, a).block_until_ready()
            path = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)[0]
            tag = f"{n}_{topc}_{oname}"
            try:
                res[f"trace {tag}"] = parse(path, tag)
            except Exception as ex:
                res[f"trace {tag}"] = f"parse error {ex!r}"
            os.system(f"cp {path} {OUT}/trace_{tag}.json.gz")
            print(json.dumps({f"trace {tag}": res[f"trace {tag}"]}), flush=True)
json.dump(res, open(f"{OUT}/res.json", "w"), indent=1)
