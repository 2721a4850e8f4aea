"""Certified exact full-vocabulary picks at (close to) top-C cost: the jnp reference (issue 14).

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

from . import reference as ref
from .head import acc_dtype, round_to
from .ops import Ops

__all__ = ["ExactPrepared", "ExactStats", "prepare_exact", "certified_full_vocab_pick", "exact_ops"]

_SLACK = 2.0 ** -10
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


def _upper(a, m, nrm):
    """A value >= the real ``a + m * nrm`` (the module doc: the rounding slack)."""
    mn = m * nrm
    return (a + mn) + _SLACK * (jnp.abs(a) + mn)


def _beta(b, u, dtype):
    """``R(fl(B + R(U)))``, NaN kept (a NaN bound excludes nothing)."""
    acc = acc_dtype(dtype)
    return round_to(b.astype(acc) + round_to(u, dtype).astype(acc), dtype).astype(acc)


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


def _exact_full_vocab_pick(logits, lat, w2_prepared, *, candidates, direct_readout):
    w2, prepared = w2_prepared
    tok, _ = certified_full_vocab_pick(ref.draft_rows(logits), lat, w2, prepared, candidates=candidates,
                                       direct_readout=direct_readout)
    return tok


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
                                          direct_readout=bool(direct_readout)))
