"""Session 15 (issue 16): the full-vocab pick alternating its vocabulary order between passes.

Prediction: the pick at N=1 reads all of w2 (78 MB) each pass, 22-24 µs in a refine's trace (3.4 TB/s). A pass
that visits each program's vocab tiles in the other order starts on the rows the previous pass read last; if
~26-40 MB of them are still in the H200's 50 MB L2, passes 2..6 read ~35-50% less from HBM: -5 to -9 µs per
pass, -25 to -45 µs per refine at N = 1..4 (full vocab ~230 -> ~190-205). Little at N >= 16, where the pick is
bound by its epilogue, not by HBM.

Variants: "served" (the Pallas steps as shipped: alternating) and "ascending" (`full_vocab_pick_reversed=None`),
chained device time per refine with a token table (`harness.time_variants`, 3 interleaved rounds), tokens
against served; then one call's kernels of each at N=1 and N=4 (profiler trace). argv[1]: JSON lines out;
argv[2]: the N list (default 1,2,4,8,16,64).
(Ran on commit 75507c1, where the step was the field `Ops.full_vocab_pick_reversed`; since replaced by
`Ops.full_vocab_pass_pick`, so this script no longer runs as it is: a record.)
"""
import dataclasses, json, os, sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import CFG as cfg, kernel_trace, time_variants  # noqa: E402
from benchmarks.bench_refine import make_problem  # noqa: E402
import xpress_jax as xj  # noqa: E402
from xpress_jax.ops import Ops  # noqa: E402
from xpress_jax.refine import refine_with  # noqa: E402

P = Ops.pallas()
A = dataclasses.replace(P, name="ascending", full_vocab_pick_reversed=None)
out = open(sys.argv[1], "w")
NS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 4, 8, 16, 64]
for n in NS:
    time_variants(n, 0, {"served": P, "ascending": A}, 3, out)
for n in (1, 4):
    params, logits, h, anchors = make_problem(cfg, n, std=0.02)
    T = jax.jit(xj.token_table)(params)
    for name, ops in (("served", P), ("ascending", A)):
        def fn(p, t, l, hh, a, ops=ops):
            return refine_with(ops, p, l, hh, a, config=cfg, topc=0, token_table=t)
        tr = kernel_trace(fn, (params, T, logits, h, anchors), f"alt_{name}_{n}")
        out.write(json.dumps(dict(trace=name, N=n, **tr)) + "\n"); out.flush()
        print(f"trace N={n} {name}: {tr['n']} kernels, span {tr['span']} busy {tr['busy']}; "
              + "; ".join(f"{k} x{c} {t}" for k, c, t in tr["top"][:4]), flush=True)
