"""Reduced draft vocabularies (``draft_vocab_size`` < V, a ``d2t`` map), the predecessor convention, and what a
bad call returns instead of a result (an invalid traced temperature, a missing proposal).

Oracles: a numpy Jacobi loop over the draft vocabulary (argmax over draft ids, lowest draft id on ties, mapped to
verifier ids with ``id + d2t[id]``), and the same head embedded in the verifier's vocabulary (``w2`` rows at the
mapped ids, logits -inf elsewhere), which an increasing map makes token-for-token equal in every greedy mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import xpress_jax as xj
from xpress_jax.head import hidden_input, latent
from xpress_jax.params import check_vocab_map
from xpress_jax.sampling import Proposal, accept
from xpress_jax.sharded import input_shardings, refine_sharded

from helpers import make_inputs

V, VD = 97, 41
CFG = xj.HeadConfig(vocab_size=V, draft_vocab_size=VD, hidden_size=8, block_size=5, rank=6, mlp_hidden=10, topc=7,
                    num_passes=3, max_num_reqs=8)
N = 3
refine = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)


def _problem(cfg=CFG, dtype=jnp.float32, seed=0, shuffle=False):
    head = xj.init_head(cfg, seed, dtype=dtype, std=0.5)
    if shuffle:  # a map that is not increasing (draft id order != verifier id order)
        mapped = np.asarray(head.params["d2t"]) + np.arange(cfg.draft_vocab_size)
        mapped = np.random.default_rng(seed).permutation(mapped)
        head = xj.Head(cfg, {**head.params, "d2t": jnp.asarray(mapped - np.arange(cfg.draft_vocab_size), jnp.int32)})
    logits, h, anchors, prev = make_inputs(xj.HeadConfig(vocab_size=cfg.draft_vocab_size, hidden_size=8,
                                                         block_size=cfg.block_size), N, seed=seed + 1, dtype=dtype)
    anchors = (anchors * 7 + 3) % cfg.vocab_size  # verifier ids, also beyond V_draft
    prev = (prev * 5 + 1) % cfg.vocab_size
    return head, logits, h, anchors, prev


def _jacobi(head, logits, h, anchors, prev, K):
    """The numpy oracle: K greedy passes over the draft vocabulary from the base argmax, mapped with d2t."""
    p = head.params
    d2t = np.asarray(p["d2t"])
    base = np.asarray(logits, np.float64)[:, 1:]
    pick = np.argmax(base, -1)
    blk = np.concatenate([np.asarray(anchors)[:, None], pick + d2t[pick]], 1)
    xh = hidden_input(p, h)
    for _ in range(K):
        pr = np.concatenate([np.asarray(prev)[:, None], blk[:, :-1]], 1)
        lat = np.asarray(latent(p, xh, jnp.asarray(pr, jnp.int32)), np.float64)
        pick = np.argmax(base + lat @ np.asarray(p["w2"], np.float64).T, -1)
        blk[:, 1:] = pick + d2t[pick]
    return blk[:, 1:]


def _embedded(head, logits):
    """The reduced head as a full-vocabulary head: w2's rows at the mapped ids (zero elsewhere), logits -inf at the
    verifier ids outside the draft vocabulary."""
    cfg, p = head
    mapped = np.asarray(p["d2t"]) + np.arange(cfg.draft_vocab_size)
    w2 = jnp.zeros((cfg.vocab_size, cfg.rank), p["w2"].dtype).at[mapped].set(p["w2"])
    full = jnp.full((*logits.shape[:2], cfg.vocab_size), -jnp.inf, logits.dtype).at[..., mapped].set(logits)
    params = {k: v for k, v in p.items() if k != "d2t"}
    full_cfg = xj.HeadConfig(**{**cfg.__dict__, "draft_vocab_size": None, "topc": cfg.topc})
    return xj.Head(full_cfg, {**params, "w2": w2}), full


@pytest.mark.parametrize("K,shuffle,mode", [(3, True, "scan"), pytest.param(3, True, "certified", marks=pytest.mark.slow),
                                            pytest.param(0, False, "scan", marks=pytest.mark.slow),
                                            pytest.param(1, False, "certified", marks=pytest.mark.slow)])
def test_reduced_refine_is_the_jacobi_loop_over_draft_ids(K, shuffle, mode):
    """float64, full vocabulary: the scan and the certified mode give the numpy loop's tokens (verifier ids)."""
    with jax.enable_x64(True):
        head, logits, h, anchors, prev = _problem(dtype=jnp.float64, shuffle=shuffle)
        want = _jacobi(head, logits, h, anchors, prev, K)
        got = refine(head, logits, h, anchors, prev, num_passes=K, topc=0, backend="xla", full_vocab=mode)
        np.testing.assert_array_equal(np.asarray(got), want)
        assert (want >= VD).any(), "the map sends some draft ids past V_draft"


@pytest.mark.parametrize("backend,topc", [pytest.param("pallas", 0, marks=pytest.mark.interpret),
                                          *(pytest.param(b, c, marks=pytest.mark.slow)
                                            for b, c in (("xla", 7), ("xla", 0), ("xla", VD), ("pallas", 7),
                                                         ("pallas", VD)))])
