"""Where a refine's time goes: per-kernel device time from a JAX profiler trace.

    PYTHONPATH=$PWD python3 -m benchmarks.dev_profile --n 256 --topc 512 --out $OUT    # on a GPU
    PYTHONPATH=$PWD python3 -m benchmarks.dev_profile --small                           # CPU smoke test

Runs ``refine`` (serving shapes, K=6, bf16) for the chosen backend, warms it up, traces
``--calls`` calls with ``jax.profiler.trace``, and reads the trace's device timeline (the
processes named ``/device:GPU:*``; on CPU the XLA worker threads): per kernel name the
launches per call and the device µs per call, sorted by time, plus the sum of kernel time,
the wall span per call and their difference (idle gaps: launch latency, host sync). Writes
profile.json and prints the table. Kernel names: Pallas kernels carry their ``name=``
(``xpress_*``), XLA fusions their HLO names (``gemm_fusion_dot...``, ``loop_*_fusion``).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem


def device_events(trace: dict) -> list[dict]:
    """Complete ('X') events of the device timeline: GPU processes if any, else XLA worker threads."""
    ev = trace["traceEvents"] if isinstance(trace, dict) else trace
    pids = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    tids = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {p for p, name in pids.items() if "GPU" in name or "gpu" in name}
    xs = [e for e in ev if e.get("ph") == "X" and "dur" in e]
    if gpu:
        # Kernels sit on the stream threads; skip any per-device summary rows (e.g. "XLA Ops" duplicates).
        return [e for e in xs if e["pid"] in gpu and "Stream" in tids.get((e["pid"], e["tid"]), "Stream")]
    return [e for e in xs if "XLA" in tids.get((e["pid"], e["tid"]), "") and "PjRt" not in tids.get((e["pid"], e["tid"]), "")]


def summarize(events: list[dict], calls: int) -> dict:
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        by[e["name"]][0] += 1
        by[e["name"]][1] += float(e["dur"])
    rows = sorted(([name, n / calls, us / calls] for name, (n, us) in by.items()), key=lambda r: -r[2])
    busy = sum(r[2] for r in rows)
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / calls if events else 0.0
    return dict(kernels=[dict(name=n, launches_per_call=c, us_per_call=u) for n, c, u in rows],
                busy_us_per_call=busy, span_us_per_call=span, launches_per_call=sum(r[1] for r in rows))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--topc", type=int, default=512)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=30, help="rows of the printed table")
    ap.add_argument("--out", default=os.environ.get("OUT", "profile_out"))
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    args = ap.parse_args(argv)
    shape = dict(SERVING)
    if args.small:
        shape.update(vocab_size=4099, hidden_size=128, rank=64, mlp_hidden=128, topc=64)
        args.topc = min(args.topc, 64)
        args.n = min(args.n, 4)
    cfg = xj.HeadConfig(**shape)
    problem = make_problem(cfg, args.n)
    f = jax.jit(lambda p, l, h, a: xj.refine(p, l, h, a, config=cfg, topc=args.topc, backend=args.backend))
    for _ in range(3):
        f(*problem).block_until_ready()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(args.calls):
                f(*problem).block_until_ready()
        paths = glob.glob(os.path.join(d, "plugins", "profile", "*", "*.trace.json.gz"))
        if not paths:
            raise SystemExit(f"no trace written under {d}")
        with gzip.open(paths[0]) as fh:
            trace = json.load(fh)
    s = summarize(device_events(trace), args.calls)
    s.update(N=args.n, topc=args.topc, backend=args.backend, calls=args.calls, device=jax.devices()[0].device_kind,
             jax=jax.__version__)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_n{args.n}_topc{args.topc}.json"), "w") as fh:
        json.dump(s, fh, indent=1)
    mode = "full vocab" if args.topc == 0 else f"top-{args.topc}"
    print(f"# refine {mode}, N={args.n}, backend={args.backend}, {s['device']}, jax {s['jax']}: "
          f"{s['launches_per_call']:.0f} launches, kernels {s['busy_us_per_call']:.0f} µs, "
          f"span {s['span_us_per_call']:.0f} µs per call")
    print("| kernel | launches / call | µs / call | share |")
    print("|---|---:|---:|---:|")
    for k in s["kernels"][: args.top]:
        share = k["us_per_call"] / s["busy_us_per_call"] if s["busy_us_per_call"] else np.nan
        print(f"| {k['name'][:70]} | {k['launches_per_call']:.1f} | {k['us_per_call']:.1f} | {share:.1%} |")


if __name__ == "__main__":
    main()
