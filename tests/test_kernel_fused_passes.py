"""Single-launch K-pass kernel (`pallas_kernels.fused_passes`) against the per-pass path.

`TestFusedPasses` runs the kernel compiled for a GPU (skipped without one);
`TestFusedPassesInterpret` runs the same tests in Pallas interpret mode on CPU.
The oracle is the per-pass jnp path: `xpress_jax.refine._refine` with `_JnpOps`
in top-C mode (K x (latent pass, top-C pick)); the kernel gets the same start
block, xh and candidates that `_refine` computes, and must return the same
tokens, token for token. Weights of std 0.25 make refinement change most of the
drafter's tokens, so a wrong shift, mixer or pick shows up at once.

Exactness: the kernel sums in float32 in another order than XLA (K/hidden/rank
chunks, per-block dots), so a latent or bias within an ulp of a rounding boundary
may round the other way, and a near tie between two candidates' bf16 scores can
flip a token (cascading into later slots and passes). Random inputs here give
identical tokens; should a mismatch ever appear, `_check_same_tokens` finds the
first pass where the blocks diverge and fails unless every diverging pick there is
a near tie (the reference's scores of both tokens within 2 ulps), which it
reports as an expected failure with the evidence.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from pallas_kernels import common
from pallas_kernels import fused_passes as fp
from xpress_jax.head import acc_dtype, hidden_input

refine_mod = importlib.import_module("xpress_jax.refine")  # the package re-exports `refine`, the function
_JnpOps = refine_mod._JnpOps

TRITON_CALL = "custom_call @__gpu$xla.gpu.triton"
NAME = 'name = "xpress_topc_all_passes"'

# name: (N, B, K, C, dtype, head sizes (V, H, r, M), config overrides or None = default_config).
# r = 24, M = 40: rank and hidden tails (padded to 32 / 48 -> 64 columns, masked); C = 37 is
# not a multiple of any candidate tile (masked tail); B = 6: padded slots (Bp = 8), and by
# default two blocks per program, so N = 1 and N = 3 have a block past N.
SMALL_HEAD = (611, 48, 24, 40)
TILED_HEAD = (509, 32, 64, 128)
CASES = {
    "n1_b16_k4_c37_f32": (1, 16, 4, 37, jnp.float32, SMALL_HEAD, None),
    # tensor-core scoring with the w2 tiles prefetched in registers (rank in 2 chunks of 16).
    "n3_b6_k4_c37_f32_dot_p2": (3, 6, 4, 37, jnp.float32, SMALL_HEAD, dict(score="dot", c_tile=4, k_tile=16,
                                                                            prefetch=2)),
    "n3_b16_k1_c64_bf16": (3, 16, 1, 64, jnp.bfloat16, SMALL_HEAD, None),
    "n1_b6_k1_c37_bf16": (1, 6, 1, 37, jnp.bfloat16, SMALL_HEAD, None),
    "n3_b6_k4_c64_bf16": (3, 6, 4, 64, jnp.bfloat16, SMALL_HEAD, None),
    # several K, hidden and rank chunks (r = 64 in 4 scoring chunks of 16), FMA scoring, w2 tiles prefetched.
    "n1_b16_k4_c64_bf16_fma_p2_tiled": (1, 16, 4, 64, jnp.bfloat16, TILED_HEAD,
                                        dict(score="fma", k_block=16, h_block=32, c_tile=16, k_tile=16, prefetch=2)),
    # 3 blocks of 16 slots, 2 per program: the second program's second block is past N; no prefetch.
    "n3_b16_k4_c37_bf16_bpp2_p0_tiled": (3, 16, 4, 37, jnp.bfloat16, TILED_HEAD,
                                         dict(blocks_per_program=2, k_block=32, h_block=64, c_tile=2, k_tile=32,
                                              prefetch=0)),
}


def _head(B, C, head, dtype, seed):
    V, H, r, M = head
    cfg = xj.HeadConfig(vocab_size=V, hidden_size=H, block_size=B, rank=r, mlp_hidden=M, topc=C, max_num_reqs=8)
    return cfg, xj.init_params(cfg, jax.random.key(seed), dtype=dtype, std=0.25, mix_std=0.5)


def _inputs(cfg, n, dtype, seed):
    k = jax.random.split(jax.random.key(seed), 4)
    B, V, H = cfg.block_size, cfg.vocab_size, cfg.hidden_size
    logits = jax.random.normal(k[0], (n, B, V), jnp.float32).astype(dtype)
    h = jax.random.normal(k[1], (n, B, H), jnp.float32).astype(dtype)
    anchors = jax.random.randint(k[2], (n,), 0, V, jnp.int32)
    prev = jax.random.randint(k[3], (n,), 0, V, jnp.int32)
    return logits, h, anchors, prev


@functools.partial(jax.jit, static_argnames="c")
def _prologue(params, logits, h, anchors, c):
    """What `_refine` computes before its pass loop (top-C mode): xh, blk0, base_c, cand."""
    N, B, V = logits.shape
    xh = hidden_input(params, h)
    cand, base_c, start = _JnpOps.select_candidates(logits[:, 1:, :].reshape(N * (B - 1), V), c)
    blk0 = jnp.concatenate([anchors[:, None].astype(jnp.int32), start.reshape(N, B - 1)], axis=1)
    return xh, blk0, base_c, cand


def _per_pass(params, logits, h, anchors, prev, K, C):
    """The oracle: refine's per-pass jnp path (draft slots of the final block, [N, B-1])."""
    f = jax.jit(lambda p, lg, hh, a, q: refine_mod._refine(_JnpOps, p, lg, hh, a, q, K, C))
    return np.asarray(f(params, logits, h, anchors, prev))


