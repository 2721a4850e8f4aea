"""Session 15 (issue 16): full-vocab pick configs at N = 1, 2, 4 with the alternating vocabulary order.

`probe_alternate.py` measured the alternating order -22.5 µs per refine at N=1 and -13 at N=4 with the served
configs, which were tuned without it (RESULTS.md "Full-vocab pick"; re-checked inside refine in session 14).
With L2 hits the best split can move: more, shorter parts per program make the tiles read last (and first in
the next pass) a smaller share of w2. Each variant: the served Pallas steps, the full-vocab pick (both orders)
given one fixed `FullVocabConfig` (flat, lazy, base prefetch, as served); "ascending" = served configs, one order.
Chained device time per refine with a token table (3 interleaved rounds), tokens against served.
Also N=2, which ran slower than N=4 in `probe_alternate.py` (300 vs 278 µs). Writes JSON lines to argv[1].
(Ran on commit 75507c1, where the step was the field `Ops.full_vocab_pick_reversed`; since replaced by
`Ops.full_vocab_pass_pick`, so this script no longer runs as it is: a record.)
"""
import dataclasses, os, sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import CFG as cfg, time_variants  # noqa: E402
from xpress_jax import dispatch  # noqa: E402
from xpress_jax.kernels import full_vocab as fvk  # noqa: E402
from xpress_jax.ops import Ops  # noqa: E402

P = Ops.pallas()
out = open(sys.argv[1], "w")
# (row_tile, v_tile, v_steps, k_tile, num_warps, num_stages)
VARIANTS = {
    1: [(16, 128, 6, 64, 4, 4), (16, 64, 6, 64, 4, 4), (16, 64, 12, 64, 4, 4), (16, 128, 2, 64, 4, 4),
        (16, 128, 4, 64, 4, 4), (16, 256, 2, 64, 4, 4), (16, 128, 3, 64, 8, 4), (16, 128, 3, 128, 4, 3)],
    2: [(32, 64, 6, 64, 4, 4), (32, 128, 3, 64, 4, 4), (16, 128, 3, 64, 4, 4), (64, 128, 3, 64, 4, 4)],
    4: [(64, 64, 3, 64, 4, 4), (64, 128, 3, 64, 4, 4), (64, 64, 12, 64, 4, 4), (32, 64, 6, 64, 4, 4)],
}


def with_config(c):
    fc = fvk.FullVocabConfig(row_tile=c[0], v_tile=c[1], v_steps=c[2], k_tile=c[3], num_warps=c[4], num_stages=c[5],
                             hold_lat=False, flat=True, prefetch_base=True, lazy=True)

    def pick(logits, lat, w2, active=None, fallback=None, reverse=False):
        n, b, v = logits.shape
        return fvk.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fc, slot_stride=b, reverse=reverse)

    return dataclasses.replace(P, name=str(c), full_vocab_pick=pick,
                               full_vocab_pick_reversed=lambda *a: pick(*a, reverse=True))


for n in (1, 2, 4):
    served = dispatch.plan(n, cfg.block_size, cfg.vocab_size, cfg.rank, 0, jax.numpy.bfloat16).full_vocab
    variants = {"served": P, "ascending": dataclasses.replace(P, full_vocab_pick_reversed=None),
                **{str(c): with_config(c) for c in VARIANTS[n]}}
    time_variants(n, 0, variants, 3, out, dict(served_config=str(served)))
