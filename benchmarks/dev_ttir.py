"""What Triton makes of the full-vocab pick kernel: MMA flavour, registers, spills, shared memory.

    # 1. capture the Triton IR Pallas builds for the served configs (any machine with JAX):
    PYTHONPATH=$PWD python3 benchmarks/dev_ttir.py capture --out /tmp/ttir [--n 1,4,16,64,256]
    # 2. compile it for sm_90a with the standalone Triton (a venv with `pip install triton==3.6.0`
    #    works on a CPU machine; Triton's bundled ptxas gives registers and spills):
    python3 benchmarks/dev_ttir.py compile --out /tmp/ttir

``warp_group_dot`` in the TTGIR / ``wgmma.mma_async`` in the PTX = Hopper warp-group MMA;
``mma.sync`` = the Ampere instruction. XLA compiles the same IR with its own Triton pipeline
(its dump does not include Pallas kernels' PTX), so this is strong evidence, not proof, of what
runs. Step 2 imports only triton (no JAX). Results of 2026-11-30: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys


def capture(fn, *args):
    """The Triton modules (text) of every pallas_call in ``fn(*args)``, lowered for an H200."""
    from jax._src.pallas.triton import lowering as L

    from pallas_kernels.common import lower_triton

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


def capture_main(args):
    import dataclasses

    import jax
    import jax.numpy as jnp

    from pallas_kernels import api, full_vocab

    V, r, B = 151936, 256, 16
    meta = {}
    for n in (int(x) for x in args.n.split(",")):
        rows = n * (B - 1)
        _, cfg = api.full_vocab_config(rows, V, r, jnp.bfloat16)
        for lazy in (False, True):
            c = dataclasses.replace(cfg, lazy=lazy)
            shapes = (jax.ShapeDtypeStruct((n * B, V), jnp.bfloat16), jax.ShapeDtypeStruct((rows, r), jnp.bfloat16),
                      jax.ShapeDtypeStruct((V, r), jnp.bfloat16))
            mods = capture(lambda b, l, w, c=c: full_vocab.full_vocab_pick(b, l, w, variant="fused", config=c,
                                                                            slot_stride=B), *shapes)
            name = f"pick_n{n}_{'lazy' if lazy else 'eager'}"
            with open(os.path.join(args.out, name + ".ttir"), "w") as f:
                f.write(mods[0])  # stage 1 (the combine kernel is mods[1])
            meta[name] = dict(num_warps=c.num_warps, num_stages=c.num_stages, config=dataclasses.asdict(c))
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"wrote {len(meta)} kernels to {args.out}")


def compile_main(args):
    import triton
    from triton.backends.compiler import GPUTarget

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    meta = json.load(open(os.path.join(args.out, "meta.json")))
    print(f"triton {triton.__version__}, target sm_90a")
    print("| kernel | warps | stages | MMA | wgmma | mma.sync | registers | spill B | shared KB |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for name, m in meta.items():
        path = os.path.join(args.out, name + ".ttir")
        k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=m["num_warps"], num_stages=m["num_stages"]))
        ttgir, ptx = k.asm.get("ttgir", ""), k.asm.get("ptx", "")
        with open(path + ".ptx", "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path + ".ptx", "-o", os.devnull],
                             capture_output=True, text=True)
        regs = re.search(r"Used (\d+) registers", out.stderr)
        spill = re.search(r"(\d+) bytes spill stores", out.stderr)
        mma = "wgmma" if "warp_group_dot" in ttgir else ("mma v2" if "versionMajor = 2" in ttgir else "?")
        print(f"| {name} | {m['num_warps']} | {m['num_stages']} | {mma} | {ptx.count('wgmma.mma_async')} | "
              f"{ptx.count('mma.sync')} | {regs.group(1) if regs else '?'} | {spill.group(1) if spill else '?'} | "
              f"{k.metadata.shared // 1024} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=("capture", "compile"))
    ap.add_argument("--out", default=os.environ.get("OUT", "ttir_out"))
    ap.add_argument("--n", default="1,4,16,64,256")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    return capture_main(args) if args.step == "capture" else compile_main(args)


if __name__ == "__main__":
    sys.exit(main())
