"""The speculators recipe (`xpress_jax.train`: ``loss``, the per-slot decay, the consistency rounds): properties of
the loss, the toy task's teacher, and parity with speculators' own ``compute_metrics`` (eager losses, float32)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xpress_jax.head import XPressHead
from xpress_jax.toy import ToyConfig, ToyTask
from xpress_jax.train import (RECIPES, TrainConfig, distribution_loss, loss_and_metrics, slot_weights, train,
                              xpress_loss)

TOY = ToyConfig(vocab_size=16, block_size=5, hidden_size=8, seed=0)
SPEC = dict(RECIPES["speculators"])  # loss, loss_decay_gamma, consistency_weight, consistency_passes
TERMS = [{"ce": 1.0}, {"tv": 1.0}, {"ce": 0.1, "tv": 0.9}]


@pytest.fixture(scope="module")
def task():
    return ToyTask(TOY)


@pytest.fixture(scope="module")
def model(task):
    return XPressHead(task.head_config(rank=8, mlp_hidden=8, topc=4), rngs=nnx.Rngs(0), std=0.3)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# ---------------------------------------------------------------- the loss's properties
def test_slot_weights_decay_from_slot_1():
    w = np.asarray(slot_weights(6, 4.0))
    np.testing.assert_allclose(w, np.exp(-np.arange(6) / 4.0), rtol=1e-7)  # slot k = 1..6: exp(-(k - 1) / 4)
    assert w[0] == 1.0 and np.all(np.diff(w) < 0)
    assert np.all(np.asarray(slot_weights(6, None)) == 1.0)


def test_distribution_loss_terms():
    rng = np.random.default_rng(0)
    s, t = (jnp.asarray(rng.standard_normal((4, 3, 11)) * 2, jnp.float32) for _ in range(2))
    mask = (rng.random((4, 3)) < 0.7).astype(np.float64)
    _, same = distribution_loss(s, s, terms={"tv": 1.0})
    assert abs(float(same["tv"])) < 1e-6  # TV of identical distributions: 0
    # By hand (float64): CE against the teacher's argmax, TV = 1 - sum min(p, q), each decayed and normalised.
    w = np.exp(-np.arange(3) / 4.0)
    q, p = _softmax(np.asarray(s, np.float64)), _softmax(np.asarray(t, np.float64))
    ce = -np.log(np.take_along_axis(q, p.argmax(-1)[..., None], -1)[..., 0])
    tv = 1 - np.minimum(p, q).sum(-1)
    assert 0 < tv.min() and tv.max() < 1
    total, parts = distribution_loss(s, t, mask, terms={"ce": 0.1, "tv": 0.9}, gamma=4.0)
    want = {n: np.sum(mask * w * e) / (mask.sum() + 1e-5) for n, e in (("ce", ce), ("tv", tv))}
    for n in want:
        assert float(parts[n]) == pytest.approx(want[n], rel=1e-5)
    assert float(total) == pytest.approx(0.1 * want["ce"] + 0.9 * want["tv"], rel=1e-5)
    # A masked slot counts for nothing; an all-masked batch is 0, not nan.
    m0 = mask.copy()
    m0[0, 0] = 0.0
    moved = s.at[0, 0].set(-s[0, 0])
    assert float(distribution_loss(moved, t, m0)[0]) == float(distribution_loss(s, t, m0)[0])
    assert float(distribution_loss(s, t, np.zeros((4, 3)))[0]) == 0.0
    # At T: the terms of scores / T against teacher / T.
    got = distribution_loss(s, t, mask, temperature=0.7)[0]
    assert float(got) == pytest.approx(float(distribution_loss(s / 0.7, t / 0.7, mask)[0]), rel=1e-6)


def test_toy_batches_carry_the_teacher(task):
    V = TOY.vocab_size
    nl = task.tables["next_logits"]
    sample = jax.jit(ToyTask.sample, static_argnums=(2, 3))
    for t in (None, 1.0):
        b = sample(task.tables, jax.random.key(1), 32, t)
        prev, a, tgt = (np.asarray(x) for x in (b.prev_ids, b.anchors, b.target))
        teacher = np.asarray(b.teacher_logits)
        assert teacher.shape == (32, TOY.block_size - 1, V) and teacher.dtype == np.float32
        seq = np.concatenate([prev[:, None], a[:, None], tgt], axis=1)
        for k in range(TOY.block_size - 1):  # slot k + 1: the chain's logits after the two tokens before it
            np.testing.assert_array_equal(teacher[:, k], nl[seq[:, k], seq[:, k + 1]])
        if t is None:  # along the greedy continuation, the teacher's argmax is the continuation itself
            np.testing.assert_array_equal(teacher.argmax(-1), tgt)


@pytest.mark.slow
def test_consistency_rounds_feed_refines_tokens_with_gradient_only_through_each_rounds_forward(task, model):
    batch = ToyTask.sample(task.tables, jax.random.key(2), 16)
    graphdef, params = nnx.split(model, nnx.Param)

    def score(m, tokens):  # the draft slots' scores with the block [anchor, tokens] fed
        blk = jnp.concatenate([batch.anchors[:, None], tokens], axis=1)
        return m(batch.logits, batch.h, XPressHead.prev_tokens(blk, batch.prev_ids))

    @jax.jit
    def both(p):
        # Round j's tokens by hand: refine's after j passes (round 0: the drafter's argmax), from the model's
        # params as constants: no gradient reaches them.
        fixed = [model.refine(batch.logits, batch.h, batch.anchors, batch.prev_ids, num_passes=j) for j in range(3)]

        def by_hand(p):
            m = nnx.merge(graphdef, p)
            rounds = [score(m, tok) for tok in fixed]
            return xpress_loss(score(m, batch.target), rounds, batch.teacher_logits, terms=SPEC["loss"])[0]

        def ours(p):
            return loss_and_metrics(nnx.merge(graphdef, p), batch, **SPEC)

        # The K-pass term is one round: kpass_passes = p scores round p - 1's inputs.
        _, km = loss_and_metrics(nnx.merge(graphdef, p), batch, **SPEC, kpass_weight=1.0, kpass_passes=3)
        return jax.value_and_grad(ours, has_aux=True)(p), jax.value_and_grad(by_hand)(p), km

    ((loss, metrics), grads), (want, want_grads), km = both(params)
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-7)
    assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)) > 0
    assert float(km["kpass_ce"]) == pytest.approx(float(km["consistency_round2"]), rel=1e-6)
    assert float(km["loss"]) == pytest.approx(float(metrics["loss"]) + float(km["kpass_ce"]), rel=1e-6)


def test_the_default_loss_is_unchanged_and_the_predecessor_is_the_heads(task, model):
    batch = ToyTask.sample(task.tables, jax.random.key(3), 8)
    anchor = XPressHead(dataclasses.replace(model.config, predecessor="anchor"), rngs=nnx.Rngs(0), std=0.3)
    as_anchor = batch._replace(prev_ids=batch.anchors)

    @jax.jit
    def losses(batch, as_anchor):
        return loss_and_metrics(model, batch), loss_and_metrics(anchor, batch)[0], loss_and_metrics(model, as_anchor)[0]

    (loss, m), anchor_loss, as_anchor_loss = losses(batch, as_anchor)
    assert set(m) == {"ce", "slot_accuracy", "loss"} and float(loss) == float(m["ce"])
    # An "anchor" head reads the anchor in slot 0 (as vLLM serves it), a "previous" head the batch's prev_ids.
    assert float(anchor_loss) == float(as_anchor_loss) != float(loss)
    # The recipe needs the teacher.
    with pytest.raises(ValueError, match="teacher_logits"):
        loss_and_metrics(model, batch._replace(teacher_logits=None), loss={"tv": 1.0})


def test_train_config_recipes():
    tc = TrainConfig.from_recipe("speculators", steps=10)
    assert tc.loss == (("ce", 0.1), ("tv", 0.9)) and tc.loss_decay_gamma == 4.0 and tc.steps == 10
    assert (tc.consistency_weight, tc.consistency_passes, tc.kpass_weight) == (0.3, 3, 0.0)
    assert TrainConfig.from_recipe("ce") == TrainConfig() and TrainConfig().loss is None
    assert TrainConfig(loss='{"ce": 0.1, "tv": 0.9}').loss == tc.loss  # speculators' --loss-fn spelling
    hash(tc)
    for bad in ({"kl_div": 1.0}, {}, {"ce": -1.0}, "nope"):
        with pytest.raises(ValueError, match="loss"):
            TrainConfig(loss=bad)
    for field, bad in (("loss_decay_gamma", 0.0), ("consistency_weight", -1.0), ("consistency_passes", 0)):
        with pytest.raises(ValueError, match=field):
            TrainConfig(**{field: bad})
    with pytest.raises(ValueError, match="recipe"):
        TrainConfig.from_recipe("eagle")


@pytest.mark.slow
def test_the_recipe_trains_and_beats_the_drafter_at_t1(task):
    from xpress_jax.demo import evaluate_sampled

    cfg = task.head_config(rank=8, mlp_hidden=16, topc=4)
    tc = TrainConfig.from_recipe("speculators", steps=150, batch_size=64, learning_rate=1e-2, sample_temperature=1.0)
    res = train(cfg, task.tables, ToyTask.sample, tc, progress=False)
    first, last = res.history[0], res.history[-10:]
    assert np.mean([h["loss"] for h in last]) < 0.8 * first["loss"]  # 0.38 -> 0.25 (JAX 0.11.2)
    assert np.mean([h["accept_rate"] for h in last]) > first["accept_rate"] + 0.08  # 0.62 -> 0.78
    ev = evaluate_sampled(task, res.model.to_serving(), temperature=1.0, n_blocks=512, topcs=(0,))
    assert ev["refined"][0][-1] > ev["drafter"] + 0.3, ev  # 2.82 vs 2.17


# ---------------------------------------------------------------- parity with speculators
@pytest.fixture(scope="module")
def speculators():
    """torch and speculators' loss functions; skips without them (fails with XPRESS_REQUIRE_SPECULATORS=1: CI's
    speculators stage)."""
    required = os.environ.get("XPRESS_REQUIRE_SPECULATORS") == "1"
    if not required and importlib.util.find_spec("speculators") is None:  # before torch's import (seconds)
        pytest.skip("need speculators: not installed (.ci/run's speculators stage installs it)")
    torch = importlib.import_module("torch") if required else pytest.importorskip("torch")
    # speculators imports transformers, which imports torchvision and torchaudio when installed; a build of them
    # that does not match torch (a CUDA torchvision beside a CPU torch: its ops fail to load) would fail that
    # import. speculators' losses need neither: hide a broken one from transformers.
    for name in ("torchvision", "torchaudio"):
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                pass
            except Exception:  # noqa: BLE001  (RuntimeError, OSError: a library that does not load)
                sys.modules[name] = None
    with warnings.catch_warnings():  # transformers' and torch's deprecation notices, at import
        warnings.simplefilter("ignore")
        importlib.import_module("speculators") if required else pytest.importorskip("speculators")
        from speculators.losses import resolve_loss_config
        from speculators.models.xpress.metrics import compute_metrics

    return torch, resolve_loss_config, compute_metrics


def _inputs(n, b, v, seed):
    """speculators' layout ([1, n * b, v], slot 0 of each block masked) and ours (the draft slots, [n, b-1, v])."""
    rng = np.random.default_rng(seed)
    f = lambda: (rng.standard_normal((n, b, v)) * 3).astype(np.float32)  # noqa: E731
    tf, teacher, rounds = f(), f(), [f() for _ in range(3)]
    mask = (rng.random((n, b)) < 0.8).astype(np.float32)
    mask[:, 0] = 0.0  # speculators masks the anchor slot (sample_from_anchor=False)
    return tf, rounds, teacher, mask


