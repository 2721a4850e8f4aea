"""The jnp reference of every refine step: the XLA path's implementation and the kernels' oracle.

Each function is one step of a pass (see `xpress_jax.refine`), as plain jnp. `Ops.xla()`
(`xpress_jax.ops`) serves them; the tests compare each Pallas kernel in `xpress_jax.kernels`
with the function of the same name here. The kernels import nothing from this package.

Value rules (docs/semantics.md): a score is ``float(dtype(base + bias))``, the sum formed in the
accumulation dtype and rounded to the logits' dtype before comparing; NaN counts as -inf;
full-vocab ties go to the lowest vocab id; top-C ties to the larger base logit, then the lowest id.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp

from .dispatch import Thresholds
from .head import acc_dot, acc_dtype, hidden_input, latent, precision_for, round_to
from .kernels.common import gumbel, sample_key

__all__ = [
    "GPU_MATERIALIZE_XH_N", "hidden_input_gpu", "SLACK", "bound_upper", "bound_beta", "certify_rows", "clean",
    "round_sum", "topc_winner", "readout", "draft_rows", "full_vocab_start", "latent_pass", "LatentSum",
    "latent_value", "full_vocab_pick", "full_vocab_best", "select_candidates", "topc_gather", "topc_pick",
    "topc_pick_best", "topc_scores", "candidates_best", "best_by_score", "best_by_topc_rule", "full_vocab_sample",
    "full_vocab_sample_best", "topc_sample", "topc_sample_best", "sample_extras",
]


#: The block counts N (inclusive) where `hidden_input_gpu` materialises ``xh`` behind an optimization barrier by
#: default: the measured table's (`xpress_jax.dispatch.Thresholds.materialize_xh`; the Pallas steps pass their
#: table's).
GPU_MATERIALIZE_XH_N = Thresholds().materialize_xh


def hidden_input_gpu(params: Mapping[str, jax.Array], h: jax.Array,
                     materialize: tuple[int, int] = GPU_MATERIALIZE_XH_N) -> jax.Array:
    """`xpress_jax.head.hidden_input` spelled for XLA:GPU: the same sums, fewer slow fusions.

    N = 1: ``g`` is padded to 16 rows behind an optimization barrier, so XLA runs ``g @ down_g`` as a GEMM
    instead of a multiply over a materialised float32 [H, r] and a reduction. N in `GPU_MATERIALIZE_XH_N`:
    ``xh`` passes an optimization barrier, so XLA materialises it once instead of fusing the reduction of
    its split-K partials into pass 1 (``materialize``: that N range). Neither changes a sum (H200: python -m
    benchmarks.bench_refine).
    """
    n = h.shape[0]
    xh = hidden_input(params, h, pad_rows=16 if n == 1 else 0)
    lo, hi = materialize
    return jax.lax.optimization_barrier(xh) if lo <= n <= hi else xh


def clean(s: jax.Array) -> jax.Array:
    """The non-finite rule: NaN scores count as -inf (they never win; +inf does)."""
    return jnp.where(jnp.isnan(s), jnp.array(-jnp.inf, s.dtype), s)


def round_sum(a: jax.Array, b: jax.Array) -> jax.Array:
    """``float(dtype(a + b))``: the sum formed in the accumulation dtype, rounded to the logits' dtype."""
    acc = acc_dtype(a.dtype)
    return clean(round_to(a.astype(acc) + b.astype(acc), a.dtype))


def topc_winner(s: jax.Array, base_c: jax.Array, cand: jax.Array) -> jax.Array:
    """[rows,C] scores, base logits (NaN-free), vocab ids -> [rows] int32: the top-C tie rule.

    The largest score; among equal scores the larger base logit; among equal base logits the
    lowest vocab id. (Values compare as numbers: -0.0 == +0.0.)
    """
    return best_by_topc_rule(s, base_c, cand)[2]


def best_by_score(s: jax.Array, ids: jax.Array, axis: int = -1):
    """The full-vocab rule along ``axis``: (the largest score, the lowest id holding it).

    Combines per-part or per-shard winners exactly as one argmax over all of them would
    (scores NaN-free; values compare as numbers)."""
    best = jnp.max(s, axis=axis, keepdims=True)
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.min(jnp.where(s == best, ids, big), axis=axis)
    return jnp.squeeze(best, axis), idx.astype(jnp.int32)


def best_by_topc_rule(s: jax.Array, base: jax.Array, ids: jax.Array, axis: int = -1):
    """The top-C rule along ``axis``: (the largest score, the largest base logit among those,
    the lowest id among those). Combines per-split or per-shard winners exactly."""
    best = jnp.max(s, axis=axis, keepdims=True)
    tied = s == best
    top_base = jnp.max(jnp.where(tied, base, jnp.array(-jnp.inf, base.dtype)), axis=axis, keepdims=True)
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.min(jnp.where(tied & (base == top_base), ids, big), axis=axis)
    return jnp.squeeze(best, axis), jnp.squeeze(top_base, axis), idx.astype(jnp.int32)


