"""Certified exact full-vocabulary picks at (close to) top-C cost (issue 14).

Three things live here (the pruned mode below is the third):

- **The refine mode** ``refine(..., topc=0, full_vocab="certified")`` (`Certified`,
  `certified_passes`): the tokens of ``topc=0`` (the plain full scan, ``full_vocab="scan"``) from the
  top-C machinery wherever a cheap bound proves that no other token can win, and a full-vocabulary
  scan of the rows where it cannot. No conditional: every pass runs the same steps, and the
  kernels read the decisions as device values (they skip the work they are told to skip).
- **The study's jnp oracle** (`prepare_exact`, `certified_full_vocab_pick`, `exact_ops`): tighter
  bounds (block centroids, an int8 copy of ``w2``) checked against the exact scores of the whole
  vocabulary; it computes every score (no saving) and stays as the reference for later kernels.

The refine mode
---------------
Once per call: each draft row's C largest base logits (``ops.select``: the top-C selection, whose
argmax also starts the block), ``tau`` = the row's C-th largest base logit (NaN as -inf), and
``M`` = ``max_v ||w2[v]|| (1 + 2^-9)`` (`prepare_certified`: weight-only, one read of ``w2`` per call).
Per pass, per draft row:

1. **Candidates.** ``ops.candidates_best`` scores the C candidates exactly (the top-C pick kernel,
   ``ties="id"``) and returns their winner **by the full-vocab rule**: ``best`` = the largest score,
   ``best_id`` = the lowest id holding it (not the top-C rule's larger base logit).
2. **Bound.** Every non-candidate v has ``base_v <= tau`` and a computed dot ``d_v <= U`` with
   ``U = ||lat|| M`` plus the rounding slack below, so its full-scan score is at most
   ``beta = R(fl(tau + R(U)))``. The row is **certified** iff ``beta < best``, or ``beta == best`` and
   every id ``<= best_id`` is a candidate (``best_id < mex``, ``mex`` = the row's lowest id that is not
   a candidate, found once per call), so every non-candidate scores below ``best`` or ties it with a
   larger id. The token of a certified row is ``best_id``. On the Pallas backend steps 1-2 are two
   launches (``ops.certify``: the pick kernel, then one launch that combines its splits, computes
   ``||lat||`` and the bound, and decides every row; with one row tile, it also counts the failing
   rows and names the rows to scan); the XLA backend spells them in jnp. Both follow the formulas
   below; their ``||lat||`` may differ by float32 summation order and the GPU's square root, which
   the margins cover (each bound is still at least the real one), so each is a valid bound.
3. **Scan of the failing rows.** Let F = the valid rows that are not certified (padding rows, anchor
   out of range, never count) and L = ``scan_blocks * (B-1)``. If ``|F| <= L``, ``ops.scan_failing``
   scans F: the Pallas steps move F to the front (a permutation computed on the device; the kernel
   reads each base and latent row through an index map, no copy of the logits) and, up to
   `dispatch.SCAN_FAILING_MAX_ROWS` draft rows, run one fused pick over every row tile in that order
   with the all-rows config's ``v_steps`` cut so that one row tile fills the GPU
   (`dispatch.capacity_config`). That pick is counted (`dispatch.CERTIFIED_COUNTED_SCAN`): the packing
   also writes one zero counter per row tile, the last program of a row tile to arrive combines the
   tile's parts and writes each scanned row's token to the draft row the packed order names, and the
   candidates' tokens are aliased in as the output (two launches: the packing, the pick; with the flag
   off, a third, the combine back in row order); above that, a packed launch of only
   ``ceil(L / row_tile)`` row tiles. Programs
   whose row tile holds no row of F return at once. So the pass reads ``w2`` about
   ``ceil(|F| / row_tile)`` times, spread over ~132 programs each (none when F is empty). A row of F
   takes the pick's token, every other row the candidates'. Where one row tile holds every row
   (N <= 8 at the serving shapes), one ``ops.full_vocab_pick(..., active=F | full)`` instead; on the Pallas backend
   that pick is one counted launch (``ops.gated_pick``, `dispatch.CERTIFIED_COUNTED_PICK`): the last
   program of a row tile combines the tile's parts, the candidates' tokens are aliased in as its
   output, and a row tile without a row of F runs nothing (no combine launch at all).
4. **Fallback.** If more than L rows fail in one pass (any row, when ``scan_blocks`` is 0 or at
   least N), the pass scans every row (in the one-launch scan: the same launch, with the all-rows
   config's vocabulary split read at run time; above `dispatch.SCAN_FAILING_MAX_ROWS`: the all-rows
   pick, a second launch whose programs return at once in other passes) and the call has *fallen
   back* (a device bool, sticky): every later pass passes ``skip`` to the top-C pick (its programs
   return at once) and scans every row. No step waits for the host.
5. **Passes that know their number.** Unrolled (GPUs; `dispatch.CERTIFIED_PASS_NUMBERS`), pass ``q``
   (0-based) knows that the draft slots before ``q`` are final: slot j reads only the slots before it
   (SEMANTICS "One call"), so after pass j + 1 every later pass gives it the same token, and the
   certified mode's blocks are the scan's after every pass (below). Those rows keep their tokens and
   are left out of the pass's scans (the packing leaves them out even in a full pass; the all-rows
   launch above `dispatch.SCAN_FAILING_MAX_ROWS` reads the others through ``row_ids``); they are still
   decided and counted (a mask per pass measured slower at small N). A pass with every slot final
   (``q >= B-1``) runs nothing. Its full-vocab picks read ``w2`` in the order and with the L2 hint of
   the scan's pass pick (``ops.full_vocab_pick(..., q=q)``; in the one-launch scan only with
   `dispatch.CERTIFIED_SCAN_KEEP`).

Why the tokens are those of ``topc=0`` on the same backend.
  *The score pipeline is monotone.* The full scan scores v as
  ``s_v = clean(R(fl(base_v + R(d_v))))``: ``d_v`` the readout dot accumulated in float32 (float64
  for float64), ``R`` rounding to the logits' dtype (to nearest even: non-decreasing), ``fl`` the
  accumulation-dtype addition (non-decreasing in each argument), ``clean`` NaN -> -inf. So
  ``base_v <= tau`` and ``d_v <= U`` give ``s_v <= beta`` (or ``s_v = -inf``): the bound goes through
  the same two roundings as the score and is compared in the logits' values, never in more precision.
  *U bounds the computed dot.* For any summation order, FMA or not, split-K included,
  ``|d_v - lat . w2[v]| <= gamma_r ||lat|| ||w2[v]||`` with ``gamma_r = r u / (1 - r u)`` (Higham,
  eq. 3.5), so ``d_v <= ||lat|| ||w2[v]|| (1 + gamma_r)``. We require ``r u <= 2^-12`` (r <= 4096 in
  float32; r = 256 gives ``gamma_r ~ 2^-16``) and store ``M = max_v ||w2[v]|| (1 + 2^-9)``, which
  covers ``1 + gamma_r`` and the float32 rounding of the norms themselves; ``||lat||`` is computed in
  float32 and multiplied by ``1 + 2^-10``; ``U = fl(M ||lat||) (1 + 2^-10)`` then exceeds the real
  product (its own roundings are below 2u of it). A tensor-core accumulator that truncates instead
  of rounding (error <= 2u per addition) is covered by the same margins many times over. Overflow
  gives +inf and NaN compares false: such rows are never certified.
  *Ties at the bound.* The full scan's winner is the largest score, lowest id. With ``beta < best``
  no non-candidate reaches ``best``; with ``beta == best`` one may tie it, but only with an id
  ``> best_id`` (every smaller id is a candidate), so it loses the tie. Either way the full scan's
  winner is the candidates' lowest-id winner. A row whose candidates all score -inf (``best = -inf``)
  is certified only when ``tau = -inf`` too (every non-candidate scores -inf) and every id below its
  lowest candidate id is a candidate: exactly when the full scan also returns that id. NaN or +inf logits need no special case.
  *Rows that are not certified* (and every row once the call has fallen back) get the full-vocab
  pick itself: the same ``ops`` step, with the same config as ``full_vocab="scan"`` (chosen by the
  same N), the only differences being which rows are active and, for the packed launch of F, how
  many vocabulary tiles one program loops over (``v_steps``), and in the counted launches which
  program combines the parts (the last to arrive, by the combine launch's rule). None changes a token: every dot,
  rounding and comparison is per (row, id) and computed the same way in every program that holds it
  (same row tile size, rank chunks and instructions; the rows a row shares a tile with, or its
  position in the packed order, change no operation on its own row), and the winner over the
  vocabulary parts (largest score, lowest id) does not depend on how the vocabulary is split.
  The candidates' token of a skipped pass is never used.
  *So the tokens equal ``topc=0``'s whenever the candidates' scores are computed bit for bit as the
  full scan computes them.* The one place they can differ is float32 summation order: on the Pallas
  backend the candidates are scored by the top-C pick kernel (a per-candidate multiply-and-sum) and
  the full scan by the tensor-core kernel; on the XLA backend the candidates' einsum and the
  readout GEMM may also sum in different orders. (The previous design's subset scan ran the kernel
  with the config of its own smaller row count: a second source, now gone.) A different order changes a dot by a few float32
  ulps, which changes a token only when two scores lie within that of each other across a rounding
  boundary (a near tie, `tests/conftest.near_tie_rows`). `tests/test_certified.py` checks, with the
  Pallas kernels in interpret mode, that every row where the certified pick differs from the scan is
  such a near tie; in its CPU runs (XLA and interpret mode; bf16, float32, float64) no token differed.
  Counting them on the GPU: `benchmarks/bench_refine`'s agreement column for an ``@certified`` backend.

When it is fast, and what a fallback costs (measured on an H200, twenty-seventh session: benchmarks/RESULTS.md,
"The certified mode's one-launch scan counted; ..."). Where every row certifies, 1.20-1.26x top-512's
time and 0.42-0.64x the scan's at N = 1, 4, 16, 64, 256; where nothing certifies, 1.14-1.19x the scan.
Where 2-7% of rows fail (seventh session, H200), 0.47x the scan at N=256, 0.70x at N=64, 1.08x at N=16
and 1.19x at N=1 (one failing row scans the whole call there).
  A pass always launches the top-C pick and the certify launch, then the scan of the failing rows:
  up to `dispatch.SCAN_FAILING_MAX_ROWS` draft rows two launches (the packing, one counted full-vocab
  pick in packed order, which writes nothing where no row fails), above it the packed launch for F and the all-rows one (plus small
  XLA ops: the failing-row count, the packing permutation and a [rows, r] latent gather); where one
  row tile holds every row (N <= 8 at the serving shapes) or any failing row falls back (N = 1), one full-vocab
  launch with the failing rows active: the counted launch (``ops.gated_pick``), which writes nothing
  where no row fails (with `dispatch.CERTIFIED_COUNTED_PICK` off: the pick and its combine, which
  writes the certified rows' tokens too; measured 10.9 / 13.1 µs per refine slower at N = 1 / 4 on
  an H100 where every row certifies, benchmarks/RESULTS.md, twenty-sixth session). The
  call adds the top-C selection (which replaces the scan's argmax start) and, unless given
  ``certified_prepared``, one read of ``w2`` for ``M`` (~78 MB in bf16, some 20 µs on an H200;
  `RefineServer` computes it once per weights). A certified pass costs a top-C pass plus the scan's
  launches with every program returning at once; a pass with failing rows adds ``ceil(|F| / row_tile)``
  row tiles' worth of a full-vocab pick spread over a whole wave; a fallen-back pass costs a full-vocab
  pass plus an empty top-C launch (and, above the threshold, an empty packed launch). No conditional: XLA:GPU's conditionals copy the branch index to the host and wait
  (``ConditionalThunk``), measured at ~25 µs per pass at N=1 in the previous design.
  On the XLA backend nothing can be skipped without a conditional: it computes the candidates and
  the full pick of every row every pass (the same tokens, more work than the scan); the mode is
  meant for the kernels.
  The bound is Cauchy-Schwarz, loose by ~sqrt(r): on the synthetic serving head (logits N(0, 2)),
  std 0.02 certifies 93-97% of rows with C = 512 (the rest are scanned every pass) and all
  with C = 2048; std 0.04 and 0.06 certify none, and every call falls back after its first pass
  (benchmarks/RESULTS.md, "Exact mode").

The pruned mode
---------------
``refine(..., topc=0, full_vocab="pruned")`` (`Pruned`, `pruned_passes`, `prepare_pruned`, the kernel
`xpress_jax.kernels.pruned`, its jnp spelling `reference.pruned_pick`): the scan's tokens, **bit for bit**,
scoring exactly only the vocab tiles that an int8 copy of ``w2`` cannot exclude. Once per call (weights
only, or given as ``certified_prepared``): ``q_v = round(w2[v] / s_v)`` in [-127, 127] with
``s_v = max|w2[v]| / 127``, ``e_v = w2[v] - s_v q_v``, ``E_v = (||e_v|| + 2^-11 (s_v ||q_v|| + ||w2[v]||)) (1 + 2^-9)``
and ``M = max ||w2[v]|| (1 + 2^-9)``. Per pass and draft row: a guess id g (``guess="candidates"``: the
winner of the C largest base logits by the full-vocab rule, from the top-C pick; ``"previous"``: the
row's previous token), then the pruned pick.

Why its tokens are the scan's (the pick reads the row's held latent ``x`` in the logits' dtype, as
the scan's kernel does, and ``n = ||x|| (1 + 2^-10)``, at least the real norm):
  *Every score is bounded.* The scan's dot ``d_v`` (float32, any order) obeys
  ``d_v <= x . w2[v] + gamma_r ||x|| ||w2[v]||`` and ``x . w2[v] = s_v (x . q_v) + x . e_v``. The pick's
  ``t_v`` (the int8 row converted exactly to the logits' dtype, float32 tensor-core sum) obeys
  ``|t_v - x . q_v| <= gamma_r ||x|| ||q_v||``. So ``d_v <= s_v t_v + ||x|| (||e_v|| + gamma_r (s_v ||q_v||
  + ||w2[v]||))``. ``U_v = fl(t_v s_v) + fl(n E_v)`` exceeds that: with ``r u <= 2^-12`` (checked),
  ``gamma_r < 2^-11`` covers the dot errors and the three float32 roundings of ``U_v`` (each below
  ``u (|s_v t_v| + n E_v)``, and ``|s_v t_v| <= s_v ||q_v|| ||x|| (1 + gamma_r)``) fall inside the ``2^-11``
  and ``1 + 2^-9`` slack; the norms' own float32 errors (relative ``(r/2 + 1) u``) too. The score pipeline
  ``R(fl(base + R(d)))`` is monotone, so ``ub_v = R(fl(base_v + R(U_v)))`` >= the scan's score of v (a NaN
  ``ub`` forces the exact step).
  *The threshold is at most the winning score.* ``thr = clean(R(fl(base_g + R(d_g - 2 eps))))`` with
  ``d_g`` = ``x . w2[g]`` in float32 (any order) and ``eps = 2^-11 n M``: the scan's ``d_g`` differs from
  it by at most ``2 gamma_r ||x|| ||w2[g]|| < eps``, so by monotonicity ``thr`` <= the scan's score of g
  <= the row's winning score. Inside a program ``thr`` rises to the best exact score seen (a score of
  the scan itself).
  *Nothing that could win or tie the winner is skipped.* A tile is skipped only if every id in it has
  ``ub < thr``: each scores below ``thr`` <= the winner's score, so it is neither the winner nor tied
  with it (ties at the bound need no rule: equality is never excluded). The winner's own ``ub`` >=
  its score >= ``thr``, so its tile is scored exactly, by the scan kernel's code: the same held latent
  chunks, the same dots (the same row, vocab and rank tiles: `kernels.pruned.pruned_config`), the same
  lazy epilogue, the same combine. Each row's (largest score, lowest id) over the scored tiles is then
  the scan's. NaN logits score -inf in both; a NaN or inf latent makes ``||x||`` inf or NaN, so every
  bound is inf or NaN and every tile is scored.
  So, unlike the certified mode, the candidates' scores never enter a comparison (they only choose
  ``g``), and no float32 summation order of another kernel can change a token. What remains is the
  compiler: the exact step issues the scan's dots on the same chunk shapes, in the same order, with the
  same warps, but in another loop (the scan at N <= 4 uses its flat loop), and nothing but Triton's
  choices makes the two instruction sequences equal; in every compiled run so far no token differed. `tests/test_pruned.py` checks the bound id by id
  (``ub >= score``), that a too-small bound is caught, and the tokens against the scan (odd shapes,
  ties, NaN/inf, adversarial heads, both kernel loops, compiled on an H200).
  *Fallback.* A pass that scores more than ``max_exact`` of its vocab tiles exactly sets a device flag:
  every later pass runs the kernel's plain loop (every tile, no int8 work) and skips the top-C pick.
  Float64 runs the scan (no int8 kernel; stats report every pass as a full scan).

What it costs (H200, 2026-12-02, benchmarks/RESULTS.md "Pruned mode"): it prunes well — on the
synthetic std-0.04 serving head (strong refinement: the certified mode certifies no row there),
99.9% of (row, id) pairs excluded, 1.9 / 7.1 / 7.8% of (row tile, vocab tile) pairs scored exactly at
N = 1 / 16 / 256, 0 tokens differ — but it is **slower than the scan**: 366 / 1056 / 11671 µs per
refine against the scan's 242 / 549 / 5819 (the first kernel version; the pick alone, later variants:
0.95-1.4x the scan's pick at N=1, 1.7-2.3x at N=16, 1.9x at N=256). The int8 bound pass costs about
what the bf16 scan costs: at N >= 16 the scan is not bound by reading ``w2`` (its pick runs at ~26% of
the tensor cores' peak, ~3 TB/s), and the int8 tile must be converted for a bf16 tensor-core dot. So
``"scan"`` stays the default and this mode is for measurement and later kernels (an int8 x int8 dot
with a quantised latent, which the same argument covers with one more error term).

The study's oracle
------------------
`certified_full_vocab_pick` returns, for every draft row, exactly `reference.full_vocab_pick`'s
token (the argmax of ``float(dtype(base + dtype(lat @ w2.T)))``, lowest vocab id on ties) while
scoring exactly only what an upper bound cannot exclude:

1. **Candidates.** Each row's C largest base logits (`reference.select_candidates`) are scored
   exactly; ``best`` is their largest score and ``best_id`` the lowest id holding it.
2. **Block bound (stage 1).** The vocabulary is cut into blocks of ``block`` ids. For block j,
   with centroid ``c_j`` and radius ``rho_j = max_v ||w2[v] - c_j||`` (weights only:
   `prepare_exact`), every member's dot obeys ``lat . w2[v] <= lat . c_j + rho_j ||lat||``.
   With ``B_j = min(tau, max base in block j)`` (``tau``: the C-th largest base logit; every
   non-candidate has ``base <= tau``) this bounds every non-candidate's score in the block.
3. **Quantized rows (stage 2).** In blocks that stage 1 cannot exclude, each id v gets
   ``lat . w2[v] <= lat . deq[v] + ||lat|| ||w2[v] - deq[v]||`` with ``deq[v] = scale[v] * q[v]``
   a per-row-scaled int8 (or 4-bit) copy of ``w2`` and its per-row error norm (weights only),
   and its own base logit.
4. **Exact scan.** Ids that neither stage excludes are scored exactly; the winner is the best
   over the candidates and those ids.

Why an excluded id cannot change the token (the argument the tests check).
  *The score pipeline is monotone.* The reference score of v is
  ``s_v = clean(R(fl(base_v + R(d_v))))`` where ``d_v`` is the readout dot accumulated in the
  accumulation dtype (float32; float64 for float64), ``R`` rounds to the logits' dtype (round to
  nearest even: non-decreasing), ``fl`` is the accumulation-dtype addition (non-decreasing in each
  argument) and ``clean`` maps NaN to -inf. So if ``base_v <= B`` and ``d_v <= U`` then
  ``s_v <= R(fl(B + R(U))) =: beta`` (or ``s_v = -inf``): the bound is pushed through the same two
  roundings the score takes, never compared in higher precision.
  *U bounds the computed dot, not just the real one.* For a dot of r terms accumulated in
  precision u (2^-24 for float32), in any order, with or without FMA, split-K included,
  ``|d_v - lat . w2[v]| <= gamma_r ||lat|| ||w2[v]||`` with ``gamma_r = r u / (1 - r u)``
  (Higham, Accuracy and Stability, eq. 3.5; ``sum |lat_i w_i| <= ||lat|| ||w||``). We require
  ``r u <= 2^-12`` (r <= 4096 in float32) and fold ``gamma_r`` into the stored radii:
  ``M_j = rho_j (1 + 2^-9) + 2^-9 ||c_j||`` (covers ``rho_j + gamma_r (2 ||c_j|| + rho_j)``, the
  error of our own ``lat . c_j``, and the rounding of the float32 norms themselves) and, per
  quantized row, ``E_v = ||w2[v] - deq[v]|| (1 + 2^-9) + 2^-9 (||w2[v]|| + ||deq[v]||)``.
  ``||lat||`` is computed in float32 and multiplied by ``1 + 2^-10`` (its relative error is below
  (r/2 + 1) u). The bound ``U = fl(a + M ||lat||) + 2^-10 (|a| + M ||lat||)`` (a = the computed
  ``lat . c_j`` or ``lat . deq[v]``) then exceeds the real ``a + M ||lat||``: every rounding in
  its own arithmetic is below 4u (|a| + M ||lat||), far below the 2^-10 slack. Overflow gives
  +inf (excludes nothing); NaN compares false (excludes nothing).
  *Ties.* The lowest id wins ties, so an id whose score could EQUAL ``best`` matters if its id is
  lower than ``best_id``. An id (block) is excluded iff ``beta < best``, or ``beta == best`` and
  the id (the block's first id) is greater than ``best_id``: then every member either scores
  below ``best`` or ties it with a larger id. The final winner is the largest exact score over
  the kept ids (candidates and unexcluded ids), lowest id among them: every excluded id scores
  at most that maximum and, on equality, has a larger id than some kept id that holds it, so the
  result is the full-vocab argmax. The bound is never trusted beyond this: a NaN or -inf row
  (``best = -inf``) excludes only blocks of larger ids than its lowest -inf candidate.

The jnp reference computes the exact scores of the whole vocabulary once (it is the oracle) and
masks the excluded ids to -inf before the argmax, so a wrong bound would give a wrong token; the
stats also count ``violations`` (excluded ids that could have won: must be 0). What a GPU kernel
would read is what the counters say: the candidates' rows, the stage-1 data for every block, the
quantized rows of the unexcluded blocks, and the w2 rows of the unexcluded ids.

`exact_ops(inner)` is ``inner`` with this pick as its ``full_vocab_pick``, usable with
``xpress_jax.refine.refine_with(ops, head, logits, h, anchors, topc=0)``. Design: its
``full_vocab_prepare`` is `prepare_exact`, which refine runs once per call on the ``w2`` it is
given (inside the jitted refine: no weights are closed over as constants, STYLE: weights enter
jit as arguments), and its ``full_vocab_pick`` reads ``(w2, prepared)``. The tokens are exact for
whatever ``w2`` is passed. A serving path would keep the prepared data with the loaded params
instead of recomputing it per call (later work).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import dispatch
from . import reference as ref
from .reference import SLACK, bound_beta as _beta, bound_upper as _upper, certify_rows
from .head import acc_dtype
from .ops import Ops

__all__ = ["SLACK", "certify_rows", "lowest_missing", "FULL_VOCAB", "Auto", "Certified", "CertifiedStats", "CertifiedPrepared", "PrunedPrepared", "prepare_pruned", "Pruned", "PrunedStats", "pruned_passes", "resolve_full_vocab", "prepare_certified",
           "certified_pick", "certified_passes", "ExactPrepared", "ExactStats", "prepare_exact", "certified_full_vocab_pick", "exact_ops"]

_SLACK = SLACK
_RAD = 2.0 ** -9


class ExactPrepared(NamedTuple):
    """Weight-only data (`prepare_exact`), accumulation dtype unless stated. ``nb = ceil(V / block)``."""

    centroid: jax.Array  # [nb, r] block centroids c_j
    radius: jax.Array  # [nb] M_j: rho_j with the dot-error margin folded in
    q: jax.Array  # [V, r] int8 quantized rows (values in [-127, 127], or [-7, 7] for 4 bits)
    scale: jax.Array  # [V] per-row scale: deq[v] = scale[v] * q[v]
    qerr: jax.Array  # [V] E_v: ||w2[v] - deq[v]|| with the dot-error margin folded in


class ExactStats(NamedTuple):
    """Per-call counters, each a scalar (fractions over draft rows or (row, id) pairs)."""

    rows_certified: jax.Array  # rows where no non-candidate needed an exact score
    blocks_excluded: jax.Array  # (row, block) pairs excluded by the block bound (stage 1)
    ids_quant_scanned: jax.Array  # (row, id) pairs that stage 2 had to bound (ids in unexcluded blocks)
    ids_exact_scanned: jax.Array  # (row, non-candidate id) pairs scored exactly
    violations: jax.Array  # int32: excluded ids that could have won (the self-check: must be 0)


def _check_rank(r: int, acc) -> None:
    u = float(jnp.finfo(acc).eps) / 2
    if r * u > 2.0 ** -12:
        raise ValueError(f"rank r={r} is too large for the rounding margins in {jnp.dtype(acc)} (need r*u <= 2^-12)")


def prepare_exact(w2: jax.Array, *, block: int = 64, bits: int = 8) -> ExactPrepared:
    """[V, r] -> `ExactPrepared`: block centroids and radii, and a per-row quantized copy of ``w2``.

    Depends on the weights only: compute once when params are loaded (or, in `exact_ops`, inside
    the jitted refine). ``bits``: 8 (int8, scale = max|w|/127) or 4 (values in [-7, 7], stored in
    int8 here). Every stored radius includes the rounding margins of the module doc.
    """
    if block < 1:
        raise ValueError(f"block={block} must be >= 1")
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} must be 4 or 8")
    V, r = w2.shape
    acc = acc_dtype(w2.dtype)
    _check_rank(r, acc)
    nb = -(-V // block)
    w = w2.astype(acc)
    wp = jnp.pad(w, ((0, nb * block - V), (0, 0))).reshape(nb, block, r)
    valid = (jnp.arange(nb * block) < V).reshape(nb, block)
    count = valid.sum(1).astype(acc)
    cen = wp.sum(1) / count[:, None]  # any vector works: rho is measured from the stored one
    dist = jnp.linalg.norm(wp - cen[:, None], axis=-1)
    rho = jnp.max(jnp.where(valid, dist, 0), axis=1)
    radius = rho * (1 + _RAD) + _RAD * jnp.linalg.norm(cen, axis=-1)
    qmax = 127 if bits == 8 else 7
    amax = jnp.max(jnp.abs(w), axis=1)
    scale = jnp.where(amax > 0, amax / qmax, 1).astype(acc)
    q = jnp.clip(jnp.round(w / scale[:, None]), -qmax, qmax)
    deq = q * scale[:, None]
    qerr = (jnp.linalg.norm(w - deq, axis=-1) * (1 + _RAD)
            + _RAD * (jnp.linalg.norm(w, axis=-1) + jnp.linalg.norm(deq, axis=-1)))
    return ExactPrepared(cen, radius, q.astype(jnp.int8), scale, qerr)




def _excluded(beta, ids, best, best_id):
    return (beta < best) | ((beta == best) & (ids > best_id))


def certified_full_vocab_pick(base: jax.Array, lat: jax.Array, w2: jax.Array, prepared: ExactPrepared, *,
                              candidates: int = 512, direct_readout: bool = False):
    """[rows,V] base, [rows,r] lat, [V,r] w2, `prepare_exact` (w2) -> (tokens [rows] int32, `ExactStats`).

    ``tokens`` equals ``reference.full_vocab_pick(base, lat, w2)`` by construction (module doc);
    ``candidates`` (C, clamped to V) base logits per row are scored exactly first.
    """
    rows, V = base.shape
    r = lat.shape[1]
    dtype = base.dtype
    acc = acc_dtype(dtype)
    _check_rank(r, acc)
    nb = prepared.centroid.shape[0]
    block = -(-V // nb)
    if -(-V // block) != nb or prepared.q.shape != (V, r):
        raise ValueError(f"prepared data (blocks {nb}, q {prepared.q.shape}) does not fit w2 [{V}, {r}]")
    c = min(int(candidates), V)
    if c < 1:
        raise ValueError(f"candidates={candidates} must be >= 1")
    hi = jax.lax.Precision.HIGHEST

    # Exact scores: the oracle's own computation (a kernel scores only the kept ids).
    s = ref.round_sum(base, ref.readout(lat, w2, dtype, direct=direct_readout)).astype(acc)  # [rows, V]
    ids = jnp.arange(V, dtype=jnp.int32)
    cand, base_c, _ = ref.select_candidates(base, c)
    is_cand = jnp.zeros((rows, V), bool).at[jnp.arange(rows)[:, None], cand].set(True)
    s_c = jnp.take_along_axis(s, cand, axis=1)
    best, best_id = ref.best_by_score(s_c, cand)
    best_c, best_id_c = best[:, None], best_id[:, None]

    cb = ref.clean(base)
    tau = jnp.min(ref.clean(base_c), axis=1)  # the C-th largest base logit
    latf = lat.astype(acc)
    nrm = jnp.sqrt(jnp.sum(latf * latf, axis=1)) * (1 + _SLACK)  # [rows]

    # Stage 1: per block, B_j = min(tau, block max) and U = lat . c_j + M_j ||lat||.
    pad = nb * block - V
    bmax = jnp.max(jnp.pad(cb, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(rows, nb, block), axis=2)
    b1 = jnp.minimum(tau[:, None], bmax)
    cl = jnp.matmul(latf, prepared.centroid.astype(acc).T, precision=hi)  # [rows, nb]
    beta1 = _beta(b1, _upper(cl, prepared.radius[None], nrm[:, None]), dtype)
    first = jnp.arange(nb, dtype=jnp.int32) * block
    ex_blk = _excluded(beta1, first[None], best_c, best_id_c)  # [rows, nb]
    ex1 = jnp.repeat(ex_blk, block, axis=1)[:, :V]

    # Stage 2: per id, its own base and U = lat . deq[v] + E_v ||lat||.
    qd = jnp.matmul(latf, prepared.q.astype(acc).T, precision=hi) * prepared.scale[None].astype(acc)
    beta2 = _beta(cb, _upper(qd, prepared.qerr[None].astype(acc), nrm[:, None]), dtype)
    ex2 = _excluded(beta2, ids[None], best_c, best_id_c)

    keep = is_cand | ~(ex1 | ex2)
    top = jnp.max(jnp.where(keep, s, -jnp.inf), axis=1, keepdims=True)
    big = jnp.iinfo(jnp.int32).max
    tok = jnp.min(jnp.where(keep & (s == top), ids[None], big), axis=1).astype(jnp.int32)

    nonc = ~is_cand
    scanned = nonc & keep
    lost = ~keep & ((s > best_c) | ((s == best_c) & (ids[None] < best_id_c)))
    stats = ExactStats(
        rows_certified=jnp.mean(~jnp.any(scanned, axis=1)),
        blocks_excluded=jnp.mean(ex_blk),
        ids_quant_scanned=jnp.mean(~ex1),
        ids_exact_scanned=jnp.sum(scanned) / jnp.maximum(jnp.sum(nonc), 1),
        violations=jnp.sum(lost).astype(jnp.int32),
    )
    return tok, stats


def _exact_prepare(w2, *, block, bits):
    return w2, prepare_exact(w2, block=block, bits=bits)


def _exact_full_vocab_pick(logits, lat, w2_prepared, active=None, fallback=None, *, candidates,
                           direct_readout, q=None):
    from .ops import with_fallback

    w2, prepared = w2_prepared
    tok, _ = certified_full_vocab_pick(ref.draft_rows(logits), lat, w2, prepared, candidates=candidates,
                                       direct_readout=direct_readout)
    return with_fallback(tok, active, fallback)


@functools.lru_cache(maxsize=None)
def exact_ops(inner: Ops, *, candidates: int = 512, block: int = 64, bits: int = 8,
              direct_readout: bool = False) -> Ops:
    """``inner`` with the certified pick as ``full_vocab_pick`` (run it with ``topc=0``).

    One object per argument set (cached: a static jit arg that does not retrace). Its
    ``full_vocab_prepare`` computes the weight data once per refine call (module doc, "Design").
    """
    return dataclasses.replace(
        inner, name=f"{inner.name}+exact",
        full_vocab_prepare=functools.partial(_exact_prepare, block=int(block), bits=int(bits)),
        full_vocab_pick=functools.partial(_exact_full_vocab_pick, candidates=int(candidates),
                                          direct_readout=bool(direct_readout)),
        full_vocab_capacity=None)  # the oracle picks every row


# ============================================================================= the refine mode

#: The spellings of `refine`'s ``full_vocab`` (how ``topc=0`` is computed; a `Certified` also works).
FULL_VOCAB = ("scan", "certified", "pruned")


@dataclasses.dataclass(frozen=True)
class Certified:
    """Settings of ``full_vocab="certified"`` (frozen: a static jit argument). None changes a token.

    candidates: C, the candidates scored exactly per draft row each pass (its C largest base logits;
      clamped to V). A top-C pass's cost; a larger C certifies more rows (a lower ``tau``) at a
      higher cost per pass.
    scan_blocks: how many blocks' worth of failing rows (B-1 rows each; bound not certified) a pass
      scans in the packed launch; a pass with more scans every row, and the rest of the call falls
      back to the plain full-vocab pick (no more candidate picks). ``None``: ``ceil(N / 8)``; ``0``,
      or at least N: any failing row falls back.
    """

    candidates: int = 512
    scan_blocks: int | None = None

    def __post_init__(self):
        c = self.candidates
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
            raise ValueError(f"Certified: candidates must be an int >= 1, got {c!r}")
        s = self.scan_blocks
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0):
            raise ValueError(f"Certified: scan_blocks must be None or an int >= 0, got {s!r}")

    def blocks(self, n: int) -> int:
        """The scan_blocks used at N blocks."""
        return -(-n // 8) if self.scan_blocks is None else int(self.scan_blocks)


@dataclasses.dataclass(frozen=True)
class Pruned:
    """Settings of ``full_vocab="pruned"`` (frozen: a static jit argument). None changes a token.

    guess: where each row's threshold id comes from: ``"candidates"`` (the winner of its C largest
      base logits, scored by the top-C pick each pass: the best guess, one top-C pass's cost) or
      ``"previous"`` (the row's token from the previous pass, the base argmax in pass 1: free).
    candidates: C for ``guess="candidates"``.
    max_exact: a pass that scores more than this fraction of its vocab tiles exactly makes the call
      fall back: every later pass is the plain scan (no int8 work, no candidates).
    """

    guess: str = "candidates"
    candidates: int = 512
    max_exact: float = 0.25

    def __post_init__(self):
        if self.guess not in ("candidates", "previous"):
            raise ValueError(f"Pruned: guess must be 'candidates' or 'previous', got {self.guess!r}")
        c = self.candidates
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
            raise ValueError(f"Pruned: candidates must be an int >= 1, got {c!r}")
        if not 0 <= self.max_exact <= 1:
            raise ValueError(f"Pruned: max_exact must lie in [0, 1], got {self.max_exact!r}")


@dataclasses.dataclass(frozen=True)
class Auto:
    """``RefineServer(full_vocab="auto")``: exact tokens, the certified mode where it pays, the scan elsewhere.

    A per-bucket policy of the server (plain `refine` has no state between calls, so it does not
    take it). Buckets of fewer than ``min_blocks`` blocks always scan (on an H200 the certified
    mode was slower than the scan at N <= 16 even where 97% of rows certified, and faster from
    N = 64: benchmarks/RESULTS.md "Exact mode"). Larger buckets start certified; every
    ``check_every``-th certified call keeps its `CertifiedStats`, read by a later call once the device
    has finished it (never waiting); if its fraction of fallen-back passes exceeds ``max_fallback``
    the bound is not pruning for this head and traffic, and the bucket scans for the next
    ``retry_after`` calls, then tries the certified mode again. The tokens are the scan's either way.
    Costs: two executables per large bucket (start-up time), one device-to-host read of a scalar
    every ``check_every`` certified calls, and in the regime where pruning fails about one certified
    call in ``retry_after`` (measured 1.1-1.4x a scan call).
    """

    min_blocks: int = 64
    check_every: int = 16
    retry_after: int = 256
    max_fallback: float = 0.5
    certified: Certified = Certified()

    def __post_init__(self):
        for name in ("min_blocks", "check_every", "retry_after"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Auto: {name} must be an int >= 1, got {v!r}")
        if not 0 <= self.max_fallback <= 1:
            raise ValueError(f"Auto: max_fallback must lie in [0, 1], got {self.max_fallback!r}")
        if not isinstance(self.certified, Certified):
            raise ValueError(f"Auto: certified must be an xpress_jax.exact.Certified, got {self.certified!r}")


def resolve_full_vocab(full_vocab) -> "Certified | Pruned | None":
    """``"scan"`` -> None (the plain full scan), ``"certified"`` -> ``Certified()``, ``"pruned"`` ->
    ``Pruned()``, a `Certified` or `Pruned` -> itself; anything else raises ValueError naming ``full_vocab``."""
    if isinstance(full_vocab, (Certified, Pruned)):
        return full_vocab
    if isinstance(full_vocab, str) and full_vocab in FULL_VOCAB:
        return {"scan": None, "certified": Certified(), "pruned": Pruned()}[full_vocab]
    raise ValueError(f"full_vocab must be one of {FULL_VOCAB}, an xpress_jax.exact.Certified or an "
                     f"xpress_jax.exact.Pruned, got {full_vocab!r}")


class CertifiedPrepared(NamedTuple):
    """Weight-only data of the certified mode (`prepare_certified`)."""

    max_norm: jax.Array  # [] accumulation dtype: M = max_v ||w2[v]|| (1 + 2^-9), the dot-error margin folded in


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den`` of int32 counts as float32, exactly 1 where they are equal and 0 where ``num`` is 0:
    XLA on GPUs may divide float32 approximately (measured on an H200: 40 / 40 gave 0.99999994)."""
    q = num.astype(jnp.float32) / den.astype(jnp.float32)
    return jnp.where(num == den, 1.0, jnp.where(num == 0, 0.0, q)).astype(jnp.float32)


class CertifiedStats(NamedTuple):
    """Per-call counters of the certified mode (float32 scalars; `refine(..., return_stats=True)`).

    Valid rows only (a row whose anchor or prev id is out of range is padding and never counts).
    The bound is one per row, not per block of vocab ids, so the fraction of (row, vocab block) pairs
    excluded without a scan is ``rows_certified`` too: a certified row excludes every block, a
    failing row scans all of them.
    """

    rows_certified: jax.Array  # certified rows / rows tried (the rows of the passes that scored candidates; 1 if none)
    passes_certified: jax.Array  # fraction of the K passes in which every row certified (no scan at all)
    passes_row_scan: jax.Array  # fraction of passes that scanned their failing rows, at most scan_blocks * (B-1)
    passes_full_scan: jax.Array  # fraction of passes from the fallback on: the pass with more failing rows (it scans them) and every later pass (the plain full-vocab pick, no candidates)


def prepare_certified(w2: jax.Array) -> CertifiedPrepared:
    """[V, r] -> `CertifiedPrepared`: ``M = max_v ||w2[v]|| (1 + 2^-9)`` in the accumulation dtype.

    Weights only: `refine` computes it once per call (one read of ``w2``, ~20 µs at serving shapes on
    an H200) unless given it as ``certified_prepared`` (`RefineServer` computes it at start-up and at
    every reload). Refuses ranks too large for the margins (``r u > 2^-12``)."""
    acc = acc_dtype(w2.dtype)
    _check_rank(w2.shape[1], acc)
    w = w2.astype(acc)
    return CertifiedPrepared(jnp.max(jnp.sqrt(jnp.sum(w * w, axis=1))) * (1 + _RAD))


class PrunedPrepared(NamedTuple):
    """Weight-only data of the pruned mode (`prepare_pruned`; float32 unless stated)."""

    q: jax.Array  # [V, r] int8: w2[v] ~ scale[v] * q[v], values in [-127, 127]
    scale: jax.Array  # [V] s_v = max|w2[v]| / 127 (1 where the row is 0)
    err: jax.Array  # [V] E_v: ||w2[v] - s_v q[v]|| with every rounding margin folded in (the pruned mode's doc)
    max_norm: jax.Array  # [] M = max_v ||w2[v]|| (1 + 2^-9)


def prepare_pruned(w2: jax.Array) -> PrunedPrepared:
    """[V, r] -> `PrunedPrepared` for ``full_vocab="pruned"``: a per-row int8 copy of ``w2`` and its error norms.

    Weights only: `refine` computes it once per call (one read of ``w2`` and a 39 MB int8 write at
    serving shapes) unless given it as ``certified_prepared``; a server keeps it with the loaded
    params. ``E_v = (||e_v|| + 2^-11 (s_v ||q_v|| + ||w2[v]||)) (1 + 2^-9)`` with ``e_v = w2[v] - s_v q_v``
    (module doc, "The pruned mode", why this covers every rounding). Refuses ranks too large for the
    margins (``r u > 2^-12`` in float32) and float64 weights (the pruned kernel's dtypes are bf16,
    f16 and f32)."""
    _check_rank(w2.shape[1], jnp.float32)
    if jnp.dtype(w2.dtype) == jnp.float64:
        raise TypeError("prepare_pruned: float64 weights have no pruned kernel (use full_vocab='scan')")
    w = w2.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=1)
    scale = jnp.where(amax > 0, amax / 127, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(w / scale[:, None]), -127, 127)
    e = jnp.linalg.norm(w - q * scale[:, None], axis=1)
    nq = jnp.linalg.norm(q, axis=1)
    nw = jnp.linalg.norm(w, axis=1)
    err = (e + 2.0 ** -11 * (scale * nq + nw)) * (1 + _RAD)
    return PrunedPrepared(q.astype(jnp.int8), scale, err.astype(jnp.float32), (jnp.max(nw) * (1 + _RAD)).astype(jnp.float32))


