"""Issue 16, session 11, probe 3: the tokens written straight to pinned host memory.

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02-s11/probe_host_out.py OUT.jsonl

A serving loop needs the tokens on the host. "plain" = exe(*args) then np.asarray (a device result,
then a device-to-host copy); "host" = the executable's output placed in pinned host memory
(out_shardings memory_kind="pinned_host"), then np.asarray; "donate" = probe_stable.py's stable
output buffer (not a usable API: for comparison). Per case: one call's wall to a numpy array and its
enqueue (median of 100, 3 interleaved rounds, best round), and whether the tokens equal plain's.
"""
import json, os, statistics, sys, time

import jax, jax.numpy as jnp, numpy as np
from jax.sharding import SingleDeviceSharding

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem

SMALL = os.environ.get("PROBE_SMALL")
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=1001, hidden_size=64, rank=24, mlp_hidden=40, topc=17)
                       if SMALL else SERVING))
backend = "xla" if SMALL else "pallas"
out = open(sys.argv[1], "a")
VLOG = os.environ.get("TF_CPP_VMODULE")
dev = jax.devices()[0]
host = SingleDeviceSharding(dev, memory_kind="pinned_host")

for n, topc in ((1, 512), (1, 0), (16, 512), (16, 0)):
    topc = topc and cfg.topc
    name = f"N{n}_{'top' if topc else 'full'}"
    prob = list(make_problem(cfg, n, std=0.02))

    def fn(p, l, h, a, topc=topc):
        return xj.refine(p, l, h, a, config=cfg, topc=topc, backend=backend)

    exes = {"plain": jax.jit(fn).lower(*prob).compile()}
    try:
        exes["host"] = jax.jit(fn, out_shardings=host).lower(*prob).compile()
    except Exception as e:  # noqa: BLE001
        print(f"{name}: pinned_host output refused: {type(e).__name__}: {str(e)[:200]}", flush=True)
    buf0 = jnp.zeros((n, cfg.block_size - 1), jnp.int32)
    don = jax.jit(lambda b, *a: fn(*a) + 0 * b, donate_argnums=0).lower(buf0, *prob).compile()
    ref = np.asarray(exes["plain"](*prob))
    same = {k: bool((np.asarray(e(*prob)) == ref).all()) for k, e in exes.items()}
    kinds = list(exes) + ["donate"]
    res = {k: [] for k in kinds}
    buf = jnp.array(buf0)
    for _ in range(3):
        buf = don(buf, *prob); np.asarray(buf)
        for e in exes.values():
            np.asarray(e(*prob))
    for rnd in range(1 if VLOG else 3):
        for kind in kinds:
            if VLOG:
                print(f"=== MARK {name} {kind}", file=sys.stderr, flush=True)
            w, q = [], []
            for _ in range(6 if VLOG else (5 if SMALL else 100)):
                t0 = time.perf_counter()
                if kind == "donate":
                    r = buf = don(buf, *prob)
                else:
                    r = exes[kind](*prob)
                t1 = time.perf_counter()
                np.asarray(r)
                w.append(time.perf_counter() - t0); q.append(t1 - t0)
            res[kind].append((statistics.median(w) * 1e6, statistics.median(q) * 1e6))
    row = dict(case=name, same_tokens=same, host_sharding=str(exes["host"].output_shardings) if "host" in exes else None,
               **{k: [[round(a, 1), round(b, 1)] for a, b in v] for k, v in res.items()})
    out.write(json.dumps(row) + "\n"); out.flush()
    print(f"{name:9s} same {same} " + " ".join(
        f"{k} {min(v)[0]:6.1f}/{min(v)[1]:5.1f}" for k, v in res.items()), flush=True)