def readout(lat: jax.Array, w2: jax.Array, dtype, *, direct: bool = False) -> jax.Array:
    """``dtype(lat @ w2.T)`` accumulated in float32 (float64 for float64): the readout bias [rows, V].

    ``direct=True`` (what `Ops.xla` uses on GPUs, for 16-bit dtypes only) lets the dot write the 16-bit
    result itself: the GEMM still accumulates in float32 and rounds once (the same values), without storing
    the float32 [rows, V] product (H200: python -m benchmarks.bench_refine).
    """
    if direct and jnp.dtype(dtype).itemsize == 2:
        return jnp.matmul(lat, w2.T, preferred_element_type=dtype)
    return round_to(acc_dot(lat, w2.T, acc_dtype(dtype)), dtype)


def draft_rows(logits: jax.Array) -> jax.Array:
    """[N, B, V] logits -> [N*(B-1), V]: the draft slots' rows (slot 0, the anchor, is never scored)."""
    n, b, v = logits.shape
    return logits[:, 1:].reshape(n * (b - 1), v)


def full_vocab_start(logits: jax.Array) -> jax.Array:
    """[N, B, V] -> [N*(B-1)] int32: each draft slot's full-vocab argmax of its base logits (NaN as
    -inf, lowest id on ties): where a full-vocab refine starts the block."""
    return jnp.argmax(clean(draft_rows(logits)), axis=-1).astype(jnp.int32)


class LatentSum(NamedTuple):
    """A pass's latent as the two terms of the head's residual, before their sum: ``lat =
    round_to(u + d, dtype)`` with ``u`` the mixer's output and ``d = down(silu(gate) * up)``, both in
    the accumulation dtype (float32 for 16-bit weights), same shape.

    The Pallas top-C pick kernel takes it (``lat_add``) and forms the sum as it loads the latent, so the
    residual needs no XLA kernel of its own. `latent_value` gives the latent itself.
    """

    u: jax.Array
    d: jax.Array

    def reshape(self, *shape) -> "LatentSum":
        return LatentSum(self.u.reshape(*shape), self.d.reshape(*shape))


def latent_value(lat, dtype) -> jax.Array:
    """The latent in ``dtype``: ``lat`` itself, or a `LatentSum`'s ``round_to(u + d, dtype)``."""
    if isinstance(lat, LatentSum):
        return round_to(lat.u + lat.d, dtype)
    return lat


def latent_pass(params: Mapping[str, jax.Array], xh: jax.Array, blk: jax.Array, prev_ids: jax.Array, *,
                terms: bool = False, barrier: bool = False):
    """[N,B,r], [N,B] int32, [N] int32 -> [N, B-1, r]: the draft slots' latents for this pass.

    Slot 0's predecessor is ``prev_ids``, slot b's is ``blk[:, b-1]`` (`xpress_jax.head.latent`).
    ``terms=True``: a `LatentSum` (the residual's terms; the latent is their rounded sum).
    ``barrier``: `xpress_jax.head.latent`'s (the same values; how XLA fuses them).
    """
    prev = jnp.concatenate([prev_ids[:, None], blk[:, :-1]], axis=1)
    if terms:
        return LatentSum(*latent(params, xh, prev, terms=True, barrier=barrier))
    return latent(params, xh, prev, barrier=barrier)


def full_vocab_pick(base: jax.Array, lat: jax.Array, w2: jax.Array, *, direct_readout: bool = False) -> jax.Array:
    """[rows,V], [rows,r], [V,r] -> [rows] int32: argmax_v dtype(base + dtype(lat @ w2.T)), lowest id on ties."""
    bias = readout(lat, w2, base.dtype, direct=direct_readout)
    return jnp.argmax(round_sum(base, bias), axis=-1).astype(jnp.int32)


def full_vocab_best(base: jax.Array, lat: jax.Array, w2: jax.Array, *, direct_readout: bool = False):
    """`full_vocab_pick` with its winning score: (score [rows] float32, id [rows] int32)."""
    s = round_sum(base, readout(lat, w2, base.dtype, direct=direct_readout))
    idx = jnp.argmax(s, axis=-1).astype(jnp.int32)  # lowest id among the largest: best_by_score's rule
    return jnp.take_along_axis(s, idx[:, None], axis=-1)[:, 0].astype(acc_dtype(base.dtype)), idx


