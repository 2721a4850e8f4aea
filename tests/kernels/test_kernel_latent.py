"""Latent-pass kernel (`xpress_jax.kernels.latent`) against its jnp reference.

`TestLatentKernel` runs the kernel compiled for a GPU (skipped without one);
`TestLatentKernelInterpret` runs the same tests in Pallas interpret mode on CPU.
Every test runs the fused variant and the split one (three kernels for small N).
The lowering tests build the kernels' Triton IR for an H200 on any machine.

Exactness: interpret mode groups the float32 sums differently from
`xpress_jax.head.latent` (K and hidden chunks, per-block dots, the mixer summed
in slot order), so outputs are compared with a tolerance (float32: max error
<= 1e-6 of the output's max magnitude; bf16: within 1 ulp on >= 99.9% of
elements) and refined tokens must be identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dataclasses
import functools

from helpers import lower_triton
from xpress_jax import reference as R
from xpress_jax.config import HeadConfig
from xpress_jax.kernels import common, latent
from xpress_jax.ops import Ops
from xpress_jax.params import param_shapes
from xpress_jax.refine import refine_with

VARIANTS = ("fused", "split")

CASES = {
    # name: (N, B, V, r, M, config overrides). K and hidden dims are split in several
    # chunks; "odd" has B, r, M not powers of two (masked slots, K and hidden tails)
    # and a last program with one block past N.
    "n1_b16": (1, 16, 97, 64, 128, dict(variant="fused", k_block=16, h_block=32)),
    "n5_b6_odd_bpp2": (5, 6, 97, 48, 80, dict(variant="fused", k_block=32, h_block=32, blocks_per_program=2)),
    "n2_b16_serving_rm": (2, 16, 97, 256, 512, dict(variant="fused")),
    # split: 4 column programs (stages 1, 3) x 4 hidden programs (stage 2); 15 rows in one
    # 16-row tile (one masked row).
    "split_n1_b16": (1, 16, 97, 64, 128, dict(variant="split", k_block=16, h_block=32, col_block=16)),
    # odd: column, K (r and M) and hidden tails, masked slots, a stage-1 block past N.
    "split_n3_b6_odd_bpp2": (3, 6, 97, 48, 80, dict(variant="split", k_block=32, h_block=32, col_block=32,
                                                    blocks_per_program=2)),
    # serving r, M with the split defaults: 45 rows -> three 16-row tiles, the last one partial.
    "split_n3_b16_serving_rm": (3, 16, 97, 256, 512, dict(variant="split")),
}


def _config(n, dtype, rank, variant=None, **fields):
    """`latent.default_config` for N blocks of ``dtype`` at ``rank``, with these fields set."""
    return dataclasses.replace(latent.default_config(n, dtype, variant, rank=rank), **fields)


def _params(rng, B, V, r, M, dtype, std=0.2):
    """Head-latent params with non-trivial values: unit-scale activations, std ~0.1-0.3 weights.

    NumPy draws (eager jax.random would compile every op for every new shape).
    """

    def w(shape, fan_in):
        return rng.standard_normal(shape) * std * np.sqrt(16.0 / fan_in)

    mix = np.tril(np.ones((B, B)))[:, :, None] * rng.standard_normal((B, B, r)) * std
    p = {
        "w1": rng.standard_normal((V, r)) * 3 * std,
        "in_proj_token": w((r, r), r),
        "mix": mix + np.eye(B)[:, :, None],
        "mlp_gate": w((r, M), r),
        "mlp_up": w((r, M), r),
        "mlp_down": w((M, r), M),
    }
    return {k: _arr(v, dtype) for k, v in p.items()}


def _arr(x, dtype):
    return jnp.asarray(np.asarray(x, np.float32).astype(jnp.dtype(dtype)))


def _inputs(seed, N, B, V, r, M, dtype):
    rng = np.random.default_rng(seed)
    params = _params(rng, B, V, r, M, dtype)
    xh = _arr(rng.standard_normal((N, B, r)), dtype)
    blk = jnp.asarray(rng.integers(0, V, (N, B)), jnp.int32)
    prev = jnp.asarray(rng.integers(0, V, (N,)), jnp.int32)
    return params, xh, blk, prev


def _ordered_bits(x):
    """bf16 bits mapped to integers that order like the values (ulp distance = difference)."""
    i = np.asarray(x).view(np.int16).astype(np.int32)
    return np.where(i < 0, -(i & 0x7FFF), i)


def assert_close(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    o = np.asarray(out.astype(jnp.float32))
    r = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(o).all()
    if ref.dtype == jnp.float32:
        err = np.abs(o - r).max() / np.abs(r).max()
        assert err <= 1e-6, f"float32 relative error {err:.3g} > 1e-6"
    else:
        ulps = np.abs(_ordered_bits(out) - _ordered_bits(ref))
        frac = (ulps > 1).mean()
        assert frac <= 1e-3, f"{frac:.3%} of bf16 elements differ by more than 1 ulp (max {ulps.max()})"
        assert np.abs(o - r).max() <= np.abs(r).max() * 2.0**-7


SLOW = pytest.mark.slow


class TestLatentKernel:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _device(self):
        if not self.INTERPRET and not common.gpu_supported():
            pytest.skip("compiled kernel needs a CUDA GPU (sm80+); the Interpret twin runs on CPU")

    def run(self, params, xh, blk, prev, **cfg):
        return latent.latent_pass(params, xh, blk, prev, interpret=self.INTERPRET,
                                  config=_config(xh.shape[0], xh.dtype, xh.shape[2], **cfg))

    # every case and dtype; one in the default run, the rest `slow`
    @pytest.mark.parametrize("case,dtype", [
        pytest.param(case, dt, id=f"{case}-{name}", marks=() if f"{case}-{name}" == "n5_b6_odd_bpp2-f32" else SLOW)
        for case in CASES for dt, name in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16"))])
    def test_matches_reference(self, case, dtype):
        N, B, V, r, M, cfg = CASES[case]
        params, xh, blk, prev = _inputs(sorted(CASES).index(case), N, B, V, r, M, dtype)
        out = self.run(params, xh, blk, prev, **cfg)
        ref = R.latent_pass(params, xh, blk, prev)
        assert out.shape == (N, B - 1, r)
        assert_close(out, ref)

    @pytest.mark.parametrize("variant", VARIANTS)
    def test_matches_refine_oracle_interface(self, variant):
        """Same as `reference.latent_pass` (what refine calls), incl. ids the oracle clips."""
        N, B, V, r, M, cfg = CASES["n5_b6_odd_bpp2"]  # same shapes: reuses the compiled kernel
        cfg = dict(cfg, variant=variant)
        params, xh, blk, prev = _inputs(7, N, B, V, r, M, jnp.float32)
        blk = blk.at[0, 2].set(V + 5).at[4, 4].set(V - 1)  # out of range: both sides clip to V-1
        ref = R.latent_pass(params, xh, blk, prev)
        out = self.run(params, xh, blk, prev, **cfg)
        assert_close(out, ref)
        moved = self.run(params, xh, blk.at[0, 2].set(V - 1), prev, **cfg)
        np.testing.assert_array_equal(np.asarray(moved), np.asarray(out))

    @pytest.mark.parametrize("variant", ["fused", pytest.param("split", marks=SLOW)])
    def test_causal_and_blocks_independent(self, variant):
        """Slot k's latent depends only on predecessors of slots <= k, and only on its own block."""
        N, B, V, r, M = 3, 12, 97, 32, 64
        params, xh, blk, prev = _inputs(3, N, B, V, r, M, jnp.float32)
        cfg = dict(variant=variant, blocks_per_program=4)  # one (stage-1) program: 3 blocks + one past N
        base = np.asarray(self.run(params, xh, blk, prev, **cfg))
        s = 5  # blk[:, s] is the predecessor of slot s+1, i.e. lat[:, s]
        moved = np.asarray(self.run(params, xh, blk.at[1, s].set((blk[1, s] + 1) % V), prev, **cfg))
        np.testing.assert_array_equal(moved[[0, 2]], base[[0, 2]])
        np.testing.assert_array_equal(moved[1, :s], base[1, :s])
        assert (moved[1, s:] != base[1, s:]).any(axis=-1).all()
        # prev_ids feeds slot 0, which every draft slot sees through the mixer.
        moved = np.asarray(self.run(params, xh, blk, prev.at[2].set((prev[2] + 1) % V), **cfg))
        np.testing.assert_array_equal(moved[:2], base[:2])
        assert (moved[2] != base[2]).any(axis=-1).all()
        # xh of the last slot reaches no draft slot but the last.
        moved = np.asarray(self.run(params, xh.at[0, B - 1].add(1.0), blk, prev, **cfg))
        np.testing.assert_array_equal(moved[0, :-1], base[0, :-1])
        assert (moved[0, -1] != base[0, -1]).all()

    @pytest.mark.parametrize("dtype,topc,variant", [
        pytest.param(jnp.float32, 0, "fused", id="f32_full-fused"),
        pytest.param(jnp.bfloat16, 7, "split", id="bf16_top7-split", marks=pytest.mark.slow),
        pytest.param(jnp.float32, 0, "split", id="f32_full-split", marks=pytest.mark.slow),
        pytest.param(jnp.bfloat16, 7, "fused", id="bf16_top7-fused", marks=pytest.mark.slow)])
    @pytest.mark.slow(interpret_only=True)
    def test_refined_tokens_identical(self, dtype, topc, variant):
        """Downstream: K passes of refine with the kernel give the oracle's tokens."""
        cfg = HeadConfig(vocab_size=97, hidden_size=24, block_size=6, rank=48, mlp_hidden=80,
                         topc=topc, num_passes=5, max_num_reqs=4)
        rng = np.random.default_rng(11)
        params = {k: _arr(rng.standard_normal(shape) * 0.3, dtype) for k, shape in param_shapes(cfg).items()}
        B = cfg.block_size
        mix = np.tril(np.ones((B, B)))[:, :, None] * rng.standard_normal((B, B, cfg.rank)) * 0.3
        params["mix"] = _arr(mix + np.eye(B)[:, :, None], dtype)  # folded: raw * tril + I
        N = 3
        logits = _arr(rng.standard_normal((N, B, 97)) * 2, dtype)
        h = _arr(rng.standard_normal((N, B, 24)), dtype)
        anchors = jnp.asarray(rng.integers(0, 97, (N,)), jnp.int32)
        interpret = self.INTERPRET

        xla = Ops.xla()
        kernel_ops = dataclasses.replace(xla, name="xla+latent-kernel", latent=functools.partial(
            latent.latent_pass, interpret=interpret, config=latent.default_config(N, dtype, variant, rank=cfg.rank)))

        def run(ops):
            f = jax.jit(lambda p, lg, hh, a: refine_with(ops, p, lg, hh, a, num_passes=5, topc=topc))
            return np.asarray(f(params, logits, h, anchors))

        want = run(xla)
        got = run(kernel_ops)
        np.testing.assert_array_equal(got, want)
        start = np.asarray(jnp.argmax(logits[:, 1:].astype(jnp.float32), axis=-1))
        assert (want != start).mean() > 0.2, "refinement should change a good share of the draft"


