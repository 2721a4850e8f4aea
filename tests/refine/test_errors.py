"""Bad input is refused with an error naming the argument, before anything is traced or compiled; configs.

The arguments are numpy arrays of zeros (no value matters here), so that building a wrong one compiles nothing
either, and each refusal runs under `refused`: nothing traced, nothing compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax.params import VOCAB_MAP

from helpers import SMALL, serving


def zero_params(cfg: xj.HeadConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """Params of ``cfg``'s shapes, all zeros (``d2t`` int32), without a device op."""
    return {k: np.zeros(s, np.int32 if k == VOCAB_MAP else dtype) for k, s in xj.param_shapes(cfg).items()}


def zero_inputs(cfg: xj.HeadConfig, n: int):
    """(logits, h, anchors, prev_ids) of ``n`` blocks, zeros, as numpy arrays."""
    B, H = cfg.block_size, cfg.hidden_size
    ids = np.zeros((n,), np.int32)
    return np.zeros((n, B, cfg.draft_vocab_size), np.float32), np.zeros((n, B, H), np.float32), ids, ids.copy()


@contextlib.contextmanager
def refused(err, match):
    """``pytest.raises(err, match=match)``, the error raised before anything is traced (a trace raises
    RuntimeError here) or compiled."""
    with serving() as compiles:
        with pytest.raises(err, match=match):
            yield
    assert compiles() == 0


@pytest.fixture(scope="module")
def setup():
    cfg = xj.HeadConfig(**SMALL)
    return cfg, zero_params(cfg), zero_inputs(cfg, 3)


