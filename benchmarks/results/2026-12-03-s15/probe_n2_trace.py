"""Session 15: why N=2 is slower than N=4 (bench h200_run4, with a token table: top-512 148 vs 143 µs, full vocab
302 vs 274). One call's kernels at N = 2 and 4, both modes (`harness.kernel_trace`). Writes JSON lines to argv[1]."""
import json, os, sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import CFG as cfg, kernel_trace  # noqa: E402
from benchmarks.bench_refine import make_problem  # noqa: E402
import xpress_jax as xj  # noqa: E402
from xpress_jax.ops import Ops  # noqa: E402
from xpress_jax.refine import refine_with  # noqa: E402

P = Ops.pallas()
out = open(sys.argv[1], "w")
for topc in (512, 0):
    for n in (2, 4):
        params, logits, h, anchors = make_problem(cfg, n, std=0.02)
        T = jax.jit(xj.token_table)(params)

        def fn(p, t, l, hh, a, topc=topc):
            return refine_with(P, p, l, hh, a, config=cfg, topc=topc, token_table=t)
        tr = kernel_trace(fn, (params, T, logits, h, anchors), f"n2_{topc}_{n}")
        out.write(json.dumps(dict(topc=topc, N=n, **tr)) + "\n"); out.flush()
        print(f"topc={topc} N={n}: {tr['n']} kernels, span {tr['span']} busy {tr['busy']}")
        for k, c, t in tr["top"]:
            print(f"    {k:40s} x{c:2d} {t:7.1f}")
