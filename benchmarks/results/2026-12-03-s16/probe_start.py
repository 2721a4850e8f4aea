"""Prepared in session 16 for the next device session (not run yet; issue 16 / full vocab at N >= 16).

Session 16's trace (`probe_small.py`): a full-vocab refine at N=16 starts with XLA's argmax over the draft rows'
base logits (`reference.full_vocab_start`, one `input_reduce_fusion`) taking 32.9 µs for ~73 MB, about 2x its
read floor (~15 µs at 4.8 TB/s); the top-C selection's first kernel (`select_bstats`), which reads the same rows
and also finds each row's argmax, took 27.6. Variants of the full-vocab refine's start (served steps otherwise):
"select1": the Pallas selection with c=1 (its argmax output; same rule: NaN as -inf, values compared, lowest id;
3 more small launches). Prediction: -3 to -8 µs at N=16, -50 to -150 at N=256 if bstats keeps its ~2.7 TB/s there,
+3 to +6 at N=1 (the extra launches). Also one call's trace at N=64 and 256 (full vocab; what the start costs
there). Chained device µs per refine with a token table (3 interleaved rounds), tokens against served (0 must
differ: the same argmax). JSON lines to argv[1].
Run: PYTHONPATH=$PWD python3 benchmarks/results/2026-12-03-s16/probe_start.py $OUT/start.jsonl
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
S1 = dataclasses.replace(P, name="select1", start=lambda logits: P.select(logits, 1)[2])
out = open(sys.argv[1], "w")
for n in (1, 16, 64, 256):
    time_variants(n, 0, {"served": P, "select1": S1}, 3, out)
for n in (64, 256):
    params, logits, h, anchors = make_problem(cfg, n, std=0.02)
    T = jax.jit(xj.token_table)(params)

    def fn(p, t, l, hh, a):
        return refine_with(P, p, l, hh, a, config=cfg, topc=0, token_table=t)
    tr = kernel_trace(fn, (params, T, logits, h, anchors), f"s16_start_{n}")
    out.write(json.dumps(dict(kind="trace", topc=0, N=n, **tr)) + "\n"); out.flush()
    print(f"full N={n}: {tr['n']} kernels, span {tr['span']} busy {tr['busy']}")
    for k, c, t in tr["top"][:8]:
        print(f"    {k:40s} x{c:2d} {t:7.1f}")
