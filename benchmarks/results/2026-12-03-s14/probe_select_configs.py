"""Session 14, prepared for the next session (not run yet): selection configs inside refine (issue 16).

Section "Top-C pick configs inside refine" found the pick's configs, chosen by timing the kernel alone, 12-18%
slower inside refine from N=32. The selection's configs were chosen the same way (dev_select, kernel alone,
except the block size at N = 1..16, measured inside refine on 2026-12-02). Each variant here is the served
Pallas steps with the selection given one set of `SelectConfig` overrides on top of the plan's; chained
device time per refine with a token table, top-512 (3 interleaved rounds), and the tokens against the served
selection (every config gives the same candidate sets, so 0 must differ). A config the kernel refuses is
reported and skipped. Writes JSON lines to argv[1]; argv[2]: the N list (default 1,16,64,256).
"""
import dataclasses, os, sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import CFG as cfg, time_variants  # noqa: E402
from xpress_jax import dispatch  # noqa: E402
from xpress_jax.kernels import select  # noqa: E402
from xpress_jax.ops import Ops  # noqa: E402

P = Ops.pallas()
out = open(sys.argv[1], "w")
NS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 16, 64, 256]
VARIANTS = [dict(num_warps=4), dict(num_warps=16), dict(gather_warps=8), dict(gather_warps=2),
            dict(finish_warps=8), dict(finish_warps=32), dict(target_programs=256), dict(target_programs=1024),
            dict(stats_blocks=256), dict(stats_blocks=1024), dict(stats_unroll=2), dict(scan_blocks=512),
            dict(scan_blocks=2048), dict(gather_blocks=32), dict(gather_blocks=128)]


def with_select(over):
    def sel(logits, c):
        n, b, v = logits.shape
        kw = {**dispatch.plan(n, b, v, 1, c, logits.dtype).select, **over}
        return select.select_candidates(logits.reshape(n * b, v), c, slot_stride=b, **kw)

    return dataclasses.replace(P, name=str(over), select=sel)


for n in NS:
    served = dispatch.plan(n, cfg.block_size, cfg.vocab_size, cfg.rank, 512, jax.numpy.bfloat16).select
    variants = {"served": P, **{str(o): with_select(o) for o in VARIANTS}}
    time_variants(n, 512, variants, 3, out, dict(served_select=str(served)), width=28)