def test_config_validation():
    with pytest.raises(ValueError, match="vocab_size"):
        xj.HeadConfig(vocab_size=0, hidden_size=4)
    with pytest.raises(TypeError, match="block_size"):
        xj.HeadConfig(vocab_size=10, hidden_size=4, block_size=True)
    with pytest.raises(TypeError, match="rank"):
        xj.HeadConfig(vocab_size=10, hidden_size=4, rank="256")
    with pytest.raises(ValueError, match="block_size"):
        xj.HeadConfig(vocab_size=10, hidden_size=4, block_size=1)
    assert xj.HeadConfig(vocab_size=10, hidden_size=4, topc=11).topc == 10  # clamped: vLLM's min(topc, V)
    with pytest.raises(ValueError, match="topc"):
        xj.HeadConfig(vocab_size=10, hidden_size=4, topc=-1)
    with pytest.raises(ValueError, match="num_passes"):
        xj.HeadConfig(vocab_size=10, hidden_size=4, num_passes=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        xj.HeadConfig(vocab_size=10, hidden_size=4, topc=0).rank = 3


def test_from_hf_config_reads_vllm_fields():
    cfg = xj.HeadConfig.from_hf_config(
        {"vocab_size": 1000, "hidden_size": 64, "num_speculative_steps": 7, "xpress_rank": 32,
         "xpress_mlp_hidden": 48, "xpress_topc": 100, "xpress_num_passes": 3, "max_num_seqs": 9,
         "unrelated": "ignored"}
    )
    assert (cfg.block_size, cfg.rank, cfg.mlp_hidden, cfg.topc, cfg.num_passes, cfg.max_num_reqs) == (8, 32, 48, 100, 3, 9)
    assert xj.HeadConfig.from_hf_config({"vocab_size": 1000, "hidden_size": 64, "xpress_block_size": 12,
                                          "num_speculative_steps": 7}).block_size == 12
    d = xj.HeadConfig.from_hf_config({"vocab_size": 151936, "hidden_size": 4096})
    assert (d.block_size, d.rank, d.mlp_hidden, d.topc, d.num_passes, d.max_num_reqs) == (16, 256, 512, 512, 6, 256)
    assert xj.HeadConfig.from_hf_config(cfg.to_hf_config()) == cfg
    with pytest.raises(ValueError, match="hidden_size"):
        xj.HeadConfig.from_hf_config({"vocab_size": 10})
    assert xj.HeadConfig.from_hf_config({"vocab_size": 10, "hidden_size": 4, "xpress_topc": 20}).topc == 10
    hash(cfg)


def test_config_from_params_sizes_the_params_it_came_from():
    """`config_from_params` on random configs' params: the config it infers sizes them (`param_shapes`,
    `check_params`), a reduced head's ``draft_vocab_size`` read from ``w2``'s rows (``d2t`` present); given
    the fields shapes do not hold, it is the config itself. A ``w2`` shorter than ``w1`` without ``d2t`` is
    refused."""
    rng = np.random.default_rng(0)
    for i in range(40):
        V = int(rng.integers(1, 3000))
        cfg = xj.HeadConfig(vocab_size=V, hidden_size=int(rng.integers(1, 300)), block_size=int(rng.integers(2, 33)),
                            rank=int(rng.integers(1, 300)), mlp_hidden=int(rng.integers(1, 600)),
                            draft_vocab_size=int(rng.integers(1, V + 1)) if i % 2 else None,
                            topc=int(rng.integers(0, 600)), num_passes=int(rng.integers(0, 9)),
                            max_num_reqs=int(rng.integers(1, 300)), predecessor=("anchor", "previous")[i % 3 == 0])
        params = zero_params(cfg)
        got = xj.config_from_params(params)
        assert xj.param_shapes(got) == xj.param_shapes(cfg), cfg
        xj.check_params(params, got)
        assert got.draft_vocab_size == params["w2"].shape[0] and got.reduced == (VOCAB_MAP in params)
        rest = {k: getattr(cfg, k) for k in ("topc", "num_passes", "max_num_reqs", "predecessor")}
        assert xj.config_from_params(params, **rest) == cfg
        if cfg.reduced:
            with pytest.raises(ValueError, match="w2"):
                xj.config_from_params({k: v for k, v in params.items() if k != VOCAB_MAP})


def test_shape_errors(setup):
    cfg, params, (logits, h, a, p) = setup
    kw = dict(num_passes=2, topc=0)
    with refused(ValueError, "logits"):
        xj.refine(params, logits[..., :-1], h, a, p, **kw)
    with refused(ValueError, "block size|block_size"):
        xj.refine(params, logits[:, :-1], h[:, :-1], a, p, **kw)
    with refused(ValueError, "logits"):
        xj.refine(params, logits[0], h, a, p, **kw)
    with refused(ValueError, "h must"):
        xj.refine(params, logits, h[..., :-1], a, p, **kw)
    with refused(ValueError, "h must"):
        xj.refine(params, logits, h[:2], a, p, **kw)
    with refused(ValueError, "anchors"):
        xj.refine(params, logits, h, a[:2], p, **kw)
    with refused(ValueError, "prev_ids"):
        xj.refine(params, logits, h, a, p[:, None], **kw)


def test_dtype_errors(setup):
    cfg, params, (logits, h, a, p) = setup
    kw = dict(num_passes=2, topc=0)
    with refused(TypeError, "logits dtype"):
        xj.refine(params, logits.astype(jnp.bfloat16), h, a, p, **kw)
    with refused(TypeError, "h dtype"):
        xj.refine(params, logits, h.astype(jnp.bfloat16), a, p, **kw)
    with refused(TypeError, "anchors"):
        xj.refine(params, logits, h, a.astype(jnp.float32), p, **kw)
    with refused(TypeError, "prev_ids"):
        xj.refine(params, logits, h, a, p.astype(jnp.float32), **kw)
    mixed = dict(params, w2=params["w2"].astype(jnp.bfloat16))
    with refused(TypeError, "w2"):
        xj.refine(mixed, logits, h, a, p, **kw)


def test_param_errors(setup):
    cfg, params, (logits, h, a, p) = setup
    kw = dict(num_passes=2, topc=0)
    with refused(ValueError, "mlp_up"):
        xj.refine(dict(params, mlp_up=params["mlp_up"][:, :-1]), logits, h, a, p, **kw)
    missing = dict(params)
    del missing["mix"]
    with refused(ValueError, "mix"):
        xj.refine(missing, logits, h, a, p, **kw)
    other = xj.HeadConfig(**dict(SMALL, rank=SMALL["rank"] + 1))
    with refused(ValueError, "in_proj|w1"):
        xj.refine(params, logits, h, a, p, config=other, **kw)


def test_block_size_and_max_num_reqs(setup):
    cfg, params, _ = setup
    x = zero_inputs(cfg, cfg.max_num_reqs + 1)
    with refused(ValueError, "max_num_reqs"):
        xj.refine(params, *x, config=cfg)
    # max_num_reqs= lifts the limit: refine traces (shapes only, nothing compiled)
    run = functools.partial(xj.refine, config=cfg, max_num_reqs=cfg.max_num_reqs + 1, topc=0, num_passes=1)
    out = jax.eval_shape(run, params, *x)
    assert out.shape == (cfg.max_num_reqs + 1, cfg.block_size - 1) and out.dtype == jnp.int32


@pytest.mark.parametrize("bad", [-1, 2.0, True, "6"])
def test_num_passes_must_be_a_non_negative_int(setup, bad):
    cfg, params, x = setup
    with refused(ValueError, "num_passes"):
        xj.refine(params, *x, num_passes=bad, topc=0)


def test_topc_range(setup):
    cfg, params, x = setup
    with refused(ValueError, "topc"):
        xj.refine(params, *x, num_passes=1, topc=cfg.vocab_size + 1)
    with refused(ValueError, "topc"):
        xj.refine(params, *x, num_passes=1, topc=-1)
    with refused(TypeError, "topc"):
        xj.refine(params, *x, num_passes=1, topc=3.0)


def test_backend_name(setup):
    cfg, params, x = setup
    with refused(ValueError, "backend"):
        xj.refine(params, *x, num_passes=1, topc=0, backend="cuda")


@pytest.mark.slow
def test_errors_also_under_jit(setup):
    cfg, params, (logits, h, a, p) = setup
    f = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)
    with pytest.raises(ValueError, match="h must"):
        f(params, logits, h[:, :, :-1], a, p, num_passes=1, topc=0)
    with pytest.raises(ValueError, match="num_passes"):
        f(params, logits, h, a, p, num_passes=-1, topc=0)