def _compare(speculators, n, b, v, seed):
    torch, resolve_loss_config, compute_metrics = speculators
    tf, rounds, teacher, mask = _inputs(n, b, v, seed)
    flat = lambda x: torch.from_numpy(x.reshape(1, n * b, *x.shape[2:]))  # noqa: E731
    worst = {}
    for terms in TERMS:
        for with_rounds in (False, True):
            ref_loss, ref = compute_metrics(flat(tf), [flat(r) for r in rounds] if with_rounds else [], None,
                                            flat(teacher), flat(mask), b,
                                            loss_config=resolve_loss_config(json.dumps(terms), "eager"),
                                            gamma=4.0, consistency_weight=0.3)
            loss, ours = xpress_loss(tf[:, 1:], [r[:, 1:] for r in rounds] if with_rounds else [], teacher[:, 1:],
                                     mask[:, 1:], terms=terms, gamma=4.0, consistency_weight=0.3)
            pairs = {"loss": (loss, ref_loss), "tf_loss": (ours["tf_loss"], ref["tf_loss_sum"])}
            if len(terms) > 1:  # speculators reports each term only for a compound loss
                pairs.update({f"tf_{t}": (ours[f"tf_{t}"], ref[f"{t}_loss_sum"]) for t in terms})
            if with_rounds:
                pairs["consistency_loss"] = (ours["consistency_loss"], ref["consistency_loss_sum"])
                pairs.update({f"consistency_round{j}": (ours[f"consistency_round{j}"],
                                                        ref[f"consistency_round{j}_loss_sum"]) for j in range(3)})
            for name, (got, want) in pairs.items():
                got, want = float(got), float(want)
                key = f"{'+'.join(terms)}{' +rounds' if with_rounds else ''}: {name}"
                worst[key] = abs(got - want) / abs(want)
                assert got == pytest.approx(want, rel=1e-5), key
    print("\nmax relative difference to speculators, per term:",
          *(f"  {k}: {d:.1e}" for k, d in worst.items()), sep="\n")
    return worst


def test_parity_with_speculators_compute_metrics(speculators):
    _compare(speculators, n=6, b=5, v=33, seed=0)


@pytest.mark.slow
def test_parity_with_speculators_at_serving_block_size(speculators):
    _compare(speculators, n=16, b=16, v=4096, seed=1)
