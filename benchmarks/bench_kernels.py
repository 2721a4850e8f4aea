"""Per-kernel benchmark: every step refine runs, the served Pallas kernel vs its jnp reference.

    PYTHONPATH=$PWD python -m benchmarks.bench_kernels --out kernels_out/      # on a GPU
    PYTHONPATH=$PWD python -m benchmarks.bench_kernels --small --n 1 --reps 1  # CPU smoke (interpret mode)

Steps (serving shapes V=151936, H=4096, B=16, r=256, M=512, C=512, bf16): ``select`` (top-C
selection of the draft rows + their argmax), ``latent`` (one latent pass), ``full_vocab`` (one
full-vocab pick), ``topc`` (one top-C pick). Each implementation is timed as M calls chained in a
``lax.fori_loop`` (each call's output perturbs the next call's input, so nothing is hoisted),
device time per call = median of ``--reps`` / M, including the loop's own cost per iteration,
which is measured alone and reported (``loop``). The Pallas side is what `refine` serves at that
shape (the dispatch's kernel and config); the jnp side is the reference `refine(backend="xla")`
runs. Writes kernels.jsonl as it goes and kernels.md at the end.
``--topc`` lists the C values of the top-C steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem
from benchmarks.timing import time_jitted
from xpress_jax.ops import Ops

STEPS = ("select", "latent", "full_vocab", "topc")


def _impls(interpret: bool):
    return {"pallas": Ops.pallas(interpret), "xla": Ops.xla(jax.default_backend())}


def step_fn(step, ops, cfg, problem):
    """(fn(state) -> state, initial state): one call of ``step`` whose output feeds the next call."""
    params, logits, h, anchors = problem
    N, B, V = logits.shape
    r, c = cfg.rank, cfg.topc
    rows = N * (B - 1)
    lat0 = (0.1 * jax.random.normal(jax.random.key(3), (rows, r), jnp.float32)).astype(logits.dtype)
    if step == "select":
        def f(lg):
            cand, _, am = ops.select(lg, c)
            return jax.lax.optimization_barrier((lg, cand))[0]  # the next call depends on this one; no copy of lg
        return f, logits
    if step == "latent":
        xh = xj.hidden_input(params, h)
        blk = jnp.concatenate([anchors[:, None], jnp.argmax(logits[:, 1:], -1).astype(jnp.int32)], axis=1)

        def f(blk):
            lat = ops.latent(params, xh, blk, anchors)
            return blk.at[0, 1].set((lat[0, 0, 0] > 0).astype(jnp.int32))
        return f, blk
    if step == "full_vocab":
        def f(lat):
            tok = ops.full_vocab_pick(logits, lat, params["w2"])[0]
            return lat.at[0, 0].add((tok[0] % 2).astype(lat.dtype))
        return f, lat0
    if step == "topc":
        cand, base_c, _ = ops.select(logits, c)
        prepared = ops.topc_prepare(params["w2"], cand)

        def f(lat):
            tok = ops.topc_pick(base_c, cand, lat, prepared)[0]
            return lat.at[0, 0].add((tok[0] % 2).astype(lat.dtype))
        return f, lat0
    raise ValueError(f"step {step!r} must be one of {STEPS}")


def time_step(f, x0, m, reps):
    def run(x):
        return jax.lax.fori_loop(0, m, lambda i, x: f(x), x)

    _, t, _ = time_jitted(jax.jit(run), (x0,), reps)
    return t / m * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1,4,16,64,256", help="comma list of N (blocks)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {STEPS}")
    ap.add_argument("--topc", default="512", help="comma list of C (top-C steps; --small maps 512 to its C)")
    ap.add_argument("--impls", default="pallas,xla", help="comma list of pallas | xla")
    ap.add_argument("--chain", type=int, default=20, help="calls chained per measurement (M)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test; Pallas in interpret mode)")
    ap.add_argument("--out", default=os.environ.get("OUT", "kernels_out"))
    args = ap.parse_args(argv)
    shape = dict(SERVING)
    if args.small:
        shape.update(vocab_size=4099, hidden_size=128, rank=64, mlp_hidden=128, topc=64)
    cfg = xj.HeadConfig(**shape)
    dev = jax.devices()[0]
    impls = _impls(interpret=dev.platform != "gpu")
    topcs = [shape["topc"] if (args.small and int(x) == 512) else int(x) for x in args.topc.split(",")]
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), device=dev.device_kind, jax=jax.__version__, shape=shape)
    rows = []
    with open(os.path.join(args.out, "kernels.jsonl"), "w") as stream:
        stream.write(json.dumps(dict(kind="meta", **meta)) + "\n")
        for n in (int(x) for x in args.n.split(",")):
            problem = make_problem(cfg, n)
            loop = time_step(lambda x: x + 1, jnp.int32(0), args.chain, args.reps)
            for step in args.steps.split(","):
                for c in (topcs if step.startswith("topc") else [cfg.topc]):
                    step_cfg = dataclasses.replace(cfg, topc=c)
                    for name in args.impls.split(","):
                        f, x0 = step_fn(step, impls[name], step_cfg, problem)
                        rows.append(dict(N=n, C=c, step=step, impl=name,
                                         device_us=time_step(f, x0, args.chain, args.reps), loop_us=loop))
                        print(json.dumps(rows[-1]), flush=True)
                        stream.write(json.dumps(dict(kind="kernel", **rows[-1])) + "\n")
                        stream.flush()
    names = args.impls.split(",")
    md = [f"Device: {meta['device']}, JAX {meta['jax']}, {meta['date']}; µs per call incl. the loop's own cost",
          "", "| step | N | C | " + " | ".join(names) + " | loop |", "|---|---:|---:|" + "---:|" * (len(names) + 1)]
    for step in args.steps.split(","):
        for n in sorted({r["N"] for r in rows}):
            for c in sorted({r["C"] for r in rows if r["step"] == step}):
                rs = {r["impl"]: r for r in rows if r["step"] == step and r["N"] == n and r["C"] == c}
                if rs:
                    md.append(f"| {step} | {n} | {c} | " + " | ".join(
                        f"{rs[x]['device_us']:.1f}" if x in rs else "-" for x in names)
                        + f" | {next(iter(rs.values()))['loop_us']:.1f} |")
    with open(os.path.join(args.out, "kernels.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
