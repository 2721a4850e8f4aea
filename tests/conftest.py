"""Shared fixtures: small heads and inputs for CPU tests."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

# Small enough for 2 CPU cores, large enough that refinement changes most draft tokens.
SMALL = dict(vocab_size=611, hidden_size=48, block_size=8, rank=24, mlp_hidden=40, topc=37, max_num_reqs=8)


def make_head(cfg: xj.HeadConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.25):
    return xj.init_params(cfg, jax.random.key(seed), dtype=dtype, std=std, mix_std=0.5)


def make_inputs(cfg: xj.HeadConfig, n: int, seed: int = 1, dtype=jnp.float32, logit_std: float = 1.0):
    """Random drafter outputs: logits [N,B,V], h [N,B,H], anchors [N], prev_ids [N]."""
    k = jax.random.split(jax.random.key(seed), 4)
    B, V, H = cfg.block_size, cfg.vocab_size, cfg.hidden_size
    logits = (jax.random.normal(k[0], (n, B, V), jnp.float32) * logit_std).astype(dtype)
    h = jax.random.normal(k[1], (n, B, H), jnp.float32).astype(dtype)
    anchors = jax.random.randint(k[2], (n,), 0, V, jnp.int32)
    prev = jax.random.randint(k[3], (n,), 0, V, jnp.int32)
    return logits, h, anchors, prev


@pytest.fixture
def small_cfg():
    return xj.HeadConfig(**SMALL)


def sequential_greedy(params, logits, h, anchors, prev_ids):
    """Oracle for Jacobi exactness: decode the draft slot by slot, each pick seeing the final earlier slots."""
    from xpress_jax.head import hidden_input, latent
    from xpress_jax.refine import _JnpOps

    N, B, V = logits.shape
    xh = hidden_input(params, h)
    blk = np.zeros((N, B), np.int32)
    blk[:, 0] = np.asarray(anchors)
    for b in range(1, B):
        prev = jnp.concatenate([prev_ids[:, None].astype(jnp.int32), jnp.asarray(blk[:, :-1])], axis=1)
        lat = latent(params, xh, prev)  # [N, B-1, r]
        blk[:, b] = np.asarray(_JnpOps.full_vocab_pick(logits[:, b], lat[:, b - 1], params["w2"]))
    return blk[:, 1:]