class PrunedStats(NamedTuple):
    """Per-call counters of the pruned mode (float32 scalars; `refine(..., return_stats=True)`).

    Over the passes that ran the bound (not fallen back) and the valid rows. The winner's own bound
    always reaches its threshold, so a row is *certified* when its bound excluded every other id.
    """

    rows_certified: jax.Array  # rows whose bound excluded every id but one / rows tried (1 if none)
    ids_excluded: jax.Array  # (row, id) pairs the row's bound excluded / pairs tried (1 if none)
    tiles_exact: jax.Array  # (row tile, vocab tile) pairs the kernel scored exactly / pairs, mean over passes tried
    passes_full_scan: jax.Array  # fraction of the K passes run as the plain scan (after a fallback)


def lowest_missing(cand: jax.Array) -> jax.Array:
    """[rows, C] distinct ids -> [rows] int32: each row's lowest id that is not among them."""
    rows, c = cand.shape
    present = jnp.zeros((rows, c + 1), bool).at[jnp.arange(rows)[:, None], jnp.minimum(cand, c)].set(True)
    return jnp.argmin(present, axis=1).astype(jnp.int32)  # the first False (column c: all of 0..c-1 present)


class _CallData(NamedTuple):
    """What the certified mode computes once per call (module doc, "The refine mode")."""

    cand: jax.Array  # [rows, C] int32
    base_c: jax.Array  # [rows, C]
    start: jax.Array  # [rows] int32: the full-vocab argmax of the base logits
    cprep: object  # ops.topc_prepare(w2, cand)
    fprep: object  # ops.full_vocab_prepare(w2)
    tau: jax.Array | None  # [rows] accumulation dtype: the C-th largest base logit (None: C = V)
    max_norm: jax.Array | None  # [] M
    mex: jax.Array | None  # [rows] int32: the lowest id that is not a candidate (None: C = V)


