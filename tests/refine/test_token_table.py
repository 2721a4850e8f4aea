"""The prepared token table (`xpress_jax.token_table`, `refine(..., token_table=...)`).

The claim: ``table[prev]`` is ``w1[prev] @ in_proj_token``, the same products summed in the same
dtype, so refine gives the same tokens with the table as without it. Checked three ways: the table
against a float64 numpy product; latents bit for bit where every partial sum is exact (dyadic weights:
no summation order can change them); tokens on random heads for every mode. A table from other
weights must change the tokens (the table is really read).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax.head import TOKEN_TABLE, hidden_input, latent

from helpers import make_head, make_inputs

refine_jit = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)

# Odd V and B, a rank that is not a power of two.
CFG = xj.HeadConfig(vocab_size=301, hidden_size=40, block_size=7, rank=20, mlp_hidden=24, topc=11,
                    num_passes=6, max_num_reqs=16)


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16, jnp.float16])
def test_table_is_the_product_in_the_accumulation_dtype(dtype):
    params = make_head(CFG, seed=1, dtype=dtype)
    table = xj.token_table(params)
    assert table.shape == (CFG.vocab_size, CFG.rank) and table.dtype == jnp.float32
    want = np.asarray(params["w1"], np.float64) @ np.asarray(params["in_proj_token"], np.float64)
    np.testing.assert_allclose(np.asarray(table, np.float64), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(xj.token_table(xj.Head(CFG, params))), np.asarray(table))


@pytest.mark.slow
def test_table_in_float64():
    with jax.enable_x64(True):
        params = make_head(CFG, seed=2, dtype=jnp.float64)
        table = xj.token_table(params)
        assert table.dtype == jnp.float64
        want = np.asarray(params["w1"]) @ np.asarray(params["in_proj_token"])
        np.testing.assert_allclose(np.asarray(table), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_latent_bit_for_bit_where_every_sum_is_exact(dtype):
    """Dyadic w1 and in_proj_token: every partial sum of a table row is exact in float32 in any order,
    so the latents with and without the table must agree bit for bit (in every later step too)."""
    params = dict(make_head(CFG, seed=3, dtype=dtype))
    rng = np.random.default_rng(3)
    for k in ("w1", "in_proj_token"):
        params[k] = jnp.asarray(rng.integers(-4, 5, params[k].shape) / 16, dtype)
    logits, h, anchors, prev = make_inputs(CFG, 5, seed=4, dtype=dtype)
    xh = hidden_input(params, h)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (5, CFG.block_size)), jnp.int32)
    want = latent(params, xh, ids)
    got = latent({**params, TOKEN_TABLE: xj.token_table(params)}, xh, ids)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    out = xj.refine(params, logits, h, anchors, prev, config=CFG, backend="xla", token_table=xj.token_table(params))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(xj.refine(params, logits, h, anchors, prev, config=CFG,
                                                                         backend="xla")))


# C = 1, a middle C, C = V and full vocab; the exact modes; early exit; jit.
MODES = [dict(topc=0), dict(topc=1), dict(topc=11), dict(topc=301), dict(topc=0, full_vocab="certified"),
         dict(topc=11, early_exit=True)]


@pytest.mark.slow  # the default suite: the refine above, same tokens with and without the table
@pytest.mark.parametrize("mode,dtype", [
    pytest.param(m, dt, id="-".join(f"{k}={v}" for k, v in m.items()) + f"-{jnp.dtype(dt).name}")
    for m in MODES for dt in (jnp.float32, jnp.bfloat16)])
def test_same_tokens_with_the_table(mode, dtype):
    params = make_head(CFG, seed=5, dtype=dtype, std=0.5)
    logits, h, anchors, prev = make_inputs(CFG, 9, seed=6, dtype=dtype)
    table = xj.token_table(params)
    want = np.asarray(xj.refine(params, logits, h, anchors, prev, config=CFG, backend="xla", **mode))
    got = refine_jit(params, logits, h, anchors, prev, config=CFG, backend="xla", token_table=table, **mode)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.interpret_refine
@pytest.mark.parametrize("topc", [0, pytest.param(11, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_same_tokens_with_the_table_pallas_interpret(topc):
    params = make_head(CFG, seed=7, std=0.5)
    logits, h, anchors, prev = make_inputs(CFG, 4, seed=8)
    kw = dict(config=CFG, topc=topc, backend="pallas", interpret=True)
    want = np.asarray(xj.refine(params, logits, h, anchors, prev, **kw))
    got = xj.refine(params, logits, h, anchors, prev, token_table=xj.token_table(params), **kw)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.slow
def test_the_table_is_read():
    """A table from other weights changes the tokens: refine uses the table it is given (which is why it
    must come from the very weights passed)."""
    params = make_head(CFG, seed=9, std=1.0)
    other = make_head(CFG, seed=10, std=1.0)
    logits, h, anchors, prev = make_inputs(CFG, 9, seed=11, logit_std=0.1)
    want = np.asarray(xj.refine(params, logits, h, anchors, prev, config=CFG, topc=0, backend="xla"))
    wrong = np.asarray(xj.refine(params, logits, h, anchors, prev, config=CFG, topc=0, backend="xla",
                                 token_table=xj.token_table(other)))
    assert (wrong != want).mean() > 0.2


def test_bad_tables_are_refused():
    params = make_head(CFG, seed=12)
    logits, h, anchors, prev = make_inputs(CFG, 2, seed=13)
    call = lambda t: xj.refine(params, logits, h, anchors, prev, config=CFG, backend="xla", token_table=t)
    table = xj.token_table(params)
    with pytest.raises(ValueError, match=r"token_table must be xpress_jax.token_table\(params\): shape \(301, 20\)"):
        call(table[:-1])
    with pytest.raises(ValueError, match="dtype float32; got shape .* dtype bfloat16"):
        call(table.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="token_table must be an array"):
        call([[0.0] * 20] * 301)


@pytest.mark.parametrize("rows_n", [(1, True), (274, True), (275, False)])  # B=8: 7 rows a block; 274*7 = 1918
def test_with_a_table_the_latent_is_xlas_up_to_the_dispatch_bound(rows_n, monkeypatch):
    """The entries' ``table_latent``: with a table, the Pallas ops run XLA's latent (which reads the
    table) up to that many draft rows, the Pallas latent kernel above it; without a table, the plan decides
    (in interpret mode: the kernel everywhere)."""
    from xpress_jax import dispatch, reference
    from xpress_jax.kernels import latent as latent_kernel
    from xpress_jax.ops import Ops

    n, xla = rows_n
    # at B=8: 274 blocks = 1918 rows <= 1920 < 275 blocks
    assert dispatch.TABLE.entry(1920).switches.table_latent and not dispatch.TABLE.entry(1921).switches.table_latent
    cfg = xj.HeadConfig(vocab_size=64, hidden_size=16, block_size=8, rank=8, mlp_hidden=8, topc=4, num_passes=2)
    params = make_head(cfg, seed=14)
    calls = []
    monkeypatch.setattr(latent_kernel, "latent_pass", lambda *a, **k: calls.append("kernel") or "kernel")
    monkeypatch.setattr(reference, "latent_pass", lambda *a, **k: calls.append("xla") or "xla")
    xh = jnp.zeros((n, 8, 8), jnp.float32)
    blk = jnp.zeros((n, 8), jnp.int32)
    ops = Ops.pallas(interpret=True)
    ops.latent({**params, TOKEN_TABLE: xj.token_table(params)}, xh, blk, blk[:, 0])
    ops.latent(params, xh, blk, blk[:, 0])
    assert calls == ["xla" if xla else "kernel", "kernel"]
