"""Top-C stream pick (xpress_jax.kernels.topc_stream) against the top-C pick kernel and the jnp oracle.

The stream pick sums each bias in the blocks of `topc_pick` (`topc_stream.like_topc`), so its tokens must equal
`topc_pick.topc_pick`'s on every row, near ties included; against the jnp oracle (an XLA einsum: another
summation order) on every row that is not a near tie (`conftest.near_tie_rows`) and on every row of dyadic inputs.

`TestTopCStream` runs the kernels for real (GPU only, with a serving-shape check); its twin
`TestTopCStreamInterpret` runs the same tests on CPU in interpret mode; `TestTopCStreamLowering` lowers them for
an H200 on CPU; `test_refine_with_the_stream_pick` runs a whole refine through `dispatch.Entry.topc_stream`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL, make_head, make_inputs, near_tie_rows, pick_inputs, triton_operand_counts

import xpress_jax as xj
from xpress_jax import dispatch
from xpress_jax import reference as R
from xpress_jax.kernels import common
from xpress_jax.kernels import topc_pick as tp
from xpress_jax.kernels import topc_stream as ts
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

TRITON_CALL = "__gpu$xla.gpu.triton"

# (rows, V, C, r, top-C config): odd V, ranks that are not powers of two (a masked rank tail), C = 1 and C = V,
# a C that is no multiple of the tile.
SHAPES = [
    (15, 1001, 100, 40, tp.TopCConfig(c_tile=32, c_steps=1, k_tile=16)),
    (25, 1001, 1, 100, tp.TopCConfig(c_tile=1, c_steps=1, k_tile=64)),
    (9, 300, 300, 40, tp.TopCConfig(c_tile=128, c_steps=1, k_tile=64, num_warps=8, num_stages=2)),
    (30, 2003, 77, 100, tp.TopCConfig(c_tile=64, c_steps=2, k_tile=128)),
]
DTYPES = [jnp.float32, jnp.bfloat16]


def _shape_dtypes(fast: set):
    out = []
    for sh in SHAPES:
        for dt in DTYPES:
            name = f"rows{sh[0]}-V{sh[1]}-C{sh[2]}-r{sh[3]}-{jnp.dtype(dt).name}"
            out.append(pytest.param(sh, dt, id=name, marks=() if name in fast else pytest.mark.slow))
    return out


SHAPE_DTYPES = _shape_dtypes({"rows25-V1001-C1-r100-bfloat16"})


def _stream_config(cfg: tp.TopCConfig) -> ts.StreamConfig:
    return ts.like_topc(cfg.c_tile, cfg.k_tile, cfg.num_warps, cfg.num_stages)


def _inputs(rows, vocab, c, rank, dtype, seed, dyadic=False):
    """The C largest base logits as refine takes them, shuffled (candidate order is arbitrary)."""
    base, lat, w2 = pick_inputs(rows, vocab, rank, dtype, seed, dyadic)
    base_c, cand = jax.lax.top_k(base, c)
    perm = jax.random.permutation(jax.random.key(seed), c)
    return base_c[:, perm], cand[:, perm].astype(jnp.int32), lat, w2


def _reference(base_c, cand, lat, w2):
    return np.asarray(R.topc_pick(base_c, cand, lat, R.topc_gather(w2, cand)))


class TestTopCStream:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not common.gpu_supported():
            pytest.skip("needs a CUDA GPU; TestTopCStreamInterpret runs these tests on CPU")

    def both(self, base_c, cand, lat, w2, cfg, **kw):
        """(the top-C pick's tokens, the stream pick's) with matching blocks."""
        want = tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=cfg, **kw)
        got = ts.topc_stream_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=_stream_config(cfg), **kw)
        return np.asarray(want), np.asarray(got)

    @pytest.mark.parametrize("shape,dtype", SHAPE_DTYPES)
    def test_matches_topc_pick_and_reference(self, shape, dtype):
        rows, vocab, c, rank, cfg = shape
        args = _inputs(rows, vocab, c, rank, dtype, seed=rows + c)
        want, got = self.both(*args, cfg)
        assert got.dtype == np.int32 and got.shape == (rows,)
        np.testing.assert_array_equal(got, want)
        ref = _reference(*args)
        near = near_tie_rows(args[0], args[2], args[3], ref, cand=args[1])
        np.testing.assert_array_equal(got[~near], ref[~near])
        dy = _inputs(rows, vocab, c, rank, dtype, seed=rows, dyadic=True)
        want, got = self.both(*dy, cfg)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, _reference(*dy))

    def test_concentrated_candidates(self):
        """Every row's candidates in one narrow vocab range (the sorted pairs of one id span several programs),
        with the default config (other blocks than the top-C pick's: dyadic inputs, exact in any order)."""
        rows, vocab, c, rank = 20, 1001, 48, 24
        base_c, _, lat, w2 = _inputs(rows, vocab, c, rank, jnp.float32, seed=5, dyadic=True)
        rng = np.random.default_rng(5)
        cand = jnp.asarray(np.stack([600 + rng.permutation(64)[:c] for _ in range(rows)]).astype(np.int32))
        want = _reference(base_c, cand, lat, w2)
        for cfg in (ts.StreamConfig(), ts.StreamConfig(p_tile=16, k_tile=8, row_tile=4, c_tile=16)):
            got = ts.topc_stream_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=cfg)
            np.testing.assert_array_equal(np.asarray(got), want)

    @pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, id="float32"),
                                       pytest.param(jnp.bfloat16, id="bfloat16", marks=pytest.mark.slow)])
    def test_ties_and_nonfinite(self, dtype):
        """The top-C rule on crafted rows: equal scores -> the larger base logit, equal base logits -> the lowest
        id, whichever programs the tied pairs land in; NaN never wins, +inf does, all -inf / all NaN rows give the
        lowest id; a tie made by rounding to bf16."""
        rows, vocab, c, rank = 16, 1000, 100, 16
        rng = np.random.default_rng(0)
        special = [1, 2, 3, 5, 9, 20, 40, 50, 200, 400, 500, 600, 700, 800, 801, 804, 805, 806, 807, 808]
        pool = np.setdiff1d(np.arange(vocab), special)
        cand = np.stack([rng.permutation(pool)[:c] for _ in range(rows)]).astype(np.int32)
        base_c = np.full((rows, c), -5.0, np.float32)
        lat = np.zeros((rows, rank), np.float32)
        w2 = np.zeros((vocab, rank), np.float32)
        inf, nan = np.inf, np.nan
        expect = {}
        cand[0, [2, 90]] = [700, 9]; base_c[0, [2, 90]] = 2; expect[0] = 9  # tie on base: lowest id
        cand[1, [10, 40, 70]] = [600, 400, 500]; base_c[1, [10, 40, 70]] = 2; expect[1] = 400
        cand[2, [1, 2]] = [1, 2]; base_c[2, 1] = nan; base_c[2, 2] = 1; expect[2] = 2  # NaN never wins
        cand[3, [60, 6]] = [600, 200]; base_c[3, [60, 6]] = inf; expect[3] = 200  # +inf, lowest id
        base_c[4] = -inf; expect[4] = int(cand[4].min())  # all -inf -> lowest-id candidate
        base_c[5] = nan; expect[5] = int(cand[5].min())  # all NaN -> lowest-id candidate
        # Rounding tie: 1 + 2^-10 rounds to 1 in bf16 (tie -> id 20), stays larger in float32 (id 40).
        cand[6, [3, 80]] = [40, 20]; base_c[6, [3, 80]] = 1.0; lat[6, 0] = 2.0**-10; w2[40, 0] = 1.0
        expect[6] = 20 if dtype == jnp.bfloat16 else 40
        # inf * 0 -> NaN bias; +inf base + -inf bias -> NaN: all scores -inf -> the largest base (50).
        cand[7, 5] = 50; base_c[7, 5] = inf; lat[7, 1] = inf; w2[50, 1] = -1.0; expect[7] = 50
        # Equal scores, different base logits (1.0 + 0.5 == 1.5 + 0): the larger base logit, not the lower id.
        cand[8, [5, 70]] = [800, 801]; base_c[8, [5, 70]] = [1.0, 1.5]; lat[8, 0] = 1.0; w2[800, 0] = 0.5
        expect[8] = 801
        # Tied only after rounding to bf16: the larger base logit (805) wins.
        cand[9, [3, 40]] = [804, 805]; base_c[9, [3, 40]] = [0.5, 1.0]; lat[9, 0] = 1.0
        w2[804, 0] = 0.5; w2[805, 0] = 2.0**-10
        expect[9] = 805
        # Three-way score tie, two also tied on the base logit: the larger base, then the lower id.
        cand[10, [0, 33, 64]] = [806, 808, 807]; base_c[10, [0, 33, 64]] = [1.0, 1.5, 1.5]; lat[10, 0] = 1.0
        w2[806, 0] = 0.5
        expect[10] = 807
        base_c[11:] = rng.integers(0, 4, (rows - 11, c))  # massive ties: the lowest id of the max
        for r in range(11, rows):
            expect[r] = int(cand[r][base_c[r] == base_c[r].max()].min())
        args = (jnp.asarray(base_c).astype(dtype), jnp.asarray(cand), jnp.asarray(lat).astype(dtype),
                jnp.asarray(w2).astype(dtype))
        want = np.array([expect[r] for r in range(rows)])
        np.testing.assert_array_equal(_reference(*args), want)
        for cfg in (ts.StreamConfig(p_tile=16, k_tile=8, row_tile=4, c_tile=32), ts.StreamConfig()):
            got = ts.topc_stream_pick(*args, interpret=self.INTERPRET, config=cfg)
            np.testing.assert_array_equal(np.asarray(got), want)

    @pytest.mark.parametrize("dtype", [pytest.param(jnp.bfloat16, id="bfloat16"),
                                       pytest.param(jnp.float32, id="float32", marks=pytest.mark.slow)])
    def test_row_ids_skip_slots_and_lat_add(self, dtype):
        """``row_ids`` (any order, repeats), ``skip_slots`` (rows of the first s slots of each block not scored)
        and ``lat_add`` (the residual's two float32 terms): the top-C pick's tokens for the same rows; a prepared
        sort passed in gives the same tokens as one made inside."""
        per, n = 5, 7  # 7 blocks of 5 draft slots
        rows = per * n
        cfg = tp.TopCConfig(c_tile=16, c_steps=2, k_tile=16)
        base_c, cand, lat, w2 = _inputs(rows, 900, 70, 40, dtype, seed=21)
        lat32 = lat.astype(jnp.float32)
        add = jnp.asarray(np.random.default_rng(4).standard_normal(lat.shape).astype(np.float32) * 0.05)
        kw = dict(interpret=self.INTERPRET)
        scfg = _stream_config(cfg)
        all_rows = np.asarray(tp.topc_pick(base_c, cand, lat, w2, config=cfg, **kw))
        summed = np.asarray(tp.topc_pick(base_c, cand, lat32, w2, config=cfg, lat_add=add, **kw))
        prep = ts.prepare(cand)
        np.testing.assert_array_equal(np.asarray(ts.topc_stream_pick(base_c, cand, lat, w2, prep, config=scfg, **kw)),
                                      all_rows)
        np.testing.assert_array_equal(
            np.asarray(ts.topc_stream_pick(base_c, cand, lat32, w2, prep, config=scfg, lat_add=add, **kw)), summed)
        ids = np.random.default_rng(3).choice(rows, 11).astype(np.int32)
        ids[:3] = [rows - 1, 0, rows - 1]
        got = ts.topc_stream_pick(base_c, cand, lat, w2, prep, config=scfg, row_ids=jnp.asarray(ids), **kw)
        np.testing.assert_array_equal(np.asarray(got), all_rows[ids])
        s = 2  # slots 0, 1 of every block final: the pass pick's rows
        kept = (np.arange(n)[:, None] * per + np.arange(s, per)[None, :]).reshape(-1).astype(np.int32)
        got = ts.topc_stream_pick(base_c, cand, lat32, w2, prep, config=scfg, lat_add=add, row_ids=jnp.asarray(kept),
                                  skip_slots=(per, s), **kw)
        np.testing.assert_array_equal(np.asarray(got), summed[kept])
        assert len(set(summed[kept].tolist())) > 1

    def test_bad_arguments(self):
        base_c, cand, lat, w2 = _inputs(15, 300, 20, 8, jnp.float32, seed=4)
        kw = dict(interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="p_tile"):
            ts.topc_stream_pick(base_c, cand, lat, w2, config=ts.StreamConfig(p_tile=24), **kw)
        with pytest.raises(ValueError, match="w2"):
            ts.topc_stream_pick(base_c, cand, lat, w2[:, :4], **kw)
        with pytest.raises(ValueError, match="row_ids"):
            ts.topc_stream_pick(base_c, cand, lat, w2, row_ids=jnp.zeros((0,), jnp.int32), **kw)
        with pytest.raises(ValueError, match="skip_slots"):
            ts.topc_stream_pick(base_c, cand, lat, w2, skip_slots=(5, 5), **kw)
        with pytest.raises(ValueError, match="prepared"):
            ts.topc_stream_pick(base_c, cand, lat, w2, ts.prepare(cand[:3]), **kw)
        with pytest.raises(ValueError, match="lat_add"):
            ts.topc_stream_pick(base_c, cand, lat, w2, lat_add=lat[:, :4], **kw)
        with jax.enable_x64(True):
            b64, c64, l64, w64 = _inputs(15, 300, 20, 8, jnp.float64, seed=3)
            with pytest.raises(TypeError, match="float64"):
                ts.topc_stream_pick(b64, c64, l64, w64, **kw)

    @pytest.mark.parametrize("n", [16, 256])
    def test_serving_shapes_equal_the_topc_pick(self, n):
        """GPU only: at serving shapes (V=151936, r=256, C=512, bf16, B=16) with the served top-C config, the
        stream pick's tokens are the top-C pick's, on every row and with the pass pick's row subsets."""
        if self.INTERPRET:
            pytest.skip("serving shapes: the compiled kernels only")
        rows, vocab, c, rank, dt = n * 15, 151936, 512, 256, jnp.bfloat16
        cfg = dispatch.plan(rows, 2, vocab, rank, c, dt).topc
        args = _inputs(rows, vocab, c, rank, dt, seed=n)
        want, got = self.both(*args, cfg)
        np.testing.assert_array_equal(got, want)
        kept = (np.arange(n)[:, None] * 15 + np.arange(3, 15)[None, :]).reshape(-1).astype(np.int32)
        got = ts.topc_stream_pick(*args, config=_stream_config(cfg), row_ids=jnp.asarray(kept), skip_slots=(15, 3))
        np.testing.assert_array_equal(np.asarray(got), want[kept])


