"""`round_to`: the roundings of the reference, kept where XLA may drop ``f32 -> bf16 -> f32`` pairs.

XLA on GPUs removes convert pairs by default (``xla_allow_excess_precision``), which flips near-tied
tokens of the XLA backend against exact arithmetic (docs/semantics.md); ``reduce_precision`` is kept.
These CPU tests check the values (round to nearest even, like a convert) and that every rounding of the
jnp path is spelled with ``reduce_precision`` in the lowered program, so a plain ``astype`` cannot creep back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax import reference as R

from helpers import SMALL, make_head, make_inputs


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_round_to_equals_round_to_nearest_even(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(20000).astype(np.float32) * rng.choice([1e-3, 1.0, 300.0], 20000).astype(np.float32)
    np_dt = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16
    # Exact halfway cases (ties to even), values past the largest finite, inf and NaN.
    grid = np.arange(-64, 64, dtype=np.float32).astype(np_dt).astype(np.float32)
    ulp = np.abs(np.spacing(grid.astype(np_dt))).astype(np.float32)
    halfway = grid + ulp / 2
    with np.errstate(over="ignore"):  # bfloat16's max * 1.5 is past float32's: inf, also a case
        big = np.float32(ml_dtypes.finfo(np_dt).max) * np.float32(1.5)
    tiny = float(ml_dtypes.finfo(np_dt).tiny)  # subnormals of the target (float16: below 2^-14)
    sub = rng.uniform(-tiny, tiny, 2000).astype(np.float32)
    x = np.concatenate([x, halfway, sub, [np.inf, -np.inf, np.nan, big, -big, 0.0, -0.0]]).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: xj.round_to(v, dtype))(jnp.asarray(x)))
    with np.errstate(over="ignore"):  # values past the largest finite round to inf
        want = x.astype(np_dt)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_round_to_same_dtype_is_identity():
    x = jnp.arange(5, dtype=jnp.float32)
    assert xj.round_to(x, jnp.float32) is x


def test_every_rounding_of_the_jnp_path_uses_reduce_precision():
    """bf16 head: hidden cache (hh, g, hg), xh, and per pass the latent's three roundings, the
    readout bias and the score sum are all spelled with reduce_precision."""
    cfg = xj.HeadConfig(**SMALL)
    params = make_head(cfg, dtype=jnp.bfloat16)
    logits, h, anchors, _ = make_inputs(cfg, 3, dtype=jnp.bfloat16)
    for topc in (0, 8):
        f = jax.jit(lambda p, l, hh, a: xj.refine(p, l, hh, a, num_passes=1, topc=topc, backend="xla"))
        n_rp = f.lower(params, logits, h, anchors).as_text().count("reduce_precision")
        # On a GPU the full-vocab readout dot writes bf16 itself (preferred_element_type: one rounding
        # of the float32 accumulator, which XLA cannot skip), so it needs no reduce_precision there.
        dot_rounds = topc == 0 and jax.default_backend() == "gpu"
        assert n_rp >= 4 + 5 - dot_rounds, (topc, n_rp)


def test_oracles_apply_both_roundings():
    """A pick decided by the two roundings of the reference. Base 8.1875 at ids 3 and 7; biases
    -0.093933 (id 3) and -0.083787 (id 7), each an exact float32 sum of two bf16 products.
    Rounded: -0.09375 / -0.083984; sums 8.09375 / 8.103516 both round to 8.125 -> tie -> id 3.
    Without the bias rounding, id 3's sum 8.093567 rounds to 8.0625 and id 7 would win."""
    V = 64
    exact = jnp.zeros((V,), jnp.float32).at[7].set(-0.083787).at[3].set(-0.093933)
    hi = exact.astype(jnp.bfloat16)
    lo = (exact - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    w2 = jnp.stack([hi, lo], axis=1)  # [V, 2]
    lat = jnp.ones((1, 2), jnp.bfloat16)
    base = jnp.full((1, V), -30.0, jnp.bfloat16).at[0, 7].set(8.1875).at[0, 3].set(8.1875)
    bias = np.asarray(w2.astype(jnp.float32).sum(1))  # exact: two terms

    def bf(v):
        return float(np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32))

    assert bf(8.1875 + bf(bias[7])) == bf(8.1875 + bf(bias[3])) == 8.125  # the tie, both roundings
    assert bf(8.1875 + bias[3]) == 8.0625  # without the bias rounding: no tie
    assert int(R.full_vocab_pick(base, lat, w2)[0]) == 3
    cand = jnp.asarray([[7, 3]], jnp.int32)
    base_c = base[:, jnp.asarray([7, 3])]
    assert int(R.topc_pick(base_c, cand, lat, R.topc_gather(w2, cand))[0]) == 3