def _scores(params, xh, blk, prev, base_c, cand):
    """The reference's top-C scores [N*(B-1), C] for one pass from ``blk`` (float32 of the dtype values)."""
    N, B = blk.shape
    lat = _JnpOps.latent_pass(params, xh, blk, prev).reshape(N * (B - 1), -1)
    acc = acc_dtype(base_c.dtype)
    w2c = jnp.take(params["w2"], cand, axis=0)
    bias = jnp.einsum("nr,ncr->nc", lat, w2c, preferred_element_type=acc,
                      precision=jax.lax.Precision.HIGHEST).astype(base_c.dtype)
    return np.asarray(refine_mod._round_sum(base_c, bias).astype(jnp.float32))


class TestFusedPasses:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _device(self):
        if not self.INTERPRET and not common.gpu_supported():
            pytest.skip("compiled kernel needs a CUDA GPU (sm80+); the Interpret twin runs on CPU")

    def run(self, params, xh, blk0, prev, base_c, cand, K, config=None):
        return fp.topc_all_passes(params, xh, blk0, prev, base_c, cand, num_passes=K, interpret=self.INTERPRET,
                                  config=config)

    def _check_same_tokens(self, got, want, params, xh, blk0, prev, base_c, cand, K, config):
        """got == want, or (only) near-tie flips at the first pass where the blocks diverge (xfail)."""
        if np.array_equal(got, want):
            return
        ref = blk0
        for p in range(1, K + 1):  # the first pass after which the kernel and the oracle differ
            ref_next = np.asarray(fp.reference(params, xh, blk0, prev, base_c, cand, num_passes=p))
            ker_next = np.asarray(self.run(params, xh, blk0, prev, base_c, cand, p, config))
            if not np.array_equal(ref_next, ker_next):
                break
            ref = ref_next
        else:
            raise AssertionError("passes agree one by one but not after K: nondeterminism?")
        s = _scores(params, xh, jnp.asarray(ref), prev, base_c, cand)  # both start pass p from `ref`
        N, B = blk0.shape
        diff = np.nonzero((ref_next != ker_next)[:, 1:].reshape(-1))[0]
        c = np.asarray(cand)
        nmant = jnp.finfo(base_c.dtype).nmant  # ulp(x) = 2^(floor(log2 |x|) - nmant)
        gaps = []
        for row in diff:
            pick_r, pick_k = ref_next[:, 1:].reshape(-1)[row], ker_next[:, 1:].reshape(-1)[row]
            s_r, s_k = s[row][c[row] == pick_r][0], s[row][c[row] == pick_k][0]
            ulp = 2.0 ** (np.floor(np.log2(max(abs(s_r), abs(s_k), 1e-30))) - nmant)
            gaps.append((int(row), int(pick_r), int(pick_k), float(s_r), float(s_k), float((s_r - s_k) / ulp)))
        evidence = f"pass {p}: rows (row, oracle id, kernel id, oracle s, s of kernel id, gap in ulps) {gaps}"
        assert all(g[-1] <= 2 for g in gaps), "kernel tokens differ beyond near ties: " + evidence
        pytest.xfail("near-tie flip (scores within 2 ulps; float32 summation order): " + evidence)

    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_per_pass_path(self, case):
        N, B, K, C, dtype, head, overrides = CASES[case]
        seed = sorted(CASES).index(case)
        cfg, params = _head(B, C, head, dtype, seed)
        logits, h, anchors, prev = _inputs(cfg, N, dtype, seed + 100)
        want = _per_pass(params, logits, h, anchors, prev, K, C)
        xh, blk0, base_c, cand = _prologue(params, logits, h, anchors, C)
        config = None if overrides is None else dataclasses.replace(fp.default_config(N, B, dtype), **overrides)
        got = np.asarray(self.run(params, xh, blk0, prev, base_c, cand, K, config))
        assert got.shape == (N, B) and got.dtype == np.int32
        np.testing.assert_array_equal(got[:, 0], np.asarray(anchors))  # slot 0 is never rewritten
        start = np.asarray(blk0)[:, 1:]
        assert (want != start).mean() > 0.2, "refinement should change a good share of the draft"
        self._check_same_tokens(got[:, 1:], want, params, xh, blk0, prev, base_c, cand, K, config)

    def test_reference_is_the_refine_loop(self):
        """`fused_passes.reference` (the float64 fallback) is exactly refine's per-pass path."""
        N, B, K, C = 3, 6, 3, 37
        cfg, params = _head(B, C, SMALL_HEAD, jnp.float32, 5)
        logits, h, anchors, prev = _inputs(cfg, N, jnp.float32, 6)
        xh, blk0, base_c, cand = _prologue(params, logits, h, anchors, C)
        ref = np.asarray(fp.reference(params, xh, blk0, prev, base_c, cand, num_passes=K))
        np.testing.assert_array_equal(ref[:, 1:], _per_pass(params, logits, h, anchors, prev, K, C))

    def test_blocks_independent_and_jacobi(self):
        """A block's tokens depend only on its own inputs; K passes = the K-th pass of K chained launches."""
        N, B, C = 3, 6, 37
        cfg, params = _head(B, C, SMALL_HEAD, jnp.float32, 7)
        logits, h, anchors, prev = _inputs(cfg, N, jnp.float32, 8)
        xh, blk0, base_c, cand = _prologue(params, logits, h, anchors, C)
        two = np.asarray(self.run(params, xh, blk0, prev, base_c, cand, 2))
        one = self.run(params, xh, blk0, prev, base_c, cand, 1)
        np.testing.assert_array_equal(np.asarray(self.run(params, xh, one, prev, base_c, cand, 1)), two)
        moved = np.asarray(self.run(params, xh, blk0, prev.at[1].set((prev[1] + 1) % cfg.vocab_size),
                                    base_c, cand, 2))
        np.testing.assert_array_equal(moved[[0, 2]], two[[0, 2]])

    def test_zero_passes_and_empty(self):
        N, B, C = 2, 6, 37
        cfg, params = _head(B, C, SMALL_HEAD, jnp.float32, 9)
        logits, h, anchors, prev = _inputs(cfg, N, jnp.float32, 10)
        xh, blk0, base_c, cand = _prologue(params, logits, h, anchors, C)
        np.testing.assert_array_equal(np.asarray(self.run(params, xh, blk0, prev, base_c, cand, 0)),
                                      np.asarray(blk0))
        out = self.run(params, xh[:0], blk0[:0], prev[:0], base_c[:0], cand[:0], 2)
        assert out.shape == (0, B)


