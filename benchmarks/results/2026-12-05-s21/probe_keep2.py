"""Session 21 (issue 16), second probe. `probe_keep.py` found: at N=1..4 (flat loop) splitting the pick's loop
where the hint changes costs more than any L2 gain (N=1 207.7 -> 213.0, N=4 277.1 -> 365.3), yet at N=8 and 16
(held latent, one loop step per tile) "last" was faster (524.3 -> 513.0, 531.1 -> 500.8). Which part does it:
"split" = the same loop split with no hint (control), "last_only", "first", "last", at N = 8, 16, 32, 64, 128.
Prediction: if the hint (not the split) does it, "split" = served and the gain grows with the row tiles that
re-read w2 (N=16: 2 row tiles; N=64: 8). Then at N=1, full vocab: the mixer barrier (201.4 vs 207.7 in
probe_keep) with the combine launch in other shapes (rows per program, warps): served is one program of 16 rows
x 512 parts (8 warps), 2.0 µs per pass in the trace. Same kernels' sums: 0 tokens may differ. JSON to argv[1]."""
import dataclasses, os, sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import CFG, time_variants  # noqa: E402
from probe_keep_common import P, barrier_latent, with_keep  # noqa: E402
from xpress_jax import dispatch, ops as O  # noqa: E402
from xpress_jax.kernels import full_vocab as fvk  # noqa: E402

out = open(sys.argv[1], "w")
for n in (8, 16, 32, 64, 128):
    served = dispatch.plan(n, CFG.block_size, CFG.vocab_size, CFG.rank, 0, jnp.bfloat16).full_vocab
    variants = {k: with_keep(k) for k in ("split", "last", "last_only", "first")}
    time_variants(n, 0, {"served": P, **variants}, 3, out, dict(served_config=str(served)))


def with_combine(row_tile, warps):
    def run(logits, lat, w2, q):
        n, b, v = logits.shape
        cfg = dispatch.plan(n, b, v, lat.shape[1], 0, logits.dtype).full_vocab
        rows, rank = lat.shape
        mv, mi = fvk._fused_launch((logits.reshape(n * b, v), lat, w2), cfg, rows=rows, vocab=v, rank=rank,
                                   dtype=logits.dtype, slot_stride=b, interpret=False, reverse=q % 2 == 1)
        return fvk.combine_partials(mv, mi, row_tile=row_tile, num_warps=warps)[:rows], 0

    return dataclasses.replace(P, name=f"combine {row_tile}x{warps}", latent=barrier_latent,
                               full_vocab_pass_pick=O.PassPick(P.full_vocab_pick, run))


V1 = {"barrier": dataclasses.replace(P, latent=barrier_latent),
      **{f"barrier+combine {t}x{w}": with_combine(t, w) for t, w in ((16, 8), (16, 4), (8, 4), (4, 4), (2, 2), (1, 1),
                                                                      (1, 4))}}
time_variants(1, 0, {"served": P, **V1}, 3, out)
