"""`XPressHead`, the NNX training form: its params, the fold identity, and refine-equality with the serving form."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import xpress_jax as xj
from xpress_jax.head import MODULE_PARAM_NAMES, hidden_input, latent
from xpress_jax.params import source_shapes

from helpers import SMALL, make_inputs

CFG = xj.HeadConfig(**SMALL)


def random_module(cfg=CFG, seed=0, dtype=jnp.float32, std=0.2):
    return xj.XPressHead(cfg, rngs=nnx.Rngs(seed), param_dtype=dtype, std=std)


@pytest.mark.slow
def test_params_are_the_checkpoint_names_in_pytorch_layouts():
    m = random_module()
    sd = m.state_dict()
    assert set(sd) == set(xj.HYBRID_KEY_MAP) and set(MODULE_PARAM_NAMES.values()) == set(xj.HYBRID_KEY_MAP)
    assert {k: tuple(v.shape) for k, v in sd.items()} == source_shapes(CFG)
    # The params NNX sees are exactly these arrays: nothing else is trained.
    _, params = nnx.split(m, nnx.Param)
    pure = nnx.to_pure_dict(params)
    assert set(pure) == set(MODULE_PARAM_NAMES)
    for attr, source in MODULE_PARAM_NAMES.items():
        np.testing.assert_array_equal(np.asarray(pure[attr]), np.asarray(sd[source]))
    # The training init leaves the drafter's tokens alone (w2 = 0) and mixes nothing (raw L = 0).
    fresh = xj.XPressHead(CFG, rngs=nnx.Rngs(0))
    raw = np.asarray(fresh.mix_L[...])
    upper = np.triu_indices(CFG.block_size, 1)
    assert not np.any(np.tril(raw)) and np.all(raw[:, upper[0], upper[1]] != 0)  # masked noise: reads as raw
    assert not np.any(np.asarray(fresh.w2[...]))
    logits, h, a, p = make_inputs(CFG, 3)
    np.testing.assert_array_equal(np.asarray(fresh.refine(logits, h, a, p, num_passes=2)),
                                  np.asarray(jnp.argmax(logits[:, 1:], axis=-1)))


@pytest.mark.slow
def test_fold_identity_module_latents_equal_serving_latents():
    """x + (raw_L*tril) x with whole in_proj (training) == Lf x with split in_proj (serving), float64."""
    with jax.enable_x64(True):
        m = random_module(dtype=jnp.float64, std=0.3)
        assert np.any(np.triu(np.asarray(m.mix_L[...]), 1))  # the upper triangle must be masked away
        head = m.to_serving()
        logits, h, a, p = make_inputs(CFG, 3, dtype=jnp.float64)
        blk = jnp.concatenate([a[:, None], jnp.argmax(logits[:, 1:], -1)], axis=1)
        prev = xj.XPressHead.prev_tokens(blk, p)
        train = np.asarray(m.latents(m.hidden_cache(h), prev)[:, 1:])
        serve = np.asarray(latent(head.params, hidden_input(head.params, h), prev))
        assert np.abs(train).mean() > 0.1
        np.testing.assert_allclose(serve, train, rtol=1e-12, atol=1e-12)
        folded = np.asarray(head.params["mix"]).transpose(2, 0, 1)
        raw = np.asarray(m.mix_L[...])
        np.testing.assert_array_equal(folded, raw * np.tril(np.ones(raw.shape[1:])) + np.eye(raw.shape[1]))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_serving_refine_gives_the_modules_tokens(dtype):
    with jax.enable_x64(dtype == "float64"):
        dt = jnp.dtype(dtype)
        m = random_module(dtype=dt, std=0.2)
        head = m.to_serving()
        assert head.dtype == dt
        logits, h, a, p = make_inputs(CFG, 6, dtype=dt)
        drafter = np.asarray(jnp.argmax(logits[:, 1:], axis=-1))
        for topc in (0, CFG.topc):
            for K in (1, CFG.block_size - 1):
                ours = np.asarray(m.refine(logits, h, a, p, num_passes=K, topc=topc))
                serving = np.asarray(xj.refine(head, logits, h, a, p, num_passes=K, topc=topc))
                np.testing.assert_array_equal(serving, ours, err_msg=f"{dtype} topc={topc} K={K}")
                if K == CFG.block_size - 1:
                    assert np.mean(ours != drafter) > 0.3  # the head really changes tokens: a real comparison


def test_module_jits_with_static_passes_and_does_not_retrace_on_new_weights():
    logits, h, a, p = make_inputs(CFG, 3)
    f = nnx.jit(xj.XPressHead.refine, static_argnames=("num_passes", "topc"))
    m1, m2 = random_module(seed=1), random_module(seed=2)
    out1 = f(m1, logits, h, a, p, num_passes=2, topc=5)
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(m1.refine(logits, h, a, p, num_passes=2, topc=5)))
    with jax.no_tracing():  # same shapes, new weights: the compiled function is reused
        out2 = f(m2, logits, h, a, p, num_passes=2, topc=5)
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(m2.refine(logits, h, a, p, num_passes=2, topc=5)))
    # The functional form: split once, merge inside jax.jit.
    graphdef, params = nnx.split(m1)
    g = jax.jit(lambda params, *x, K: nnx.merge(graphdef, params).refine(*x, num_passes=K), static_argnames="K")
    np.testing.assert_array_equal(np.asarray(g(params, logits, h, a, p, K=2)),
                                  np.asarray(m1.refine(logits, h, a, p, num_passes=2)))
    # A traced K is refused with the fix, not a tracer-conversion error.
    with pytest.raises(TypeError, match="static"):
        nnx.jit(lambda m, K: m.refine(logits, h, a, num_passes=K))(m1, 2)
    with pytest.raises(ValueError, match="num_passes"):
        m1.refine(logits, h, a, num_passes=-1)
    with pytest.raises(ValueError, match="topc"):
        m1.refine(logits, h, a, num_passes=1, topc=CFG.vocab_size + 1)


def test_to_serving_keeps_sizes_and_takes_c_and_k():
    m = random_module()
    head = m.to_serving(dataclasses.replace(CFG, topc=5, num_passes=2), dtype=jnp.bfloat16)
    assert head.config.topc == 5 and head.config.num_passes == 2 and head.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="rank=8"):
        m.to_serving(dataclasses.replace(CFG, rank=8))
    with pytest.raises(TypeError, match="HeadConfig"):
        xj.XPressHead({"vocab_size": 3}, rngs=nnx.Rngs(0))
