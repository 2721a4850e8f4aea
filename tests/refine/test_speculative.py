"""Speculative sampling with a sampled refine stays exact: draft (T = 1), refine(temperature=1, key, proposal="scores"),
`xpress_jax.sampling.accept` against the target's logits; the emitted tokens are distributed as the target's own.

The embedded task (`xpress_jax.toy`): the target is a second-order Markov chain with known next-token probabilities,
so the exact joint law of the first two emitted tokens after a context (a, b) is P(x1 | a, b) P(x2 | b, x1). Any head
keeps it (a random one here): the draft of slot j is a Gumbel-max sample of softmax(q_j / T), with q_j the last
pass's scores, given noise of the earlier slots only, so accepting with min(1, p/q) and resampling the residual
emits p. The second token comes from the same block when the first was accepted, else from the next block (a second
round from the context (b, x1)). Negative control: the same loop told a wrong q (the drafter's base logits instead
of the refined scores) is detected as biased.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from helpers import chi2
from xpress_jax.sampling import accept
from xpress_jax.toy import ToyConfig, ToyTask

TASK = ToyTask(ToyConfig(vocab_size=12, block_size=4, hidden_size=8, seed=3))
V, B = TASK.config.vocab_size, TASK.config.block_size
LOGP = np.log(TASK.next_probs).astype(np.float32)  # [a, b, c] = log P(c | a, b)


def head_for(topc: int, num_passes: int, n: int) -> xj.Head:
    cfg = TASK.head_config(rank=8, mlp_hidden=16, topc=topc, num_passes=num_passes, max_num_reqs=n)
    return xj.init_head(cfg, jax.random.key(5), std=0.4)


def target_logits(prev, anchors, draft):
    """[N, B-1, V]: the target's logits at every draft position, given the draft before it."""
    ctx = jnp.concatenate([prev[:, None], anchors[:, None], draft], axis=1)  # x_{-1}, x_0, x_1 .. x_{B-1}
    return jnp.asarray(LOGP)[ctx[:, :-2], ctx[:, 1:-1]]


def one_round(head, tables, prev, anchors, key, wrong_q: bool):
    """One speculative round from the contexts (prev, anchors): (emitted tokens [N, B-1] (-1 after the last),
    n_emitted [N])."""
    k_draft, k_acc = jax.random.split(key)
    ctx = prev * V + anchors
    logits = jnp.take(tables["drafter_logits"], ctx, axis=0)
    h = jnp.take(tables["hidden"], ctx, axis=0)
    draft, prop = xj.refine(head, logits, h, anchors, prev, temperature=1.0, key=k_draft, proposal="scores",
                            backend="xla")
    base = logits[:, 1:] if prop.ids is None else jnp.take_along_axis(logits[:, 1:], prop.ids, axis=-1)
    # wrong_q: the drafter's distribution instead of the refined one (the tokens' true law is not this q).
    told = prop._replace(scores=jnp.where(wrong_q, base.astype(prop.scores.dtype), prop.scores))
    out, n_out = accept(target_logits(prev, anchors, draft), draft, told, 1.0, k_acc)
    return out, n_out, (prop.scores[:, 0], base[:, 0])


@jax.jit
def first_two_tokens(head, tables, a, b, key, wrong_q):
    """The first two tokens emitted after the context (a, b) of every block ([N, 2]), the first round's mean
    number of emitted tokens, and slot 1's proposal and drafter scores of the first block."""
    k1, k2 = jax.random.split(key)
    out1, n1, (q1, base1) = one_round(head, tables, a, b, k1, wrong_q)
    x1 = out1[:, 0]
    out2, _, _ = one_round(head, tables, b, x1, k2, wrong_q)  # the next round, used where round 1 emitted one token
    x2 = jnp.where(n1 >= 2, out1[:, 1], out2[:, 0])
    return jnp.stack([x1, x2], axis=1), jnp.mean(n1.astype(jnp.float32)), (q1[0], base1[0])


def joint_test(topc: int, num_passes: int, n: int, context: tuple[int, int], seed: int):
    """((statistic, critical value) of the true loop, the same of the loop told a wrong q, slot 1's total variation
    between the refined proposal and the drafter's distribution) for the first two tokens after ``context``."""
    a, b = context
    head = head_for(topc, num_passes, n)
    tables = {k: jnp.asarray(TASK.tables[k]) for k in ("drafter_logits", "hidden")}
    A, Bv = jnp.full((n,), a, jnp.int32), jnp.full((n,), b, jnp.int32)
    want = TASK.next_probs[a, b][:, None] * TASK.next_probs[b]  # [x1, x2] = P(x1 | a, b) P(x2 | b, x1)

    def stat(wrong_q):
        x, emitted, (q1, base1) = first_two_tokens(head, tables, A, Bv, jax.random.key(seed), jnp.bool_(wrong_q))
        x = np.asarray(x)
        assert x.min() >= 0 and x.max() < V and 1 <= float(emitted) <= B - 1
        counts = np.bincount(x[:, 0] * V + x[:, 1], minlength=V * V).reshape(V, V)
        p, r = np.asarray(jax.nn.softmax(q1.astype(jnp.float32))), np.asarray(jax.nn.softmax(base1))
        return chi2(counts, want), 0.5 * float(np.abs(p - r).sum())

    (right, tv), (wrong, _) = stat(False), stat(True)
    return right, wrong, tv


# (topc, K): K < B-1 (the block not settled: q of slot j comes from the previous pass's block) and K = B-1.
CASES = [pytest.param(0, 2, id="full-K2"), pytest.param(4, 3, id="top4-K3")]


@pytest.mark.slow  # the default suite: the first slot's distribution (test_sampling.py)
@pytest.mark.parametrize("topc,num_passes", CASES)
def test_emitted_tokens_are_the_targets(topc, num_passes):
    (stat, crit), (wrong, _), tv = joint_test(topc, num_passes, n=8192, context=(2, 7), seed=1)
    assert stat < crit, (stat, crit)
    assert tv > 0.1, tv  # the refinement moved slot 1's distribution (else the control below could not fail)
    assert wrong > 2 * crit, (wrong, crit)  # the negative control: a wrong q is caught


@pytest.mark.slow
@pytest.mark.parametrize("topc,num_passes", [(0, 0), (0, 1), (0, 3), (4, 0), (4, 2), (1, 2), (V, 3)])
@pytest.mark.parametrize("context", [(2, 7), (9, 0)])
def test_emitted_tokens_are_the_targets_sweep(topc, num_passes, context):
    (stat, crit), _, _ = joint_test(topc, num_passes, n=65536, context=context, seed=2)
    assert stat < crit, (stat, crit)
