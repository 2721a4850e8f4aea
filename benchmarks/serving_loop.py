"""What refine adds to one step of a serving loop: its marginal latency behind a drafter.

    PYTHONPATH=$PWD python -m benchmarks.serving_loop [--n 1,16] [--topc 512,0] [--out DIR]   # GPU, serving shapes
    PYTHONPATH=$PWD python -m benchmarks.serving_loop --small                                 # smoke test on a CPU

A serving loop does not call refine on an idle device: the drafter's work is still running when refine
is dispatched on its outputs. This times whole steps. A stand-in drafter (one jit: hidden states from
token embeddings, then ``logits = h @ lm_head`` with an [H, V] lm_head, 1.24 GB in bf16 at serving
shapes, about an LM head's read) is dispatched first, then (per kind):

  drafter        nothing more: block on the drafter's logits (the baseline step)
  +refine dev    ``jax.jit(refine)``, output on the device, then ``np.asarray`` (a device-to-host copy)
  +refine host   the same refine with its output in pinned host memory, then ``np.asarray``
  +server host   ``RefineServer(output="host").tokens(...)`` (with its token table: the default)

Per (N, C): the median step over ``--steps`` steps, in ``--rounds`` interleaved rounds (the best round is
reported), and **marginal = step - drafter step**: what the user waits for refine in such a loop. Compare
it with refine's device time (chained in one jit, same run) and with one call's wall time on an idle
device (`benchmarks.bench_refine`). Every kind is checked to give the same tokens. Writes
serving_loop.jsonl (a line per (N, C), as it goes) and serving_loop.md under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chain_length, chained, make_problem, time_device

KINDS = ("drafter", "+refine dev", "+refine host", "+server host")
SMALL = dict(SERVING, vocab_size=1001, hidden_size=64, rank=24, mlp_hidden=40, topc=17)


def make_drafter(cfg: xj.HeadConfig, dtype, seed: int = 5):
    """A jitted stand-in drafter: tokens [N, B] -> (logits [N, B, V], h [N, B, H], anchors [N])."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    H, V, B = cfg.hidden_size, cfg.vocab_size, cfg.block_size
    emb = (jax.random.normal(k1, (V, H), jnp.float32) * 0.02).astype(dtype)
    lm_head = (jax.random.normal(k2, (H, V), jnp.float32) * 0.02).astype(dtype)
    pos = jax.random.normal(k3, (B, H), jnp.float32).astype(dtype)

    @jax.jit
    def drafter(tok):
        h = jnp.tanh(emb[tok] + pos)
        return (h @ lm_head) * 8.0, h, tok[:, 0]

    return drafter