class TestTopCStreamInterpret(TestTopCStream):
    INTERPRET = True


class TestTopCStreamLowering:
    """Both kernels lower to Triton for an H200 at serving shapes."""

    @pytest.mark.parametrize("rows", [pytest.param(240, marks=pytest.mark.slow), 3840])
    def test_lowers_at_serving_shapes(self, rows):
        V, C, r, dt = 151936, 512, 256, jnp.bfloat16
        S = jax.ShapeDtypeStruct
        args = (S((rows, C), dt), S((rows, C), jnp.int32), S((rows, r), dt), S((V, r), dt))
        cfg = _stream_config(dispatch.plan(rows, 2, V, r, C, dt).topc)
        hlo = common.lower_triton(functools.partial(ts.topc_stream_pick, config=cfg), *args).as_text()
        assert triton_operand_counts(hlo, "xpress_topc_stream_bias") == [4]
        assert triton_operand_counts(hlo, "xpress_topc_stream_winner") == [3]
        # A pass that skips the first 3 slots, the latent as the residual's two float32 terms.
        f32 = S((rows, r), jnp.float32)

        def f(b_, c_, l_, w_, a_, i_):
            return ts.topc_stream_pick(b_, c_, l_, w_, config=cfg, lat_add=a_, row_ids=i_, skip_slots=(15, 3))

        hlo = common.lower_triton(f, args[0], args[1], f32, args[3], f32, S((rows * 12 // 15,), jnp.int32)).as_text()
        assert triton_operand_counts(hlo, "xpress_topc_stream_bias") == [4]
        assert triton_operand_counts(hlo, "xpress_topc_stream_winner") == [4]


@pytest.mark.interpret_refine
@pytest.mark.slow
@pytest.mark.parametrize("unroll", [pytest.param(True, id="unrolled"), pytest.param(False, id="loop")])
def test_refine_with_the_stream_pick(unroll):
    """A whole top-C refine with `dispatch.Entry.topc_stream` on (the plain pick, the unrolled pass pick over the
    slots not yet final, the split latent of small N) gives the default table's tokens, which change most drafts."""
    cfg = xj.HeadConfig(**SMALL)
    params = make_head(cfg, dtype=jnp.bfloat16)
    logits, h, anchors, prev = make_inputs(cfg, 3, dtype=jnp.bfloat16)
    stream = Ops.pallas(interpret=True, table=dispatch.TABLE.with_columns(topc_stream=True))
    want = refine_with(Ops.pallas(interpret=True), params, logits, h, anchors, prev, config=cfg, unroll=unroll)
    got = refine_with(stream, params, logits, h, anchors, prev, config=cfg, unroll=unroll)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    start = np.asarray(R.full_vocab_start(logits)).reshape(3, -1)
    assert (np.asarray(got) != start).mean() > 0.3


@pytest.mark.interpret
@pytest.mark.parametrize("temperature", [0.0, 0.7, 3.0])
def test_sampled_stream_pick_is_the_sampled_topc_pick(temperature):
    """With the noise (``seeds``, ``inv_t``), the stream pick's tokens are `topc_pick.topc_pick`'s sampled ones on
    every row (the same biases, the same key per (row, candidate)), also through ``row_ids`` / ``skip_slots``; the
    noise changes some rows' winners (T > 0) and none at T = 0 (the greedy tokens)."""
    rows, v, c, r, cfg = SHAPES[0]
    base, lat, w2 = pick_inputs(rows, v, r, jnp.bfloat16, seed=7)
    base_c, cand = jax.lax.top_k(R.clean(base), c)
    cand = cand.astype(jnp.int32)
    seeds = jax.random.randint(jax.random.key(5), (rows,), -2**31, 2**31 - 1, jnp.int32)
    inv_t = jnp.float32(0.0 if temperature == 0 else 1 / temperature)
    scfg = ts.like_topc(cfg.c_tile, cfg.k_tile, cfg.num_warps, cfg.num_stages)
    kw = dict(seeds=seeds, inv_t=inv_t, interpret=True)
    want = np.asarray(tp.topc_pick(base_c, cand, lat, w2, config=cfg, **kw))
    got = np.asarray(ts.topc_stream_pick(base_c, cand, lat, w2, config=scfg, **kw))
    np.testing.assert_array_equal(got, want)
    greedy = np.asarray(tp.topc_pick(base_c, cand, lat, w2, config=cfg, interpret=True))
    assert (got != greedy).any() == (temperature > 0)
    ids = np.arange(2, rows, dtype=np.int32)  # the rows of "slots" 2.. of blocks of 3 rows, as a pass pick asks
    ids = ids[ids % 3 >= 2]
    part = np.asarray(ts.topc_stream_pick(base_c, cand, lat, w2, config=scfg, row_ids=jnp.asarray(ids),
                                          skip_slots=(3, 2), **kw))
    np.testing.assert_array_equal(part, want[ids])


@pytest.mark.slow
@pytest.mark.interpret_refine
@pytest.mark.parametrize("unroll", [True, False])
def test_sampled_refine_with_the_stream_pick(unroll):
    """A sampled top-C refine with `dispatch.Entry.topc_stream` on gives the default table's tokens."""
    cfg = xj.HeadConfig(**SMALL)
    params = make_head(cfg, dtype=jnp.bfloat16)
    logits, h, anchors, prev = make_inputs(cfg, 3, dtype=jnp.bfloat16)
    kw = dict(config=cfg, unroll=unroll, temperature=0.8, key=jax.random.key(11))
    stream = Ops.pallas(interpret=True, table=dispatch.TABLE.with_columns(topc_stream=True))
    want = refine_with(Ops.pallas(interpret=True), params, logits, h, anchors, prev, **kw)
    got = refine_with(stream, params, logits, h, anchors, prev, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