class TestLatentKernelInterpret(TestLatentKernel):
    INTERPRET = True


def _abstract(N, B, V, r, M, dtype):
    S = jax.ShapeDtypeStruct
    params = {
        "w1": S((V, r), dtype), "in_proj_token": S((r, r), dtype), "mix": S((B, B, r), dtype),
        "mlp_gate": S((r, M), dtype), "mlp_up": S((r, M), dtype), "mlp_down": S((M, r), dtype),
    }
    return params, S((N, B, r), dtype), S((N, B), jnp.int32), S((N,), jnp.int32)


SPLIT_NAMES = ("xpress_latent_pass_mix", "xpress_latent_pass_gateup", "xpress_latent_pass_down")


@pytest.mark.parametrize(
    "N,B,dtype,cfg,names",
    [
        pytest.param(4, 16, jnp.bfloat16, dict(variant="fused"), ("xpress_latent_pass",), id="bf16_n4_fused",
                     marks=SLOW),
        pytest.param(256, 16, jnp.bfloat16, dict(blocks_per_program=2), ("xpress_latent_pass",),  # served at N=256
                     id="bf16_n256"),
        pytest.param(64, 16, jnp.bfloat16, dict(variant="fused", blocks_per_program=4, h_block=32),
                     ("xpress_latent_pass",), id="bf16_bpp4", marks=SLOW),
        pytest.param(5, 12, jnp.bfloat16, dict(variant="fused", blocks_per_program=2, num_warps=4),
                     ("xpress_latent_pass",), id="bf16_b12", marks=SLOW),
        pytest.param(4, 16, jnp.float32, dict(variant="fused"), ("xpress_latent_pass",), id="f32_n4_fused"),
        pytest.param(1, 16, jnp.bfloat16, dict(variant="split"), SPLIT_NAMES, id="bf16_n1_split", marks=SLOW),
        pytest.param(4, 16, jnp.bfloat16, dict(variant="split"), SPLIT_NAMES, id="bf16_n4_split"),
        pytest.param(32, 16, jnp.bfloat16, dict(variant="split", row_block=64, num_warps=8, blocks_per_program=2),
                     SPLIT_NAMES, id="bf16_n32_split_rb64", marks=SLOW),
        pytest.param(5, 12, jnp.bfloat16, dict(variant="split", col_block=16, h_block=64, k_block=32), SPLIT_NAMES,
                     id="bf16_b12_split", marks=SLOW),
        pytest.param(3, 16, jnp.float32, dict(variant="split"), SPLIT_NAMES, id="f32_n3_split", marks=SLOW),
    ],
)
def test_lowers_to_triton_for_h200(N, B, dtype, cfg, names):
    """Serving-like shapes lower to one Triton custom call per kernel, each named after it."""
    args = _abstract(N, B, 1024, 256, 512, dtype)
    config = _config(N, dtype, 256, **cfg)
    lowered = lower_triton(lambda p, x, b, q: latent.latent_pass(p, x, b, q, config=config), *args)
    text = lowered.as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == len(names)
    for name in names:
        assert text.count(f'name = "{name}"') == 1, name


