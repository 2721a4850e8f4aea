"""The fast XLA top-C steps (`xpress_jax.xla_ops`) against their references (`xpress_jax.reference`), and the XLA
refine against the all-reference one.

The selection must return the reference's candidates exactly (the same set, the same values, the same argmax;
``method="top_k"`` also their order), in every dtype; the passes use the reference's arithmetic on the same
candidates, so the tokens are equal (no reassociation to excuse: near ties are counted, and must be none)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax import reference as R
from xpress_jax import xla_ops as X
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

from conftest import make_head, make_inputs, near_tie_rows

slow = pytest.mark.slow
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float64": jnp.float64}


def mixed_rows(v: int, c: int, seed: int) -> np.ndarray:
    """[12, V] float64 rows (cast by the caller) for every rule: ties at the C-th place, NaN, +-inf, +-0."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((12, v)) * 2
    x[1] = np.round(x[1])  # few distinct values: a tie class straddles the C-th place
    x[2] = 1.5  # all equal: ids 0..C-1, argmax 0
    x[3] = np.where(np.arange(v) % 3 == 0, -0.0, 0.0)  # -0.0 ranks below +0.0; argmax 0 (a -0.0)
    x[4][rng.random(v) < 0.3] = np.nan
    x[4][rng.random(v) < 0.2] = -np.inf
    x[5] = np.nan  # all NaN: all -inf, argmax 0
    x[6] = np.where(rng.random(v) < 0.5, -np.inf, np.nan)
    x[6, v - 1] = -3.0  # one finite value, in the last (padded) group
    x[7, 5] = x[7, v - 2] = np.inf  # +inf wins, lowest id
    # The C-th place inside a tie class scattered over many groups: C - 3 values above, then copies of 1.0.
    x[8] = -rng.random(v)
    above = max(c - 3, 0)
    top = rng.choice(v, min(above + 11, v), replace=False)
    x[8, top[:above]] = 2.0 + rng.random(above)
    x[8, top[above:]] = 1.0
    # More +0.0 than C (C = 1): the argmax (values compared, -0.0 == +0.0) is the -0.0 at id 0, no candidate.
    x[9] = np.where(rng.random(v) < 0.5, -0.0, 0.0)
    x[9, 0] = -0.0
    x[10] = np.sort(x[10])  # ascending: the best values in the last groups
    x[11, ::4] += 6.0  # one residue class above the rest
    return x


def check_select(base, c, method, **kw):
    """The fast selection equals the reference's: the argmax, and the candidates with their values (bit for bit;
    in the reference's order for top_k, in ascending id order for threshold)."""
    want = [np.asarray(a) for a in R.select_candidates(base, c)]
    cand, vals, start = (np.asarray(a) for a in jax.jit(functools.partial(
        X.select_candidates, c=c, method=method, **kw))(base))
    np.testing.assert_array_equal(start, want[2])
    if method == "threshold":
        order = np.argsort(want[0], axis=1)
        want[0], want[1] = (np.take_along_axis(a, order, axis=1) for a in want[:2])
    np.testing.assert_array_equal(cand, want[0])
    np.testing.assert_array_equal(vals.view(np.uint8), want[1].view(np.uint8))  # -0.0 and +0.0 told apart


# Odd V with a padded last group (611 = 152 * 4 + 3: g = 4), C = 1 (g = 16), C = V (one stage).
SHAPES = [(611, 37), (257, 1), (97, 97)]


@pytest.mark.parametrize("method", X.METHODS)
@pytest.mark.parametrize("dtype", [
    "bfloat16", pytest.param("float32", marks=slow), pytest.param("float64", marks=slow)])
def test_select_equals_reference(dtype, method):
    with jax.enable_x64(dtype == "float64"):
        for i, (v, c) in enumerate(SHAPES):
            base = jnp.asarray(mixed_rows(v, c, seed=i), DTYPES[dtype])
            check_select(base, c, method)


@slow
@pytest.mark.parametrize("radix_bits", [1, 2])
def test_threshold_radix(radix_bits):
    """The bit search a bit or two at a time (4, the default, above) finds the same threshold; float32 keys."""
    base = jnp.asarray(mixed_rows(611, 37, seed=7), jnp.float32)
    check_select(base, 37, "threshold", radix_bits=radix_bits)


@pytest.mark.slow
def test_threshold_long_rows():
    """C = V = 33000: one stage over rows longer than 2^15 (two prefix counts instead of one packed)."""
    x = np.round(np.random.default_rng(9).standard_normal((2, 33000)) * 8)
    x[1, ::7] = np.nan
    check_select(jnp.asarray(x, jnp.bfloat16), 33000, "threshold")


@slow
def test_float16_keys():
    base = jnp.asarray(mixed_rows(300, 20, seed=8), jnp.float16)
    for method in X.METHODS:
        check_select(base, 20, method)


def test_order_keys_round_trip_and_order():
    """`order_key` orders every value as ``lax.top_k`` does (-0.0 below +0.0) and `key_value` inverts it."""
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        fi = jnp.finfo(dtype)
        big, sub = float(fi.max), float(fi.smallest_subnormal)
        x = jnp.asarray([-np.inf, -big, -1.5, -sub, -0.0, 0.0, sub, 2.0, big, np.inf], dtype)
        k = np.asarray(X.order_key(x))
        assert np.all(np.diff(k.astype(np.int64)) >= 0) and k[4] == -1 and k[5] == 0
        assert k.dtype.itemsize == jnp.dtype(dtype).itemsize and k.min() > np.iinfo(k.dtype).min
        np.testing.assert_array_equal(np.asarray(X.key_value(jnp.asarray(k), dtype)).view(np.uint8),
                                      np.asarray(x).view(np.uint8))


