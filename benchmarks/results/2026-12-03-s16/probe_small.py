"""Session 16 (issue 16): (1) one call's kernels after the skip change, for planning (`harness.kernel_trace`):
top-512 at N = 1 and 16, full vocab at N = 1 and 16, with a token table. (2) The full-vocab pick's config at
N = 2 and 3 (30 and 45 draft rows; served: the 64-row tile of N = 2..4, `dispatch._FV_60`). Session 15 measured
(32, 64, 6, 64, 4, 4) at 273.3 against the served 283.9 at N=2 in one run. Prediction: a 32-row tile wastes 2
of 32 rows at N=2 instead of 34 of 64, and at N=2 the pick is ~2 waves of programs either way; -5 to -10 µs per
refine at N=2, and at N=3 (two 32-row tiles against one 64-row tile) +0 to +10. Each variant runs the served
steps with the pass pick given one fixed config (alternating order as served); chained device µs per refine,
3 interleaved rounds, tokens against served. Writes JSON lines to argv[1]."""
import dataclasses, json, os, sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import CFG as cfg, kernel_trace, time_variants  # noqa: E402
from benchmarks.bench_refine import make_problem  # noqa: E402
import xpress_jax as xj  # noqa: E402
from xpress_jax.kernels import full_vocab as fvk  # noqa: E402
from xpress_jax.ops import Ops, PassPick  # noqa: E402
from xpress_jax.refine import refine_with  # noqa: E402

P = Ops.pallas()
out = open(sys.argv[1], "w")
for topc, n in ((512, 1), (512, 16), (0, 1), (0, 16)):
    params, logits, h, anchors = make_problem(cfg, n, std=0.02)
    T = jax.jit(xj.token_table)(params)

    def fn(p, t, l, hh, a, topc=topc):
        return refine_with(P, p, l, hh, a, config=cfg, topc=topc, token_table=t)
    tr = kernel_trace(fn, (params, T, logits, h, anchors), f"s16_{topc}_{n}")
    out.write(json.dumps(dict(kind="trace", topc=topc, N=n, **tr)) + "\n"); out.flush()
    print(f"topc={topc} N={n}: {tr['n']} kernels, span {tr['span']} busy {tr['busy']}")
    for k, c, t in tr["top"][:8]:
        print(f"    {k:40s} x{c:2d} {t:7.1f}")


def with_config(c):
    fc = fvk.FullVocabConfig(row_tile=c[0], v_tile=c[1], v_steps=c[2], k_tile=c[3], num_warps=c[4], num_stages=c[5],
                             hold_lat=False, flat=True, prefetch_base=True, lazy=True)

    def run(logits, lat, w2, q):
        n, b, v = logits.shape
        tok = fvk.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fc, slot_stride=b, reverse=q % 2 == 1)
        return tok, 0

    return dataclasses.replace(P, name=str(c), full_vocab_pass_pick=PassPick(P.full_vocab_pick, run))


VARIANTS = [(32, 64, 6, 64, 4, 4), (32, 128, 3, 64, 4, 4), (32, 64, 12, 64, 4, 4), (64, 64, 6, 64, 4, 4)]
for n in (2, 3):
    time_variants(n, 0, {"served": P, **{str(c): with_config(c) for c in VARIANTS}}, 3, out, dict(kind="config"))
