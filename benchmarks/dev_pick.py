"""Dev benchmark of the pick kernels at serving shapes: which variant and tiles to serve.

    PYTHONPATH=$PWD python3 benchmarks/dev_pick.py [--n 1,4,16,64,256] [--budget 110]

On one GPU (written for an H200, JAX 0.11.2). Shapes: V=151936, r=256, C=512,
bf16, rows = 15 N; w2 and lat ~ N(0, 0.02^2) / N(0, 1), base logits ~ N(0, 1),
candidates = each row's top C base logits (lax.top_k, shuffled: order is arbitrary).

For every (N, variant): one jitted chain of M picks in a fori_loop, where pick
i's first token perturbs lat for pick i+1 (a one-element in-place add that
XLA cannot prove to be zero), so nothing is hoisted; device time per pick =
wall time of the chain / M, median of 5 after a warm-up. Agreement: the
chain's first picks (unperturbed lat) against the XLA oracle's, as a count of
equal tokens out of rows. "prep+w2c" times materialising w2[cand] (once per
call in refine) plus one pick, so prep = (prep+w2c) - w2c.

Floors: full vocab = max(read w2 + base at 4.8 TB/s, 2 rows V r flops at
790 TFLOP/s); top-C = read rows C r bf16 (+ base_c, cand) at 4.8 TB/s.
Prints a table last; writes $OUT/pick.json when OUT is set. Variants that fail
to compile (e.g. shared memory) are reported, not fatal. Stops starting new
measurements after --budget seconds (compile time counts).
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

from pallas_kernels import full_vocab as fv
from pallas_kernels import topc_pick as tp
from xpress_jax.refine import _JnpOps

V, R, C, DT = 151936, 256, 512, jnp.bfloat16
HBM, FLOPS = 4.8e12, 790e12
M, REPS = 100, 5
INTERPRET = False  # --small: tiny shapes in interpret mode, a CPU smoke test of this script


def pow2_at_least(n, lo=1):
    return max(lo, 1 << (int(n) - 1).bit_length())


def full_vocab_variants(rows):
    """name -> pick(lat, base, w2). Tile alternatives sized for this row count."""
    d_add = fv.default_config(rows, V, R, DT, "add_argmax")
    d_fused = fv.default_config(rows, V, R, DT, "fused")
    rt_mid = min(64, pow2_at_least(rows, 16))

    def steps_for(row_tile, v_tile, target=1024):  # enough programs, the rest looped
        programs = -(-rows // row_tile) * -(-V // v_tile)
        s = 1
        while s < 16 and programs // (2 * s) >= target:
            s *= 2
        return s

    cfgs = {
        "add_argmax": d_add,
        "add_argmax/b": fv.FullVocabConfig(row_tile=min(16, pow2_at_least(rows)), v_tile=512,
                                           v_steps=steps_for(min(16, pow2_at_least(rows)), 512),
                                           num_warps=4, combine="xla"),
        "fused": d_fused,
        # Classic pipelined rank loop, lat re-read per vocab tile (~98 KB shared at rt=64; 2 blocks/SM).
        "fused/b": fv.FullVocabConfig(row_tile=rt_mid, v_tile=128, v_steps=steps_for(rt_mid, 128), k_tile=128,
                                      num_warps=8 if rt_mid >= 64 else 4, num_stages=2, hold_lat=False),
        # The default's row tile x 128 columns, rank loop of 64 (at 128 x 128: ~64 KB shared, ~212 regs).
        "fused/c": dataclasses.replace(d_fused, v_tile=128, k_tile=64, num_stages=2, hold_lat=False,
                                       v_steps=steps_for(d_fused.row_tile, 128)),
    }
    out = {"xla": (lambda lat, base, w2: _JnpOps.full_vocab_pick(base, lat, w2), None)}
    for name, cfg in cfgs.items():
        variant = name.split("/")[0]
        out[name] = (lambda lat, base, w2, v=variant, c=cfg:
                     fv.full_vocab_pick(base, lat, w2, variant=v, config=c, interpret=INTERPRET), cfg)
    return out


def topc_variants(rows):
    """name -> pick(lat, base_c, cand, prepared, ...)."""
    d = tp.default_config(rows, C, R, DT)
    one = tp.TopCConfig(c_tile=64, c_steps=-(-C // 64), k_tile=128, num_warps=4, num_stages=2)  # 1 launch
    wide = dataclasses.replace(d, c_tile=128, c_steps=max(1, d.c_steps // 2), k_tile=64, num_warps=8)

    def pick(cfg):  # prepared = w2: the kernel gathers the candidates' rows
        return lambda lat, base_c, cand, w2, w2c: tp.topc_pick(base_c, cand, lat, w2, config=cfg, interpret=INTERPRET)

    def prep_w2c(lat, base_c, cand, w2, w2c):
        # Depends on lat (never true in practice) so the gather is redone every iteration.
        cand = cand.at[0, 0].add((lat[0, 0] > 1e4).astype(jnp.int32))
        return tp.topc_pick(base_c, cand, lat, tp.topc_prepare(w2, cand, materialize=True), config=d,
                            interpret=INTERPRET)

    return {
        "xla": (lambda lat, base_c, cand, w2, w2c: _JnpOps.topc_pick(base_c, cand, lat, w2c), None),
        "gather": (pick(d), d),
        "gather/1L": (pick(one), one),
        "gather/b": (pick(wide), wide),
        "w2c": (lambda lat, base_c, cand, w2, w2c:
                tp.topc_pick(base_c, cand, lat, w2c, config=d, interpret=INTERPRET), d),
        "prep+w2c": (prep_w2c, d),
    }


def chain(pick, m):
    """jit(m picks in a fori_loop), lat perturbed by each pick's token. Returns (first picks, checksum)."""

    def run(lat, *args):
        def body(i, carry):
            lat, first, acc = carry
            tok = pick(lat, *args)
            first = jnp.where(i == 0, tok, first)
            lat = lat.at[0, 0].add((tok[0] & 1).astype(lat.dtype) * jnp.asarray(2.0**-8, lat.dtype))
            return lat, first, acc + tok[-1]

        rows = lat.shape[0]
        _, first, acc = jax.lax.fori_loop(0, m, body, (lat, jnp.zeros((rows,), jnp.int32), jnp.int32(0)))
        return first, acc

    return jax.jit(run)


