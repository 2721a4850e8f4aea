"""Sampling refine: temperature T > 0 with frozen Gumbel noise, and the proposal a verifier needs.

Each draft slot's token is ``argmax_v(s[v] / T + g[v])`` (the Gumbel-max trick: a sample of softmax(s / T)) with
``s`` the pass's score (greedy mode's, rounded to the logits' dtype) and ``g`` noise drawn once per block and
reused by the seed block and every pass (docs/semantics.md, "Sampling"). The noise is never stored: it is a
counter-based function of (key, draft row, vocab id) (`xpress_jax.kernels.common.gumbel`), which every kernel
recomputes. ``s / T`` is computed as ``s * (1 / T)``, the reciprocal rounded once per call, the same on every
backend. T = 0 gives the greedy tokens.

The proposal (`Proposal`) is the last pass's scores: the draft distribution is softmax(q / T), and a verifier's
acceptance test needs only ``log q(x) = token_score / T - lse`` (`Proposal.log_prob`); `accept` is that test.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .kernels.common import noise_seed
from .params import to_verifier_ids

__all__ = ["Proposal", "PROPOSALS", "Sampler", "accept", "row_seeds", "check_sampling", "inverse_temperature"]

#: What ``refine(..., proposal=...)`` returns beside the tokens: "logprob" (each drafted token's score and the
#: log-normalizer), "scores" (also the last pass's scores).
PROPOSALS = ("logprob", "scores")


class Proposal(NamedTuple):
    """The draft distribution of a sampled refine, per draft slot (``q`` = the last pass's scores; K = 0: the base
    logits). Full-vocab mode: support the vocabulary; top-C mode: the slot's C candidates.

    token_score: [N, B-1] float32, ``q[x]`` of the drafted token x.
    lse: [N, B-1] float32, ``logsumexp(q / T)`` over the support (+inf at T = 0, where the draft is deterministic).
    scores: [N, B-1, V] (full vocab) or [N, B-1, C] (top-C) in the logits' dtype with ``proposal="scores"``, else None.
    ids: [N, B-1, C] int32, the candidates' vocab ids (top-C with ``proposal="scores"``), else None.
    Rows marked invalid (draft tokens -1) hold unspecified values.
    """

    token_score: jax.Array
    lse: jax.Array
    scores: jax.Array | None = None
    ids: jax.Array | None = None

    def log_prob(self, temperature) -> jax.Array:
        """[N, B-1] float32: log q(x) of each drafted token under softmax(q / T)."""
        return self.token_score / jnp.float32(temperature) - self.lse


class Sampler(NamedTuple):
    """A sampled call's data: each draft row's noise seed ([rows] int32, `row_seeds`), ``1 / T`` (float32 scalar,
    0 = greedy) and the proposal wanted (None, "logprob", "scores"; static)."""

    seeds: jax.Array
    inv_t: jax.Array
    proposal: str | None = None


def check_sampling(temperature: Any, key: Any, proposal: Any) -> None:
    """Refuse (naming the argument) a bad ``temperature`` / ``key`` / ``proposal`` combination: a key or proposal
    without a temperature, a temperature without a key, a concrete temperature that is negative or not finite."""
    if proposal is not None and proposal not in PROPOSALS:
        raise ValueError(f"proposal must be None or one of {PROPOSALS}, got {proposal!r}")
    if temperature is None:
        if key is not None or proposal is not None:
            what = "key" if key is not None else "proposal"
            raise ValueError(f"{what} is for sampling: pass temperature=T as well (T > 0 samples, 0 is greedy)")
        return
    if key is None:
        raise ValueError("temperature needs key=jax.random.key(seed): the noise is a function of the key")
    if not hasattr(key, "dtype") or not (jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                                         or (key.dtype == jnp.uint32 and key.ndim >= 1)):
        raise TypeError(f"key must be a JAX PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), "
                        f"got {type(key).__name__} {getattr(key, 'dtype', '')}")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape != ():
        raise ValueError(f"key must be one key (shape ()), got shape {key.shape}")
    raw = tuple(jax.random.key_data(jax.random.key(0)).shape)  # jax.random.PRNGKey(seed)'s shape
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and tuple(key.shape) != raw:
        raise ValueError(f"key must be one key: a raw uint32 key has shape {raw}, got shape {tuple(key.shape)}")
    if hasattr(temperature, "shape") and temperature.shape != ():
        raise ValueError(f"temperature must be a scalar, got shape {temperature.shape}")
    if not isinstance(temperature, jax.core.Tracer):
        t = float(np.asarray(temperature))
        if not np.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {t}")


def inverse_temperature(temperature: Any) -> jax.Array:
    """float32 ``1 / T``, 0 where T is 0 (the greedy pick), NaN where T is not a temperature (negative, NaN or
    infinite): `xpress_jax.refine` then returns -1 in every draft slot."""
    t = jnp.asarray(temperature, jnp.float32)
    ok = (t > 0) & jnp.isfinite(t)
    return jnp.where(ok, 1.0 / jnp.where(ok, t, 1.0), jnp.where(t == 0, 0.0, jnp.nan)).astype(jnp.float32)


def row_seeds(key: jax.Array, rows: int, row_offset: Any = 0) -> jax.Array:
    """[rows] int32: the noise seed of draft rows ``row_offset .. row_offset + rows - 1`` (row = block * (B-1) +
    slot - 1) from ``key``'s first two 32-bit words of ``jax.random.bits``."""
    words = jax.lax.bitcast_convert_type(jax.random.bits(key, (2,), jnp.uint32), jnp.int32)
    return noise_seed(words[0], words[1], row_offset + jnp.arange(rows, dtype=jnp.int32))


