"""Token parity with a PyTorch spelling of the reference head (float64 and float32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xpress_jax as xj  # noqa: E402
from xpress_jax.convert.torch_reference import reference_refine  # noqa: E402
from xpress_jax.params import source_shapes  # noqa: E402

from helpers import SMALL  # noqa: E402


def _source(cfg, seed, std=0.25):
    rng = np.random.default_rng(seed)
    t = {k: rng.normal(0, std, size=s) for k, s in source_shapes(cfg).items()}
    t["mix.L"] = rng.normal(0, 0.5, size=t["mix.L"].shape)  # raw: upper triangle non-zero too
    return t


def _inputs(cfg, n, seed):
    rng = np.random.default_rng(seed + 100)
    B, V, H = cfg.block_size, cfg.vocab_size, cfg.hidden_size
    return (rng.normal(size=(n, B, V)), rng.normal(size=(n, B, H)),
            rng.integers(0, V, n), rng.integers(0, V, n))


# Each dtype, (N, K) and mode once in the default suite; the whole grid under `slow` (CI runs it where torch is).
FAST = {("float64", 1, 1, 0), ("float32", 3, 4, 29), ("float64", 8, 9, 29)}


@pytest.mark.parametrize("dtype,n,K,topc", [
    pytest.param(dt, n, K, c, id=f"{c}-{n}-{K}-{dt}", marks=() if (dt, n, K, c) in FAST else pytest.mark.slow)
    for c in (0, 29) for n, K in ((1, 1), (3, 4), (8, 9)) for dt in ("float64", "float32")])
def test_tokens_match_the_pytorch_reference(dtype, n, K, topc):
    cfg = xj.HeadConfig(**SMALL)
    src = {k: v.astype(dtype) for k, v in _source(cfg, seed=n * 7 + K).items()}
    logits, h, a, p = _inputs(cfg, n, seed=n + K)
    logits, h = logits.astype(dtype), h.astype(dtype)
    tdtype = getattr(torch, dtype)
    want = reference_refine(src, logits, h, a, p, num_passes=K, topc=topc, dtype=tdtype)
    with jax.enable_x64(dtype == "float64"):
        params = xj.params_from_state_dict(src, cfg)
        got = xj.refine(params, jnp.asarray(logits), jnp.asarray(h), jnp.asarray(a, jnp.int32),
                        jnp.asarray(p, jnp.int32), num_passes=K, topc=topc, backend="xla")
        got = np.asarray(got)
    drafter = np.argmax(logits[:, 1:], axis=-1)
    assert np.mean(want != drafter) > 0.3, "refinement barely changes tokens: the comparison would be weak"
    np.testing.assert_array_equal(got, want)
