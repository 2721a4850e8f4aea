"""Hidden-input kernels (`xpress_jax.kernels.hidden`) against `xpress_jax.head.hidden_input`.

`TestHiddenKernel` runs compiled on a GPU (skipped without one); `TestHiddenKernelInterpret` runs the same
tests in interpret mode on CPU. The lowering test builds the Triton IR for an H200 on any machine.
Outputs are compared like the latent kernel's (float32: max error <= 1e-6 of the largest magnitude; bf16:
within 1 ulp on >= 99.9% of elements), and refined tokens must be identical.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xpress_jax.config import HeadConfig
from xpress_jax.head import hidden_input
from xpress_jax.kernels import common, hidden
from xpress_jax.ops import Ops
from xpress_jax.params import param_shapes
from xpress_jax.refine import refine_with

from test_kernel_latent import assert_close

CASES = {
    # name: (N, B, H, r, config overrides)
    # one block, 4 column programs, H in 2 chunks
    "n1_b16": (1, 16, 256, 64, dict(k_block=128)),
    # odd: B=6 (8 padded slots, 2 blocks per program, a block past N), H and r tails, 2 column programs
    "n3_b6_odd_bpp2": (3, 6, 200, 48, dict(blocks_per_program=2, col_block=32, k_block=64, row_block=32)),
    # serving rank, two blocks, the default config
    "n2_b16_r256": (2, 16, 512, 256, {}),
}


def _inputs(seed, N, B, H, r, dtype):
    rng = np.random.default_rng(seed)

    def arr(x):
        return jnp.asarray(np.asarray(x, np.float32).astype(jnp.dtype(dtype)))

    params = {
        "w1": arr(np.zeros((3, r))),
        "down_h": arr(rng.standard_normal((H, r)) / np.sqrt(H) * 2),
        "down_g": arr(rng.standard_normal((H, r)) / np.sqrt(H) * 2),
        "in_proj_hidden": arr(rng.standard_normal((2 * r, r)) / np.sqrt(2 * r) * 2),
    }
    return params, arr(rng.standard_normal((N, B, H)))


class TestHiddenKernel:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _device(self):
        if not self.INTERPRET and not common.gpu_supported():
            pytest.skip("compiled kernel needs a CUDA GPU (sm80+); the Interpret twin runs on CPU")

    def run(self, params, h, **cfg):
        return hidden.hidden_input(params, h, interpret=self.INTERPRET, **cfg)

    @pytest.mark.parametrize("case,dtype", [
        pytest.param(case, dt, id=f"{case}-{name}")
        for case in CASES for dt, name in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16"))])
    def test_matches_reference(self, case, dtype):
        N, B, H, r, cfg = CASES[case]
        params, h = _inputs(sorted(CASES).index(case), N, B, H, r, dtype)
        out = self.run(params, h, **cfg)
        assert out.shape == (N, B, r)
        assert_close(out, hidden_input(params, h))

    def test_blocks_independent_and_slot_mean(self):
        """A change to one slot's h moves every slot of its block (the slot mean feeds them all), no other block."""
        N, B, H, r, cfg = CASES["n3_b6_odd_bpp2"]
        params, h = _inputs(5, N, B, H, r, jnp.float32)
        base = np.asarray(self.run(params, h, **cfg))
        moved = np.asarray(self.run(params, h.at[1, 3, 7].add(2.0), **cfg))
        np.testing.assert_array_equal(moved[[0, 2]], base[[0, 2]])
        assert (moved[1] != base[1]).any(axis=-1).all()

    @pytest.mark.parametrize("dtype,topc", [(jnp.bfloat16, 7), (jnp.float32, 0)])
    def test_refined_tokens_identical(self, dtype, topc):
        """Downstream: refine with the hidden kernels gives the oracle's tokens."""
        cfg = HeadConfig(vocab_size=97, hidden_size=40, block_size=6, rank=48, mlp_hidden=80,
                         topc=topc, num_passes=5, max_num_reqs=4)
        rng = np.random.default_rng(13)
        params = {k: jnp.asarray((rng.standard_normal(shape) * 0.3).astype(np.float32)).astype(dtype)
                  for k, shape in param_shapes(cfg).items()}
        B = cfg.block_size
        mix = np.tril(np.ones((B, B)))[:, :, None] * rng.standard_normal((B, B, cfg.rank)) * 0.3
        params["mix"] = jnp.asarray((mix + np.eye(B)[:, :, None]).astype(np.float32)).astype(dtype)
        N = 3
        logits = jnp.asarray((rng.standard_normal((N, B, 97)) * 2).astype(np.float32)).astype(dtype)
        h = jnp.asarray(rng.standard_normal((N, B, 40)).astype(np.float32)).astype(dtype)
        anchors = jnp.asarray(rng.integers(0, 97, (N,)), jnp.int32)
        xla = Ops.xla()
        with_kernel = dataclasses.replace(xla, name="xla+hidden-kernel", hidden=functools.partial(
            hidden.hidden_input, interpret=self.INTERPRET, col_block=16, k_block=16))

        def run(ops):
            f = jax.jit(lambda p, lg, hh, a: refine_with(ops, p, lg, hh, a, num_passes=5, topc=topc))
            return np.asarray(f(params, logits, h, anchors))

        want = run(xla)
        np.testing.assert_array_equal(run(with_kernel), want)
        start = np.asarray(jnp.argmax(logits[:, 1:].astype(jnp.float32), axis=-1))
        assert (want != start).mean() > 0.2, "refinement should change a good share of the draft"


class TestHiddenKernelInterpret(TestHiddenKernel):
    INTERPRET = True


@pytest.mark.parametrize("N,B,dtype,cfg", [
    (1, 16, jnp.bfloat16, {}),
    (4, 16, jnp.bfloat16, dict(blocks_per_program=2, col_block=32)),
    (16, 16, jnp.bfloat16, dict(blocks_per_program=4, col_block=64, row_block=64, proj_col_block=32)),
    (3, 6, jnp.bfloat16, dict(k_block=64)),
    (2, 16, jnp.float32, dict(k_block=32)),
], ids=["bf16_n1", "bf16_n4_bpp2", "bf16_n16_bpp4", "bf16_b6", "f32_n2"])
def test_lowers_to_triton_for_h200(N, B, dtype, cfg):
    """Serving shapes (H=4096, r=256) lower to the two named Triton custom calls."""
    S = jax.ShapeDtypeStruct
    H, r = 4096, 256
    params = {"w1": S((8, r), dtype), "down_h": S((H, r), dtype), "down_g": S((H, r), dtype),
              "in_proj_hidden": S((2 * r, r), dtype)}
    lowered = common.lower_triton(lambda p, h: hidden.hidden_input(p, h, **cfg), params, S((N, B, H), dtype))
    text = lowered.as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2
    for name in ("xpress_hidden_cache", "xpress_hidden_input"):
        assert text.count(f'name = "{name}"') == 1, name


def test_refuses_float64_and_bad_configs():
    with jax.enable_x64(True):
        params, h = _inputs(1, 1, 4, 32, 16, jnp.float64)
        with pytest.raises(TypeError, match="float64"):
            hidden.hidden_input(params, h, interpret=True)
    with pytest.raises(ValueError, match="col_block"):
        hidden.HiddenConfig(col_block=8)
    with pytest.raises(ValueError, match="k_block"):
        hidden.HiddenConfig(k_block=48)
    params, h = _inputs(1, 1, 4, 32, 16, jnp.float32)
    with pytest.raises(ValueError, match="h.shape"):
        hidden.hidden_input(params, h[:, :, :16], interpret=True)
