"""Compile the full-vocab pick kernel's Triton IR with the standalone Triton (GPU machine) and report
the MMA flavour, shared memory, registers and spills.

    PYTHONPATH=$PWD python3 -m benchmarks.dev_ttir --out $OUT

Captures the Triton module Pallas builds (``lower_jaxpr_to_triton_module``) for the fused pick at
3840 rows (N=256) under a few configs, and compiles each with ``triton.compile`` for sm_90a.
``warp_group_dot`` in the TTGIR / ``wgmma`` in the PTX = Hopper warp-group MMA; ``mma.sync`` = the
Ampere instruction. XLA compiles the same IR with its own Triton pipeline, so this is a
strong hint, not proof, of what runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

import jax
import jax.numpy as jnp


def capture(fn, *args):
    from pallas_kernels.common import lower_triton

    from jax._src.pallas.triton import lowering as L

    got = []
    orig = L.lower_jaxpr_to_triton_module

    def wrap(*a, **k):
        res = orig(*a, **k)
        got.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    L.lower_jaxpr_to_triton_module = wrap
    try:
        lower_triton(fn, *args)
    finally:
        L.lower_jaxpr_to_triton_module = orig
    return got


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "ttir_out"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import triton
    from triton.backends.compiler import GPUTarget

    from pallas_kernels import api, full_vocab

    V, r, rows = 151936, 256, 3840
    base = jax.ShapeDtypeStruct((rows, V), jnp.bfloat16)
    lat = jax.ShapeDtypeStruct((rows, r), jnp.bfloat16)
    w2 = jax.ShapeDtypeStruct((V, r), jnp.bfloat16)
    _, table = api.full_vocab_config(rows, V, r, jnp.bfloat16)
    cfgs = {"table": table,
            "k64-nohold": dataclasses.replace(table, hold_lat=False, k_tile=64),
            "128x128-w8": dataclasses.replace(table, v_tile=128, v_steps=16),
            "64x128-w4": dataclasses.replace(table, row_tile=64, v_tile=128, v_steps=16, num_warps=4)}
    print(f"triton {triton.__version__}")
    for name, cfg in cfgs.items():
        mods = capture(lambda b, l, w, cfg=cfg: full_vocab.full_vocab_pick(b, l, w, variant="fused", config=cfg),
                       base, lat, w2)
        ttir = os.path.join(args.out, f"pick_{name}.ttir")
        with open(ttir, "w") as f:
            f.write(mods[0])
        try:
            k = triton.compile(ttir, target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
            ttgir, ptx = k.asm.get("ttgir", ""), k.asm.get("ptx", "")
            regs = spills = "?"
            try:
                k._init_handles()
                regs, spills = k.n_regs, k.n_spills
            except Exception as e:  # noqa: BLE001
                regs = f"({type(e).__name__})"
            mma = re.findall(r"versionMajor = (\d)", ttgir)
            print(f"{name}: {dataclasses.asdict(cfg)}\n   warp_group_dot {ttgir.count('warp_group_dot')}, "
                  f"mma versions {sorted(set(mma))}, ptx wgmma {ptx.count('wgmma.mma_async')}, "
                  f"mma.sync {ptx.count('mma.sync')}, ldmatrix {ptx.count('ldmatrix')}, cp.async {ptx.count('cp.async')}, "
                  f"shared {k.metadata.shared} B, regs {regs}, spills {spills}", flush=True)
            with open(os.path.join(args.out, f"pick_{name}.ttgir"), "w") as f:
                f.write(ttgir)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: compile failed: {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    main()