def _call_data(ops: Ops, logits: jax.Array, w2: jax.Array, c: int, prepared: "CertifiedPrepared | None" = None) -> _CallData:
    if ops.candidates_best is None:
        raise ValueError(f"full_vocab='certified' needs Ops with candidates_best; {ops.name!r} has none "
                         "(the vocabulary-sharded steps do not support it)")
    acc = acc_dtype(logits.dtype)
    _check_rank(w2.shape[1], acc)
    cand, base_c, start = ops.select(logits, c)
    tau = max_norm = mex = None
    if c < logits.shape[2]:
        tau = jnp.min(ref.clean(base_c).astype(acc), axis=1)
        max_norm = (prepare_certified(w2) if prepared is None else prepared).max_norm
        mex = lowest_missing(cand)
    return _CallData(cand, base_c, start, ops.topc_prepare(w2, cand), ops.full_vocab_prepare(w2), tau, max_norm, mex)


def _decide(ops: Ops, d: _CallData, lat: jax.Array, dtype, valid, fallen, limit=None):
    """``ops.certify`` (or its jnp spelling where the steps have none): (best_id [rows] int32, fail
    [rows], act [rows], flags) as ``ops.certify`` returns them (``fail``/``act`` bool or int32 0/1;
    ``flags`` int32 [8] with ``limit``, else None). ``fallen`` (a device flag: a bool scalar or int32
    flags): the candidates' kernel reads nothing, ``best_id`` is unspecified and no row fails."""
    if d.tau is None:  # every id is a candidate: every row is certified
        _, best_id = ops.candidates_best(d.base_c, d.cand, lat, d.cprep, skip=fallen)
        none = jnp.zeros(best_id.shape, bool)
        if limit is None:
            return best_id, none, none, None
        was = ref.flag_value(fallen)
        return best_id, none, none | was, ref.make_flags(was, 0)
    if ops.certify is not None:
        return ops.certify(d.base_c, d.cand, lat, d.cprep, d.tau, d.max_norm, d.mex, valid, fallen, limit)
    best, best_id = ops.candidates_best(d.base_c, d.cand, lat, d.cprep, skip=fallen)
    return certify_rows(best, best_id, lat, d.tau, d.max_norm, d.mex, valid, fallen, limit, dtype)


