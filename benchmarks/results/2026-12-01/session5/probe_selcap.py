"""Selection for C > 512: cap 1024 (default) vs larger caps. Exact vs lax.top_k (as sets), chained device time."""
import sys; sys.path.insert(0, ".")
import json, os, statistics, time
import jax, jax.numpy as jnp, numpy as np
from jax import lax
import xpress_jax as xj
from xpress_jax.kernels import select
from benchmarks.bench_refine import SERVING, make_problem
OUT = os.environ.get("OUT", "/tmp/out")
cfg = xj.HeadConfig(**SERVING)
V = 151936
res = []
combos = [(512, 1024, 2048, 0), (768, 2048, 2048, 0), (768, 2048, 4096, 0), (1024, 2048, 4096, 0), (1024, 2048, 4096, 16), (2048, 4096, 8192, 16), (2048, 8192, 8192, 16), (2048, 4096, 4096, 16), (4096, 8192, 16384, 8), (4096, 16384, 16384, 8)]
for n in [int(a) for a in sys.argv[1].split(",")]:
    _, x, _, _ = make_problem(cfg, n)
    draft = x[:, 1:].reshape(n * 15, V)
    for c, cap, G, bs in combos:
        try:
            bl = bs or (16 if n >= 16 else 32)
            f = lambda x, c=c, cap=cap, G=G, bl=bl: select.select_candidates(x.reshape(n * 16, V), c, slot_stride=16, cap=cap, block=bl, groups=G)
            cand, val, am = jax.jit(f)(x)
            tv, ti = lax.top_k(draft, c)
            ok = bool(np.array_equal(np.sort(np.asarray(cand), 1), np.sort(np.asarray(ti), 1)))
            M = 20
            @jax.jit
            def chain(x):
                def body(i, carry):
                    x, acc = carry
                    cand, val, am = f(x)
                    x, cand = lax.optimization_barrier((x, cand))
                    return x, acc + am.sum() + cand[0, 0]
                return lax.fori_loop(0, M, body, (x, jnp.int32(0)))[1]
            chain(x).block_until_ready()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter(); chain(x).block_until_ready(); ts.append((time.perf_counter() - t0) / M * 1e6)
            r = dict(n=n, c=c, cap=cap, G=G, bs=bl, exact=ok, us=round(statistics.median(ts), 1))
        except Exception as e:
            r = dict(n=n, c=c, cap=cap, G=G, error=repr(e)[:300])
        print(r, flush=True); res.append(r)
json.dump(res, open(f"{OUT}/selcap.json", "w"))
