"""Session 15 (issue 16 / large N): passes that skip the draft slots that are final (full vocab and top-C).

Draft slot j reads only the slots before it, so after pass j+1 it is final; pass q (0-based) needs only slots
q.. (SEMANTICS "One call"). At B=16, K=6 that is 15+14+13+12+11+10 = 75 of 90 row-passes. The pick runs the
remaining rows through the kernel's ``row_ids`` (same config, so the same tokens bit for bit).
Prediction: at N=256 the pick is ~870 µs of a ~970 µs pass and scales with its row tiles (30 -> 28, 26, 24,
22, 20): -14% of the picks, ~-700 µs of ~5850 per refine; N=64 (8 -> 8, 7, 7, 6, 5 row tiles): ~-120 of 1775;
N=16 (2 row tiles in every pass): no tile fewer, so the difference is the index-map path's own cost (+0-5 µs).
Variants, full vocab: "served" (the Pallas steps as shipped: `dispatch.SKIP_FINAL_SLOTS_MIN_ROWS` = None, no
skipping), "skip" (skips wherever it can). Top-512: "served", "skip" (the top-C pick's `row_ids`, one program
per row and split: ~-17% of the picks' programs; at N=256 the pick reads ~1 GB per pass, ~213 µs: predicted
~-200 µs of ~1870), and "fori" (no `topc_pass_pick`: the passes in `lax.fori_loop(unroll=True)` as before
this session, against the shipped Python loop; predicted equal: on a CPU the XLA steps' top-C refine compiles to
the same HLO op counts in both forms). Chained device µs per refine with a token table (`harness.time_variants`, 3 interleaved rounds), tokens
against served (0 must differ). argv[1]: JSON lines out; argv[2]: N list (default 16,64,128,256).
"""
import dataclasses, functools, os, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import time_variants  # noqa: E402
from xpress_jax import ops as ops_mod  # noqa: E402
from xpress_jax.ops import Ops, PassPick  # noqa: E402

P = Ops.pallas()
S = dataclasses.replace(P, name="skip", full_vocab_pass_pick=PassPick(
    P.full_vocab_pick, functools.partial(ops_mod._pallas_pass_pick, interpret=False, skip=True)),
    topc_pass_pick=PassPick(P.topc_pick, functools.partial(ops_mod._pallas_topc_pass_pick, interpret=False, skip=True)))
F = dataclasses.replace(P, name="fori", topc_pass_pick=None)
out = open(sys.argv[1], "w")
NS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16, 64, 128, 256]
for n in NS:
    time_variants(n, 0, {"served": P, "skip": S}, 3, out)
    time_variants(n, 512, {"served": P, "skip": S, "fori": F}, 3, out)