def certified_pick(ops: Ops, logits: jax.Array, lat: jax.Array, w2: jax.Array, cfg: Certified = Certified()):
    """One pass of the certified mode on given latents (for tests and experiments).

    ``logits`` [N, B, V] (draft slots 1..B-1 are the rows), ``lat`` [rows, r]. Returns (tokens [rows]
    int32, certified [rows] bool): the candidates' winner where the bound certifies it, else
    ``ops.full_vocab_pick``'s token (its active rows: those not certified). The tokens equal
    ``ops.full_vocab_pick(logits, lat, w2)`` by the argument of the module doc.
    """
    d = _call_data(ops, logits, w2, min(int(cfg.candidates), logits.shape[2]))
    rows = lat.shape[0]
    best_id, fail, _, _ = _decide(ops, d, lat, logits.dtype, jnp.ones((rows,), bool), jnp.zeros((), bool))
    return ops.full_vocab_pick(logits, lat, d.fprep, active=fail, fallback=best_id), fail == 0


def certified_passes(ops: Ops, params, logits: jax.Array, xh: jax.Array, anchors: jax.Array, prev_ids: jax.Array,
                     valid: jax.Array, num_passes: int, unroll: bool, cfg: Certified,
                     prepared: "CertifiedPrepared | None" = None):
    """The K passes of ``refine(..., topc=0, full_vocab=cfg)`` (module doc, "The refine mode").

    ``anchors``/``prev_ids`` [N] int32 in range, ``valid`` [N] bool (rows of invalid blocks never
    count), ``xh`` [N, B, r]. ``prepared``: `prepare_certified` of these weights' ``w2`` (None: computed
    here, one read of ``w2``). Returns (the block [N, B] int32 after K passes, `CertifiedStats`).
    No conditional: every pass runs the same ops, and the decisions are device values that the
    kernels read (the top-C pick's ``skip``, the full-vocab pick's ``active`` rows).
    """
    N, B, V = logits.shape
    r = params["w1"].shape[1]
    rows = N * (B - 1)
    dtype = logits.dtype
    k_sub = cfg.blocks(N)
    limit = k_sub * (B - 1) if 0 < k_sub < N else 0  # more failing rows in a pass: the call falls back
    d = _call_data(ops, logits, params["w2"], min(int(cfg.candidates), V), prepared)  # once per call
    # A packed scan of the failing rows, where the steps have one that saves work (else one pick).
    packed = bool(limit and ops.scan_failing and ops.full_vocab_capacity
                  and ops.full_vocab_capacity(N, B, V, r, dtype, limit) is not None)
    row_valid = jnp.repeat(valid, B - 1)
    n_valid = jnp.sum(row_valid, dtype=jnp.int32)
    gated = ops.gated_pick if ops.gated_pick is not None and ops.gated_pick.pick is ops.full_vocab_pick else None

    def one_pass(q, carry):
        # q: the 0-based pass number where the passes are unrolled (a Python int), else None. Then the draft
        # slots before s are final (module doc, "Passes that know their number"): they keep their tokens and the
        # scans leave them out.
        # flags: int32 [8] = [fallen, the last pass's failing rows, 0, ...], as the kernels write and
        # read it (`kernels.common.flag_operand`): between two kernels of the certified mode no XLA op runs
        blk, flags, (tried, certified, outcomes) = carry
        s = 0 if q is None else min(q, B - 1)
        if s == B - 1:  # every draft slot is final: the pass would give the block it has (counted as certified)
            return blk, flags, (tried, certified, outcomes.at[0].add(1))
        kw = {} if q is None else {"q": q}
        fallen = ref.flag_value(flags)
        lat = ops.latent(params, xh, blk, prev_ids).reshape(rows, r)
        # fail: valid rows whose bound fails (none once fallen: then the candidates' kernel reads nothing). The
        # final slots are decided too (a mask per pass would put XLA ops between the kernels: +9 µs per refine
        # at N=1 on the H200); the scans skip them.
        best_id, fail, act, decided = _decide(ops, d, lat, dtype, row_valid, flags, None if packed else limit)
        if packed:  # the failing rows (every row of a slot >= s if the pass is full) scanned, the others best_id
            tok, flags = ops.scan_failing(logits, lat, d.fprep, fail, flags, best_id, limit, **kw)
        elif gated is not None:  # the same pick in a launch that runs nothing where no row is active
            tok, flags = gated.run(logits, lat, d.fprep, act, best_id, decided, **kw)
        else:  # one pick: its active rows (act = fail | full) get its token, the others best_id
            tok, flags = ops.full_vocab_pick(logits, lat, d.fprep, active=act, fallback=best_id, **kw), decided
        # full: this pass scanned every row (padding rows too: tokens stay real ids)
        full, n_fail = flags[0] != 0, flags[1]
        outcome = jnp.where(full, 2, jnp.where(n_fail == 0, 0, 1))  # certified / rows scanned / fallen back
        tried = tried + jnp.where(fallen, 0, n_valid)
        certified = certified + jnp.where(fallen, 0, n_valid - n_fail)
        outcomes = outcomes + (jnp.arange(3) == outcome).astype(jnp.int32)
        # the final slots keep their tokens (the pass would give them the same)
        return blk.at[:, 1 + s:].set(tok.reshape(N, B - 1)[:, s:]), flags, (tried, certified, outcomes)

    blk = jnp.concatenate([anchors[:, None], d.start.reshape(N, B - 1)], axis=1)
    zero = jnp.zeros((), jnp.int32)
    carry = (blk, jnp.zeros((8,), jnp.int32), (zero, zero, jnp.zeros((3,), jnp.int32)))
    if unroll and dispatch.CERTIFIED_PASS_NUMBERS:  # each pass knows its number
        for q in range(num_passes):
            carry = one_pass(q, carry)
        blk, _, (tried, certified, outcomes) = carry
    else:
        blk, _, (tried, certified, outcomes) = jax.lax.fori_loop(0, num_passes, lambda _, c: one_pass(None, c), carry,
                                                                 unroll=unroll)
    frac = _ratio(outcomes, jnp.int32(num_passes))
    stats = CertifiedStats(
        rows_certified=jnp.where(tried > 0, _ratio(certified, jnp.maximum(tried, 1)), 1.0),
        passes_certified=frac[0], passes_row_scan=frac[1], passes_full_scan=frac[2])
    return blk, stats