def select_candidates(base: jax.Array, c: int):
    """[rows,V] -> (cand [rows,C] int32, base_c [rows,C], argmax [rows] int32).

    NaN counts as -inf; ``lax.top_k`` (lowest ids first among values tied at the C-th place);
    the full-vocab argmax (lowest id on ties) starts the block.
    """
    cl = clean(base)
    base_c, cand = jax.lax.top_k(cl, c)
    return cand.astype(jnp.int32), base_c, jnp.argmax(cl, axis=-1).astype(jnp.int32)


def topc_gather(w2: jax.Array, cand: jax.Array) -> jax.Array:
    """``w2[cand]`` [rows, C, r]: the candidates' readout rows, gathered once per call."""
    return jnp.take(w2, cand, axis=0)


def topc_pick(base_c: jax.Array, cand: jax.Array, lat: jax.Array, w2c: jax.Array) -> jax.Array:
    """[rows,C], [rows,C] int32, [rows,r], w2c = `topc_gather` (w2, cand) -> [rows] int32 vocab ids.

    ``s = dtype(base_c + dtype(lat . w2[cand]))``. vLLM's rule (its candidates are sorted by
    base logit, largest first, and the first position holding the largest s wins), spelled
    so that it does not depend on the order of the candidates: the largest s wins; among
    equal s the larger base logit; among equal base logits the lowest vocab id.
    """
    return topc_winner(topc_scores(base_c, lat, w2c), clean(base_c), cand)


def topc_pick_best(base_c: jax.Array, cand: jax.Array, lat: jax.Array, w2c: jax.Array):
    """`topc_pick` with the winner's score and base logit: (score, base, id), [rows] each
    (float32, float32, int32)."""
    acc = acc_dtype(base_c.dtype)
    s, b, i = best_by_topc_rule(topc_scores(base_c, lat, w2c), clean(base_c), cand)
    return s.astype(acc), b.astype(acc), i


def candidates_best(base_c: jax.Array, cand: jax.Array, lat: jax.Array, w2c: jax.Array):
    """The candidates' winner by the **full-vocab** rule (largest score, lowest vocab id among equal
    scores; the base logit plays no part): (score [rows] float32, id [rows] int32). What a certified
    exact pick (`xpress_jax.exact`) needs from the candidates."""
    s, i = best_by_score(topc_scores(base_c, lat, w2c), cand)
    return s.astype(acc_dtype(base_c.dtype)), i


def topc_scores(base_c: jax.Array, lat: jax.Array, w2c: jax.Array) -> jax.Array:
    """[rows,C], [rows,r], w2c [rows,C,r] -> [rows,C]: each candidate's score
    ``float(dtype(base_c + dtype(lat . w2[cand])))`` (NaN as -inf), in the logits' dtype."""
    acc = acc_dtype(base_c.dtype)
    bias_c = round_to(jnp.einsum(
        "nr,ncr->nc", lat, w2c, precision=precision_for(lat.dtype), preferred_element_type=acc
    ), base_c.dtype)
    return round_sum(base_c, bias_c)


# ----------------------------------------------------------------------------- sampling (temperature > 0)
# A sampled pick maximises ``key = s * inv_t + g`` (`kernels.common.sample_key`; ``inv_t = 1 / T``, 0 for greedy) with
# ``g`` the frozen noise of (row seed, vocab id) (`kernels.common.gumbel`), under the mode's tie rule. ``lat`` None
# scores the base logits themselves: the seed block. The extras of a pick (``proposal`` "logprob" or "scores"):
# (token_score [rows] float32: the winner's s; lse [rows] float32: logsumexp(s * inv_t) over the scored ids, +inf at
# T = 0; scores: s in the logits' dtype, or None).

def full_vocab_sample_best(base: jax.Array, lat, w2: jax.Array, seeds: jax.Array, inv_t: jax.Array, *,
                           id_offset=0, direct_readout: bool = False):
    """[rows,V], [rows,r] or None, [V,r], [rows] int32, [] float32 -> (key [rows], id [rows] int32, s [rows,V]): the
    sampled full-vocab pick (the largest key, lowest id on ties) and the scores. ``id_offset``: the global id of
    column 0 (a vocabulary shard)."""
    s = clean(base) if lat is None else round_sum(base, readout(lat, w2, base.dtype, direct=direct_readout))
    acc = acc_dtype(base.dtype)
    ids = id_offset + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    key = sample_key(s.astype(acc), inv_t.astype(acc), gumbel(seeds[:, None], ids).astype(acc))
    idx = jnp.argmax(key, axis=-1).astype(jnp.int32)
    return jnp.take_along_axis(key, idx[:, None], axis=-1)[:, 0], idx + id_offset, s


