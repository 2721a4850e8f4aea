"""The top-C tie rule equals vLLM's spelling: candidates sorted by base logit, first position wins.

vLLM takes each slot's candidates from ``torch.topk(..., sorted=True)`` (largest base logit
first; lowest vocab id first among equal logits, as a stable sort gives) and picks the first
candidate position holding the largest rounded score. `refine` spells the same rule without
depending on the candidates' order (the selection kernel does not sort them): the largest
score, then the larger base logit, then the lowest vocab id.

Here both spellings run on inputs where every dot product is exact in any summation order
("dyadic" values), with base logits on a coarse grid so that tied rounded scores with
different base logits are common. The spelling below is independent of the code under test:
numpy, a stable sort, float64 arithmetic (exact here) and ml_dtypes rounding.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from xpress_jax import dispatch
from xpress_jax.kernels import select, topc_pick
from xpress_jax import reference as R

DTYPES = {"float32": (jnp.float32, np.float32), "bfloat16": (jnp.bfloat16, ml_dtypes.bfloat16)}


def _dyadic(rows, vocab, rank, seed, dtype):
    """base on a grid of 1/4 (many equal logits), lat in {-1,0,1}/2, w2 in {-1,0,1}/4: every bias is a
    multiple of 1/8, exact in any summation order, so equal scores from different base logits are common."""
    rng = np.random.default_rng(seed)
    base = rng.integers(-12, 13, (rows, vocab)) / 4
    lat = rng.integers(-1, 2, (rows, rank)) / 2
    w2 = rng.integers(-1, 2, (vocab, rank)) / 4
    return tuple(jnp.asarray(a, dtype) for a in (base, lat, w2))


def sorted_first_position(base, lat, w2, c, np_dtype):
    """vLLM's rule, spelled as it computes it: sorted candidates, first position of the max."""
    b = np.asarray(base.astype(jnp.float32), np.float64)
    b = np.where(np.isnan(b), -np.inf, b)
    order = np.argsort(-b, axis=1, kind="stable")[:, :c]  # largest first, lowest id first on ties
    base_c = np.take_along_axis(b, order, axis=1)
    bias = np.einsum("nr,ncr->nc", np.asarray(lat.astype(jnp.float32), np.float64),
                     np.asarray(w2.astype(jnp.float32), np.float64)[order])  # exact (dyadic)
    bias = bias.astype(np_dtype).astype(np.float64)
    s = (base_c + bias).astype(np.float32).astype(np_dtype).astype(np.float64)
    return np.take_along_axis(order, np.argmax(s, axis=1)[:, None], axis=1)[:, 0]


def lowest_id_rule(base, lat, w2, c, np_dtype):
    """The rule refine used before (lowest vocab id among equal scores): to show the cases differ."""
    b = np.asarray(base.astype(jnp.float32), np.float64)
    order = np.argsort(-b, axis=1, kind="stable")[:, :c]
    bias = np.einsum("nr,ncr->nc", np.asarray(lat.astype(jnp.float32), np.float64),
                     np.asarray(w2.astype(jnp.float32), np.float64)[order]).astype(np_dtype).astype(np.float64)
    s = (np.take_along_axis(b, order, axis=1) + bias).astype(np.float32).astype(np_dtype).astype(np.float64)
    return np.where(s == s.max(1, keepdims=True), order, np.iinfo(np.int64).max).min(1)


@functools.lru_cache(maxsize=None)
def _case(dtype_name, rows, vocab, rank, c, seed):
    jdt, ndt = DTYPES[dtype_name]
    base, lat, w2 = _dyadic(rows, vocab, rank, seed, jdt)
    want = sorted_first_position(base, lat, w2, c, ndt)
    old = lowest_id_rule(base, lat, w2, c, ndt)
    return base, lat, w2, want, old


# rows = N*(B-1); C = 1 (no ties possible), a mid C, C = V (every id is a candidate).
CASES = [(45, 300, 16, 37), (30, 257, 8, 1), (15, 97, 24, 97)]


@pytest.mark.parametrize("rows,vocab,rank,c,dtype_name", [
    pytest.param(*case, dt, id=(name := "-".join(map(str, case + (dt,)))),
                 marks=() if name == "30-257-8-1-bfloat16" else pytest.mark.slow)
    for case in CASES for dt in DTYPES])
def test_jnp_rule_equals_sorted_first_position(dtype_name, rows, vocab, rank, c):
    base, lat, w2, want, old = _case(dtype_name, rows, vocab, rank, c, seed=rows + c)
    cand, base_c, _ = R.select_candidates(base, c)
    # The rule must not depend on the candidates' order: shuffle them.
    perm = np.random.default_rng(c).permutation(c)
    cand, base_c = cand[:, perm], base_c[:, perm]
    got = np.asarray(R.topc_pick(base_c, cand, lat, R.topc_gather(w2, cand)))
    np.testing.assert_array_equal(got, want)
    if c == 37:  # the case is discriminating: the lowest-id rule gives other tokens on some rows
        assert np.sum(old != want) >= 3, "no row where the tie rules differ: the test would be vacuous"


@pytest.mark.interpret
@pytest.mark.parametrize("rows,vocab,rank,c,dtype_name", [
    pytest.param(*case, dt, id=(name := "-".join(map(str, case + (dt,)))),
                 marks=() if name == "45-300-16-37-float32" else pytest.mark.slow)
    for case in CASES for dt in DTYPES])  # default run: one case; the rest `slow`
@pytest.mark.slow
def test_kernels_equal_sorted_first_position(dtype_name, rows, vocab, rank, c):
    """Selection kernel + top-C pick kernel with the configs serving uses (interpret mode)."""
    base, lat, w2, want, old = _case(dtype_name, rows, vocab, rank, c, seed=rows + c)
    cand, base_c, _ = select.select_candidates(base, c, interpret=True)
    cfg = dispatch.plan(rows, 2, vocab, rank, c, base.dtype).topc
    got = np.asarray(topc_pick.topc_pick(base_c, cand, lat, w2, config=cfg,
                                         interpret=True))
    np.testing.assert_array_equal(got, want)
    # Several splits, so the combine step's tie rule is exercised too (C = 37: 3 splits of 16).
    if c > 16:
        split = topc_pick.TopCConfig(c_tile=16, c_steps=1, k_tile=8)
        got = np.asarray(topc_pick.topc_pick(base_c, cand, lat, w2, config=split, interpret=True))
        np.testing.assert_array_equal(got, want)
