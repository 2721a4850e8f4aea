"""What XLA compiled: kernel launches per refine and the tensor-core instructions of our kernels.

    XLA_FLAGS="--xla_dump_to=/tmp/xdump --xla_dump_hlo_pass_re=triton-fusion-emitter" \
        PYTHONPATH=$PWD python3 -m benchmarks.dev_dump /tmp/xdump [--pick-only]

Compiles (and runs once) a top-512 refine at N=1 and the full-vocab pick kernel at 3840 rows
(N=256), both with the Pallas backend, then reads the dump: per module, the launch-producing
instructions of the optimized HLO (fusions, custom calls, copies, ...) by kind, and in the PTX
the count of Hopper ``wgmma`` vs ``mma.sync`` instructions (does Triton use warp-group MMA?).
With ``--xla_dump_hlo_pass_re=triton-fusion-emitter`` XLA also writes each Triton kernel's IR
after every pass (``*.triton-passes.log``): its MMA version (``warp_group_dot`` = Hopper wgmma,
``versionMajor = 2`` = Ampere mma.sync) and shared memory are reported.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem

LAUNCH_OPS = ("fusion", "custom-call", "copy", "copy-start", "dynamic-update-slice", "gather", "scatter",
              "reduce", "sort", "while", "conditional", "all-reduce", "convolution", "dot")


def run_cases(pick_only=False):
    import dataclasses

    from pallas_kernels import api, full_vocab

    cfg = xj.HeadConfig(**SERVING)
    if not pick_only:
        p1 = make_problem(cfg, 1)
        f = jax.jit(lambda p, l, h, a: xj.refine(p, l, h, a, config=cfg, topc=512, backend="pallas"))
        np.asarray(f(*p1))
    params, logits, _, _ = make_problem(cfg, 256)
    B, V = cfg.block_size, cfg.vocab_size
    rows = 256 * (B - 1)
    lat = (jax.random.normal(jax.random.key(1), (rows, cfg.rank)) * 0.5).astype(jnp.bfloat16)
    _, table = api.full_vocab_config(rows, V, cfg.rank, jnp.bfloat16)
    for c in (table, dataclasses.replace(table, hold_lat=False, k_tile=64)):
        g = jax.jit(lambda lg, lt, w2, c=c: full_vocab.full_vocab_pick(
            lg.reshape(256 * B, V), lt, w2, variant="fused", config=c, slot_stride=B))
        np.asarray(g(logits, lat, params["w2"]))


def entry_ops(text: str):
    """Kinds of the ENTRY computation's instructions (what the GPU runtime launches, roughly)."""
    m = re.search(r"^ENTRY .*?\{\n(.*?)^\}", text, re.S | re.M)
    if not m:
        return collections.Counter(), []
    kinds, names = collections.Counter(), []
    for line in m.group(1).splitlines():
        mm = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+(?: \S+)*? ([a-z\-]+)\(", line)
        mk = re.search(r"= (?:\([^=]*?\)|[\w\[\]{},:\d ]+?) ([a-z][a-z\-]*)\(", line)
        kind = mk.group(1) if mk else "?"
        if kind in LAUNCH_OPS:
            kinds[kind] += 1
            tgt = re.search(r'custom_call_target="([^"]+)"', line)
            names.append(f"{kind}:{tgt.group(1) if tgt else (mm.group(1) if mm else '')}")
    return kinds, names


def report(dump: str):
    for path in sorted(glob.glob(os.path.join(dump, "*after_optimizations.txt"))):
        text = open(path).read()
        kinds, names = entry_ops(text)
        print(f"## {os.path.basename(path)}: {sum(kinds.values())} launch-like ENTRY ops {dict(kinds)}")
        for nm in names[:80]:
            print("   ", nm)
    for path in sorted(glob.glob(os.path.join(dump, "*.triton-passes.log"))):
        text = open(path).read()
        shared = re.findall(r"ttg.shared = (\d+)", text)
        print(f"## {os.path.basename(path)}: {len(text) >> 10} KiB; warp_group_dot {text.count('warp_group_dot')}, "
              f"versionMajor=3 {text.count('versionMajor = 3')}, versionMajor=2 {text.count('versionMajor = 2')}, "
              f"wgmma {text.count('wgmma')}, mma.sync {text.count('mma.sync')}, async_copy "
              f"{text.count('async_copy')}, tma {text.lower().count('tma')}, shared {shared[-1] if shared else '?'}")
    for path in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
        text = open(path).read()
        target = re.search(r"\.target (\S+)", text)
        print(f"## {os.path.basename(path)}: wgmma {text.count('wgmma.mma_async')}, "
              f"mma.sync {text.count('mma.sync')}, cp.async.bulk {text.count('cp.async.bulk')}, "
              f"ldmatrix {text.count('ldmatrix')}, .entry {text.count('.entry')}, target "
              f"{target.group(1) if target else '?'}")


if __name__ == "__main__":
    dump = sys.argv[1] if len(sys.argv) > 1 else "/tmp/xdump"
    if "--report-only" not in sys.argv:
        run_cases(pick_only="--pick-only" in sys.argv)
    report(dump)