def measure(pick, m, args):
    (first, _), t, compile_s = time_jitted(chain(pick, m), args, REPS)
    return np.asarray(first), t / m * 1e6, compile_s


def make_problem(n, seed=0):
    rows = 15 * n
    kb, kl, kw, kp = jax.random.split(jax.random.key(seed), 4)
    base = jax.random.normal(kb, (rows, V), jnp.float32).astype(DT)
    lat = jax.random.normal(kl, (rows, R), jnp.float32).astype(DT)
    w2 = (0.02 * jax.random.normal(kw, (V, R), jnp.float32)).astype(DT)
    base_c, cand = jax.jit(lambda b: jax.lax.top_k(b, C))(base)
    perm = jax.random.permutation(kp, C)
    base_c, cand = base_c[:, perm], cand[:, perm].astype(jnp.int32)
    w2c = jnp.take(w2, cand, axis=0)
    return rows, base, lat, w2, base_c, cand, w2c


def floors(rows):
    fv_us = max((V * R * 2 + rows * V * 2) / HBM, 2 * rows * V * R / FLOPS) * 1e6
    tc_us = rows * C * (R * 2 + 2 + 4) / HBM * 1e6
    return fv_us, tc_us


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1,4,16,64,256")
    ap.add_argument("--budget", type=float, default=110.0, help="seconds; no new measurement starts after it")
    ap.add_argument("--only", default="", help="comma list of kind:variant to run (e.g. fv:fused,tc:gather)")
    ap.add_argument("--small", action="store_true", help="CPU smoke test: V=4099, C=64, interpret mode, chain 3")
    args = ap.parse_args(argv)
    if args.small:
        global V, C, M, REPS, INTERPRET
        V, C, M, REPS, INTERPRET = 4099, 64, 3, 2, True
    t_start = time.perf_counter()
    ns = [int(x) for x in args.n.split(",")]
    # Most informative first (the budget may cut the tail); the table is sorted by N.
    order = sorted(ns, key=lambda n: {1: 0, 256: 1, 16: 2, 64: 3}.get(n, 4))
    only = set(filter(None, args.only.split(",")))
    dev = jax.devices()[0]
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=dev.device_kind, jax=jax.__version__,
                V=V, r=R, C=C, dtype="bfloat16", chain=M, reps=REPS)
    print(f"# dev_pick {meta['date']} on {dev.device_kind}, jax {jax.__version__}", flush=True)
    results = []
    for n in order:
        if time.perf_counter() - t_start > args.budget:
            print(f"budget reached: N={n} not run", flush=True)
            continue
        rows, base, lat, w2, base_c, cand, w2c = make_problem(n)
        fv_floor, tc_floor = floors(rows)
        for kind, variants, operands, floor in (
            ("fv", full_vocab_variants(rows), (lat, base, w2), fv_floor),
            ("tc", topc_variants(rows), (lat, base_c, cand, w2, w2c), tc_floor),
        ):
            ref = None
            for name, (pick, cfg) in variants.items():
                if only and f"{kind}:{name}" not in only and name != "xla":
                    continue
                row = dict(N=n, rows=rows, kind=kind, variant=name, floor_us=round(floor, 2),
                           config=dataclasses.asdict(cfg) if cfg is not None else None)
                if time.perf_counter() - t_start > args.budget:
                    row["error"] = "skipped: budget"
                    results.append(row)
                    continue
                m = max(1, M // 5) if name.startswith("prep") else M
                try:
                    first, us, compile_s = measure(pick, m, operands)
                    row.update(device_us=round(us, 2), compile_s=round(compile_s, 2))
                    if name == "xla":
                        ref = first
                    elif ref is not None:
                        row["agree"] = int(np.sum(first == ref))
                except Exception as e:  # a variant that does not build must not sink the run
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    traceback.print_exc(limit=2, file=sys.stderr)
                results.append(row)
                print(json.dumps(row), flush=True)
        del base, lat, w2, base_c, cand, w2c
    meta["total_s"] = round(time.perf_counter() - t_start, 1)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "pick.json"), "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    print(table(results, meta))


