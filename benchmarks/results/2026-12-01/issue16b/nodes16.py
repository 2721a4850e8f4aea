"""Issue 16: wall-time cost per graph node (chains of k tiny kernels) and per pass (refine at K=1..6)."""
import json, os, statistics, time
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
res = {}

def walls(fn, args, calls=200, rounds=3):
    W, E = [], []
    for _ in range(rounds):
        w, e = [], []
        for _ in range(calls):
            t = time.perf_counter(); o = fn(*args); t1 = time.perf_counter(); o.block_until_ready(); t2 = time.perf_counter()
            w.append(t2 - t); e.append(t1 - t)
        W.append(round(statistics.median(w) * 1e6, 1)); E.append(round(statistics.median(e) * 1e6, 1))
    return W, E

x = jnp.arange(1024, dtype=jnp.float32)
for k in (1, 8, 24, 72):
    def f(x, k=k):
        for i in range(k):
            x = jax.lax.optimization_barrier(jnp.sin(x) + 1.0)
        return x
    def dev(x, k=k, m=50):
        return jax.lax.fori_loop(0, m, lambda i, x: f(x), x)
    c = jax.jit(f).lower(x).compile()
    for _ in range(20): c(x).block_until_ready()
    d = time_jitted(jax.jit(dev), (x,), 5)[1] / 50 * 1e6
    w, e = walls(c, (x,))
    res[f"chain k={k}"] = dict(device=round(d, 1), wall=w, enqueue=e)
    print(json.dumps({f"chain k={k}": res[f"chain k={k}"]}), flush=True)

for n, topc in ((1, cfg.topc), (1, 0), (16, cfg.topc)):
    p, l, h, a = make_problem(cfg, n)
    for K in (1, 2, 4, 6):
        fn = lambda p, l, h, a, K=K, topc=topc: refine_with(OPS, p, l, h, a, config=cfg, topc=topc, num_passes=K)
        c = jax.jit(fn).lower(p, l, h, a).compile()
        for _ in range(10): c(p, l, h, a).block_until_ready()
        m = 100
        d = time_jitted(chained(cfg, m, refine_fn=fn), (p, l, h, a), 3)[1] / m * 1e6
        w, e = walls(c, (p, l, h, a), 100, 3)
        key = f"N={n} topc={topc} K={K}"
        res[key] = dict(device=round(d, 1), wall=w, enqueue=e)
        print(json.dumps({key: res[key]}), flush=True)
json.dump(res, open(f"{OUT}/nodes.json", "w"), indent=1)