def accept(target_logits: jax.Array, draft: jax.Array, proposal: Proposal, temperature, key: jax.Array,
           d2t: jax.Array | None = None):
    """Speculative sampling's acceptance test for one refine call (a reference for verifiers).

    target_logits: [N, B-1, V] the target model's logits at the draft positions (the verifier's vocabulary);
    draft: [N, B-1] the refine's tokens; proposal: its `Proposal` with ``scores`` (the residual needs q over the
    support); temperature: T > 0; d2t: a reduced head's ``head.params["d2t"]`` (its proposal is over draft ids,
    mapped here onto the verifier's vocabulary: the verifier ids outside the draft vocabulary have q = 0).
    Token x at slot j is accepted with min(1, p(x) / q(x)), p = softmax(target / T), q = softmax(scores / T)
    (top-C: over the candidates); at the first rejection the slot's token is drawn from normalize(max(0, p - q)).
    Returns (tokens [N, B-1] int32: the accepted prefix, then the replacement, then -1; n_emitted [N] int32).
    The bonus token after a fully accepted block (a sample of the target's next position) is the caller's.
    """
    if not isinstance(proposal, Proposal):
        raise TypeError(f"accept: proposal must be the xpress_jax.Proposal that refine(..., temperature=T, key=k, "
                        f"proposal='scores') returns beside the tokens, got {type(proposal).__name__}")
    if proposal.scores is None:
        raise ValueError("accept needs the proposal's scores: refine(..., proposal='scores')")
    n, d, v = target_logits.shape
    inv_t = 1.0 / jnp.float32(temperature)
    p = jax.nn.softmax(target_logits.astype(jnp.float32) * inv_t, axis=-1)
    q_sup = jax.nn.softmax(proposal.scores.astype(jnp.float32) * inv_t, axis=-1)
    ids = proposal.ids
    if d2t is not None:  # draft ids -> verifier ids (the support: the candidates, or the whole draft vocabulary)
        if ids is None:
            ids = jnp.broadcast_to(jnp.arange(q_sup.shape[-1], dtype=jnp.int32), q_sup.shape)
        ids = to_verifier_ids(ids, jnp.asarray(d2t))
    elif ids is None and q_sup.shape[-1] != v:
        raise ValueError(f"accept: the proposal scores {q_sup.shape[-1]} ids and the target {v}: a reduced head's "
                         "proposal is over its draft vocabulary; pass d2t=head.params['d2t']")
    if ids is None:
        q = q_sup
    else:  # the support's probabilities scattered onto the vocabulary
        q = jnp.zeros((n, d, v), jnp.float32).at[
            jnp.arange(n)[:, None, None], jnp.arange(d)[None, :, None], ids].set(q_sup)
    px = jnp.take_along_axis(p, draft[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    k_acc, k_res = jax.random.split(key)
    u = jax.random.uniform(k_acc, (n, d))
    ok = u * qx < px  # u < p / q, without dividing (q(x) > 0 for a drafted x)
    n_acc = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    residual = jnp.maximum(p - q, 0.0)
    at = jnp.minimum(n_acc, d - 1)
    res = jnp.take_along_axis(residual, at[:, None, None], axis=1)[:, 0]
    repl = jax.random.categorical(k_res, jnp.log(res), axis=-1).astype(jnp.int32)
    j = jnp.arange(d)[None, :]
    tokens = jnp.where(j < n_acc[:, None], draft, jnp.where(j == n_acc[:, None], repl[:, None], -1))
    return tokens.astype(jnp.int32), jnp.minimum(n_acc + 1, d)
