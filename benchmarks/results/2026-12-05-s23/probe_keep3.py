"""Session 23 (issue 16), third L2-hint probe: where to ship what probe_keep2.py found (H100, session 23 run 1):
the top-C pick's hints, two hot splits of four evict_last and the rest evict_first ("hot2"), N=16 284.4 -> 274.9
but N=64 665.0 -> 705.1; and the full-vocab pick's loop split with no hint ("split", the control), which does
what "last" did: N=16 584.2 -> 550.6, N=64 1598.1 -> 1578.4 (so the split, not the hint). Here the edges:
top-C hot1/hot2 at N = 4, 8, 16, 32; full vocab "split" at N = 4, 8, 16, 128, 256.
Prediction: hot2 helps while a pass's candidate rows (rows x 512 x 512 B) exceed L2 (50 MB on H100) and its hot half
fits: N=8 (31 MB: fits anyway) nothing, N=32 (126 MB, hot half 63 MB > L2) slower, like N=64. "split": the same
-20 to -35 at N=8 and N=128/256 as at N=16/64 (a held-latent loop, one step per tile), slower at N=4 (flat loop,
second prologue; s21 "last" N=4 277 -> 365). Same kernels' sums: 0 tokens may differ. JSON to argv[1]."""
import os, sys

import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-12-05-s21"))
sys.path.insert(0, os.path.join(HERE, "..", "2026-12-03-s14"))
from harness import CFG, time_variants  # noqa: E402
from probe_keep2 import P, topc_keep, with_keep, L, F  # noqa: E402  (probe_keep2 runs nothing when imported)
from xpress_jax import dispatch  # noqa: E402

out = open(sys.argv[1], "w")
SHORT = sys.argv[2:] == ["short"]  # after the change: served (now with the hints) against none, N=16 and N=8
TOPC = {"path (no hints)": topc_keep(None), "hot1": topc_keep((1, L, F)), "hot2": topc_keep((2, L, F))}
FULL = {"split": with_keep("split"), "no hints": with_keep(None)}
for n in (16,) if SHORT else (8, 32, 16, 4):
    time_variants(n, 512, {"served": P, **TOPC}, 3, out)
for n in (8, 16) if SHORT else (8, 128, 256, 4, 16):
    served = dispatch.plan(n, CFG.block_size, CFG.vocab_size, CFG.rank, 0, jnp.bfloat16).full_vocab
    time_variants(n, 0, {"served": P, **FULL}, 3, out, dict(served_config=str(served)))
