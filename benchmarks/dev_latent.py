"""Dev benchmark of the latent-pass kernel at serving shapes (GPU; JAX 0.11.2 on an H200).

    PYTHONPATH=$PWD python3 benchmarks/dev_latent.py        # ~60-90 s; JSON to $OUT/latent.json if set

Shapes: V=151936, B=16, r=256, M=512, bf16, N in 1, 4, 16, 64, 256; weights std 0.02,
random ids. For each N: kernel vs the jnp reference (max abs error, share of
elements that differ / differ by more than 1 bf16 ulp), then device time per call:
200 calls chained in one jitted ``lax.fori_loop`` (call i's latents perturb call
i+1's block, so nothing is hoisted), wall time / 200, median of 5. ``loop`` is the
same loop with the latent call replaced by a constant (the perturbation and the
loop itself); ``net`` = time - loop. Block-config variants (blocks per program,
num_warps, num_stages, h_block) run after every N's default, at N = 256, 1, 64,
until an 80 s budget is spent; a config that fails to compile (shared memory,
registers) is reported, not fatal. The table is printed last.

Floor per call (bf16): weights in_proj_token + gate + up + down = 0.92 MB, mix
0.13 MB (read once if L2 serves the other programs); per block w1 rows 8 KB, xh
8 KB, out 7.5 KB; FLOPs 2*N*B*(r*r + 3*r*M) + 2*N*B*B*r = 14.8 MFLOP per block
(3.8 GFLOP at N=256). HBM floor (4.8 TB/s): ~0.2 us + N*5 ns; tensor-core floor
(~990 TFLOP/s dense): N*15 ns -> ~4 us at N=256. But every program re-reads the
~1.05 MB of weights from L2: 128 programs at N=256 (2 blocks/program) move ~134 MB
L2 -> SM (~20 us at ~6 TB/s; 4 blocks/program halves it), and one program streams
its 1 MB through one SM (~100-150 GB/s per SM). Predicted: ~8-12 us for N up to
~132 programs (one wave), ~15-25 us at N=256; the jnp reference (~6-8 XLA
kernels) ~20-30 us at small N.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import latent as L

V, B, R, M = 151936, 16, 256, 512
NS = (1, 4, 16, 64, 256)
ITERS, REPEATS = 200, 5
BUDGET_S = 80.0  # stop starting new variants after this
T0 = time.perf_counter()

# label -> config overrides; run at VARIANT_NS (deduplicated against the default).
VARIANTS = {
    "b1w8s2h64": dict(blocks_per_program=1, num_warps=8, num_stages=2, h_block=64),
    "b1w4s2h64": dict(blocks_per_program=1, num_warps=4, num_stages=2, h_block=64),
    "b1w8s1h64": dict(blocks_per_program=1, num_warps=8, num_stages=1, h_block=64),
    "b1w8s3h64": dict(blocks_per_program=1, num_warps=8, num_stages=3, h_block=64),
    "b2w8s2h64": dict(blocks_per_program=2, num_warps=8, num_stages=2, h_block=64),
    "b2w4s2h64": dict(blocks_per_program=2, num_warps=4, num_stages=2, h_block=64),
    "b4w8s2h32": dict(blocks_per_program=4, num_warps=8, num_stages=2, h_block=32),
    "b4w4s2h32": dict(blocks_per_program=4, num_warps=4, num_stages=2, h_block=32),
    "b1w8s2h128": dict(blocks_per_program=1, num_warps=8, num_stages=2, h_block=128),
}
# Variants after every N's default, in this order (N=256 first: blocks/program matter most there).
VARIANT_NS = {
    256: tuple(VARIANTS),
    1: ("b1w4s2h64", "b1w8s1h64", "b1w8s3h64", "b1w8s2h128"),
    64: tuple(VARIANTS),
}

# Without a GPU: a smoke run of this script in interpret mode (numbers meaningless).
SMOKE = jax.default_backend() == "cpu"
if SMOKE:
    NS, ITERS, REPEATS = (1, 3), 2, 1
    VARIANT_NS = {3: ("b2w8s2h64",)}


def make_params(seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 6)
    dt = jnp.bfloat16

    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(dt)

    tril = jnp.tril(jnp.ones((B, B), jnp.float32))[:, :, None]
    mix = tril * jax.random.normal(ks[2], (B, B, R), jnp.float32) * 0.02 + jnp.eye(B)[:, :, None]
    return {
        "w1": w(ks[0], (V, R)), "in_proj_token": w(ks[1], (R, R)), "mix": mix.astype(dt),
        "mlp_gate": w(ks[3], (R, M)), "mlp_up": w(ks[4], (R, M)), "mlp_down": w(ks[5], (M, R)),
    }


def make_inputs(n: int, seed: int = 1):
    ks = jax.random.split(jax.random.key(seed + n), 3)
    xh = (jax.random.normal(ks[0], (n, B, R), jnp.float32) * 0.5).astype(jnp.bfloat16)
    blk = jax.random.randint(ks[1], (n, B), 0, V, jnp.int32)
    prev = jax.random.randint(ks[2], (n,), 0, V, jnp.int32)
    return xh, blk, prev


def chained(fn):
    """jit(fori_loop of ITERS calls): each call's latents pick new ids for the next call's block."""

    def body(_, blk, params, xh, prev):
        lat = fn(params, xh, blk, prev)  # [N, B-1, R]
        t = jax.lax.bitcast_convert_type(lat[:, :, 0], jnp.int16).astype(jnp.int32) & 1023
        return blk.at[:, 1:].set((blk[:, 1:] + t) % V)

    return jax.jit(lambda params, xh, blk, prev: jax.lax.fori_loop(
        0, ITERS, lambda i, b: body(i, b, params, xh, prev), blk))


def time_us(fn, args) -> float:
    f = chained(fn)
    f(*args).block_until_ready()  # compile + warm
    ts = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        f(*args).block_until_ready()
        ts.append((time.perf_counter() - t) / ITERS * 1e6)
    return statistics.median(ts)


def errors(out, ref) -> dict:
    o, r = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    ob = np.asarray(out).view(np.int16).astype(np.int32)
    rb = np.asarray(ref).view(np.int16).astype(np.int32)
    ob, rb = np.where(ob < 0, -(ob & 0x7FFF), ob), np.where(rb < 0, -(rb & 0x7FFF), rb)
    return {"max_abs": float(np.abs(o - r).max()), "scale": float(np.abs(r).max()),
            "frac_diff": float((o != r).mean()), "frac_gt1ulp": float((np.abs(ob - rb) > 1).mean())}


def kernel_fn(cfg):
    return lambda p, x, b, q: L.latent_pass(p, x, b, q, config=cfg, interpret=SMOKE)


def run_config(args, ref, rec, label, cfg) -> dict:
    row = {**rec, "config": label, "cfg": dataclasses.asdict(cfg)}
    try:
        out = jax.jit(kernel_fn(cfg))(*args)
        if ref is not None:
            row.update(errors(out, ref))
        row["kernel_us"] = time_us(kernel_fn(cfg), args)
        if "loop_us" in rec:
            row["net_us"] = row["kernel_us"] - rec["loop_us"]
            row["ref_net_us"] = rec["ref_us"] - rec["loop_us"]
    except Exception as e:  # noqa: BLE001 - a config may not fit (shared memory, registers)
        row["error"] = (repr(e).splitlines() or ["?"])[0][:300]
        traceback.print_exc(limit=1, file=sys.stderr)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    dev = jax.devices()[0]
    print(f"# {dev.device_kind}  jax {jax.__version__}  {datetime.date.today()}"
          f"{'  SMOKE RUN (no GPU): interpret mode, timings meaningless' if SMOKE else ''}", flush=True)
    params = make_params()
    rows, cases = [], {}
    for n in NS:  # reference, loop overhead and the default config at every N
        xh, blk, prev = make_inputs(n)
        args = (params, xh, blk, prev)
        const = jnp.zeros((n, B - 1, R), jnp.bfloat16)
        rec = {"N": n}
        try:
            ref = jax.jit(L.reference)(*args)
            rec["loop_us"] = time_us(lambda p, x, b, q: const + x[:, 1:] * 0, args)
            rec["ref_us"] = time_us(L.reference, args)
        except Exception as e:  # noqa: BLE001 - report and go on
            ref, rec["ref_error"] = None, repr(e)[:300]
        default = L.default_config(n, jnp.bfloat16)
        cases[n] = (args, ref, rec, default)
        rows.append(run_config(args, ref, rec, "default", default))
    for n, labels in VARIANT_NS.items():
        if n not in cases:
            continue
        args, ref, rec, default = cases[n]
        for label in labels:
            cfg = dataclasses.replace(default, **VARIANTS[label])
            if cfg == default:
                continue
            if time.perf_counter() - T0 > BUDGET_S:
                rows.append({**rec, "config": label, "skipped": "time budget"})
                continue
            rows.append(run_config(args, ref, rec, label, cfg))
    rows.sort(key=lambda row: (row["N"], row["config"] != "default"))

    print(f"\n# {dev.device_kind}  jax {jax.__version__}  total {time.perf_counter() - T0:.0f}s")
    print(f"{'N':>4} {'config':<11} {'b/w/s/h':<10} {'kern_us':>8} {'net_us':>7} {'ref_us':>7} "
          f"{'ref_net':>7} {'loop':>6} {'max_abs':>9} {'diff%':>7} {'>1ulp%':>7}")
    for row in rows:
        c = row.get("cfg", {})
        cs = (f"{c.get('blocks_per_program')}/{c.get('num_warps')}/{c.get('num_stages')}/{c.get('h_block')}"
              if c else "-")
        if "kernel_us" not in row:
            print(f"{row['N']:>4} {row['config']:<11} {cs:<10} {row.get('error') or row.get('skipped')}")
            continue
        nan = float("nan")
        print(f"{row['N']:>4} {row['config']:<11} {cs:<10} {row['kernel_us']:8.2f} {row.get('net_us', nan):7.2f} "
              f"{row.get('ref_us', nan):7.2f} {row.get('ref_net_us', nan):7.2f} "
              f"{row.get('loop_us', nan):6.2f} {row.get('max_abs', nan):9.2e} "
              f"{100 * row.get('frac_diff', nan):7.3f} "
              f"{100 * row.get('frac_gt1ulp', nan):7.3f}")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "latent.json")
        with open(path, "w") as f:
            json.dump({"device": dev.device_kind, "jax": jax.__version__, "date": str(datetime.date.today()),
                       "shapes": dict(V=V, B=B, r=R, M=M, dtype="bfloat16"), "iters": ITERS,
                       "repeats": REPEATS, "rows": rows}, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