class TestFusedPassesInterpret(TestFusedPasses):
    INTERPRET = True


def test_interpret_twin_runs_on_cpu():
    """Guard against a silently skipped twin: the interpret class must not skip on CPU."""
    assert TestFusedPassesInterpret.INTERPRET and not TestFusedPasses.INTERPRET


def _abstract(N, B, V, r, M, C, dtype):
    S = jax.ShapeDtypeStruct
    params = {"w1": S((V, r), dtype), "in_proj_token": S((r, r), dtype), "mix": S((B, B, r), dtype),
              "mlp_gate": S((r, M), dtype), "mlp_up": S((r, M), dtype), "mlp_down": S((M, r), dtype),
              "w2": S((V, r), dtype)}
    rows = N * (B - 1)
    return (params, S((N, B, r), dtype), S((N, B), jnp.int32), S((N,), jnp.int32), S((rows, C), dtype),
            S((rows, C), jnp.int32))


@pytest.mark.parametrize(
    "N,B,dtype,overrides",
    [
        (1, 16, jnp.bfloat16, {}),  # the default: tensor-core scoring, ids prefetched, 3 stages
        (132, 16, jnp.bfloat16, dict(score="fma", c_tile=4, num_stages=2, prefetch=2)),
        (256, 16, jnp.bfloat16, dict(blocks_per_program=2, c_tile=4, prefetch=0)),
        (5, 6, jnp.bfloat16, {}),  # Bp = 8: two blocks per program by default
        (4, 16, jnp.float32, {}),
    ],
    ids=["bf16_n1", "bf16_n132_fma", "bf16_n256_bpp2", "bf16_b6", "f32_n4"],
)
def test_lowers_to_triton_for_h200(N, B, dtype, overrides):
    """Serving-like shapes (r=256, M=512, C=512, K=6) lower to one Triton call named after the kernel."""
    args = _abstract(N, B, 4099, 256, 512, 512, dtype)
    config = dataclasses.replace(fp.default_config(N, B, dtype), **overrides)
    lowered = common.lower_triton(lambda *a: fp.topc_all_passes(*a, num_passes=6, config=config), *args)
    text = lowered.as_text()
    assert text.count(TRITON_CALL) == 1
    assert text.count(NAME) == 1