def test_default_config_variant():
    """The kernel's own default is fused (split where fused cannot fit); which variant serves at
    which N is the dispatch's decision (tests/kernels/test_dispatch.py)."""
    for dtype in (jnp.bfloat16, jnp.float32):
        assert latent.default_config(1, dtype).variant == "fused"
        assert latent.default_config(1, dtype, "split").variant == "split"
        assert latent.default_config(1, dtype, rank=4096).variant == "split"


def test_float64_is_refused():
    """The kernel refuses float64 (TypeError naming the dtype); refine routes it to the reference."""
    with jax.enable_x64(True):
        params, xh, blk, prev = _inputs(5, 2, 6, 40, 16, 32, jnp.float64)
        with pytest.raises(TypeError, match="float64"):
            latent.latent_pass(params, xh, blk, prev, interpret=True)


def test_bad_arguments_raise():
    params, xh, blk, prev = _inputs(0, 2, 6, 40, 16, 32, jnp.float32)
    with pytest.raises(ValueError, match="k_block"):
        latent.latent_pass(params, xh, blk, prev, interpret=True, config=_config(2, jnp.float32, 16, k_block=48))
    with pytest.raises(ValueError, match="h_block"):
        latent.LatentConfig(h_block=8)
    with pytest.raises(ValueError, match="variant"):
        latent.LatentConfig(variant="nope")
    with pytest.raises(ValueError, match="col_block"):
        latent.LatentConfig(col_block=24)
    with pytest.raises(ValueError, match="row_block"):
        latent.LatentConfig(row_block=8)
    with pytest.raises(ValueError, match="xh.shape"):
        latent.latent_pass(params, xh[:, :5], blk, prev, interpret=True)
    with pytest.raises(ValueError, match="prev_ids.shape"):
        latent.latent_pass(params, xh, blk, prev[:1], interpret=True)
    with pytest.raises(TypeError, match="xh.dtype"):
        latent.latent_pass(params, xh.astype(jnp.bfloat16), blk, prev, interpret=True)