def table(results, meta):
    lines = [f"dev_pick: {meta['device']}, jax {meta['jax']}, V={V} r={R} C={C} bf16; device µs per pick "
             f"(chain {M}, median {REPS}); '!k' = k tokens differ from xla; total {meta['total_s']} s"]
    for kind, title in (("fv", "full vocab"), ("tc", f"top-{C}")):
        names = list(dict.fromkeys(r["variant"] for r in results if r["kind"] == kind))
        if not names:
            continue
        lines += ["", f"{title:>10} | {'rows':>5} | {'floor':>7} | " + " | ".join(f"{x:>12}" for x in names)]
        for n in sorted({r["N"] for r in results if r["kind"] == kind}):
            rs = {r["variant"]: r for r in results if r["kind"] == kind and r["N"] == n}
            any_r = next(iter(rs.values()))
            cells = []
            for x in names:
                r = rs.get(x)
                if r is None:
                    cells.append("-")
                elif "error" in r:
                    cells.append("ERR" if not r["error"].startswith("skipped") else "skip")
                else:
                    bad = r["rows"] - r["agree"] if "agree" in r else 0
                    cells.append(f"{r['device_us']:.1f}" + (f" !{bad}" if bad else ""))
            lines.append(f"{'N=' + str(n):>10} | {any_r['rows']:>5} | {any_r['floor_us']:>7.1f} | "
                         + " | ".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