def test_group_sizes():
    """g balances the group maxima against the gathered elements; one stage where C is a large part of V."""
    assert X.group_size(151936, 512) == 16 and X.group_size(4099, 64) == 8
    assert X.group_size(611, 37) == 4 and X.group_size(97, 97) == 1 and X.group_size(64, 32) == 1
    for v, c in [(151936, 512), (151936, 1), (4099, 64), (1000, 200), (5, 5), (70, 17)]:
        g = X.group_size(v, c)
        assert g == 1 or -(-v // g) >= c


def test_invalid_arguments():
    base = jnp.zeros((2, 10), jnp.float32)
    with pytest.raises(ValueError, match="method"):
        X.select_candidates(base, 3, method="sort")
    with pytest.raises(ValueError, match="radix_bits"):
        X.select_candidates(base, 3, method="threshold", radix_bits=3)
    with pytest.raises(ValueError, match="c must be"):
        X.select_candidates(base, 11)


def test_steps_name_their_references():
    assert X.STEPS["select"].reference is R.select_candidates
    assert X.STEPS["topc_prepare"].reference is R.topc_gather
    assert Ops.xla("cpu").select is not Ops.xla("cpu", reference=True).select
    assert Ops.xla("gpu").name == "xla" and Ops.xla("gpu", reference=True).name == "xla-reference"


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=slow)])
def test_pick_does_not_depend_on_the_candidates_order(dtype):
    """The threshold selection's ascending-id order scores the same dots as the reference's order: the same
    picks (near ties counted: none may differ)."""
    base, lat, w2 = (jnp.asarray(a, DTYPES[dtype]) for a in (
        np.round(np.random.default_rng(3).standard_normal((45, 611)) * 4) / 4,  # many equal base logits
        np.random.default_rng(4).standard_normal((45, 24)), np.random.default_rng(5).standard_normal((611, 24)) / 4))
    cand, base_c, _ = R.select_candidates(base, 37)
    want = np.asarray(jax.jit(lambda *a: R.topc_pick(*a, R.topc_gather(w2, a[1])))(base_c, cand, lat))

    @jax.jit
    def fast(base, lat, w2):
        fc, fb, _ = X.select_candidates(base, 37, method="threshold")
        return X.topc_pick(fb, fc, lat, X.topc_prepare(w2, fc))

    got = np.asarray(fast(base, lat, w2))
    near = near_tie_rows(base_c, lat, w2, want, cand=cand)
    differ = np.nonzero(got != want)[0]
    assert set(differ) <= set(np.nonzero(near)[0]), f"rows {differ} differ, near ties {np.nonzero(near)[0]}"
    assert differ.size == 0, f"{differ.size} near-tie rows differ: {differ}"


CFG = xj.HeadConfig(vocab_size=611, hidden_size=40, block_size=6, rank=24, mlp_hidden=32, topc=37, max_num_reqs=8)
run = jax.jit(refine_with, static_argnums=0, static_argnames=("num_passes", "topc", "proposal"))


@pytest.mark.parametrize("platform,dtype", [
    pytest.param("cpu", "bfloat16", marks=slow), pytest.param("gpu", "bfloat16", marks=slow),
    pytest.param("cpu", "float32", marks=slow),
    pytest.param("gpu", "float32", marks=slow)])
def test_refine_tokens_equal_reference(platform, dtype):
    """The whole top-C refine: `Ops.xla` (on "gpu": the threshold selection) vs every step the reference's."""
    params = make_head(CFG, dtype=DTYPES[dtype])
    x = make_inputs(CFG, 3, seed=11, dtype=DTYPES[dtype], logit_std=2.0)
    want = np.asarray(run(Ops.xla(platform, reference=True), params, *x, num_passes=4, topc=37))
    got = np.asarray(run(Ops.xla(platform), params, *x, num_passes=4, topc=37))
    np.testing.assert_array_equal(got, want)
    assert np.mean(want != np.asarray(jnp.argmax(x[0][:, 1:], -1))) > 0.2  # the passes changed the draft


@slow
def test_sampled_refine_and_proposal_equal_reference():
    """Sampled top-C with the proposal's scores: the same tokens; the candidates (ids and scores) the same up to
    their order (ascending ids with the threshold selection), the log-normalizer up to its summation order."""
    params = make_head(CFG, dtype=jnp.bfloat16)
    x = make_inputs(CFG, 3, seed=12, dtype=jnp.bfloat16)
    kw = dict(num_passes=3, topc=37, temperature=0.8, key=jax.random.key(2), proposal="scores")
    tok0, p0 = run(Ops.xla("gpu", reference=True), params, *x, **kw)
    tok1, p1 = run(Ops.xla("gpu"), params, *x, **kw)
    np.testing.assert_array_equal(tok1, tok0)
    np.testing.assert_array_equal(p1.token_score, p0.token_score)
    np.testing.assert_allclose(p1.lse, p0.lse, rtol=1e-6)  # a sum over the candidates: their order may round it
    o0, o1 = np.argsort(p0.ids, -1), np.argsort(p1.ids, -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(p1.ids), o1, -1),
                                  np.take_along_axis(np.asarray(p0.ids), o0, -1))
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(p1.scores), o1, -1),
                                  np.take_along_axis(np.asarray(p0.scores), o0, -1))
