"""Is the chained harness copying the logits per iteration? bump variants at N=16/256."""
import sys; sys.path.insert(0, ".")
import json, os, jax, jax.numpy as jnp
import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem
from benchmarks.timing import time_jitted
OUT = os.environ.get("OUT", "/tmp/out"); cfg = xj.HeadConfig(**SERVING); res = {}

def chain(m, variant, **kw):
    def run(params, logits, h, anchors):
        def body(i, carry):
            logits, h, anchors, acc = carry
            out = xj.refine(params, logits, h, anchors, config=cfg, backend="pallas", **kw)
            tok = out[:, -1]
            if variant == "bump":
                bump = (tok[0] % 2).astype(logits.dtype)
                logits = logits.at[0, 0, 0].add(bump); h = h.at[0, 0, 0].add(bump)
            elif variant == "barrier":
                logits, h, tok = jax.lax.optimization_barrier((logits, h, tok))
            return logits, h, tok, acc + out.sum()
        return jax.lax.fori_loop(0, m, body, (logits, h, anchors, jnp.int32(0)))[3]
    return jax.jit(run)

for n, m in ((16, 40), (256, 8)):
    args = make_problem(cfg, n)
    for kw in (dict(topc=512), dict(topc=0)):
        for variant in ("bump", "barrier", "none"):
            f = chain(m, variant, **kw)
            _, t, _ = time_jitted(f, args, 3)
            txt = f.lower(*args).compile().as_text()
            key = f"N={n} topc={kw['topc']} {variant}"
            res[key] = dict(us=round(t / m * 1e6, 1), copies=txt.count(" copy("), copy_start=txt.count("copy-start"))
            print(key, res[key], flush=True)
json.dump(res, open(f"{OUT}/chain.json", "w"), indent=1)
