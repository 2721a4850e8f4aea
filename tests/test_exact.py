"""The certified exact full-vocab pick (`xpress_jax.exact`): tokens equal full-vocab mode, by construction."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax import reference as ref
from xpress_jax.exact import certified_full_vocab_pick, exact_ops, prepare_exact
from xpress_jax.head import hidden_input
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

DTYPES = [jnp.bfloat16, jnp.float32]


@jax.jit
def _pick(base, lat, w2, prepared):
    return certified_full_vocab_pick(base, lat, w2, prepared, candidates=16)


def _pass_latents(params, logits, h, anchors, k):
    """The latents of every pass of a full-vocab reference refine: [k, rows, r]."""
    N, B, _ = logits.shape
    r = params["w1"].shape[1]
    xh = hidden_input(params, h)
    blk = jnp.concatenate([anchors[:, None], ref.full_vocab_start(logits).reshape(N, B - 1)], axis=1)
    out = []
    for _ in range(k):
        lat = ref.latent_pass(params, xh, blk, anchors).reshape(-1, r)
        out.append(lat)
        blk = blk.at[:, 1:].set(ref.full_vocab_pick(ref.draft_rows(logits), lat, params["w2"]).reshape(N, B - 1))
    return jnp.stack(out)


def _problem(dtype, std, v=2048, seed=0):
    cfg = xj.HeadConfig(vocab_size=v, hidden_size=48, block_size=6, rank=32, mlp_hidden=32, topc=16, num_passes=3)
    kp, kl, kh, ka = jax.random.split(jax.random.key(seed), 4)
    params = xj.init_params(cfg, kp, dtype=dtype, std=std)
    logits = (jax.random.normal(kl, (3, 6, v)) * 2).astype(dtype)
    h = jax.random.normal(kh, (3, 6, 48)).astype(dtype)
    anchors = jax.random.randint(ka, (3,), 0, v)
    return cfg, params, logits, h, anchors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("std", [0.02, 0.3])
def test_refine_tokens_equal_full_vocab(dtype, std):
    """Through refine_with: tokens == refine(topc=0, backend="xla"); V not a multiple of the block."""
    cfg, params, logits, h, anchors = _problem(dtype, std, v=2000)
    want = xj.refine(params, logits, h, anchors, config=cfg, topc=0, backend="xla")
    ops = exact_ops(Ops.xla("cpu"), candidates=16)
    got = jax.jit(lambda p, lg, hh, a: refine_with(ops, p, lg, hh, a, config=cfg, topc=0))(params, logits, h, anchors)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert exact_ops(Ops.xla("cpu"), candidates=16) is ops  # cached: a static arg that does not retrace


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_pass_certified_or_scanned(dtype):
    """Per pass: tokens == reference, no violation; weak heads certify rows, strong ones need scans."""
    fracs = {}
    for std in (0.02, 0.3):
        cfg, params, logits, h, anchors = _problem(dtype, std, seed=1)
        prep = prepare_exact(params["w2"])
        base = ref.draft_rows(logits)
        for lat in _pass_latents(params, logits, h, anchors, 3):
            tok, st = _pick(base, lat, params["w2"], prep)
            np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref.full_vocab_pick(base, lat, params["w2"])))
            assert int(st.violations) == 0
        fracs[std] = float(st.rows_certified)
    assert fracs[0.02] == 1.0  # the bounds do certify a weak head
    assert fracs[0.3] < 1.0  # and a strong one takes the exact scan for some rows


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_adversarial_pruning_fails(dtype, bits):
    """Flat base logits, huge w2 rows: the bounds exclude little, the fallback scan keeps it exact."""
    rng = np.random.default_rng(0)
    v, r, rows = 1024, 32, 12
    base = jnp.asarray(rng.normal(size=(rows, v)) * 1e-3, dtype)
    w2 = jnp.asarray(rng.normal(size=(v, r)) * np.where(rng.random((v, 1)) < 0.1, 50.0, 1.0), dtype)
    lat = jnp.asarray(rng.normal(size=(rows, r)), dtype)
    prep = prepare_exact(w2, bits=bits)
    tok, st = _pick(base, lat, w2, prep)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref.full_vocab_pick(base, lat, w2)))
    assert float(st.rows_certified) < 1.0 and float(st.ids_exact_scanned) > 0
    assert float(st.blocks_excluded) < 0.5
    assert int(st.violations) == 0


def _tie_problem(dtype, nc_id, delta=0.0):
    """One row: candidate id 100 scores exactly 4; non-candidate ``nc_id`` scores 4 - delta."""
    v, r, c = 256, 8, 16
    base = np.full((1, v), -3.0, np.float32)
    base[0, 100] = 4.0
    base[0, 120:135] = 3.0  # the other candidates: score 3
    base[0, nc_id] = 1.0  # below tau = 3: not a candidate
    w2 = np.zeros((v, r), np.float32)
    w2[nc_id, 0] = 3.0 - delta
    lat = np.zeros((1, r), np.float32)
    lat[0, 0] = 1.0
    assert c == 16
    return jnp.asarray(base, dtype), jnp.asarray(lat, dtype), jnp.asarray(w2, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tie_at_the_bound_lowest_id_wins(dtype):
    """A non-candidate that TIES the best score: with a lower id it wins, with a higher id it loses;
    just below the best score it never wins. Every case exactly as the reference."""
    for nc_id, delta, want in ((5, 0.0, 5), (200, 0.0, 100), (5, 0.25, 100)):
        base, lat, w2 = _tie_problem(dtype, nc_id, delta)
        tok, st = _pick(base, lat, w2, prepare_exact(w2))
        assert int(ref.full_vocab_pick(base, lat, w2)[0]) == want
        assert int(tok[0]) == want, (nc_id, delta)
        assert int(st.violations) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_logits(dtype):
    """NaN counts as -inf; +inf wins; an all-NaN row picks id 0; -inf rows; as the reference."""
    from conftest import nonfinite_pick_inputs

    base, lat, w2 = (jnp.asarray(x, dtype) for x in nonfinite_pick_inputs())
    tok, st = _pick(base, lat, w2, prepare_exact(w2))
    want = ref.full_vocab_pick(base, lat, w2)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
    assert [int(want[i]) for i in (1, 2, 3, 4)] == [300, 0, 0, 0]
    assert int(st.violations) == 0


def test_bad_arguments():
    w2 = jnp.zeros((100, 8), jnp.float32)
    with pytest.raises(ValueError, match="bits"):
        prepare_exact(w2, bits=3)
    with pytest.raises(ValueError, match="rank"):
        prepare_exact(jnp.zeros((10, 8192), jnp.float32))
    with pytest.raises(ValueError, match="does not fit"):
        certified_full_vocab_pick(jnp.zeros((2, 100)), jnp.zeros((2, 8)), w2, prepare_exact(w2[:50]))
