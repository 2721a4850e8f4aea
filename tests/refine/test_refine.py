"""Core properties of the head and of `refine` (jnp path): fold, causality, Jacobi exactness, ties, jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax.head import hidden_input, latent
from xpress_jax import reference as R

from helpers import make_head, make_inputs, sequential_greedy

refine_jit = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)


# ---------------------------------------------------------------- fold identity
@pytest.mark.parametrize("B", [5, 16])
def test_fold_identity_training_vs_serving_form(B):
    rng = np.random.default_rng(B)
    r = 7
    raw = rng.normal(size=(r, B, B))  # includes a non-zero upper triangle that must be masked away
    x = rng.normal(size=(r, B, 3))  # per channel c: x[c] is [B slots, 3 columns]
    training = x + np.einsum("ckj,cjm->ckm", raw * np.tril(np.ones((B, B))), x)
    with jax.enable_x64(True):
        folded = np.asarray(xj.fold_causal_mixer(jnp.asarray(raw)))
    serving = np.einsum("ckj,cjm->ckm", folded, x)
    np.testing.assert_allclose(serving, training, rtol=1e-13, atol=1e-13)
    assert np.all(np.triu(folded, 1) == 0) and np.all(np.diagonal(folded, axis1=1, axis2=2) == 1 + np.diagonal(raw, axis1=1, axis2=2))


def test_fold_rounds_like_the_reference_in_bf16():
    # The reference folds in the checkpoint's dtype: raw*tril + eye in bf16 (one rounding).
    torch = pytest.importorskip("torch")
    raw = torch.randn(4, 6, 6).to(torch.bfloat16) * 3
    ref = raw * torch.tril(torch.ones(6, 6, dtype=torch.bfloat16)) + torch.eye(6, dtype=torch.bfloat16)
    cfg = xj.HeadConfig(vocab_size=10, hidden_size=3, block_size=6, rank=4, mlp_hidden=2, topc=0)
    tensors = _random_state_dict(cfg, np.random.default_rng(0))
    tensors["mix.L"] = raw
    p = xj.params_from_state_dict(tensors, cfg, dtype=jnp.bfloat16)
    ours = np.asarray(p["mix"].astype(jnp.float32)).transpose(2, 0, 1)
    np.testing.assert_array_equal(ours, ref.float().numpy())


def _random_state_dict(cfg, rng):
    from xpress_jax.params import source_shapes

    return {k: rng.normal(size=s).astype(np.float32) for k, s in source_shapes(cfg).items()}


def test_params_from_state_dict_layouts(small_cfg):
    rng = np.random.default_rng(3)
    sd = _random_state_dict(small_cfg, rng)
    p = xj.params_from_state_dict(sd, small_cfg)
    r = small_cfg.rank
    np.testing.assert_array_equal(p["down_h"], sd["down_h.weight"].T)
    np.testing.assert_array_equal(p["in_proj_hidden"], sd["in_proj.weight"][:, : 2 * r].T)
    np.testing.assert_array_equal(p["in_proj_token"], sd["in_proj.weight"][:, 2 * r :].T)
    np.testing.assert_array_equal(p["mlp_down"], sd["mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(p["w2"], sd["w2.weight"])
    B = small_cfg.block_size
    folded = sd["mix.L"] * np.tril(np.ones((B, B), np.float32)) + np.eye(B, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(p["mix"]).transpose(2, 0, 1), folded)


def test_params_from_state_dict_reports_keys_by_name(small_cfg):
    sd = _random_state_dict(small_cfg, np.random.default_rng(0))
    bad = dict(sd)
    del bad["w2.weight"]
    bad["extra.thing"] = np.zeros(3, np.float32)
    bad["down_g.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError) as e:
        xj.params_from_state_dict(bad, small_cfg)
    msg = str(e.value)
    assert "w2.weight" in msg and "extra.thing" in msg and "down_g.weight" in msg


# ---------------------------------------------------------------- causality
def test_latent_is_causal(small_cfg):
    params = make_head(small_cfg)
    logits, h, _, _ = make_inputs(small_cfg, 3)
    N, B = 3, small_cfg.block_size
    xh = hidden_input(params, h)
    rng = np.random.default_rng(0)
    prev = rng.integers(0, small_cfg.vocab_size, (N, B)).astype(np.int32)
    lat = np.asarray(latent(params, xh, jnp.asarray(prev)))  # lat[:, b-1] is slot b
    for c in range(B):
        p2 = prev.copy()
        p2[:, c] = (p2[:, c] + 1 + rng.integers(0, 100, N)) % small_cfg.vocab_size
        lat2 = np.asarray(latent(params, xh, jnp.asarray(p2)))
        # draft slots b < c are untouched, bit for bit; slot max(c,1) onwards moves.
        np.testing.assert_array_equal(lat2[:, : max(c - 1, 0)], lat[:, : max(c - 1, 0)])
        assert np.all(np.any(lat2[:, max(c, 1) - 1] != lat[:, max(c, 1) - 1], axis=-1))


@pytest.mark.slow
def test_refine_output_is_causal_in_the_logits(small_cfg):
    params = make_head(small_cfg)
    logits, h, a, p = make_inputs(small_cfg, 4)
    for topc in (0, small_cfg.topc):
        base = np.asarray(xj.refine(params, logits, h, a, p, num_passes=7, topc=topc))
        c = 4
        logits2 = logits.at[:, c].set(jnp.flip(logits[:, c], axis=-1))  # change slot c's logits only
        out2 = np.asarray(xj.refine(params, logits2, h, a, p, num_passes=7, topc=topc))
        np.testing.assert_array_equal(out2[:, : c - 1], base[:, : c - 1])
        assert np.any(out2[:, c - 1 :] != base[:, c - 1 :])


@pytest.mark.slow  # jit against eager: test_jit_matches_eager_and_does_not_retrace
def test_determinism(small_cfg):
    params = make_head(small_cfg)
    x = make_inputs(small_cfg, 5)
    for topc in (0, 13):
        outs = [np.asarray(refine_jit(params, *x, num_passes=3, topc=topc)) for _ in range(3)]
        outs.append(np.asarray(xj.refine(params, *x, num_passes=3, topc=topc)))
        outs.append(np.asarray(refine_jit(params, *x, num_passes=3, topc=topc, unroll=True)))
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])


# ---------------------------------------------------------------- Jacobi exactness
# bf16 is `slow` here: the default run checks bf16 Jacobi exactness on the Pallas refine
# (test_kernel_shapes.test_jacobi_exactness_full_vocab_pallas_bf16), which equals this XLA refine.
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_jacobi_exactness_full_vocab(small_cfg, dtype):
    params = make_head(small_cfg, dtype=dtype)
    logits, h, a, p = make_inputs(small_cfg, 6, dtype=dtype)
    B = small_cfg.block_size
    seq = sequential_greedy(params, logits, h, a, p)
    drafter = np.asarray(jnp.argmax(logits[:, 1:], axis=-1))
    assert np.mean(seq != drafter) > 0.5, "weights too weak: refinement changes few tokens, test is vacuous"
    for K in (B - 1, B + 2):
        np.testing.assert_array_equal(np.asarray(refine_jit(params, logits, h, a, p, num_passes=K, topc=0)), seq)
    # after pass p, slots 1..p are final (and, for this input, slot p+1 usually is not yet)
    not_final = 0
    for K in range(1, B - 1):
        out = np.asarray(refine_jit(params, logits, h, a, p, num_passes=K, topc=0))
        np.testing.assert_array_equal(out[:, :K], seq[:, :K])
        not_final += int(np.any(out[:, K:] != seq[:, K:]))
    assert not_final > 0


def test_prev_ids_defaults_to_anchors(small_cfg):
    params = make_head(small_cfg)
    logits, h, a, _ = make_inputs(small_cfg, 3)
    np.testing.assert_array_equal(
        np.asarray(xj.refine(params, logits, h, a, num_passes=2, topc=0)),
        np.asarray(xj.refine(params, logits, h, a, a, num_passes=2, topc=0)),
    )
    assert np.any(
        np.asarray(xj.refine(params, logits, h, a, (a + 1) % small_cfg.vocab_size, num_passes=2, topc=0))
        != np.asarray(xj.refine(params, logits, h, a, num_passes=2, topc=0))
    )


def test_topc_equals_full_vocab_when_c_is_v(small_cfg):
    params = make_head(small_cfg)
    x = make_inputs(small_cfg, 4)
    V = small_cfg.vocab_size
    np.testing.assert_array_equal(
        np.asarray(refine_jit(params, *x, num_passes=4, topc=V)), np.asarray(refine_jit(params, *x, num_passes=4, topc=0))
    )


def test_topc_never_leaves_the_candidate_set(small_cfg):
    params = make_head(small_cfg)
    logits, h, a, p = make_inputs(small_cfg, 4)
    C = 5
    out = np.asarray(refine_jit(params, logits, h, a, p, num_passes=4, topc=C))
    top = np.argsort(-np.asarray(logits[:, 1:]), axis=-1, kind="stable")[..., :C]
    assert np.all((top == out[..., None]).any(-1))
    full = np.asarray(refine_jit(params, logits, h, a, p, num_passes=4, topc=0))
    assert np.any(out != full)  # with C=5 the exact decode leaves the set somewhere


# ---------------------------------------------------------------- tie rules
def _tie_case(dtype):
    """base ties at ids 3 and 9 once the sum is rounded to dtype; a float32 comparison would pick 9."""
    V, r = 16, 4
    base = np.full((1, V), -4.0, np.float32)
    base[0, [3, 9]] = 1.0
    w2 = np.zeros((V, r), np.float32)
    lat = np.zeros((1, r), np.float32)
    lat[0, 0] = 1.0
    if dtype == jnp.bfloat16:
        w2[9, 0] = 2.0**-9  # 1 + 2^-9 rounds to 1.0 in bf16 (ulp 2^-7)
    return jnp.asarray(base, dtype), jnp.asarray(lat, dtype), jnp.asarray(w2, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_full_vocab_tie_goes_to_lowest_id_after_rounding(dtype):
    base, lat, w2 = _tie_case(dtype)
    assert int(R.full_vocab_pick(base, lat, w2)[0]) == 3
    if dtype == jnp.bfloat16:  # the unrounded float32 sum is not tied: the rounding is what decides
        s32 = base.astype(jnp.float32) + lat.astype(jnp.float32) @ w2.astype(jnp.float32).T
        assert int(jnp.argmax(s32[0])) == 9


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_topc_equal_scores_and_base_go_to_lowest_vocab_id_not_position(dtype):
    base, lat, w2 = _tie_case(dtype)
    cand = jnp.array([[9, 0, 3, 5]], jnp.int32)  # tied ids, higher one first
    base_c = jnp.take_along_axis(base, cand, axis=1)
    pick = R.topc_pick(base_c, cand, lat, R.topc_gather(w2, cand))
    assert int(pick[0]) == 3


def test_candidate_membership_ties_at_the_cth_value():
    V = 50
    row = np.zeros(V, np.float32)
    row[[40, 45]] = 5.0  # clear winners
    row[[7, 12, 30, 33, 49]] = 2.0  # five-way tie for the last two places
    cand, base_c, am = R.select_candidates(jnp.asarray(row[None]), 4)
    assert sorted(np.asarray(cand[0]).tolist()) == [7, 12, 40, 45]
    assert sorted(np.asarray(base_c[0]).tolist()) == [2.0, 2.0, 5.0, 5.0]
    assert int(am[0]) == 40


def test_refine_topc_tie_at_the_boundary_end_to_end(small_cfg):
    # All base logits equal: the candidate set must be ids 0..C-1 whatever the bias is.
    params = make_head(small_cfg)
    _, h, a, p = make_inputs(small_cfg, 3)
    logits = jnp.zeros((3, small_cfg.block_size, small_cfg.vocab_size), jnp.float32)
    out = np.asarray(refine_jit(params, logits, h, a, p, num_passes=3, topc=6))
    assert out.min() >= 0 and out.max() < 6


# ---------------------------------------------------------------- non-finite and invalid ids
def test_nan_counts_as_minus_inf_and_inf_wins(small_cfg):
    params = make_head(small_cfg)
    logits, h, a, p = make_inputs(small_cfg, 2)
    V = small_cfg.vocab_size
    ref = np.asarray(xj.refine(params, logits, h, a, p, num_passes=1, topc=0))
    lg = np.array(logits)
    lg[0, 1, ref[0, 0]] = np.nan  # the winner of slot 1 becomes NaN: it must lose now
    lg[1, 2, 17] = np.inf  # +inf wins slot 2 of row 1 whatever the bias
    lg[1, 3, :] = np.nan  # a row with nothing above -inf picks id 0
    for topc in (0, 9):
        out = np.asarray(xj.refine(params, jnp.asarray(lg), h, a, p, num_passes=1, topc=topc))
        assert out[0, 0] != ref[0, 0]
        assert out[1, 1] == 17
        assert out[1, 2] == 0
        assert np.all((out >= 0) & (out < V))


def test_out_of_range_ids_raise_when_concrete(small_cfg):
    params = make_head(small_cfg)
    logits, h, a, p = make_inputs(small_cfg, 3)
    V = small_cfg.vocab_size
    with pytest.raises(ValueError, match="anchors"):
        xj.refine(params, logits, h, a.at[1].set(V), p, num_passes=1, topc=0)
    with pytest.raises(ValueError, match="prev_ids"):
        xj.refine(params, logits, h, a, p.at[0].set(-3), num_passes=1, topc=0)


def test_out_of_range_ids_under_jit_give_the_sentinel(small_cfg):
    params = make_head(small_cfg)
    logits, h, a, p = make_inputs(small_cfg, 4)
    V = small_cfg.vocab_size
    for topc in (0, 11):
        good = np.asarray(refine_jit(params, logits, h, a, p, num_passes=3, topc=topc))
        bad_a = a.at[1].set(-1).at[2].set(V + 5)
        bad_p = p.at[3].set(2**30)
        out = np.asarray(refine_jit(params, logits, h, bad_a, bad_p, num_passes=3, topc=topc))
        assert np.all(out[1:] == xj.INVALID_TOKEN)
        np.testing.assert_array_equal(out[0], good[0])  # other rows are unaffected


@pytest.mark.slow
def test_int64_ids_are_range_checked_before_narrowing(small_cfg):
    """Under x64, 2**32 + id wraps to id in int32: it must still be an invalid row (and raise when concrete)."""
    params = make_head(small_cfg)
    logits, h, a, p = make_inputs(small_cfg, 3)
    with jax.enable_x64(True):
        good = np.asarray(refine_jit(params, logits, h, a, p, num_passes=2, topc=0))
        a64, p64 = np.asarray(a).astype(np.int64), np.asarray(p).astype(np.int64)
        bad_a = a64.copy(); bad_a[1] += 2**32
        bad_p = p64.copy(); bad_p[2] -= 2**32
        out = np.asarray(refine_jit(params, logits, h, jnp.asarray(bad_a), jnp.asarray(bad_p), num_passes=2, topc=0))
        assert np.all(out[1:] == xj.INVALID_TOKEN)
        np.testing.assert_array_equal(out[0], good[0])
        with pytest.raises(ValueError, match="anchors"):
            xj.refine(params, logits, h, jnp.asarray(bad_a), jnp.asarray(p64), num_passes=1, topc=0)


# ---------------------------------------------------------------- jit
@pytest.mark.slow
def test_jit_matches_eager_and_does_not_retrace(small_cfg):
    params = make_head(small_cfg)
    x1 = make_inputs(small_cfg, 3, seed=1)
    x2 = make_inputs(small_cfg, 3, seed=2)
    for topc in (0, 7):
        kw = dict(num_passes=4, topc=topc, config=small_cfg)
        np.testing.assert_array_equal(np.asarray(refine_jit(params, *x1, **kw)), np.asarray(xj.refine(params, *x1, **kw)))
        params2 = jax.tree.map(lambda w: w * 1.5, params)
        with jax.no_tracing():  # new values, same shapes: no retrace (weights are arguments)
            out2 = refine_jit(params2, *x2, **kw)
        np.testing.assert_array_equal(np.asarray(out2), np.asarray(xj.refine(params2, *x2, **kw)))


@pytest.mark.slow
def test_bf16_refine_runs_and_returns_int32(small_cfg):
    params = make_head(small_cfg, dtype=jnp.bfloat16)
    x = make_inputs(small_cfg, 2, dtype=jnp.bfloat16)
    for topc in (0, 5):
        out = refine_jit(params, *x, num_passes=2, topc=topc)
        assert out.dtype == jnp.int32 and out.shape == (2, small_cfg.block_size - 1)


@pytest.mark.slow
def test_refine_server_pads_masks_and_never_retraces(small_cfg):
    params = make_head(small_cfg)
    head = xj.Head(small_cfg, params)
    server = xj.RefineServer(head, buckets=(2, 4), num_passes=3, topc=0, progress=False)
    x = make_inputs(small_cfg, 4, seed=1)
    for n in (1, 3, 4):
        ref = np.asarray(xj.refine(params, *[a[:n] for a in x], num_passes=3, topc=0, config=small_cfg))
        with jax.no_tracing():  # a bucket-sized buffer with n real rows: no trace at all
            masked = np.asarray(server(*x, num_valid=n))
            host = server.tokens(*[np.asarray(a[:n]) for a in x])  # numpy of any N: padded on the host
        np.testing.assert_array_equal(masked[:n], ref)
        assert np.all(masked[n:] == xj.INVALID_TOKEN)
        np.testing.assert_array_equal(host, ref)
    with pytest.raises(ValueError, match="N=5"):
        server.bucket_for(5)

@pytest.mark.parametrize("name", ["topc", "num_passes"])
def test_traced_static_argument_names_static_argnames(small_cfg, name):
    """jax.jit(xj.refine) without static names traces topc / num_passes: the error says how to jit it."""
    params = make_head(small_cfg, seed=0)
    logits, h, anchors, _ = make_inputs(small_cfg, 2, seed=0)
    f = jax.jit(lambda v: xj.refine(params, logits, h, anchors, config=small_cfg, backend="xla", **{name: v}))
    with pytest.raises(TypeError, match=rf"{name} must be a static int.*static_argnames=xj\.STATIC_ARGNAMES"):
        f(1)
    with pytest.raises(TypeError, match="STATIC_ARGNAMES"):  # as a user would write it
        jax.jit(xj.refine)(xj.Head(small_cfg, params), logits, h, anchors, **{name: 1})
