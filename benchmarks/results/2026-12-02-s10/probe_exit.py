"""Issue 16, session 10: early exit at the passes' fixed point, on the H200.

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02-s10/probe_exit.py OUT.jsonl SPEC [SPEC ...]

SPEC = std:N:topc:variant[,variant...]; variants: plain (early_exit=False, unrolled: the old
code), exit (early_exit, unrolled: passes 2..K under lax.cond), while (early_exit, one while loop),
cmdbuf (exit, compiled with WHILE and CONDITIONAL command buffer types), cA.B (checks after
passes A and B only), fail (exit, but every check's predicate made false at run time: the
worst case, where the fixed point never comes), kK (suffix: num_passes=K).
Per variant: device µs per refine (chained, barrier harness), one call's wall (median of 100, AOT
executable), the passes run on the first call, tokens that differ from the first variant.
"""
import json, statistics, sys, time

import jax, jax.numpy as jnp, numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chain_length, chained, make_problem, time_device
from xpress_jax.ops import Ops
from xpress_jax.refine import _refine, resolve_call, refine_with

import os
SMALL = os.environ.get("PROBE_SMALL")  # CPU smoke test: tiny shapes, kernels interpreted
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=1001, hidden_size=64, rank=24, mlp_hidden=40, topc=17)
                       if SMALL else SERVING))
CMDBUF = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"}
out = open(sys.argv[1], "a")
ops = Ops.pallas(bool(SMALL))
for spec in sys.argv[2:]:
    std, n, topc, variants = spec.split(":")
    std, n, topc = float(std), int(n), int(topc) and cfg.topc
    problem = make_problem(cfg, n, std=std)
    first = None
    for var in variants.split(","):
        name, _, kk = var.partition("k")
        k = int(kk) if kk else cfg.num_passes
        ee = name != "plain"
        if name.startswith("c") and name[1:2].isdigit():  # c2.4: checks after passes 2 and 4
            ee = tuple(int(x) for x in name[1:].split(".")) if name != "c" else ()
        unroll = False if name == "while" else None

        R = sys.modules["xpress_jax.refine"]

        class _FailJ:  # jnp with an all() that XLA cannot fold but is never true
            def __getattr__(self, k):
                return getattr(jnp, k)

            @staticmethod
            def all(x):
                return jnp.all(x) & (jnp.sum(x.astype(jnp.int32)) < -1)

        R.jnp = _FailJ() if name.startswith("fail") else jnp
        if name.startswith("fail") and name != "fail":  # failA.B: fail with checks after A, B
            ee = tuple(int(x) for x in name[4:].split(".")) if name != "failcmdbuf" else True

        def fn(p, l, h, a, k=k, ee=ee, unroll=unroll):
            return refine_with(ops, p, l, h, a, config=cfg, topc=topc, num_passes=k, unroll=unroll, early_exit=ee)

        p, q, kq, c, u = resolve_call(*problem, config=cfg, topc=topc, num_passes=k, unroll=unroll)
        passes = int(jax.jit(lambda p, l, h, a, q: _refine(ops, p, l, h, a, q, kq, c, u, early_exit=ee,
                                                           return_passes=True)[1])(p, problem[1], problem[2],
                                                                                    problem[3], q))
        opts = CMDBUF if name in ("cmdbuf", "failcmdbuf") else None
        exe = jax.jit(fn).lower(*problem).compile(compiler_options=opts) if opts else jax.jit(fn).lower(*problem).compile()
        tok = np.asarray(exe(*problem))
        walls = []
        for _ in range(100):
            t0 = time.perf_counter(); exe(*problem).block_until_ready(); walls.append(time.perf_counter() - t0)
        m = 3 if SMALL else chain_length(n, topc, "pallas")
        if opts:
            ch = jax.jit(chained(cfg, m, refine_fn=fn)).lower(*problem).compile(compiler_options=opts)
        else:
            ch = chained(cfg, m, refine_fn=fn)
        dev = time_device(ch, problem, 5) / m * 1e6
        if first is None:
            first = tok
        row = dict(std=std, N=n, topc=topc, variant=var, K=k, passes=passes, device_us=round(dev, 1),
                   wall_us=round(statistics.median(walls) * 1e6, 1), wall_min_us=round(min(walls) * 1e6, 1),
                   differ=int((tok != first).sum()), chain=m)
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"std {std} N={n:3d} topc={topc:3d} {var:10s} passes {passes} device {dev:8.1f} wall "
              f"{row['wall_us']:8.1f} (min {row['wall_min_us']:7.1f}) differ {row['differ']}", flush=True)
