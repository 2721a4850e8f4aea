"""Session 14 probe: full-vocab pick configs inside refine at N = 1 and 4 (issue 16: full vocab N=1 <= 200 µs).

The top-C pick's configs, tuned on the kernel alone, lost up to 17% inside refine
(`probe_pick_configs.py`). The same question for the full-vocab pick: each variant is the served
Pallas steps with the full-vocab pick given one fixed `FullVocabConfig` (flat, lazy, base prefetch as
served); chained device time per refine with a token table (3 interleaved rounds) and the tokens
against the served config. A config the kernel refuses is reported and skipped. Writes JSON lines to argv[1].
"""
import dataclasses, os, sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import CFG as cfg, time_variants  # noqa: E402
from xpress_jax import dispatch  # noqa: E402
from xpress_jax.kernels import full_vocab as fvk  # noqa: E402
from xpress_jax.ops import Ops  # noqa: E402

P = Ops.pallas()
out = open(sys.argv[1], "w")
# (row_tile, v_tile, v_steps, k_tile, num_warps, num_stages)
VARIANTS = {
    1: [(16, 128, 2, 64, 4, 4), (16, 128, 4, 64, 4, 4), (16, 128, 6, 64, 4, 4), (16, 64, 6, 64, 4, 4),
        (16, 256, 2, 64, 4, 4), (16, 256, 1, 64, 8, 4), (16, 128, 3, 128, 4, 3), (16, 128, 3, 64, 4, 5),
        (16, 128, 3, 64, 4, 6), (16, 128, 3, 32, 4, 6), (16, 128, 3, 64, 8, 4), (16, 128, 1, 64, 4, 4)],
    4: [(64, 64, 3, 64, 4, 4), (64, 64, 12, 64, 4, 4), (64, 128, 3, 64, 4, 4), (64, 128, 6, 64, 8, 4),
        (64, 64, 6, 64, 4, 5), (64, 64, 6, 128, 4, 3), (32, 64, 6, 64, 4, 4), (16, 128, 3, 64, 4, 4)],
}


def with_config(c):
    fc = fvk.FullVocabConfig(row_tile=c[0], v_tile=c[1], v_steps=c[2], k_tile=c[3], num_warps=c[4], num_stages=c[5],
                             hold_lat=False, flat=True, prefetch_base=True, lazy=True)

    def pick(logits, lat, w2, active=None, fallback=None):
        n, b, v = logits.shape
        return fvk.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fc, slot_stride=b)

    return dataclasses.replace(P, name=str(c), full_vocab_pick=pick)


for n in (1, 4):
    served = dispatch.plan(n, cfg.block_size, cfg.vocab_size, cfg.rank, 0, jax.numpy.bfloat16).full_vocab
    variants = {"served": P, **{str(c): with_config(c) for c in VARIANTS[n]}}
    time_variants(n, 0, variants, 3, out, dict(served_config=str(served)))
