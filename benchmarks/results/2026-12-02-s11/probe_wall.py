"""Issue 16, session 11: where one call's wall time goes -- does XLA re-record its command buffer every call?

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02-s11/probe_wall.py time OUT.jsonl
    TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 \
        PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02-s11/probe_wall.py vlog OUT.jsonl 2> vlog.txt

Cases: a chain of 72 barrier-separated tiny kernels, and refine (Pallas, serving shapes, bf16, K=6)
top-512 / full vocab at N = 1 and 16, each an AOT executable. Per case, one call's wall (median of 100,
3 interleaved rounds) when the call's buffers stay the same ("same": the same input arrays, output
dropped), when the output of the previous call is kept alive ("keep"), when inputs alternate between
two copies ("alt"), and with a fresh copy of the logits per call ("fresh", copy made before the clock).
In "vlog" mode: a few calls of each kind between markers, for XLA's command-buffer log lines.
"""
import json, os, statistics, sys, time

import jax, jax.numpy as jnp, numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chain_length, chained, make_problem, time_device

MODE, OUT = sys.argv[1], sys.argv[2]
SMALL = os.environ.get("PROBE_SMALL")
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=1001, hidden_size=64, rank=24, mlp_hidden=40, topc=17)
                       if SMALL else SERVING))
backend = "xla" if SMALL else "pallas"
out = open(OUT, "a")


def tiny_chain(k):
    def f(x):
        for _ in range(k):
            x = jax.lax.optimization_barrier(x * 1.0001 + 1.0)
        return x
    return f


cases = []
x0 = jnp.arange(1024, dtype=jnp.float32)
cases.append(("chain72", jax.jit(tiny_chain(72)).lower(x0).compile(), [x0], None))
for n, topc in ((1, 512), (1, 0), (16, 512), (16, 0)):
    topc = topc and cfg.topc
    prob = make_problem(cfg, n, std=0.02)

    def fn(p, l, h, a, topc=topc):
        return xj.refine(p, l, h, a, config=cfg, topc=topc, backend=backend)

    exe = jax.jit(fn).lower(*prob).compile()
    cases.append((f"N{n}_{'top' if topc else 'full'}", exe, list(prob), (n, topc, fn)))


def one(exe, args):
    t0 = time.perf_counter()
    r = exe(*args)
    t1 = time.perf_counter()
    r.block_until_ready()
    return time.perf_counter() - t0, t1 - t0, r


def variant(exe, args, kind, calls):
    walls, enq = [], []
    keep = []
    alt = [args, [a + 0 if i == 1 or len(args) == 1 else a for i, a in enumerate(args)]]
    jax.block_until_ready(alt)
    for i in range(calls):
        a = args
        if kind == "alt":
            a = alt[i % 2]
        elif kind == "fresh":
            j = 1 if len(args) > 1 else 0
            a = list(args); a[j] = jax.block_until_ready(args[j] + 0)
        w, e, r = one(exe, a)
        if kind == "keep":
            keep = (keep + [r])[-2:]
        walls.append(w); enq.append(e)
    return statistics.median(walls) * 1e6, statistics.median(enq) * 1e6


KINDS = ("same", "keep", "alt", "fresh")
if MODE == "vlog":
    for name, exe, args, _ in cases:
        exe(*args).block_until_ready()
        for kind in KINDS:
            print(f"=== MARK {name} {kind}", file=sys.stderr, flush=True)
            variant(exe, args, kind, 6)
        print(f"=== MARK {name} end", file=sys.stderr, flush=True)
    sys.exit(0)

for name, exe, args, extra in cases:
    for _ in range(3):
        exe(*args).block_until_ready()
    dev = None
    if extra is not None and not SMALL:
        n, topc, fn = extra
        m = chain_length(n, topc, "pallas")
        dev = time_device(chained(cfg, m, refine_fn=fn), args, 5) / m * 1e6
    res = {k: [] for k in KINDS}
    for rnd in range(3):
        for kind in KINDS:
            res[kind].append(variant(exe, args, kind, 100 if not SMALL else 5))
    row = dict(case=name, device_us=dev and round(dev, 1),
               **{f"wall_{k}": [round(w, 1) for w, _ in v] for k, v in res.items()},
               **{f"enq_{k}": [round(e, 1) for _, e in v] for k, v in res.items()})
    out.write(json.dumps(row) + "\n"); out.flush()
    print(f"{name:10s} dev {dev and round(dev,1)!s:>7} " + " ".join(
        f"{k} {min(w for w, _ in v):6.1f}/{min(e for _, e in v):5.1f}" for k, v in res.items()), flush=True)
