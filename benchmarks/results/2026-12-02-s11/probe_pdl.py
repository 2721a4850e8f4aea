"""Issue 16, session 11: XLA's programmatic dependent launch (PDL) flags, per executable, on the H200.

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02-s11/probe_pdl.py OUT.jsonl

PDL lets a kernel start while the one before it drains (Hopper and newer); XLA has it behind
``xla_gpu_enable_pdl`` / ``xla_gpu_enable_pdl_launch`` (its own fusions; a custom call only with
``uses_pdl``, which Pallas-Triton does not set). Per (N, mode) and setting (default / both true / with
PROBE_NOPDL=1 both false; passed as compile options): device µs per refine (chained), one call's wall to numpy with the
output in pinned host memory (median of 100), tokens that differ from the default.
"""
import json, os, statistics, sys, time

import jax, numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chain_length, chained, make_problem

SMALL = os.environ.get("PROBE_SMALL")
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=1001, hidden_size=64, rank=24, mlp_hidden=40, topc=17)
                       if SMALL else SERVING))
backend = "xla" if SMALL else "pallas"
out = open(sys.argv[1], "a")
host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
SETTINGS = {"default": None,
            "pdl": {"xla_gpu_enable_pdl": True, "xla_gpu_enable_pdl_launch": True}}
if os.environ.get("PROBE_NOPDL"):
    SETTINGS["nopdl"] = {"xla_gpu_enable_pdl": False, "xla_gpu_enable_pdl_launch": False}


def timed(exe, args, reps=5):
    exe(*args).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); exe(*args).block_until_ready(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


for n, topc in ((1, 512), (1, 0), (16, 512), (16, 0))[:int(os.environ.get("PROBE_CASES", 4))]:
    topc = topc and cfg.topc
    prob = make_problem(cfg, n, std=0.02)
    fn = lambda p, l, h, a, topc=topc: xj.refine(p, l, h, a, config=cfg, topc=topc, backend=backend)
    m = 2 if SMALL else chain_length(n, topc, "pallas")
    res, first = {}, None
    for name, opts in SETTINGS.items():
        kw = {} if opts is None else dict(compiler_options=opts)
        single = jax.jit(fn, out_shardings=host).lower(*prob).compile(**kw)
        chain = jax.jit(chained(cfg, m, refine_fn=fn)).lower(*prob).compile(**kw)
        tok = np.asarray(single(*prob))
        first = tok if first is None else first
        res[name] = dict(tok=tok, chain=chain, single=single, dev=[], wall=[])
    for _ in range(int(os.environ.get("PROBE_ROUNDS", 3))):  # interleaved rounds
        for name, r in res.items():
            r["dev"].append(timed(r["chain"], prob) / m * 1e6)
            ws = []
            for _ in range(5 if SMALL else 100):
                t0 = time.perf_counter(); np.asarray(r["single"](*prob)); ws.append(time.perf_counter() - t0)
            r["wall"].append(statistics.median(ws) * 1e6)
    for name, r in res.items():
        row = dict(N=n, topc=topc, setting=name, device_us=[round(x, 1) for x in r["dev"]],
                   wall_host_us=[round(x, 1) for x in r["wall"]], differ=int((r["tok"] != first).sum()))
        out.write(json.dumps(row) + "\n"); out.flush()
        print(f"N={n:3d} topc={topc:3d} {name:8s} device {min(r['dev']):7.1f} wall->numpy {min(r['wall']):7.1f} "
              f"differ {row['differ']}", flush=True)
