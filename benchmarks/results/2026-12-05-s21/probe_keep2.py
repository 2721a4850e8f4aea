"""Session 21 (issue 16), second probe (the top-C part runs first; at N=1 full vocab "served" has the mixer barrier,
shipped after probe_keep.py). `probe_keep.py` found: at N=1..4 (flat loop) splitting the pick's loop
where the hint changes costs more than any L2 gain (N=1 207.7 -> 213.0, N=4 277.1 -> 365.3), yet at N=8 and 16
(held latent, one loop step per tile) "last" was faster (524.3 -> 513.0, 531.1 -> 500.8). Which part does it:
"split" = the same loop split with no hint (control), "last_only", "first", "last", at N = 8, 16, 32, 64, 128.
Prediction: if the hint (not the split) does it, "split" = served and the gain grows with the row tiles that
re-read w2 (N=16: 2 row tiles; N=64: 8). Then at N=1, full vocab: the mixer barrier (201.4 vs 207.7 in
probe_keep) with the combine launch in other shapes (rows per program, warps): served is one program of 16 rows
x 512 parts (8 warps), 2.0 µs per pass in the trace. Third, the top-C pick with hints (`topc_pick(keep=(hot, p, q))`):
a row's candidates are the same in every pass, and at N >= 8 a pass gathers more w2 rows than L2 holds (N=16:
240 rows x 512 x 512 B = 63 MB, 16.5 µs per pick in the trace, ~3.8 TB/s). Splits j < hot gather with
evict_last (stay in L2 for the next pass), the rest evict_first. Prediction: N=16 -3 to -6 µs per pass with one
hot split of four (16 MB), up to -8 with two, -20 to -40 µs per refine; at N=1..4 nothing (3.9 MB fits L2
anyway). "index form, no hint": the hinted loads' spelling (index arrays) without a hint, a control. Same kernels' sums: 0 tokens may differ. JSON to argv[1]."""
import dataclasses, os, sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import CFG, time_variants  # noqa: E402
from probe_keep_common import P, barrier_latent, with_keep  # noqa: E402
from xpress_jax import dispatch, ops as O  # noqa: E402
from xpress_jax import reference as ref  # noqa: E402
from xpress_jax.kernels import full_vocab as fvk  # noqa: E402
from xpress_jax.kernels import topc_pick as tpk  # noqa: E402

def topc_keep(keep):
    """The served top-C pass pick (`ops._pallas_topc_pass_pick`), every pass through `topc_pick` with ``keep``."""
    def run(base_c, cand, lat, prepared, q, n):
        rows, c = base_c.shape
        b = rows // n + 1
        s = dispatch.pass_pick_rows(n, b, q, 1, min_rows=dispatch.TOPC_SKIP_FINAL_SLOTS_MIN_ROWS)
        if s == b - 1:
            return jnp.zeros((0,), jnp.int32), s
        lat_add = None
        if isinstance(lat, ref.LatentSum):
            lat, lat_add = lat
        v, r = prepared.shape
        p = O._plan(rows, 2, v, r, c, base_c.dtype, False)
        ids = O._slot_rows(n, b, s) if s else None
        return tpk.topc_pick(base_c, cand, lat, prepared, config=p.topc, lat_add=lat_add, row_ids=ids, keep=keep), s

    return dataclasses.replace(P, name=f"topc keep={keep}", topc_pass_pick=O.PassPick(P.topc_pick, run))


L, F, NORM = "evict_last", "evict_first", None
TOPC = {"path (no hints)": topc_keep(None), "hot1": topc_keep((1, L, F)), "hot2": topc_keep((2, L, F)),
        "hot1 rest normal": topc_keep((1, L, NORM)), "all first": topc_keep((0, L, F)),
        "index form, no hint": topc_keep((0, L, "evict_normal"))}


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
      **{f"barrier+combine {t}x{w}": with_combine(t, w) for t, w in ((16, 4), (4, 4), (1, 1))}}
if __name__ == "__main__":  # (session 23: behind this guard, so that probe_keep3.py can import the variants)
    out = open(sys.argv[1], "w")
    for n in (16, 64):
        time_variants(n, 512, {"served": P, **TOPC}, 3, out)
    for n in (16, 64):  # (8, 32, 128 too, first; cut for device time after failed starts)
        served = dispatch.plan(n, CFG.block_size, CFG.vocab_size, CFG.rank, 0, jnp.bfloat16).full_vocab
        variants = {k: with_keep(k) for k in ("split", "last", "last_only", "first")}
        time_variants(n, 0, {"served": P, **variants}, 3, out, dict(served_config=str(served)))
    time_variants(1, 0, {"served": P, **V1}, 3, out)
