"""Issue 16 call 5: latent choice N=8..64 in refine; optimized HLO at N=1; server vs jit wall; graph update test."""
import dataclasses, functools, json, os, statistics, time
import jax, jax.numpy as jnp, numpy as np
import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem, chained
from benchmarks.timing import time_jitted
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with
from xpress_jax.kernels import latent as lk

OUT = os.environ.get("OUT", "/tmp/out")
SMALL = jax.default_backend() != "gpu"
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=4099, hidden_size=128, rank=64, mlp_hidden=128, topc=64) if SMALL else SERVING))
base = Ops.pallas(interpret=SMALL)
res = {}
def med_wall(fn, calls=100, rounds=3, keep=False):
    W, kept = [], []
    for _ in range(rounds):
        w = []
        for _ in range(calls):
            t = time.perf_counter(); o = fn(); o.block_until_ready(); w.append(time.perf_counter() - t)
            if keep: kept.append(o)
        W.append(round(statistics.median(w) * 1e6, 1))
    return W
def emit(k, v):
    res[k] = v; print(json.dumps({k: v}), flush=True)

# (d) graph update: outputs kept alive (new addresses every call) vs dropped
x = jnp.arange(1024, dtype=jnp.float32)
def chain72(x):
    for i in range(72):
        x = jax.lax.optimization_barrier(jnp.sin(x) + 1.0)
    return x
c72 = jax.jit(chain72).lower(x).compile()
for _ in range(20): c72(x).block_until_ready()
emit("chain72 dropped", med_wall(lambda: c72(x)))
emit("chain72 kept", med_wall(lambda: c72(x), keep=True))
emit("chain72 dropped again", med_wall(lambda: c72(x)))

# (a) latent choice inside refine at N=8..64
B = lk.LatentConfig(variant="split", row_block=0, k_block=512, h_block=32, col_block=16, num_warps=4, num_stages=1)
VARS = {"plan": base, "xla": dataclasses.replace(base, latent=Ops.xla("gpu").latent),
        "B": dataclasses.replace(base, latent=functools.partial(lk.latent_pass, config=B, interpret=SMALL))}
for n in ((2, 8, 16, 32, 64) if not SMALL else (2,)):
    for topc in (cfg.topc, 0):
        p, l, h, a = make_problem(cfg, n)
        ref_tok = None
        for name, ops in VARS.items():
            fn = lambda p, l, h, a, ops=ops, topc=topc: refine_with(ops, p, l, h, a, config=cfg, topc=topc)
            c = jax.jit(fn).lower(p, l, h, a).compile()
            tok = np.asarray(c(p, l, h, a)); ref_tok = tok if ref_tok is None else ref_tok
            m = {2: 100, 8: 100, 16: 100, 32: 60, 64: 40}[n] if not SMALL else 2
            d = time_jitted(chained(cfg, m, refine_fn=fn), (p, l, h, a), 3)[1] / m * 1e6
            emit(f"N={n} topc={topc} {name}", dict(device=round(d, 1), wall=med_wall(lambda: c(p, l, h, a), 50, 2),
                                                   differ=int((tok != ref_tok).sum())))
# (b) optimized HLO at N=1 top-512
p, l, h, a = make_problem(cfg, 1)
fn = lambda p, l, h, a: refine_with(base, p, l, h, a, config=cfg, topc=cfg.topc)
open(f"{OUT}/hlo_n1_top512.txt", "w").write(jax.jit(fn).lower(p, l, h, a).compile().as_text())
# (c) server vs jit
for topc in (cfg.topc, 0):
    p, _, _, _ = make_problem(cfg, 1)
    head = xj.Head(cfg, p)
    server = xj.RefineServer(head, buckets=(1, 16), topc=topc, progress=False)
    f = jax.jit(lambda hd, l, h, a: xj.refine(hd, l, h, a, topc=topc))
    for n in (1, 16):
        _, l, h, a = make_problem(cfg, n)
        for _ in range(5): server(l, h, a).block_until_ready(); f(head, l, h, a).block_until_ready()
        ws, wj = [], []
        for _ in range(3):
            ws += med_wall(lambda: server(l, h, a), 100, 1); wj += med_wall(lambda: f(head, l, h, a), 100, 1)
        emit(f"server vs jit topc={topc} N={n}", dict(server=ws, jit=wj))
json.dump(res, open(f"{OUT}/call5.json", "w"), indent=1)
