"""How many Jacobi passes until a block stops changing: the evidence for `refine(early_exit=...)`.

    python -m benchmarks.fixed_point [--block-size 16] [--steps 1000] [--out DIR]

Trains a head on the embedded toy task (`xpress_jax.toy`, `xpress_jax.train`: the same recipe as
examples/serving_step.py), then refines 4096 blocks from the task's context distribution with
K = 1..K_max passes (float32, XLA backend, full vocabulary and top-C) and finds, per block, the first
pass that returns its input unchanged (the block's fixed point: every later pass returns it too).
A call of N blocks stops at the first checked pass after which all of its blocks are fixed; with
refine's default checks (`xpress_jax.refine.exit_checks`) that is the number of passes it runs. Prints,
per mode and N, the share of calls that stop after each pass (random calls of N of the 4096 blocks),
and writes fixed_point.json. The same for an untrained head (init std 0.02), for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from xpress_jax.refine import exit_checks
from xpress_jax.toy import ToyConfig, ToyTask, accepted_length
from xpress_jax.train import TrainConfig, train


def block_fixed_pass(head, batch, num_passes: int, topc: int) -> np.ndarray:
    """Per block: the first pass p in 1..num_passes whose output equals its input (num_passes + 1: none)."""
    run = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)
    prev = np.asarray(jnp.argmax(batch.logits[:, 1:], axis=-1))  # pass 0: the start block (full-vocab argmax)
    first = np.full(prev.shape[0], num_passes + 1)
    for p in range(1, num_passes + 1):
        out = np.asarray(run(head, batch.logits, batch.h, batch.anchors, batch.prev_ids, num_passes=p, topc=topc,
                             max_num_reqs=prev.shape[0], backend="xla"))
        same = (out == prev).all(axis=1) & (first > num_passes)
        first[same] = p
        prev = out
    return first


def passes_run(first: np.ndarray, n: int, num_passes: int, calls: int, rng) -> np.ndarray:
    """Passes a call of ``n`` random blocks runs with refine's default checks."""
    checks = exit_checks(n, num_passes)
    idx = rng.integers(0, first.shape[0], size=(calls, n))
    call_first = first[idx].max(axis=1)  # the call's fixed point: its slowest block's
    out = np.full(calls, num_passes)
    for q in sorted(checks, reverse=True):
        out[call_first <= q] = q
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=16, help="B of the toy task (serving: 16)")
    ap.add_argument("--num-passes", type=int, default=6, help="K (serving: 6)")
    ap.add_argument("--steps", type=int, default=1000, help="training steps (64 blocks each)")
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "fixed_point_out"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    task = ToyTask(ToyConfig(block_size=args.block_size))
    cfg = task.head_config(num_passes=args.num_passes)
    t0 = time.perf_counter()
    res = train(cfg, task.tables, ToyTask.sample, TrainConfig(steps=args.steps, batch_size=64), progress=False)
    train_s = time.perf_counter() - t0
    heads = {"trained": res.model.to_serving(), "untrained (std 0.02)": xj.init_head(cfg, jax.random.key(7))}
    batch = ToyTask.sample(task.tables, jax.random.key(1234), args.blocks)
    rng = np.random.default_rng(0)
    K = args.num_passes
    report = dict(jax=jax.__version__, block_size=args.block_size, K=K, steps=args.steps, train_s=round(train_s, 1),
                  vocab=cfg.vocab_size, topc=cfg.topc, blocks=args.blocks, heads={})
    lines = [f"toy task V={cfg.vocab_size} B={args.block_size} K={K}; head trained {args.steps} steps x 64 blocks "
             f"in {train_s:.1f} s; {args.blocks} blocks; JAX {jax.__version__}"]
    for name, head in heads.items():
        hrep = {}
        for topc in (0, cfg.topc):
            first = block_fixed_pass(head, batch, K, topc)
            draft = xj.refine(head, batch.logits, batch.h, batch.anchors, batch.prev_ids, num_passes=K, topc=topc,
                              max_num_reqs=args.blocks, backend="xla")
            acc = float(jnp.mean(accepted_length(draft, batch.target)))
            mode = "full vocab" if topc == 0 else f"top-{topc}"
            block_hist = {int(p): float(np.mean(first == p)) for p in range(1, K + 2)}
            per_n = {}
            for n in (1, 4, 16, 64, 256):
                runs = passes_run(first, n, K, 2000, rng)
                per_n[n] = dict(mean_passes=float(runs.mean()), share={int(q): float(np.mean(runs == q))
                                                                       for q in sorted(set(runs.tolist()))})
            hrep[mode] = dict(accepted=acc, block_first_fixed_pass=block_hist, calls=per_n)
            lines.append(f"{name:22s} {mode:10s} accepted {acc:.2f}/{args.block_size - 1}; block fixed at pass "
                         + ", ".join(f"{p}: {v:.1%}" for p, v in block_hist.items() if v)
                         + f" ({K + 1} = not within K)")
            for n, r in per_n.items():
                lines.append(f"    N={n:3d}: passes run with early_exit=True, mean {r['mean_passes']:.2f} ("
                             + ", ".join(f"{q}: {v:.1%}" for q, v in r["share"].items()) + ")")
        report["heads"][name] = hrep
    with open(os.path.join(args.out, "fixed_point.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
