"""Issue 16, session 12: JAX's own per-call floor on this machine, the way refine is called.

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-03-s12/probe_floor.py OUT.jsonl

A trivial jit (one tiny kernel: tokens [N, B-1] int32 = anchors broadcast + 1) taking refine's own
arguments (the serving params dict, logits, h, anchors), AOT-compiled, at N = 1 and 16. Median of 200
single calls, 3 interleaved rounds (µs):
  enqueue          the call, not waited on
  ready            call + block_until_ready (output on the device)
  numpy dev        call + np.asarray (output on the device: a device-to-host copy)
  numpy host       call + np.asarray with the output in pinned host memory
This is what any jitted function with these arguments pays before and after its device work.
"""
import json, os, statistics, sys, time

import jax, jax.numpy as jnp, numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem

SMALL = os.environ.get("PROBE_SMALL")
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=1001, hidden_size=64, rank=24, mlp_hidden=40, topc=17)
                       if SMALL else SERVING))
out = open(sys.argv[1], "a")
dev = jax.devices()[0]
host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
B = cfg.block_size


def trivial(p, logits, h, anchors):
    return jnp.broadcast_to(anchors[:, None], (anchors.shape[0], B - 1)) + 1


reps = 10 if SMALL else 200
for n in (1, 16):
    prob = jax.device_put(make_problem(cfg, n, std=0.02), dev)
    exe_dev = jax.jit(trivial).lower(*prob).compile()
    exe_host = jax.jit(trivial, out_shardings=host).lower(*prob).compile()
    kinds = {
        "enqueue": lambda: exe_dev(*prob),
        "ready": lambda: exe_dev(*prob).block_until_ready(),
        "numpy dev": lambda: np.asarray(exe_dev(*prob)),
        "numpy host": lambda: np.asarray(exe_host(*prob)),
    }
    res = {k: [] for k in kinds}
    for f in kinds.values():
        f()
    for _ in range(3):
        for k, f in kinds.items():
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
            jax.block_until_ready(exe_dev(*prob))
            res[k].append(round(statistics.median(ts) * 1e6, 1))
    n_args = len(jax.tree_util.tree_leaves(prob))
    row = dict(N=n, n_args=n_args, **res)
    out.write(json.dumps(row) + "\n"); out.flush()
    print(f"floor N={n:3d} args={n_args} " + " ".join(f"{k} {min(v):6.1f}" for k, v in res.items()), flush=True)