def measure(cfg, params, drafter, n: int, topc: int, steps: int, rounds: int, reps: int, backend: str) -> dict:
    """One (N, C): the steps of every kind, the marginals, refine's device time, whether the tokens agree."""
    tok = jax.random.randint(jax.random.key(n), (n, cfg.block_size), 0, cfg.vocab_size)
    logits, h, anchors = drafter(tok)
    fn = lambda p, l, hh, a: xj.refine(p, l, hh, a, config=cfg, topc=topc, backend=backend)
    host = jax.sharding.make_single_device_sharding(jax.devices()[0], memory_kind="pinned_host")
    ref_dev = jax.jit(fn).lower(params, logits, h, anchors).compile()
    ref_host = jax.jit(fn, out_shardings=host).lower(params, logits, h, anchors).compile()
    server = xj.RefineServer(xj.Head(cfg, params), buckets=(n,), topc=topc, backend=backend, output="host",
                             progress=False)
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

    res = {k: [] for k in KINDS}
    for k in KINDS:
        step(k)  # warm
    for _ in range(rounds):
        for k in KINDS:
            ts = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step(k)
                ts.append(time.perf_counter() - t0)
            res[k].append(statistics.median(ts) * 1e6)
    m = chain_length(n, topc, backend) if jax.default_backend() == "gpu" else 2
    device = time_device(chained(cfg, m, refine_fn=fn), (params, logits, h, anchors), reps) / m * 1e6
    best = {k: min(v) for k, v in res.items()}
    return dict(N=n, topc=topc, same_tokens=bool(same), device_us=round(device, 1),
                steps_us={k: [round(x, 1) for x in v] for k, v in res.items()},
                marginal_us={k: round(best[k] - best["drafter"], 1) for k in KINDS[1:]})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1,16", help="comma list of N (blocks per call)")
    ap.add_argument("--topc", default="512,0", help="comma list of C (0 = full vocabulary; with --small 512 becomes 17)")
    ap.add_argument("--steps", type=int, default=60, help="steps per round (median)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best reported)")
    ap.add_argument("--reps", type=int, default=5, help="timed repeats of the chained device-time measurement")
    ap.add_argument("--small", action="store_true", help="tiny shapes, XLA backend (smoke test on a CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "serving_loop_out"))
    args = ap.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.reps < 1:
        raise SystemExit("serving_loop: --steps, --rounds and --reps must be >= 1")
    cfg = xj.HeadConfig(**(SMALL if args.small else SERVING))
    ns = [int(x) for x in args.n.split(",")]
    topcs = [cfg.topc if (args.small and int(x) == 512) else int(x) for x in args.topc.split(",")]
    if any(x < 1 or x > cfg.max_num_reqs for x in ns):
        raise SystemExit(f"serving_loop: --n values must lie in [1, {cfg.max_num_reqs}], got {ns}")
    backend = "xla" if args.small or jax.default_backend() != "gpu" else "pallas"
    dtype = jnp.bfloat16
    params = make_problem(cfg, 1, dtype=dtype)[0]
    drafter = make_drafter(cfg, dtype)
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    print(f"# serving loop: {dev.device_kind}, jax {jax.__version__}, backend {backend}, V={cfg.vocab_size}; "
          f"results stream to {os.path.join(args.out, 'serving_loop.jsonl')}", flush=True)
    rows = []
    with open(os.path.join(args.out, "serving_loop.jsonl"), "w") as stream:
        for n in ns:
            for topc in topcs:
                row = measure(cfg, params, drafter, n, topc, args.steps, args.rounds, args.reps, backend)
                rows.append(row)
                stream.write(json.dumps(row) + "\n")
                stream.flush()
                mg = row["marginal_us"]
                print(f"N={n:3d} C={topc:4d} same {row['same_tokens']} device {row['device_us']:8.1f} | drafter step "
                      f"{min(row['steps_us']['drafter']):8.1f} | " + " ".join(f"{k} {mg[k]:+8.1f}" for k in KINDS[1:]),
                      flush=True)
    lines = [f"Serving loop on {dev.device_kind}, JAX {jax.__version__}, {time.strftime('%Y-%m-%d')}, backend "
             f"{backend}, bf16, V={cfg.vocab_size}; µs; marginal = step - drafter-only step (best of "
             f"{args.rounds} rounds of {args.steps} steps)", "",
             "| mode | N | refine device | drafter step | " + " | ".join(f"marginal {k}" for k in KINDS[1:])
             + " | same tokens |", "|---|---:|---:|---:|" + "---:|" * (len(KINDS) - 1) + "---|"]
    for r in rows:
        mode = "full vocab" if r["topc"] == 0 else f"top-{r['topc']}"
        lines.append(f"| {mode} | {r['N']} | {r['device_us']:.1f} | {min(r['steps_us']['drafter']):.1f} | "
                     + " | ".join(f"{r['marginal_us'][k]:+.1f}" for k in KINDS[1:]) + f" | {r['same_tokens']} |")
    with open(os.path.join(args.out, "serving_loop.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not all(r["same_tokens"] for r in rows):
        raise SystemExit("serving_loop: the kinds gave different tokens (see same_tokens)")


if __name__ == "__main__":
    main()
