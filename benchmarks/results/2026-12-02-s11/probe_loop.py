"""Issue 16, session 11: what refine adds to one step of a serving loop (its marginal latency).

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02-s11/probe_loop.py OUT.jsonl

A stand-in drafter (one jit: hidden states from token embeddings, then logits = h @ lm_head with a
[4096, 151936] bf16 lm_head, 1.24 GB, about an LM head's read) runs first, asynchronously, as in a
serving loop; refine is dispatched on its outputs while it runs; the step ends when the tokens are
in a numpy array. Steps (median of 60, 3 interleaved rounds, best round):
  drafter        drafter only, then block on its logits (the baseline)
  +refine dev    + jax.jit(refine) (output on the device) + np.asarray
  +refine host   + the same refine with its output in pinned host memory + np.asarray
  +server host   + RefineServer(output="host").tokens(...)
marginal = step - drafter: what the user waits for refine in such a loop; compare with refine's
device time (chained, same run).
"""
import json, os, statistics, sys, time

import jax, jax.numpy as jnp, numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chain_length, chained, make_problem, time_device

SMALL = os.environ.get("PROBE_SMALL")
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=1001, hidden_size=64, rank=24, mlp_hidden=40, topc=17)
                       if SMALL else SERVING))
backend = "xla" if SMALL else "pallas"
out = open(sys.argv[1], "a")
dev = jax.devices()[0]
host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
H, V, B = cfg.hidden_size, cfg.vocab_size, cfg.block_size
emb = jax.device_put((jax.random.normal(k1, (V, H), jnp.float32) * 0.02).astype(jnp.bfloat16), dev)
lm_head = jax.device_put((jax.random.normal(k2, (H, V), jnp.float32) * 0.02).astype(jnp.bfloat16), dev)
pos = jax.device_put(jax.random.normal(k3, (B, H), jnp.float32).astype(jnp.bfloat16), dev)


@jax.jit
def drafter(tok):  # tok [N, B] -> logits [N, B, V], h [N, B, H], anchors [N]
    h = jnp.tanh(emb[tok] + pos)
    return (h @ lm_head) * 8.0, h, tok[:, 0]


params = jax.device_put(make_problem(cfg, 1)[0], dev)
for n in (1, 16):
    tok = jax.device_put(jax.random.randint(jax.random.key(n), (n, B), 0, V), dev)
    logits, h, anchors = drafter(tok)
    for topc in (cfg.topc, 0):
        fn = lambda p, l, h, a, topc=topc: xj.refine(p, l, h, a, config=cfg, topc=topc, backend=backend)
        ref_dev = jax.jit(fn).lower(params, logits, h, anchors).compile()
        ref_host = jax.jit(fn, out_shardings=host).lower(params, logits, h, anchors).compile()
        server = xj.RefineServer(xj.Head(cfg, params), buckets=(n,), topc=topc, output="host", progress=False)
        want = np.asarray(ref_dev(params, logits, h, anchors))
        same = all(np.array_equal(want, np.asarray(x)) for x in (ref_host(params, logits, h, anchors),
                                                                server.tokens(logits, h, anchors)))

        def step(kind):
            lg, hh, an = drafter(tok)
            if kind == "drafter":
                return lg.block_until_ready()
            if kind == "+refine dev":
                return np.asarray(ref_dev(params, lg, hh, an))
            if kind == "+refine host":
                return np.asarray(ref_host(params, lg, hh, an))
            return server.tokens(lg, hh, an)

        kinds = ("drafter", "+refine dev", "+refine host", "+server host")
        res = {k: [] for k in kinds}
        for k in kinds:
            step(k)
        for _ in range(3):
            for k in kinds:
                ts = []
                for _ in range(5 if SMALL else 60):
                    t0 = time.perf_counter(); step(k); ts.append(time.perf_counter() - t0)
                res[k].append(statistics.median(ts) * 1e6)
        m = 2 if SMALL else chain_length(n, topc, "pallas")
        devt = time_device(chained(cfg, m, refine_fn=fn), (params, logits, h, anchors), 5) / m * 1e6
        best = {k: min(v) for k, v in res.items()}
        row = dict(N=n, topc=topc, same_tokens=same, device_us=round(devt, 1),
                   **{k: [round(x, 1) for x in v] for k, v in res.items()},
                   marginal={k: round(best[k] - best["drafter"], 1) for k in kinds[1:]})
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"N={n:3d} topc={topc:3d} same {same} refine device {devt:6.1f} | drafter step {best['drafter']:6.1f} | "
              + " ".join(f"{k} +{row['marginal'][k]:6.1f}" for k in kinds[1:]), flush=True)
