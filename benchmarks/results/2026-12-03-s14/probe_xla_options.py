"""Session 14, prepared for the next session (not run yet): XLA:GPU compile options for the latent's GEMMs (issue 16).

At N=1 a top-512 pass with a token table runs 4 XLA kernels before the pick (trace, `h200_run1/probe.jsonl`):
the gather + mixer fusion (~1.2 µs), the gate/up GEMM fusion (~2.0), `silu * up` + rounding (~1.2) and the down
GEMM fusion (~1.4). Earlier sessions tried command buffers, PDL and forced split-K, never the GEMM emitter's
options. Each variant compiles the chained refine (`bench_refine.chained`, with the token table) with one set
of `compiler_options` (accepted by `Compiled` in every supported JAX version; an option this XLA does not
know is reported and skipped) and times it against no options, 3 interleaved rounds; tokens against no
options (a GEMM that sums in another order may move a near tie: counted). Writes JSON lines to argv[1].
"""
import json, sys

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem
from benchmarks.timing import time_jitted
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

cfg = xj.HeadConfig(**SERVING)
P = Ops.pallas()
out = open(sys.argv[1], "w")
OPTIONS = {
    "none": {},
    "no_triton_gemm": {"xla_gpu_enable_triton_gemm": False},
    "triton_gemm_any": {"xla_gpu_triton_gemm_any": True},
    "cublaslt": {"xla_gpu_enable_cublaslt": True},
    "autotune_0": {"xla_gpu_autotune_level": 0},
    "exhaustive_tiling": {"xla_gpu_exhaustive_tiling_search": True},
    "no_split_k_autotune": {"xla_gpu_enable_split_k_autotuning": False},
    "no_cublas_fallback": {"xla_gpu_cublas_fallback": False},
}
CASES = [(1, 512), (16, 512), (1, 0)]

for n, topc in CASES:
    params, logits, h, anchors = make_problem(cfg, n, std=0.02)
    T = jax.jit(xj.token_table)(params)
    args = ((params, T), logits, h, anchors)
    m = chain_length(n, topc, "pallas")

    def fn(pt, l, hh, a):
        return refine_with(P, pt[0], l, hh, a, config=cfg, topc=topc, token_table=pt[1])

    res = {}
    for name, opts in OPTIONS.items():
        try:
            one = jax.jit(fn).lower(*args).compile(compiler_options=opts)
            ch = jax.jit(chained(cfg, m, refine_fn=fn)).lower(*args).compile(compiler_options=opts)
            res[name] = dict(tok=np.asarray(one(*args)), chain=ch, dev=[])
        except Exception as e:  # an option this XLA does not know, or a value it refuses
            print(f"N={n} topc={topc} {name} refused: {type(e).__name__}: {str(e)[:120]}", flush=True)
    for _ in range(3):
        for name, r in res.items():
            r["dev"].append(time_jitted(r["chain"], args, 5)[1] / m * 1e6)
    for name, r in sorted(res.items(), key=lambda kv: min(kv[1]["dev"])):
        row = dict(N=n, topc=topc, variant=name, options=OPTIONS[name], device_us=[round(x, 1) for x in r["dev"]],
                   differ=int((r["tok"] != res["none"]["tok"]).sum()))
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"N={n:3d} topc={topc:3d} {name:20s} dev {min(r['dev']):7.1f} differ {row['differ']}", flush=True)
