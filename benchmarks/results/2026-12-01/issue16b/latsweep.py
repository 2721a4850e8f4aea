"""Issue 16: split-latent configs inside refine at small N (device chained + one call's wall)."""
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
L = lambda **kw: lk.LatentConfig(variant="split", row_block=0, **kw)
VARS = {
    "plan": None,
    "xla": Ops.xla("gpu").latent,
    "split-default": L(k_block=64, h_block=32, col_block=32, num_warps=4, num_stages=2),
    "A kb512 hb16 cb16 w4 s1": L(k_block=512, h_block=16, col_block=16, num_warps=4, num_stages=1),
    "B kb512 hb32 cb16 w4 s1": L(k_block=512, h_block=32, col_block=16, num_warps=4, num_stages=1),
    "C kb128 hb16 cb16 w4 s2": L(k_block=128, h_block=16, col_block=16, num_warps=4, num_stages=2),
    "D kb512 hb16 cb16 w2 s1": L(k_block=512, h_block=16, col_block=16, num_warps=2, num_stages=1),
    "E kb512 hb16 cb32 w4 s1": L(k_block=512, h_block=16, col_block=32, num_warps=4, num_stages=1),
}
res = {}
def walls(fn, args, calls=100, rounds=3):
    W = []
    for _ in range(rounds):
        w = []
        for _ in range(calls):
            t = time.perf_counter(); fn(*args).block_until_ready(); w.append(time.perf_counter() - t)
        W.append(round(statistics.median(w) * 1e6, 1))
    return W
for n, topc in ((1, cfg.topc), (4, cfg.topc), (16, cfg.topc), (1, 0)):
    p, l, h, a = make_problem(cfg, n)
    ref_tok = None
    for name, v in VARS.items():
        if v is None: ops = base
        elif callable(v): ops = dataclasses.replace(base, latent=v)
        else: ops = dataclasses.replace(base, latent=functools.partial(lk.latent_pass, config=v, interpret=SMALL))
        fn = lambda p, l, h, a, ops=ops, topc=topc: refine_with(ops, p, l, h, a, config=cfg, topc=topc)
        try:
            c = jax.jit(fn).lower(p, l, h, a).compile()
            tok = np.asarray(c(p, l, h, a))
            if ref_tok is None: ref_tok = tok
            m = 100 if not SMALL else 2
            d = time_jitted(chained(cfg, m, refine_fn=fn), (p, l, h, a), 3)[1] / m * 1e6
            w = walls(c, (p, l, h, a), 100 if not SMALL else 3, 3)
            r = dict(device=round(d, 1), wall=w, differ=int((tok != ref_tok).sum()))
        except Exception as e:
            r = dict(error=repr(e)[:300])
        res[f"N={n} topc={topc} {name}"] = r
        print(json.dumps({f"N={n} topc={topc} {name}": r}), flush=True)
json.dump(res, open(f"{OUT}/latsweep.json", "w"), indent=1)