def test_reduced_equals_embedded_head(backend, topc):
    """An increasing map: every greedy mode gives the tokens of the same head embedded in the full vocabulary."""
    head, logits, h, anchors, prev = _problem(seed=2)
    full_head, full_logits = _embedded(head, logits)
    kw = dict(topc=topc, backend=backend, interpret=backend == "pallas")
    got = np.asarray(refine(head, logits, h, anchors, prev, **kw))
    want = np.asarray(refine(full_head, full_logits, h, anchors, prev, **kw))
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_reduced_sampling_draws_noise_of_draft_ids():
    """The sampled seed block (K = 0) is argmax(base / T + g(draft id)), mapped; the proposal is in draft space."""
    from xpress_jax.kernels.common import gumbel
    from xpress_jax.sampling import row_seeds

    head, logits, h, anchors, prev = _problem(seed=3)
    key, T = jax.random.key(4), 0.8
    tok, prop = refine(head, logits, h, anchors, prev, num_passes=0, topc=0, backend="xla", temperature=T,
                       key=key, proposal="scores")
    g = np.asarray(gumbel(row_seeds(key, N * 4)[:, None], jnp.arange(VD, dtype=jnp.int32)[None, :]))
    base = np.asarray(logits, np.float32)[:, 1:].reshape(N * 4, VD)
    pick = np.argmax(base * np.float32(1 / T) + g, -1)
    np.testing.assert_array_equal(np.asarray(tok).reshape(-1), pick + np.asarray(head.params["d2t"])[pick])
    assert prop.scores.shape == (N, 4, VD)


@pytest.mark.slow
@pytest.mark.parametrize("topc", [0, 7])
def test_accept_maps_a_reduced_proposal(topc):
    """accept(..., d2t) == accept on the proposal spread over the verifier vocabulary (q = 0 off the draft ids)."""
    head, logits, h, anchors, prev = _problem(seed=5)
    key, T = jax.random.key(6), 1.0
    tok, prop = refine(head, logits, h, anchors, prev, topc=topc, backend="xla", temperature=T, key=key,
                       proposal="scores")
    target = jax.random.normal(jax.random.key(7), (N, 4, V)) * 2
    mapped = np.asarray(head.params["d2t"]) + np.arange(VD)
    ids = mapped[np.asarray(prop.ids)] if topc else None
    scores = prop.scores if topc else jnp.full((N, 4, V), -jnp.inf).at[..., mapped].set(prop.scores)
    want = accept(target, tok, Proposal(prop.token_score, prop.lse, scores, ids), T, jax.random.key(8))
    got = accept(target, tok, prop, T, jax.random.key(8), d2t=head.params["d2t"])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if not topc:
        with pytest.raises(ValueError, match="d2t"):  # full vocabulary: the draft vocabulary's size tells
            accept(target, tok, prop, T, jax.random.key(8))
    with pytest.raises(TypeError, match="proposal must be the xpress_jax.Proposal"):
        accept(target, tok, None, T, jax.random.key(8))


def test_accept_names_a_missing_proposal():
    with pytest.raises(TypeError, match="proposal must be the xpress_jax.Proposal"):
        accept(jnp.zeros((1, 4, V)), jnp.zeros((1, 4), jnp.int32), None, 1.0, jax.random.key(0))


def test_vocab_map_is_validated():
    assert check_vocab_map(np.array([0, 1, 5]), 10).dtype == np.int32
    for d2t, match in (([0, 9], r"outside \[0, 10\)"), ([1, 0], "two draft ids to one verifier id"),
                       ([-1, 0], "outside")):
        with pytest.raises(ValueError, match=match):
            check_vocab_map(np.array(d2t), 10)
    t2d = np.zeros(10, bool)
    t2d[[0, 1]] = True
    check_vocab_map(np.array([0, 0]), 10, t2d)
    with pytest.raises(ValueError, match="t2d marks 2 verifier ids, but d2t has 3"):
        check_vocab_map(np.array([0, 0, 0]), 10, t2d)
    with pytest.raises(ValueError, match="draft_vocab_size=98 must be <= vocab_size=97"):
        xj.HeadConfig(vocab_size=97, draft_vocab_size=98, hidden_size=8)
    with pytest.raises(ValueError, match="predecessor must be one of"):
        xj.HeadConfig(vocab_size=97, hidden_size=8, predecessor="prev")
    head, logits, h, anchors, _ = _problem()
    with pytest.raises(ValueError, match=r"needs 'd2t'"):
        xj.Head(CFG, {k: v for k, v in head.params.items() if k != "d2t"})
    with pytest.raises(ValueError, match="draft_vocab_size is 41"):
        xj.refine(head, jnp.zeros((N, 5, V)), h, anchors, backend="xla")


