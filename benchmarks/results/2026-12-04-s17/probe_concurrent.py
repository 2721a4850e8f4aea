"""Session 17 (issue 16): XLA's command-buffer scheduling mode.

XLA:GPU records a refine as one CUDA graph. Its default scheduling mode (LHS) orders the graph's commands in
the thunk order; `xla_gpu_command_buffer_scheduling_mode=CONCURRENT` derives the graph's edges from the buffers
each command reads and writes, so commands that touch different buffers may run at the same time. In a refine
the selection (top-C: 4 kernels, ~17 µs at N=1; full vocab: the start argmax) does not depend on the hidden
input's kernels (~8 µs at N=1: two GEMMs and two fusions, once per call), nor do the two copies of the mixer
that XLA emits per full-vocab pass depend on each other. Prediction: -4 to -9 µs per refine at N=1 (the
hidden input hidden behind the selection / the start), less at N=16, ~0 at N >= 64; tokens unchanged (the
same kernels). Variants: compile options {} / CONCURRENT / SERIALIZE, on the served Pallas refine with a
token table. Per variant: chained device µs per refine (3 interleaved rounds), one call's wall time (AOT
executable, call + block_until_ready, median of 200, 3 rounds), temp bytes (memory_analysis), tokens
against {} (0 must differ). JSON lines to argv[1]; argv[2]: cases "N:topc,..." (default below).
"""
import json, statistics, sys, time

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, chain_length, make_problem, time_device
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

cfg = xj.HeadConfig(**SERVING)
P = Ops.pallas()
out = open(sys.argv[1], "w")
CASES = ([tuple(int(x) for x in c.split(":")) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else
         [(1, 512), (1, 0), (16, 512), (16, 0), (4, 512), (4, 0), (64, 512), (256, 512), (64, 0)])
MODES = {"default": {}, "concurrent": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
         "serialize": {"xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"}}


def wall(exe, args, calls=200):
    for _ in range(10):
        exe(*args).block_until_ready()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter(); exe(*args).block_until_ready(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


for n, topc in CASES:
    params, logits, h, anchors = make_problem(cfg, n, std=0.02)
    T = jax.jit(xj.token_table)(params)
    args = ((params, T), logits, h, anchors)
    m = chain_length(n, topc, "pallas")

    def fn(pt, l, hh, a):
        return refine_with(P, pt[0], l, hh, a, config=cfg, topc=topc, token_table=pt[1])

    res = {}
    for name, opts in MODES.items():
        try:
            one = jax.jit(fn).lower(*args).compile(compiler_options=opts)
            ch = jax.jit(chained(cfg, m, refine_fn=fn)).lower(*args).compile(compiler_options=opts)
            ma = one.memory_analysis()
            res[name] = dict(tok=np.asarray(one(*args)), one=one, chain=ch, dev=[], wall=[],
                             temp=getattr(ma, "temp_size_in_bytes", None))
        except Exception as e:
            print(f"N={n} topc={topc} {name} refused: {type(e).__name__}: {str(e)[:200]}", flush=True)
    for _ in range(3):
        for name, r in res.items():
            r["dev"].append(time_device(r["chain"], args, 5) / m * 1e6)
            r["wall"].append(wall(r["one"], args))
    for name, r in res.items():
        row = dict(N=n, topc=topc, variant=name, device_us=[round(x, 1) for x in r["dev"]],
                   wall_us=[round(x, 1) for x in r["wall"]], temp_bytes=r["temp"],
                   differ=int((r["tok"] != res["default"]["tok"]).sum()))
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"N={n:3d} topc={topc:3d} {name:11s} dev {min(r['dev']):7.1f} wall {min(r['wall']):7.1f} "
              f"temp {r['temp']} differ {row['differ']}", flush=True)
