"""Issue 16, session 11, probe 2: what a call costs when XLA need not update its command buffer.

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02-s11/probe_stable.py OUT.jsonl

XLA re-records the commands that touch any buffer whose address changed since the last call
(probe_wall.py's log: one allocation changes every call, even with the same inputs). Here the output
is made to alias a donated buffer that the next call donates again, so every address is stable:
"plain" = exe(*args) (new output each call); "donate" = buf = exe(buf, *args). Cases: a chain of 72
tiny kernels, refine top-512 / full at N=1 and top-512 at N=16 (Pallas, serving shapes, bf16, K=6).
Per case: one call's wall / enqueue (median of 100, 3 interleaved rounds, the best round printed).
"""
import json, os, statistics, sys, time

import jax, jax.numpy as jnp

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem

SMALL = os.environ.get("PROBE_SMALL")
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=1001, hidden_size=64, rank=24, mlp_hidden=40, topc=17)
                       if SMALL else SERVING))
backend = "xla" if SMALL else "pallas"
out = open(sys.argv[1], "a")
VLOG = os.environ.get("TF_CPP_VMODULE")


def chain(x):
    for _ in range(72):
        x = jax.lax.optimization_barrier(x * 1.0001 + 1.0)
    return x


cases = []
x0 = jnp.arange(1024, dtype=jnp.float32)
plain = jax.jit(chain).lower(x0).compile()
don = jax.jit(lambda b, x: chain(x) + 0 * b, donate_argnums=0).lower(x0, x0).compile()
cases.append(("chain72", plain, don, [x0], x0))
for n, topc in ((1, 512), (1, 0), (16, 512)):
    topc = topc and cfg.topc
    prob = list(make_problem(cfg, n, std=0.02))

    def fn(p, l, h, a, topc=topc):
        return xj.refine(p, l, h, a, config=cfg, topc=topc, backend=backend)

    plain = jax.jit(fn).lower(*prob).compile()
    buf = jnp.zeros((n, cfg.block_size - 1), jnp.int32)
    don = jax.jit(lambda b, *a: fn(*a) + 0 * b, donate_argnums=0).lower(buf, *prob).compile()
    cases.append((f"N{n}_{'top' if topc else 'full'}", plain, don, prob, buf))

for name, plain, don, args, buf0 in cases:
    buf = jnp.array(buf0)
    for _ in range(3):
        plain(*args).block_until_ready()
        buf = don(buf, *args); buf.block_until_ready()
    same = bool((plain(*args) == don(jnp.array(buf0), *args)).all()) if name != "chain72" else True
    res = {"plain": [], "donate": []}
    calls = 6 if VLOG else (5 if SMALL else 100)
    for rnd in range(1 if VLOG else 3):
        for kind in res:
            if VLOG:
                print(f"=== MARK {name} {kind}", file=sys.stderr, flush=True)
            w, e = [], []
            for _ in range(calls):
                t0 = time.perf_counter()
                if kind == "plain":
                    r = plain(*args)
                else:
                    r = buf = don(buf, *args)
                t1 = time.perf_counter()
                r.block_until_ready()
                w.append(time.perf_counter() - t0); e.append(t1 - t0)
            res[kind].append((statistics.median(w) * 1e6, statistics.median(e) * 1e6))
    row = dict(case=name, same_tokens=same, **{k: [[round(a, 1), round(b, 1)] for a, b in v] for k, v in res.items()})
    out.write(json.dumps(row) + "\n"); out.flush()
    print(f"{name:10s} same {same} " + " ".join(
        f"{k} wall/enq {min(v)[0]:6.1f}/{min(v)[1]:5.1f}" for k, v in res.items()), flush=True)
