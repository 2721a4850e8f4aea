"""Session 17: one call's kernels (profiler trace) of the served top-512 refine at N=1 and 16, XLA's default
command-buffer schedule against CONCURRENT (`probe_concurrent.py`): is the gain inside one call (the span of
its kernels), not an overlap between the chained calls? The mode comes from XLA_FLAGS (the way a user of a plain
`jax.jit(xj.refine)` would set it): run once without and once with
`XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`; argv[2] names the run. JSON lines to argv[1]."""
import json, os, sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import CFG as cfg, kernel_trace  # noqa: E402
from benchmarks.bench_refine import make_problem  # noqa: E402
import xpress_jax as xj  # noqa: E402
from xpress_jax.ops import Ops  # noqa: E402
from xpress_jax.refine import refine_with  # noqa: E402

P = Ops.pallas()
out = open(sys.argv[1], "a")
for n, topc in ((1, 512), (16, 512), (1, 0)):
    params, logits, h, anchors = make_problem(cfg, n, std=0.02)
    T = jax.jit(xj.token_table)(params)
    mode = sys.argv[2]

    def fn(p, t, l, hh, a):
        return refine_with(P, p, l, hh, a, config=cfg, topc=topc, token_table=t)
    if True:
        tr = kernel_trace(fn, (params, T, logits, h, anchors), f"s17_{n}_{topc}_{mode}")
        out.write(json.dumps(dict(kind="trace", topc=topc, N=n, mode=mode, **tr)) + "\n"); out.flush()
        print(f"topc={topc} N={n} {mode}: {tr['n']} kernels, span {tr['span']} busy {tr['busy']}")