def test_hf_config_round_trip():
    cfg = xj.HeadConfig(**{**CFG.__dict__, "predecessor": "previous"})
    assert xj.HeadConfig.from_hf_config(cfg.to_hf_config()) == cfg
    plain = xj.HeadConfig(vocab_size=97, hidden_size=8)
    assert "draft_vocab_size" not in plain.to_hf_config() and "xpress_predecessor" not in plain.to_hf_config()
    assert xj.HeadConfig.from_hf_config(plain.to_hf_config()).predecessor == "anchor"


# ----------------------------------------------------------------------------- the predecessor convention


def test_previous_head_requires_prev_ids():
    head, logits, h, anchors, prev = _problem()
    prev_head = xj.Head(xj.HeadConfig(**{**CFG.__dict__, "predecessor": "previous"}), head.params)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    calls = {"refine": lambda **kw: xj.refine(prev_head, logits, h, anchors, backend="xla", **kw),
             "refine_sharded": lambda **kw: refine_sharded(prev_head, logits, h, anchors, mesh=mesh, backend="xla", **kw)}
    for name, call in calls.items():
        with pytest.raises(ValueError, match="prev_ids is required"):
            call()


@pytest.mark.slow
def test_previous_head_in_the_server():
    head, logits, h, anchors, prev = _problem()
    prev_head = xj.Head(xj.HeadConfig(**{**CFG.__dict__, "predecessor": "previous"}), head.params)
    # prev_ids=anchors is vLLM's behaviour, the anchor head's default.
    np.testing.assert_array_equal(np.asarray(refine(prev_head, logits, h, anchors, anchors, backend="xla")),
                                  np.asarray(refine(head, logits, h, anchors, backend="xla")))
    server = xj.RefineServer(prev_head, buckets=[N], backend="xla", progress=False)
    with pytest.raises(ValueError, match="prev_ids is required"):
        server(np.asarray(logits), np.asarray(h), np.asarray(anchors))
    np.testing.assert_array_equal(np.asarray(server(np.asarray(logits), np.asarray(h), np.asarray(anchors),
                                                    np.asarray(prev))),
                                  np.asarray(xj.refine(head, logits, h, anchors, prev, backend="xla")))


def test_input_shardings_by_argument_name():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    sh = input_shardings(mesh)
    assert sh["anchors"] == sh["prev_ids"] == sh["ids"]
    assert {"logits", "h", "out"} <= set(sh)


# ----------------------------------------------------------------------------- what a bad call returns


def test_invalid_traced_temperature_gives_invalid_tokens():
    """Under jit a bad temperature cannot raise: every draft slot is -1 (refine, refine_sharded, RefineServer given
    a jax.Array); concrete, refine raises. A valid temperature in the same executable samples."""
    head, logits, h, anchors, prev = _problem(cfg=xj.HeadConfig(**{**CFG.__dict__, "draft_vocab_size": None}))
    key = jax.random.key(0)
    f = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    g = jax.jit(lambda t: refine_sharded(head, logits, h, anchors, prev, mesh=mesh, backend="xla", temperature=t,
                                         key=key))
    for run in (lambda t: f(head, logits, h, anchors, prev, backend="xla", temperature=t, key=key), g):
        for T in (-1.0, float("nan"), float("inf")):  # one executable: the temperature is traced
            np.testing.assert_array_equal(np.asarray(run(jnp.float32(T))), -1)
        assert (np.asarray(run(jnp.float32(1.0))) >= 0).all()
    for T in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
            xj.refine(head, logits, h, anchors, prev, backend="xla", temperature=T, key=key)


@pytest.mark.slow
def test_invalid_temperature_in_the_server():
    head, logits, h, anchors, prev = _problem(cfg=xj.HeadConfig(**{**CFG.__dict__, "draft_vocab_size": None}))
    server = xj.RefineServer(head, buckets=[N], backend="xla", progress=False, sampling=True)
    args = (np.asarray(logits), np.asarray(h), np.asarray(anchors), np.asarray(prev))
    for T in (-1.0, float("nan"), float("inf")):
        np.testing.assert_array_equal(np.asarray(server(*args, temperature=jnp.float32(T), key=jax.random.key(0))), -1)
    assert (np.asarray(server(*args, temperature=jnp.float32(0.5), key=jax.random.key(0))) >= 0).all()


def test_init_head_takes_an_int_seed():
    a, b = xj.init_head(CFG, 3), xj.init_head(CFG, jax.random.key(3))
    for k in a.params:
        np.testing.assert_array_equal(np.asarray(a.params[k]), np.asarray(b.params[k]))
    with pytest.raises(TypeError, match=r"key must be a jax.random.key\(seed\) or an int seed"):
        xj.init_head(CFG, "0")


def test_training_module_refuses_a_reduced_head_and_asks_for_prev_ids():
    from flax import nnx

    with pytest.raises(ValueError, match="XPressHead trains heads over the whole vocabulary"):
        xj.XPressHead(CFG, rngs=nnx.Rngs(0))
    cfg = xj.HeadConfig(**{**CFG.__dict__, "draft_vocab_size": None, "predecessor": "previous"})
    module = xj.XPressHead(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="prev_ids is required"):
        module.refine(jnp.zeros((1, 5, V)), jnp.zeros((1, 5, 8)), jnp.zeros((1,), jnp.int32), num_passes=1)
