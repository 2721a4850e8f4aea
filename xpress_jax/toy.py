"""The embedded task: a small target language model, a block drafter, and the accepted-length metric.

Every table comes from one seed. **Target**: a random second-order Markov chain over V tokens with raw logits
after ``(a, b)`` ``next_logits[a, b] = sharpness * (O[c] . (P[b] + 0.7 Q[a])) / sqrt(d) + noise * G[a, b, c]``,
sampled at the task's temperature T (``ToyConfig.temperature``, default 1): the chain is
``P(c | a, b) = softmax(next_logits[a, b] / T)``, as a language model's raw logits sampled at T. Its greedy
continuation of ``(a, b)`` is ``g1 = argmax next(a, b)``, ``g2 = argmax next(b, g1)``, ... (the same at every T).
**Contexts**: (token before the anchor, anchor) from the chain's stationary distribution; V^2 of them, so a batch
is a gather of table rows. **Drafter**: every slot independently, the target's exact k-step marginal ``m_k`` (the
best an independent predictor can do, still incoherent) on the same raw-logit scale, ``T * log m_k``, so that its
logits sampled at T (softmax(logits / T)) are ``m_k``; hidden states ``tanh(E1[x_{t-1}] + E2[x_t] + S[k])``.
**Targets**: `ToyTask.sample` gives the greedy continuation, or with a temperature a continuation sampled from
the chain (a random walk from the block's context), and the **teacher**: the chain's raw logits at every draft
slot after the two tokens before it in that continuation (the target model's logits along the data, what a
distillation loss such as `xpress_jax.train.TrainConfig.loss` scores against). **Accepted length**: the longest
prefix of the draft equal to the greedy continuation (0..B-1).

Speculative sampling at T on a task of temperature T is then consistent on every side: the target's logits are
``next_logits`` and the drafter's are its logits, both sampled at T (`xpress_jax.sampling.accept` takes
p = softmax(next_logits / T), q = softmax(scores / T)); a head trained on continuations sampled at T with the
cross-entropy of softmax(scores / T) (`xpress_jax.train.TrainConfig.sample_temperature`) learns the target's
conditional distribution at T. At T = 1 every table is what it was without a temperature.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .config import HeadConfig
from .refine import STATIC, refine

__all__ = ["ToyConfig", "ToyTask", "Batch", "accepted_length", "evaluate"]


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """The task's sizes and seed: V (at most 256), B, the drafter's H, the target's rank ``d``, the scales
    ``sharpness`` (of the rank-d part) and ``noise`` (of the unstructured part), ``seed`` (of every table), and
    ``temperature`` T > 0, the temperature the target's logits are sampled at (the chain, its stationary
    distribution and the drafter's marginals are those of softmax(next_logits / T); the greedy continuation
    does not depend on T)."""

    vocab_size: int = 64
    block_size: int = 8
    hidden_size: int = 32
    target_rank: int = 8
    sharpness: float = 2.0
    noise: float = 2.0
    seed: int = 0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        for name, minimum in (("vocab_size", 2), ("block_size", 2), ("hidden_size", 1), ("target_rank", 1),
                              ("seed", 0)):
            _positive_int(name, getattr(self, name), minimum)
        if self.vocab_size > 256:
            raise ValueError(f"vocab_size must be <= 256 (the tables hold V^3 floats), got {self.vocab_size}")
        for name in ("sharpness", "noise"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and np.isfinite(v)):
                raise ValueError(f"{name} must be a finite float >= 0, got {v!r}")
        t = self.temperature
        if isinstance(t, bool) or not (isinstance(t, (int, float)) and np.isfinite(t) and t > 0):
            raise ValueError(f"temperature must be a finite float > 0, got {t!r}")


class Batch(NamedTuple):
    """One batch of blocks: what the drafter gives the head, and what the target would accept."""

    logits: jax.Array  # [N, B, V] drafter logits (slot 0's row is zeros: unused)
    h: jax.Array  # [N, B, H] drafter hidden states
    anchors: jax.Array  # [N] int32, the verified token x_t
    prev_ids: jax.Array  # [N] int32, the token before it, x_{t-1}
    target: jax.Array  # [N, B-1] int32, the target's continuation x_{t+1..t+B-1}: greedy, or sampled
    # [N, B-1, V] float32, the teacher: the target's raw logits at draft slot k after (x_{t+k-2}, x_{t+k-1}) of
    # this continuation (its distribution at T is softmax(teacher_logits / T); its argmax is the target's greedy
    # next token given the continuation so far, ``target`` itself for a greedy batch). None: a batch without one.
    teacher_logits: jax.Array | None = None


def accepted_length(draft: jax.Array, target: jax.Array) -> jax.Array:
    """[N, B-1] draft, [N, B-1] greedy continuation -> [N] int32: the longest matching prefix (0..B-1)."""
    match = (jnp.asarray(draft) == jnp.asarray(target)).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)


class ToyTask:
    """The tables of one `ToyConfig` (numpy) and jit-able batch sampling: ``task.tables`` is the dict of
    arrays that `sample` takes as an argument (a jitted caller passes them in, not as constants)."""

    def __init__(self, config: ToyConfig = ToyConfig()):
        if not isinstance(config, ToyConfig):
            raise TypeError(f"config must be a ToyConfig, got {type(config).__name__}")
        self.config = config
        V, B, H, d = config.vocab_size, config.block_size, config.hidden_size, config.target_rank
        rng = np.random.default_rng(config.seed)
        O, P, Q = (rng.standard_normal((V, d)) for _ in range(3))
        G = rng.standard_normal((V, V, V))
        next_logits = config.sharpness * np.einsum("cd,abd->abc", O, P[None, :, :] + 0.7 * Q[:, None, :]) / np.sqrt(d)
        next_logits = next_logits + config.noise * G  # [a, b, c], the raw logits
        temp = config.temperature
        scaled = next_logits / temp
        T = np.exp(scaled - scaled.max(-1, keepdims=True))
        T /= T.sum(-1, keepdims=True)  # [a, b, c] = P(c | a, b) at the task's temperature
        self.next_logits = next_logits
        self.next_probs = T
        self.greedy_next = np.argmax(next_logits, axis=-1).astype(np.int32)  # [a, b]

        # Stationary distribution of the pair chain (a, b) -> (b, c), by power iteration.
        pi = np.full((V, V), 1.0 / V**2)
        for _ in range(500):
            pi = np.einsum("ab,abc->bc", pi, T)
        ctx_p = pi.reshape(-1)

        # Greedy continuation of every context; row n = a * V + b.
        a = np.repeat(np.arange(V), V)
        b = np.tile(np.arange(V), V)
        greedy = np.zeros((V * V, B), np.int32)
        greedy[:, 0] = b
        prev, cur = a, b
        for k in range(1, B):
            prev, cur = cur, self.greedy_next[prev, cur]
            greedy[:, k] = cur

        # The drafter: exact k-step marginals, propagating each context's distribution over pairs.
        dist = np.zeros((V * V, V, V))
        dist[np.arange(V * V), a, b] = 1.0
        Tb = T.transpose(1, 0, 2)  # [b, a, c]
        drafter = np.zeros((V * V, B, V), np.float32)
        for k in range(1, B):
            dist = np.matmul(dist.transpose(2, 0, 1), Tb).transpose(1, 0, 2)  # [n, b, c]
            drafter[:, k] = temp * np.log(dist.sum(axis=1) + 1e-30)  # sampled at T: the marginal
        E1, E2, S = rng.standard_normal((V, H)), rng.standard_normal((V, H)), rng.standard_normal((B, H))
        hidden = np.tanh(E1[a][:, None, :] + E2[b][:, None, :] + S[None, :, :]).astype(np.float32)

        # [V*V], [V*V, B, V], [V*V, B, H], [V*V, B], [V, V, V]
        self.tables = {"context_logp": np.log(ctx_p + 1e-30).astype(np.float32), "drafter_logits": drafter,
                       "hidden": hidden, "greedy": greedy, "next_logits": next_logits.astype(np.float32)}

    def head_config(self, *, rank: int = 32, mlp_hidden: int = 64, topc: int = 8, num_passes: int | None = None,
                    max_num_reqs: int = 4096, predecessor: str = "previous") -> HeadConfig:
        """A `HeadConfig` sized for this task (V, H, B from the task; default K = B-1). ``predecessor``: the
        task's batches carry the real token before the anchor (``prev_ids``), so its heads are "previous" heads
        (slot 0 reads it; refine is then given ``prev_ids``)."""
        c = self.config
        return HeadConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, block_size=c.block_size, rank=rank,
                          mlp_hidden=mlp_hidden, topc=topc, max_num_reqs=max_num_reqs,
                          num_passes=c.block_size - 1 if num_passes is None else num_passes, predecessor=predecessor)

    @staticmethod
    def sample(tables: dict, key: jax.Array, n: int, temperature: Any = None) -> Batch:
        """``n`` blocks with contexts from the stationary distribution (jit-able; ``n`` static). ``target`` is the
        greedy continuation, or with a ``temperature`` T > 0 (a float or a traced scalar) a continuation sampled
        from softmax(next_logits / T): a random walk of B-1 steps from each block's context. The contexts (and so
        every field but ``target`` and ``teacher_logits``) are those of the greedy batch of the same key.
        ``teacher_logits``: the chain's raw logits along the continuation (`Batch`)."""
        ctx = jax.random.categorical(key, jnp.asarray(tables["context_logp"]), shape=(n,))
        V = tables["drafter_logits"].shape[-1]
        greedy = jnp.take(jnp.asarray(tables["greedy"]), ctx, axis=0)
        prev_ids = (ctx // V).astype(jnp.int32)
        target = greedy[:, 1:]
        next_logits = jnp.asarray(tables["next_logits"])
        if temperature is not None:
            target = _walk(next_logits, prev_ids, greedy[:, 0], temperature, jax.random.fold_in(key, 1),
                           target.shape[1])
        seq = jnp.concatenate([prev_ids[:, None], greedy[:, :1], target], axis=1)  # x_{t-1}, x_t, the continuation
        return Batch(logits=jnp.take(jnp.asarray(tables["drafter_logits"]), ctx, axis=0),
                     h=jnp.take(jnp.asarray(tables["hidden"]), ctx, axis=0), anchors=greedy[:, 0],
                     prev_ids=prev_ids, target=target, teacher_logits=next_logits[seq[:, :-2], seq[:, 1:-1]])

    def drafter_tokens(self, batch: Batch) -> jax.Array:
        """The drafter alone: each slot's argmax, [N, B-1]."""
        return jnp.argmax(batch.logits[:, 1:], axis=-1).astype(jnp.int32)


def _walk(next_logits: jax.Array, prev: jax.Array, cur: jax.Array, temperature: Any, key: jax.Array,
          steps: int) -> jax.Array:
    """[N, steps] int32: ``steps`` tokens of the chain softmax(next_logits / T) after the contexts (prev, cur)."""
    inv_t = 1.0 / jnp.asarray(temperature, jnp.float32)
    out = []
    for k in range(steps):
        nxt = jax.random.categorical(jax.random.fold_in(key, k), next_logits[prev, cur] * inv_t, axis=-1)
        prev, cur = cur, nxt.astype(jnp.int32)
        out.append(cur)
    return jnp.stack(out, axis=1)


def evaluate(task: ToyTask, head, *, n_blocks: int = 4096, seed: int = 1234, topcs: tuple[int, ...] = (0,),
             max_passes: int | None = None, backend: str = "auto") -> dict:
    """Mean accepted length per block of the drafter alone and refined by ``head`` (a serving
    `xpress_jax.Head`) with the jitted `xpress_jax.refine` for K = 1..B-1, on ``n_blocks`` blocks drawn with
    ``seed``. Returns ``{"n_blocks", "seed", "drafter", "refined": {C: [at K = 1, 2, ...]}}`` (C = 0: full
    vocabulary)."""
    _positive_int("n_blocks", n_blocks)
    K_max = task.config.block_size - 1 if max_passes is None else max_passes
    _positive_int("max_passes", K_max)
    batch = ToyTask.sample(task.tables, jax.random.key(seed), n_blocks)
    x = (batch.logits.astype(head.dtype), batch.h.astype(head.dtype), batch.anchors, batch.prev_ids)
    run = jax.jit(refine, static_argnames=STATIC)

    def mean_accepted(draft):
        return float(jnp.mean(accepted_length(draft, batch.target)))

    refined = {int(c): [mean_accepted(run(head, *x, num_passes=K, topc=c, max_num_reqs=n_blocks, backend=backend))
                        for K in range(1, K_max + 1)] for c in topcs}
    drafter = mean_accepted(task.drafter_tokens(batch))
    return {"n_blocks": n_blocks, "seed": seed, "drafter": drafter, "refined": refined}