def test_float64_falls_back_to_reference():
    with jax.enable_x64(True):
        N, B, K, C = 1, 6, 2, 37
        cfg, params = _head(B, C, SMALL_HEAD, jnp.float64, 11)
        logits, h, anchors, prev = _inputs(cfg, N, jnp.float64, 12)
        xh, blk0, base_c, cand = _prologue(params, logits, h, anchors, C)
        f = lambda *a: fp.topc_all_passes(*a, num_passes=K, interpret=True)  # noqa: E731
        out = np.asarray(f(params, xh, blk0, prev, base_c, cand))
        np.testing.assert_array_equal(out, np.asarray(fp.reference(params, xh, blk0, prev, base_c, cand,
                                                                   num_passes=K)))
        assert "pallas_call" not in str(jax.make_jaxpr(f)(params, xh, blk0, prev, base_c, cand))


def test_default_config_and_switch():
    assert fp.default_config(1, 16, jnp.bfloat16).score == "dot"
    assert fp.default_config(1, 16, jnp.bfloat16).c_tile * 16 == 128
    assert fp.default_config(1, 6, jnp.bfloat16).c_tile * 16 == 128  # two blocks of Bp = 8
    assert fp.default_config(1, 16, jnp.float32).score == "fma"
    if fp.SINGLE_LAUNCH_N is None:
        assert not any(fp.use_single_launch(n) for n in (1, 16, 256))
    else:
        lo, hi = fp.SINGLE_LAUNCH_N
        assert fp.use_single_launch(lo) and fp.use_single_launch(hi) and not fp.use_single_launch(hi + 1)


def test_bad_arguments_raise():
    N, B, C = 2, 6, 37
    cfg, params = _head(B, C, SMALL_HEAD, jnp.float32, 13)
    logits, h, anchors, prev = _inputs(cfg, N, jnp.float32, 14)
    xh, blk0, base_c, cand = _prologue(params, logits, h, anchors, C)
    call = lambda *a, **k: fp.topc_all_passes(*a, interpret=True, **k)  # noqa: E731
    with pytest.raises(ValueError, match="c_tile"):
        fp.PassesConfig(c_tile=24)
    with pytest.raises(ValueError, match="k_block"):
        fp.PassesConfig(k_block=8)
    with pytest.raises(ValueError, match="score"):
        fp.PassesConfig(score="mma")
    with pytest.raises(ValueError, match="prefetch"):
        fp.PassesConfig(prefetch=3)
    with pytest.raises(ValueError, match="num_passes"):
        call(params, xh, blk0, prev, base_c, cand, num_passes=-1)
    with pytest.raises(ValueError, match="xh.shape"):
        call(params, xh[:, :-1], blk0, prev, base_c, cand, num_passes=1)
    with pytest.raises(ValueError, match="base_c and cand"):
        call(params, xh, blk0, prev, base_c[:-1], cand[:-1], num_passes=1)
    with pytest.raises(TypeError, match="base_c.dtype"):
        call(params, xh, blk0, prev, base_c.astype(jnp.bfloat16), cand, num_passes=1)