def sample_extras(s: jax.Array, local: jax.Array, inv_t: jax.Array, proposal: str | None):
    """The extras (section comment) of a pick of ``s`` [rows, n] whose winner sits at column ``local`` [rows]."""
    if proposal is None:
        return None
    acc = acc_dtype(s.dtype)
    sf = s.astype(acc)
    token_score = jnp.take_along_axis(sf, local[:, None], axis=-1)[:, 0]
    lse = jnp.where(inv_t > 0, jax.nn.logsumexp(sf * inv_t.astype(acc), axis=-1), jnp.inf)
    return token_score.astype(jnp.float32), lse.astype(jnp.float32), s if proposal == "scores" else None


def full_vocab_sample(base: jax.Array, lat, w2: jax.Array, seeds: jax.Array, inv_t: jax.Array,
                      proposal: str | None = None, *, direct_readout: bool = False):
    """The sampled full-vocab pick: (tokens [rows] int32, extras or None)."""
    _, idx, s = full_vocab_sample_best(base, lat, w2, seeds, inv_t, direct_readout=direct_readout)
    return idx, sample_extras(s, idx, inv_t, proposal)


def topc_sample_best(base_c: jax.Array, cand: jax.Array, lat, w2c, seeds: jax.Array, inv_t: jax.Array):
    """(key, base, id, s [rows,C], position [rows]) of the sampled top-C pick: the largest key, then the larger base
    logit, then the lowest id. ``lat`` None: the seed (the base logits themselves)."""
    s = clean(base_c) if lat is None else topc_scores(base_c, lat, w2c)
    acc = acc_dtype(base_c.dtype)
    key = sample_key(s.astype(acc), inv_t.astype(acc), gumbel(seeds[:, None], cand).astype(acc))
    k, b, idx = best_by_topc_rule(key, clean(base_c).astype(acc), cand)
    pos = jnp.argmax(cand == idx[:, None], axis=-1)  # the winner's column (candidate ids are distinct)
    return k, b, idx, s, pos


def topc_sample(base_c: jax.Array, cand: jax.Array, lat, w2c, seeds: jax.Array, inv_t: jax.Array,
                proposal: str | None = None):
    """The sampled top-C pick: (tokens [rows] int32, extras or None; extras' scores are the candidates')."""
    _, _, idx, s, pos = topc_sample_best(base_c, cand, lat, w2c, seeds, inv_t)
    return idx, sample_extras(s, pos, inv_t, proposal)


# ----------------------------------------------------------------------------- the certified mode's bound
# (`xpress_jax.exact`'s module doc gives the argument; the kernels spell the same formulas.)

#: The relative slack on ``||lat||`` and on the bound's product; the certify kernel uses the same.
SLACK = 2.0 ** -10


def bound_upper(a, m, nrm):
    """A value >= the real ``a + m * nrm`` (the rounding slack of `xpress_jax.exact`'s module doc)."""
    mn = m * nrm
    return (a + mn) + SLACK * (jnp.abs(a) + mn)


def bound_beta(b, u, dtype):
    """``R(fl(B + R(U)))``, NaN kept (a NaN bound excludes nothing)."""
    acc = acc_dtype(dtype)
    return round_to(b.astype(acc) + round_to(u, dtype).astype(acc), dtype).astype(acc)


def flag_value(x) -> jax.Array:
    """A device flag (a bool or int scalar, or int32 [k] flags: element 0) -> a bool scalar."""
    return jnp.reshape(jnp.asarray(x), (-1,))[0] != 0


def make_flags(full, n_fail) -> jax.Array:
    """The certified mode's per-pass flags as its kernels write them: int32 [8] = [full, n_fail, 0, ...]."""
    return jnp.zeros((8,), jnp.int32).at[0].set(jnp.asarray(full).astype(jnp.int32)).at[1].set(n_fail)


def certify_rows(best, best_id, lat, tau, max_norm, mex, valid, fallen, limit, dtype):
    """The jnp spelling of ``ops.certify``'s decision (module doc, step 2): (best_id, fail, act, flags).
    ``fallen``: a flag (`flag_value`); ``flags``: `make_flags` of the pass with ``limit``, else None."""
    acc = acc_dtype(dtype)
    fallen = flag_value(fallen)
    latf = lat.astype(acc)
    nrm = jnp.sqrt(jnp.sum(latf * latf, axis=1)) * (1 + SLACK)
    beta = bound_beta(tau, bound_upper(jnp.zeros_like(nrm), max_norm, nrm), dtype)
    best = best.astype(acc)
    # Ties at the bound: certified only if every id <= best_id is a candidate (best_id < mex).
    cert = (beta < best) | ((beta == best) & (best_id < mex))
    fail = valid & ~cert & ~fallen
    if limit is None:
        return best_id, fail, fail, None
    n_fail = jnp.sum(fail, dtype=jnp.int32)
    full = fallen | (n_fail > limit)
    return best_id, fail, fail | full, make_flags(full, n_fail)
