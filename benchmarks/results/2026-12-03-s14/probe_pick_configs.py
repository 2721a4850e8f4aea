"""Session 14 probe: top-C pick configs inside refine at N = 1, 4, 16 (issue 16).

The trace of `probe_counted.py` showed the pick as the longest kernel of a small-N pass (3.5 µs of
~10.5 at N=1, 18 of ~40 at N=16), and a launch between kernels costing next to nothing. Here each
variant is the served Pallas steps with the pick kernel given one fixed `TopCConfig` (the counted
pick's launch is not involved): chained device time per refine with a token table (3 interleaved
rounds, min) and the tokens against the served config. Writes one JSON line per (N, variant) to argv[1].
argv[2]: the N list; argv[3]: "sweep1" (the first run: SMALL below N=16, LARGE from 16) or "sweep2"
(the second run: the first run's winners at every N, 5 rounds) or "sweep3" (the third run, after the
dispatch change: one-step configs and the earlier served one, "old", from N=32 up, 5 rounds).
"""
import dataclasses, os, sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import CFG as cfg, time_variants  # noqa: E402
from xpress_jax import dispatch, reference as ref  # noqa: E402
from xpress_jax.kernels import topc_pick as tp  # noqa: E402
from xpress_jax.ops import Ops  # noqa: E402

P = Ops.pallas()
out = open(sys.argv[1], "w")
NS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 4, 16]
SWEEP = sys.argv[3] if len(sys.argv) > 3 else "sweep1"
ROUNDS = 3 if SWEEP == "sweep1" else 5

# (c_tile, c_steps, k_tile, num_warps, num_stages); splits = cdiv(512, c_tile * c_steps)
SMALL = [(64, 1, 128, 4, 2), (32, 1, 256, 4, 1), (32, 1, 128, 4, 2), (16, 1, 256, 2, 1), (16, 2, 256, 4, 1),
         (64, 1, 256, 4, 1), (64, 1, 64, 4, 2), (32, 1, 64, 2, 2), (128, 1, 128, 8, 1), (128, 1, 64, 4, 2),
         (64, 2, 128, 4, 2), (32, 2, 128, 4, 2)]
SWEEP3 = [(128, 1, 64, 8, 2), (64, 1, 128, 4, 2), (128, 2, 64, 8, 2), (256, 1, 64, 8, 2)]
SWEEP2 = [(32, 1, 128, 4, 2), (32, 1, 64, 2, 2), (64, 1, 128, 4, 2), (32, 1, 64, 4, 2), (64, 1, 64, 2, 2),
          (16, 1, 128, 2, 2), (128, 1, 64, 8, 2)]
LARGE = [(64, 4, 128, 4, 2), (64, 2, 128, 4, 2), (32, 4, 256, 4, 1), (128, 1, 64, 8, 2), (256, 1, 64, 8, 2),
         (64, 8, 128, 4, 2), (32, 2, 256, 4, 2), (128, 2, 128, 8, 2), (128, 4, 64, 8, 2), (64, 1, 128, 4, 2)]


def with_config(c):
    tc = tp.TopCConfig(c_tile=c[0], c_steps=c[1], k_tile=c[2], num_warps=c[3], num_stages=c[4])

    def pick(base_c, cand, lat, prepared):
        add = None
        if isinstance(lat, ref.LatentSum):
            lat, add = lat.u, lat.d
        return tp.topc_pick(base_c, cand, lat, prepared, config=tc, lat_add=add)

    return dataclasses.replace(P, name=str(c), topc_pick=pick)


for n in NS:
    w2_dtype = jax.numpy.bfloat16
    served = dispatch.plan(n, cfg.block_size, cfg.vocab_size, cfg.rank, 512, w2_dtype).topc
    cands = {"sweep2": SWEEP2, "sweep3": SWEEP3}.get(SWEEP, SMALL if n < 16 else LARGE)
    variants = {"served": P, **{str(c): with_config(c) for c in cands}}
    if SWEEP == "sweep3":  # the config served before this session, spelled out
        d = tp.default_config(n * (cfg.block_size - 1), 512, cfg.rank, w2_dtype)
        variants["old"] = with_config((128, max(1, d.c_steps // 2), 64, 8, 2))
    time_variants(n, 512, variants, ROUNDS, out, dict(served_config=str(served)), width=24)
