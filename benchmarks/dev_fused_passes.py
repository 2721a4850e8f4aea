"""Dev benchmark: the single-launch K-pass kernel vs the per-pass paths (where does one launch pay?).

    PYTHONPATH=$PWD python3 benchmarks/dev_fused_passes.py          # H200, < 120 s; JSON to $OUT/fused_passes.json
    PYTHONPATH=$PWD python3 benchmarks/dev_fused_passes.py --small  # CPU smoke run (interpret mode, tiny shapes)

Serving shapes: V=151936, H=4096, B=16, r=256, M=512, C=512, K=6, bf16, weights std
0.02 (`init_params`), logits std 2, for N in 1, 4, 16, 64, 132 (one block per SM),
256. Timed is the K-pass loop alone: xh, the start block, base_c and cand (and for
the jnp path w2[cand]) are computed once outside the timing, as `_refine` does per call.

Paths (each returns the final block [N, B]):
  fused      `fused_passes.topc_all_passes`, `default_config`: tensor-core scoring, ids prefetched,
             3 stages: two steps of w2 rows (2 x 64 KB) in flight (199 KB shared, 182 registers)
  fused/s2   2 stages, no prefetch: one step (64 KB) in flight, waited for at once (133 KB shared)
  fused/w4   4 warps, 4-candidate tiles, prefetch, 3 stages (174 KB shared, 188 registers)
  fused/fma  FMA scoring, 4-candidate tiles, prefetch, 2 stages (plain loads; 108 KB, 176 registers)
  fused/p2   w2 tiles one step ahead in registers (prefetch=2), 4 candidates x whole rank (108 KB)
(shared memory / registers from an offline sm_90a compile with Triton 3.9, not XLA's own Triton)
  pallas     the per-pass Pallas path as refine runs it on a GPU: `pallas_kernels.api.ops()`
             latent_pass + topc_pick in an unrolled Python loop of K
  xla        the same loop with `_JnpOps` (XLA), w2[cand] precomputed

Method: one jitted ``lax.fori_loop`` chains the path M times (M = 100 for N <= 16, 40 for
N = 64, 20 above); call i's last draft token of block 0 becomes call i+1's prev_ids[0],
so nothing is hoisted. Device time per K-pass loop = wall time of the chain / M, median
of 5 after a warm-up (compile) call. Agreement: the chain's first output (unperturbed
inputs) vs the pallas path's, as equal draft tokens out of N*(B-1). Paths that fail to
compile (shared memory, registers) are reported, not fatal. Phase 1 runs fused, pallas
and xla at every N; phase 2 the fused variants, until --budget seconds (compile included).

Output: one JSON line per measurement, then the table; the last lines give, per N, the
best fused variant vs pallas, and the measured range for `fused_passes.SINGLE_LAUNCH_N`
(N where the best fused variant is >= 5% faster than pallas; None if there is none).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks.timing import time_jitted
import numpy as np

import xpress_jax as xj
from pallas_kernels import api
from pallas_kernels import fused_passes as fp
from xpress_jax.head import hidden_input
from xpress_jax.refine import _JnpOps

V, H, B, R, MH, C, K, DT = 151936, 4096, 16, 256, 512, 512, 6, jnp.bfloat16
NS = (1, 4, 16, 64, 132, 256)
REPS = 5
INTERPRET = False
WIN = 0.95  # fused must take <= 95% of the pallas time to count as a win


def chain_len(n):
    return 100 if n <= 16 else 40 if n <= 64 else 20


def fused_variants():
    d = fp.default_config(1, B, DT)
    return {
        "fused": d,
        "fused/s2": dataclasses.replace(d, prefetch=0, num_stages=2),
        "fused/w4": dataclasses.replace(d, num_warps=4, c_tile=4),
        "fused/fma": dataclasses.replace(d, score="fma", c_tile=4, num_stages=2),
        "fused/p2": dataclasses.replace(d, prefetch=2, c_tile=4, k_tile=0, num_stages=2),
    }


def make_params(seed=0):
    cfg = xj.HeadConfig(vocab_size=V, hidden_size=H, block_size=B, rank=R, mlp_hidden=MH, topc=C, num_passes=K,
                        max_num_reqs=max(NS))
    return xj.init_params(cfg, jax.random.key(seed), dtype=DT, std=0.02)


@jax.jit
def _prologue(params, logits, h, anchors):
    n = logits.shape[0]
    xh = hidden_input(params, h)
    cand, base_c, start = _JnpOps.select_candidates(logits[:, 1:, :].reshape(n * (B - 1), V), C)
    blk0 = jnp.concatenate([anchors[:, None], start.reshape(n, B - 1)], axis=1)
    return xh, blk0, base_c, cand, jnp.take(params["w2"], cand, axis=0)


def make_problem(params, n, seed=1):
    k = jax.random.split(jax.random.key(seed + n), 4)
    logits = (2.0 * jax.random.normal(k[0], (n, B, V), jnp.float32)).astype(DT)
    h = jax.random.normal(k[1], (n, B, H), jnp.float32).astype(DT)
    anchors = jax.random.randint(k[2], (n,), 0, V, jnp.int32)
    prev = jax.random.randint(k[3], (n,), 0, V, jnp.int32)
    xh, blk0, base_c, cand, w2c = jax.block_until_ready(_prologue(params, logits, h, anchors))
    return dict(xh=xh, blk0=blk0, prev=prev, base_c=base_c, cand=cand, w2c=w2c)


def per_pass(ops, prepared_key):
    """K passes of ops.latent_pass + ops.topc_pick, unrolled (as refine runs on a GPU)."""

    def run(params, xh, blk, prev, base_c, cand, w2c):
        n = blk.shape[0]
        prepared = w2c if prepared_key == "w2c" else ops.topc_prepare(params["w2"], cand)
        for _ in range(K):
            lat = ops.latent_pass(params, xh, blk, prev).reshape(n * (B - 1), R)
            blk = blk.at[:, 1:].set(ops.topc_pick(base_c, cand, lat, prepared).reshape(n, B - 1))
        return blk

    return run


def fused(cfg):
    def run(params, xh, blk, prev, base_c, cand, w2c):
        return fp.topc_all_passes(params, xh, blk, prev, base_c, cand, num_passes=K, interpret=INTERPRET,
                                  config=cfg)

    return run


def chain(path, m):
    """jit(m chained K-pass loops); block 0's last draft token perturbs the next call's prev_ids[0]."""

    def run(params, xh, blk0, prev, base_c, cand, w2c):
        def body(i, carry):
            prev, first, acc = carry
            blk = path(params, xh, blk0, prev, base_c, cand, w2c)
            first = jnp.where(i == 0, blk, first)
            return prev.at[0].set(blk[0, B - 1]), first, acc + blk[-1, -1]

        _, first, acc = jax.lax.fori_loop(0, m, body, (prev, jnp.zeros_like(blk0), jnp.int32(0)))
        return first, acc

    return jax.jit(run)


def measure(path, m, params, prob):
    args = (params, prob["xh"], prob["blk0"], prob["prev"], prob["base_c"], prob["cand"], prob["w2c"])
    (first, _), t, compile_s = time_jitted(chain(path, m), args, REPS)
    return np.asarray(first), t / m * 1e6, compile_s


def recommend(results):
    """Per N: the best fused variant vs pallas; the measured SINGLE_LAUNCH_N range (or None)."""
    lines, wins = [], []
    for n in sorted({r["N"] for r in results}):
        rs = {r["path"]: r for r in results if r["N"] == n and "device_us" in r}
        fz = {k: v for k, v in rs.items() if k.startswith("fused")}
        if "pallas" not in rs or not fz:
            lines.append(f"N={n}: incomplete (no pallas or no fused time)")
            continue
        best = min(fz, key=lambda k: fz[k]["device_us"])
        ratio = fz[best]["device_us"] / rs["pallas"]["device_us"]
        win = ratio <= WIN
        wins.append((n, win))
        lines.append(f"N={n}: best {best} {fz[best]['device_us']:.1f} us vs pallas {rs['pallas']['device_us']:.1f} us"
                     f" -> x{1 / ratio:.2f} {'WIN' if win else ''}")
    won = [n for n, w in wins if w]
    if not won:
        rng = None
    else:
        lo, hi = min(won), max(won)
        inside = [w for n, w in wins if lo <= n <= hi]
        rng = (lo, hi) if all(inside) else None
        if rng is None:
            lines.append(f"wins at N={won} are not one contiguous range: leave SINGLE_LAUNCH_N = None or measure more N")
    lines.append(f"measured: fused_passes.SINGLE_LAUNCH_N = {rng}")
    return lines, rng


def table(results, meta):
    paths = list(dict.fromkeys(r["path"] for r in results))
    lines = [f"dev_fused_passes: {meta['device']}, jax {meta['jax']}, V={V} B={B} r={R} M={MH} C={C} K={K} bf16; "
             f"device us per K-pass loop (median {REPS}); '!k' = k draft tokens differ from pallas; "
             f"total {meta['total_s']} s", "",
             f"{'N':>5} | " + " | ".join(f"{p:>11}" for p in paths)]
    for n in sorted({r["N"] for r in results}):
        rs = {r["path"]: r for r in results if r["N"] == n}
        cells = []
        for p in paths:
            r = rs.get(p)
            if r is None:
                cells.append("-")
            elif "error" in r:
                cells.append("skip" if r["error"].startswith("skipped") else "ERR")
            else:
                bad = r["tokens"] - r["agree"] if "agree" in r else 0
                cells.append(f"{r['device_us']:.1f}" + (f" !{bad}" if bad else ""))
        lines.append(f"{n:>5} | " + " | ".join(f"{c:>11}" for c in cells))
    return lines


def main(argv=None):
    global V, H, R, MH, C, K, NS, REPS, INTERPRET
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default=",".join(map(str, NS)))
    ap.add_argument("--budget", type=float, default=100.0, help="seconds; no new measurement starts after it")
    ap.add_argument("--small", action="store_true", help="CPU smoke test: tiny shapes, interpret mode, chain 2")
    args = ap.parse_args(argv)
    if args.small:
        V, H, R, MH, C, K, NS, REPS, INTERPRET = 4099, 64, 64, 128, 64, 2, (1, 3), 1, True
        args.n = ",".join(map(str, NS))
    t_start = time.perf_counter()
    ns = [int(x) for x in args.n.split(",")]
    dev = jax.devices()[0]
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=dev.device_kind, jax=jax.__version__, V=V, H=H, B=B,
                r=R, M=MH, C=C, K=K, dtype="bfloat16", reps=REPS, small=args.small)
    print(f"# dev_fused_passes {meta['date']} on {dev.device_kind}, jax {jax.__version__}", flush=True)
    params = make_params()
    pallas_ops = api.ops(interpret=INTERPRET)
    variants = fused_variants()
    phase1 = {"pallas": per_pass(pallas_ops, "ops"), "fused": fused(variants["fused"]),
              "xla": per_pass(_JnpOps, "w2c")}  # pallas first: the agreement reference
    phase2 = {k: fused(cfg) for k, cfg in variants.items() if k != "fused"}
    configs = {k: dataclasses.asdict(v) for k, v in variants.items()}
    # Most informative N first (the budget may cut the tail); the table is sorted by N.
    order = sorted(ns, key=lambda n: {1: 0, 132: 1, 16: 2, 256: 3, 64: 4}.get(n, 5))
    problems, refs, results = {}, {}, []
    for phase in (phase1, phase2):
        for n in order:
            for name, path in phase.items():
                row = dict(N=n, path=name, tokens=n * (B - 1), chain=chain_len(n) if not args.small else 2,
                           config=configs.get(name))
                if time.perf_counter() - t_start > args.budget:
                    row["error"] = "skipped: budget"
                    results.append(row)
                    continue
                try:
                    if n not in problems:
                        problems[n] = make_problem(params, n)
                    first, us, compile_s = measure(path, row["chain"], params, problems[n])
                    row.update(device_us=round(us, 2), compile_s=round(compile_s, 2))
                    if name == "pallas":
                        refs[n] = first
                    if n in refs:
                        row["agree"] = int(np.sum(first[:, 1:] == refs[n][:, 1:]))
                    row["changed_vs_start"] = int(np.sum(first[:, 1:] != np.asarray(problems[n]["blk0"])[:, 1:]))
                except Exception as e:  # a variant that does not build must not sink the run
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    traceback.print_exc(limit=2, file=sys.stderr)
                results.append(row)
                print(json.dumps(row), flush=True)
    meta["total_s"] = round(time.perf_counter() - t_start, 1)
    rec_lines, rng = recommend(results)
    meta["single_launch_n"] = rng
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "fused_passes.json"), "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    print("\n".join(table(results, meta) + [""] + rec_lines))


if __name__ == "__main__":
    main()