def pruned_passes(ops: Ops, params, logits: jax.Array, xh: jax.Array, anchors: jax.Array, prev_ids: jax.Array,
                  valid: jax.Array, num_passes: int, unroll: bool, cfg: "Pruned",
                  prepared: "PrunedPrepared | None" = None):
    """The K passes of ``refine(..., topc=0, full_vocab=cfg)`` with a `Pruned` ``cfg`` (module doc,
    "The pruned mode"). Returns (the block [N, B] int32 after K passes, `PrunedStats`)."""
    N, B, V = logits.shape
    r = params["w1"].shape[1]
    rows = N * (B - 1)
    w2 = params["w2"]
    if ops.pruned_pick is None:
        raise ValueError(f"full_vocab='pruned' needs Ops with pruned_pick; {ops.name!r} has none "
                         "(the vocabulary-sharded steps do not support it)")
    fprep = ops.full_vocab_prepare(w2)
    if jnp.dtype(logits.dtype) == jnp.float64:  # no int8 bound in float64: the plain scan, reported as fallen back
        def scan_pass(_, blk):
            lat = ops.latent(params, xh, blk, prev_ids).reshape(rows, r)
            return blk.at[:, 1:].set(ops.full_vocab_pick(logits, lat, fprep).reshape(N, B - 1))

        blk = jnp.concatenate([anchors[:, None], ops.start(logits).reshape(N, B - 1)], axis=1)
        blk = jax.lax.fori_loop(0, num_passes, scan_pass, blk, unroll=unroll)
        one, nil = jnp.float32(1), jnp.float32(0)
        return blk, PrunedStats(one, one, nil, one)
    pp = prepare_pruned(w2) if prepared is None else prepared
    by_cand = cfg.guess == "candidates"
    if by_cand:
        cand, base_c, start = ops.select(logits, min(int(cfg.candidates), V))
        cprep = ops.topc_prepare(w2, cand)
    else:
        start = ops.start(logits)
    row_valid = jnp.repeat(valid, B - 1)
    n_valid = jnp.sum(row_valid, dtype=jnp.int32)

    def one_pass(_, carry):
        blk, fallen, (tried, certified, excl, exact, n_full) = carry
        lat = ops.latent(params, xh, blk, prev_ids).reshape(rows, r)
        if by_cand:
            _, guess = ops.candidates_best(base_c, cand, lat, cprep, skip=fallen)
        else:
            guess = blk[:, 1:].reshape(rows)
        tok, need, frac, _ = ops.pruned_pick(logits, lat, fprep, pp, guess, fallen)
        ran = jnp.logical_not(fallen)
        tried = tried + jnp.where(ran, n_valid, 0)
        certified = certified + jnp.where(ran, jnp.sum(row_valid & (need <= 1), dtype=jnp.int32), 0)
        excl = excl + jnp.where(ran, jnp.sum(jnp.where(row_valid, need, 0)).astype(jnp.float32), 0.0)
        exact = exact + jnp.where(ran, frac, 0.0)
        n_full = n_full + fallen.astype(jnp.int32)
        fallen = fallen | (frac > cfg.max_exact)
        return blk.at[:, 1:].set(tok.reshape(N, B - 1)), fallen, (tried, certified, excl, exact, n_full)

    blk = jnp.concatenate([anchors[:, None], start.reshape(N, B - 1)], axis=1)
    zero, zf = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
    carry = (blk, jnp.zeros((), bool), (zero, zero, zf, zf, zero))
    blk, _, (tried, certified, excl, exact, n_full) = jax.lax.fori_loop(0, num_passes, one_pass, carry, unroll=unroll)
    n_ran = num_passes - n_full
    stats = PrunedStats(
        rows_certified=jnp.where(tried > 0, _ratio(certified, jnp.maximum(tried, 1)), 1.0),
        ids_excluded=jnp.where(tried > 0, 1 - excl / (jnp.maximum(tried, 1).astype(jnp.float32) * V), 1.0),
        tiles_exact=jnp.where(n_ran > 0, exact / jnp.maximum(n_ran, 1).astype(jnp.float32), 0.0),
        passes_full_scan=_ratio(n_full, jnp.int32(num_passes)))
    return blk, stats
