"""Sampled training targets: a temperature's batch continues each context as the chain at T does (a chi-square
test with negative controls), the greedy batch is unchanged, the task's temperature makes the chain and the
drafter those of T, and the trainer draws sampled targets and scores them at T."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import chi2
from xpress_jax.head import XPressHead
from xpress_jax.toy import ToyConfig, ToyTask
from xpress_jax.train import TrainConfig, loss_and_metrics, train

TOY = ToyConfig(vocab_size=16, block_size=4, hidden_size=8, seed=0)


@pytest.fixture(scope="module")
def task():
    return ToyTask(TOY)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _accepts(tokens: np.ndarray, p: np.ndarray) -> bool:
    """``tokens`` are not rejected as draws of ``p`` at about p = 1e-5 (`helpers.chi2`)."""
    stat, crit = chi2(np.bincount(tokens, minlength=len(p)), p, z=4.26)
    return stat < crit


def _one_context(tables: dict, row: int) -> dict:
    """The tables with every block's context ``row`` (= a * V + b)."""
    logp = np.full_like(tables["context_logp"], -np.inf)
    logp[row] = 0.0
    return {**tables, "context_logp": logp}


@pytest.mark.parametrize("t", [0.7, 1.0])
def test_sampled_continuation_is_distributed_as_the_chain_at_t(task, t):
    V = TOY.vocab_size
    a, b = 3, 5
    n = 6000
    batch = jax.jit(ToyTask.sample, static_argnums=2)(_one_context(task.tables, a * V + b), jax.random.key(7), n,
                                                      jnp.float32(t))
    assert np.all(np.asarray(batch.prev_ids) == a) and np.all(np.asarray(batch.anchors) == b)
    tgt = np.asarray(batch.target)
    assert tgt.shape == (n, TOY.block_size - 1) and tgt.dtype == np.int32
    p = _softmax(task.next_logits.astype(np.float64) / t)  # [a, b, c] the chain at t
    # The first token: P(x1 | a, b) at t; a negative control: the chain at another temperature.
    assert _accepts(tgt[:, 0], p[a, b])
    assert not _accepts(tgt[:, 0], _softmax(task.next_logits[a, b] / (t + 0.5)))
    # The second token: sum_x1 P(x1 | a, b) P(x2 | b, x1) (the walk shifts its context); a negative control:
    # the same mixture with the context not shifted, P(x2 | a, x1).
    assert _accepts(tgt[:, 1], p[a, b] @ p[b])
    assert not _accepts(tgt[:, 1], p[a, b] @ p[a])


def test_greedy_batches_are_unchanged_and_share_all_but_the_target(task):
    key = jax.random.key(3)
    greedy = ToyTask.sample(task.tables, key, 256)
    sampled = ToyTask.sample(task.tables, key, 256, temperature=1.0)
    rows = np.asarray(greedy.prev_ids) * TOY.vocab_size + np.asarray(greedy.anchors)
    np.testing.assert_array_equal(np.asarray(greedy.target), task.tables["greedy"][rows, 1:])
    for name in ("logits", "h", "anchors", "prev_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(sampled, name)), np.asarray(getattr(greedy, name)))
    assert np.mean(np.asarray(sampled.target) != np.asarray(greedy.target)) > 0.2  # sampled, not greedy


def test_the_task_temperature_makes_the_chain_and_the_drafter_those_of_t(task):
    t = 0.5
    hot = ToyTask(dataclasses.replace(TOY, temperature=t))
    np.testing.assert_array_equal(hot.tables["next_logits"], task.tables["next_logits"])
    np.testing.assert_array_equal(hot.tables["greedy"], task.tables["greedy"])  # argmax does not depend on T
    np.testing.assert_allclose(hot.next_probs, _softmax(task.next_logits / t), rtol=1e-6, atol=1e-12)
    # The drafter's logits sampled at T are its marginals: slot 1's is the chain's next token at T.
    V = TOY.vocab_size
    a, b = np.divmod(np.arange(V * V), V)
    slot1 = _softmax(hot.tables["drafter_logits"][:, 1].astype(np.float64) / t)
    np.testing.assert_allclose(slot1, hot.next_probs[a, b], rtol=1e-4, atol=1e-6)
    assert not np.allclose(hot.tables["context_logp"], task.tables["context_logp"])  # the chain at T's contexts
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="temperature"):
            ToyConfig(temperature=bad)


@pytest.mark.slow
def test_the_loss_at_t_is_the_cross_entropy_of_the_scores_over_t(task):
    model = XPressHead(task.head_config(rank=4, mlp_hidden=8, topc=4), rngs=nnx.Rngs(0))
    batch = ToyTask.sample(task.tables, jax.random.key(0), 16, temperature=0.8)
    blk = jnp.concatenate([batch.anchors[:, None], batch.target], axis=1)
    scores = np.asarray(model(batch.logits, batch.h, XPressHead.prev_tokens(blk, batch.prev_ids)), np.float64)
    for t in (None, 0.8):
        logp = np.log(_softmax(scores / (1.0 if t is None else t)))
        want = -np.mean(np.take_along_axis(logp, np.asarray(batch.target)[..., None], axis=-1))
        loss, metrics = loss_and_metrics(model, batch, temperature=t)
        assert float(loss) == pytest.approx(want, rel=1e-5) and float(metrics["ce"]) == float(loss)


@pytest.mark.slow
def test_train_draws_sampled_targets_at_the_sample_temperature(task):
    seen = []

    def sample(tables, key, n, **kw):
        seen.append(kw)
        return ToyTask.sample(tables, key, n, **kw)

    cfg = task.head_config(rank=4, mlp_hidden=8, topc=4)
    res = train(cfg, task.tables, sample, TrainConfig(steps=3, batch_size=8, sample_temperature=0.9), progress=False)
    assert seen == [{"temperature": 0.9}] and len(res.history) == 3  # traced once, with the temperature
    seen.clear()
    train(cfg, task.tables, sample, TrainConfig(steps=2, batch_size=8), progress=False)
    assert seen == [{}]  # the default: greedy targets, the sampler called as before
    for bad in (0.0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="sample_temperature"):
            TrainConfig(sample_temperature=bad)


@pytest.mark.slow
def test_at_t1_the_head_trained_on_sampled_targets_beats_the_drafter_and_the_greedy_trained_head():
    """Speculative sampling at T = 1 on test_train's task: a head trained on the greedy continuation is sharper
    than the target, and the rejection sampler rejects it; one trained on sampled continuations is accepted."""
    from xpress_jax.demo import evaluate_sampled

    task = ToyTask(ToyConfig(vocab_size=32, block_size=6, hidden_size=16, seed=0))
    cfg = task.head_config(rank=16, mlp_hidden=32, topc=4)
    greedy_tc = TrainConfig(steps=300, batch_size=64, learning_rate=1e-2)
    full = {}
    for name, tc in (("greedy", greedy_tc), ("sampled", dataclasses.replace(greedy_tc, sample_temperature=1.0))):
        head = train(cfg, task.tables, ToyTask.sample, tc, progress=False).model.to_serving()
        ev = evaluate_sampled(task, head, temperature=1.0, n_blocks=512, topcs=(0,))
        full[name] = ev["refined"][0][-1]
    assert full["sampled"] >= ev["drafter"] + 0.4, (full, ev["drafter"])
    assert full["sampled"] >= full["greedy"] + 0.4, (full, ev["drafter"])
