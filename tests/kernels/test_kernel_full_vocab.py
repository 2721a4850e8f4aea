"""Full-vocab pick kernels (xpress_jax.kernels.full_vocab) against the jnp oracle.

`TestFullVocabPick` runs the kernels for real (GPU only); its twin
`TestFullVocabPickInterpret` runs the same tests on CPU in interpret mode.
`TestFullVocabLowering` lowers every kernel for an H200 on CPU.

Exactness. The outputs are token ids: demanded equal. The kernel sums the float32 dot in its own order, so a bias within an ulp of a
rounding boundary may round the other way; there we demand equality on every
row that is not such a near tie (`helpers.near_tie_rows` bounds the float32
accumulation error and checks whether the oracle's winner could lose), and
demand strict equality on "dyadic" inputs whose dot products are exact in any
summation order (which also produce many genuine ties).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TRITON_CALL, lower_triton, near_tie_rows, pick_inputs, triton_operand_counts, triton_operands

from xpress_jax import dispatch
from xpress_jax import reference as R
from xpress_jax.kernels import common
from xpress_jax.kernels import full_vocab as fv

DTYPES = [jnp.float32, jnp.bfloat16]

# (rows, V, r, config): rows = N*(B-1): N=1,B=16 / N=5,B=6 (B not a power of two) / N=5,B=16.
SHAPES = [
    (15, 1000, 32, None),
    (25, 1337, 64, fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=3, k_tile=16, hold_lat=False)),
    (25, 1337, 64, fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=3, k_tile=16, hold_lat=False, flat=True,
                                      prefetch_base=True)),
    (75, 2053, 32, fv.FullVocabConfig(row_tile=32, v_tile=256, v_steps=1)),
    # lazy (elementwise running best, one lane reduction per part): held latent and flat loop.
    (25, 1337, 64, fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=4, lazy=True, prefetch_base=True)),
    (75, 2053, 32, fv.FullVocabConfig(row_tile=32, v_tile=64, v_steps=3, k_tile=16, hold_lat=False, flat=True,
                                      lazy=True)),
]


ACTIVE_SHAPES = [
    (37, 1001, 24, fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=3, k_tile=16)),
    (25, 1337, 64, fv.FullVocabConfig(row_tile=16, v_tile=64, v_steps=4, k_tile=16, hold_lat=False, flat=True,
                                      prefetch_base=True, lazy=True)),
]


def pack_active_ref(fail: jax.Array, fallen: jax.Array, *, limit: int, skip_slots: int = 0, slots: int = 1):
    """`fv.pack_active` in jnp (the oracle of the tests below)."""
    rows = fail.shape[0]
    n_pad = common.next_pow2(rows)
    f = jnp.zeros((n_pad,), bool).at[:rows].set(fail != 0)
    n_fail = jnp.sum(f, dtype=jnp.int32)
    full = jnp.reshape(jnp.asarray(fallen), (-1,))[0] != 0
    full = full | (n_fail > limit)
    q = jnp.arange(n_pad)
    a = (f | full) & (q < rows) & (q % slots >= skip_slots)
    ai = a.astype(jnp.int32)
    n_act = jnp.sum(ai)
    pos = jnp.where(a, jnp.cumsum(ai) - 1, n_act + jnp.cumsum(1 - ai) - 1).astype(jnp.int32)
    src = jnp.zeros((n_pad,), jnp.int32).at[pos].set(jnp.arange(n_pad, dtype=jnp.int32))
    flags = jnp.zeros((8,), jnp.int32).at[0].set(full.astype(jnp.int32)).at[1].set(n_fail)
    return pos[:rows], src, (jnp.arange(n_pad) < n_act).astype(jnp.int32), ai[:rows], flags


def _mask_kinds(rows: int, t: int, rng) -> dict:
    """Active-row masks of every kind for ``rows`` rows in row tiles of ``t``: all, none, one row, the second
    row tile, the last (partial) tile's last rows, random."""
    r = np.arange(rows)
    return {"all": np.ones(rows, bool), "none": np.zeros(rows, bool), "one": r == rows // 2,
            "tile": (r >= t) & (r < 2 * t), "tail": r >= rows - 3, "random": rng.random(rows) < 0.3}


def _shape_dtypes(fast: str):
    """Every shape (config path) and dtype: the case ``fast`` in the default run, the others `slow`."""
    out = []
    for i, shape in enumerate(SHAPES):
        for dt in DTYPES:
            name = f"rows{shape[0]}-V{shape[1]}-r{shape[2]}_{i}-{jnp.dtype(dt).name}"
            out.append(pytest.param(shape, dt, id=name, marks=() if name == fast else pytest.mark.slow))
    return out


class TestFullVocabPick:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not common.gpu_supported():
            pytest.skip("needs a CUDA GPU; TestFullVocabPickInterpret runs these tests on CPU")

    def pick(self, base, lat, w2, config=None, **kw):
        return fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=config, **kw)

    @pytest.mark.parametrize("shape,dtype", _shape_dtypes("rows25-V1337-r64_4-float32"))
    def test_matches_reference(self, shape, dtype):
        rows, vocab, rank, config = shape
        # Random normal inputs.
        base, lat, w2 = pick_inputs(rows, vocab, rank, dtype, seed=rows + vocab)
        ref = np.asarray(R.full_vocab_pick(base, lat, w2))
        got = np.asarray(self.pick(base, lat, w2, config))
        assert got.dtype == np.int32 and got.shape == (rows,)
        near = near_tie_rows(base, lat, w2, ref)
        assert near.mean() < 0.1, f"{near.sum()} near ties of {rows}: the check would be vacuous"
        np.testing.assert_array_equal(got[~near], ref[~near])
        # Dyadic inputs: exact dot in any order, many ties -> strict equality for every variant.
        base, lat, w2 = pick_inputs(rows, vocab, rank, dtype, seed=rows, dyadic=True)
        ref = np.asarray(R.full_vocab_pick(base, lat, w2))
        np.testing.assert_array_equal(np.asarray(self.pick(base, lat, w2, config)), ref)

    @pytest.mark.slow  # fast: both orders in test_l2_hints_are_the_same_pick
    @pytest.mark.parametrize("shape,dtype", _shape_dtypes("rows15-V1000-r32_0-float32"))
    def test_reverse_order_is_the_same_pick(self, shape, dtype):
        """``reverse=True`` (each program visits its vocab tiles from the highest ids down; refine alternates it
        between passes) computes every (row, id) score as the ascending order does: the same ids on random and
        dyadic (tie-rich) inputs, and the same per-part winners, score and id, bit for bit."""
        rows, vocab, rank, config = shape
        for dyadic in (False, True):
            base, lat, w2 = pick_inputs(rows, vocab, rank, dtype, seed=3 * rows + vocab, dyadic=dyadic)
            want = np.asarray(self.pick(base, lat, w2, config))
            np.testing.assert_array_equal(np.asarray(self.pick(base, lat, w2, config, reverse=True)), want)
            if dyadic:  # exact dots: the oracle's ids too
                np.testing.assert_array_equal(want, np.asarray(R.full_vocab_pick(base, lat, w2)))
        fwd = self.pick(base, lat, w2, config, partials=True)
        rev = self.pick(base, lat, w2, config, partials=True, reverse=True)
        assert fwd[0].shape[0] > 1, "the config must split the vocabulary into parts"
        for a, b in zip(fwd, rev):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    @pytest.mark.parametrize("keep", [k for k in fv.KEEP_POLICIES if k is not None])
    @pytest.mark.parametrize("shape", [pytest.param(SHAPES[2], id="flat"),
                                       pytest.param(SHAPES[3], id="one-tile", marks=pytest.mark.slow),
                                       pytest.param(SHAPES[5], id="flat-lazy", marks=pytest.mark.slow)])
    @pytest.mark.slow(interpret_only=True)
    def test_l2_hints_are_the_same_pick(self, shape, keep):
        """``keep`` (L2 eviction hints on the w2 loads; the loop split where the policy changes: the part's last
        visited tile apart) gives the ids and per-part winners of the plain pick, in both orders, on random and
        dyadic (tie-rich) inputs; with ``row_ids`` too. Configs: a flat loop of 3 tiles per part, one tile per
        part (an empty first segment), a lazy flat loop."""
        rows, vocab, rank, config = shape
        for i, dyadic in enumerate((False, True)):
            base, lat, w2 = pick_inputs(rows, vocab, rank, DTYPES[i], seed=7 * rows + vocab, dyadic=dyadic)
            for reverse in (False, True):
                want = self.pick(base, lat, w2, config, partials=True, reverse=reverse)
                got = self.pick(base, lat, w2, config, partials=True, reverse=reverse, keep=keep)
                for a, b in zip(got, want):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{keep} reverse={reverse}")
            ids = jnp.asarray(np.arange(rows)[::-3].astype(np.int32))
            np.testing.assert_array_equal(np.asarray(self.pick(base, lat, w2, config, row_ids=ids, keep=keep)),
                                          np.asarray(self.pick(base, lat, w2, config))[np.asarray(ids)])

    @pytest.mark.parametrize("dtype,stride", [
        pytest.param(jnp.float32, 6, id="float32-slot-stride", marks=pytest.mark.slow),  # fast: l2_hints' row_ids
        pytest.param(jnp.float32, 0, id="float32-rows", marks=pytest.mark.slow),
        pytest.param(jnp.bfloat16, 0, id="bfloat16-rows", marks=pytest.mark.slow),
        pytest.param(jnp.bfloat16, 6, id="bfloat16-slot-stride", marks=pytest.mark.slow),
    ])
    def test_row_ids(self, dtype, stride):
        """``row_ids`` picks only the listed rows (any order, repeats allowed), each the id (and with ``partials``
        the per-part winners) the all-rows pick gives it with the same config, in either vocabulary order;
        bad ids are refused."""
        rows, vocab, rank = 25, 1337, 40  # 5 blocks of B=6; a rank tail (k_tile 16)
        cfg = fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=3, k_tile=16, hold_lat=False, flat=True,
                                 prefetch_base=True, lazy=True)
        base, lat, w2 = pick_inputs(rows, vocab, rank, dtype, seed=11)
        kw = dict(slot_stride=stride)
        if stride:  # the whole logits [N*B, V]: draft row q reads row (q // 5) * 6 + 1 + q % 5
            full = jnp.zeros((rows // (stride - 1) * stride, vocab), base.dtype)
            src = np.array([(q // (stride - 1)) * stride + 1 + q % (stride - 1) for q in range(rows)])
            base = full.at[src].set(base).at[::stride].set(100)  # slot 0 rows would win everything
        want = np.asarray(self.pick(base, lat, w2, cfg, **kw))
        parts_all = self.pick(base, lat, w2, cfg, partials=True, **kw)
        ids = np.random.default_rng(5).choice(rows, 19).astype(np.int32)  # 19 > 16: two row tiles, repeats
        ids[:3] = [rows - 1, 0, rows - 1]
        for reverse in (False, True):
            got = np.asarray(self.pick(base, lat, w2, cfg, row_ids=jnp.asarray(ids), reverse=reverse, **kw))
            np.testing.assert_array_equal(got, want[ids])
            mv, mi = self.pick(base, lat, w2, cfg, row_ids=jnp.asarray(ids), partials=True, reverse=reverse, **kw)
            np.testing.assert_array_equal(np.asarray(mv), np.asarray(parts_all[0])[:, ids])
            np.testing.assert_array_equal(np.asarray(mi), np.asarray(parts_all[1])[:, ids])
        assert len(set(want[ids].tolist())) > 1
        for bad in (jnp.asarray(ids, jnp.float32), jnp.zeros((0,), jnp.int32), jnp.asarray(ids)[None]):
            with pytest.raises(ValueError, match="row_ids"):
                self.pick(base, lat, w2, cfg, row_ids=bad, **kw)
        # active with row_ids is by position (the certified mode's fallback scan): inactive positions' row
        # tiles read nothing and report "no winner"; active ones their row's partials, bit for bit
        act = np.zeros(len(ids), np.int32)
        act[16:] = 1  # the second row tile only: the first returns at once
        mv, mi = self.pick(base, lat, w2, cfg, row_ids=jnp.asarray(ids), active=jnp.asarray(act), partials=True, **kw)
        np.testing.assert_array_equal(np.asarray(mv)[:, 16:], np.asarray(parts_all[0])[:, ids[16:]])
        np.testing.assert_array_equal(np.asarray(mi)[:, 16:], np.asarray(parts_all[1])[:, ids[16:]])
        assert np.all(np.asarray(mv)[:, :16] == -np.inf) and np.all(np.asarray(mi)[:, :16] == fv.BIG)
        got = np.asarray(self.pick(base, lat, w2, cfg, row_ids=jnp.asarray(ids), active=jnp.ones(len(ids), bool), **kw))
        np.testing.assert_array_equal(got, want[ids])
        with pytest.raises(ValueError, match="active"):
            self.pick(base, lat, w2, cfg, row_ids=jnp.asarray(ids), active=jnp.ones((rows,), bool), **kw)
        with pytest.raises(ValueError, match="fallback"):
            self.pick(base, lat, w2, cfg, row_ids=jnp.asarray(ids), active=jnp.ones(len(ids), bool),
                      fallback=jnp.zeros(len(ids), jnp.int32), **kw)

    @pytest.mark.parametrize("dtype,lazy,reverse", [
        pytest.param(jnp.bfloat16, True, False, id="bfloat16-fused-lazy-ascending"),
        pytest.param(jnp.float32, True, True, id="float32-fused-lazy-reverse"),
        pytest.param(jnp.float32, False, False, id="float32-fused-ascending", marks=pytest.mark.slow),
        pytest.param(jnp.float32, False, True, id="float32-fused-reverse", marks=pytest.mark.slow),
        pytest.param(jnp.float32, True, False, id="float32-fused-lazy-ascending", marks=pytest.mark.slow),
        pytest.param(jnp.bfloat16, False, False, id="bfloat16-fused-ascending", marks=pytest.mark.slow),
        pytest.param(jnp.bfloat16, False, True, id="bfloat16-fused-reverse", marks=pytest.mark.slow),
        pytest.param(jnp.bfloat16, True, True, id="bfloat16-fused-lazy-reverse", marks=pytest.mark.slow),
    ])
    def test_ties_and_nonfinite(self, dtype, lazy, reverse):
        # rows = 5 blocks of B=6; V=1000 is not a multiple of the 128-wide tile;
        # 2 tiles per part -> parts [0,256) [256,512) [512,768) [768,1000).
        rows, vocab, rank = 25, 1000, 16
        cfg = fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=2, lazy=lazy)
        base = np.full((rows, vocab), -5.0, np.float32)
        lat = np.zeros((rows, rank), np.float32)
        w2 = np.zeros((vocab, rank), np.float32)
        inf, nan = np.inf, np.nan
        expect = {}
        base[0, [3, 7]] = 2; expect[0] = 3  # tie inside one tile
        base[1, [900, 130, 999]] = 2; expect[1] = 130  # tie across tiles and parts, and at the last column
        base[2, [999, 500]] = 2; expect[2] = 500  # tie at the last column of V
        base[3, 999] = 3; expect[3] = 999  # the winner is the last column
        base[4, 5] = nan; base[4, 10] = 1; expect[4] = 10  # NaN never wins
        base[5, [600, 200]] = inf; expect[5] = 200  # +inf wins, lowest id among them
        base[6] = -inf; expect[6] = 0  # all -inf -> id 0
        base[7] = nan; expect[7] = 0  # all NaN -> id 0
        base[8] = -inf; base[8, 0] = nan; expect[8] = 0
        base[9] = -inf; base[9, 998] = -1e30; expect[9] = 998
        # Rounding tie: 1 + 2^-10 rounds to 1 in bf16 (tie -> id 20), stays larger in float32 (id 40).
        base[10, [20, 40]] = 1.0; lat[10, 0] = 2.0**-10; w2[40, 0] = 1.0
        expect[10] = 20 if dtype == jnp.bfloat16 else 40
        # inf * 0 in the dot -> NaN bias; +inf base + -inf bias -> NaN: all count as -inf -> id 0.
        base[11, 50] = inf; lat[11, 1] = inf; w2[50, 1] = -1.0; expect[11] = 0
        rng = np.random.default_rng(0)
        base[12:] = rng.integers(0, 4, (rows - 12, vocab))  # massive ties: the lowest id of the max
        for r in range(12, rows):
            expect[r] = int(np.argmax(base[r]))
        base, lat, w2 = (jnp.asarray(a).astype(dtype) for a in (base, lat, w2))
        ref = np.asarray(R.full_vocab_pick(base, lat, w2))
        got = np.asarray(self.pick(base, lat, w2, cfg, reverse=reverse))
        want = np.array([expect[r] for r in range(rows)])
        np.testing.assert_array_equal(ref, want)  # the oracle obeys the rules as stated
        np.testing.assert_array_equal(got, want)

    def test_float64_is_refused(self):
        """The kernel refuses float64 (TypeError naming the dtype); refine routes it to the reference."""
        with jax.enable_x64(True):
            base, lat, w2 = pick_inputs(15, 300, 8, jnp.float64, seed=3)
            with pytest.raises(TypeError, match="float64"):
                fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET)

    def test_bad_arguments(self):
        base, lat, w2 = pick_inputs(15, 300, 8, jnp.float32, seed=4)
        with pytest.raises(ValueError, match="row_tile"):
            self.pick(base, lat, w2, fv.FullVocabConfig(row_tile=12))
        with pytest.raises(ValueError, match="shapes"):
            self.pick(base, lat, w2[:-1])


    @pytest.mark.parametrize("shape,pack", [  # packed: capacity = rows
        pytest.param(ACTIVE_SHAPES[0], False, id="rows37-V1001-tiles"),
        pytest.param(ACTIVE_SHAPES[0], True, id="rows37-V1001-packed", marks=pytest.mark.slow),
        pytest.param(ACTIVE_SHAPES[1], False, id="rows25-flat-lazy-tiles", marks=pytest.mark.slow),
        pytest.param(ACTIVE_SHAPES[1], True, id="rows25-flat-lazy-packed", marks=pytest.mark.slow),
    ])
    @pytest.mark.slow(interpret_only=True)
    def test_active_rows(self, shape, pack):
        """``active``: the active rows' tokens (and partials' winners) are the plain pick's, for every mask
        kind (all, none, one row, one row tile, the last (partial) tile, random); rows not a multiple of
        the row tile, V not of the vocab tile, r not of the rank chunk. Packed (``capacity`` = every row):
        the active rows are moved to the leading tiles first; tiles: each row tile that holds an active row
        runs in place."""
        cap = dict(capacity=shape[0]) if pack else {}
        rows, vocab, rank, cfg = shape
        base, lat, w2 = pick_inputs(rows, vocab, rank, jnp.float32, seed=rows, dyadic=True)
        want = np.asarray(R.full_vocab_pick(base, lat, w2))
        rng = np.random.default_rng(rows)
        t = cfg.row_tile
        masks = _mask_kinds(rows, t, rng)
        for name, act in masks.items():
            for a in (jnp.asarray(act), jnp.asarray(act, jnp.int32)):
                got = np.asarray(fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, active=a,
                                                    **cap))
                assert got.shape == (rows,)
                np.testing.assert_array_equal(got[act], want[act], err_msg=name)
            if not pack:  # partials (capacity goes without them)
                mv, mi = fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg,
                                            active=jnp.asarray(act), partials=True)
                np.testing.assert_array_equal(np.asarray(R.best_by_score(mv, mi, axis=0)[1])[act], want[act],
                                              err_msg=name)
            if not pack:  # fallback: inactive rows return the caller's ids, written by the combine launch
                fb = rng.integers(0, vocab, rows).astype(np.int32)
                got = np.asarray(fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg,
                                                    active=jnp.asarray(act), fallback=jnp.asarray(fb)))
                np.testing.assert_array_equal(got, np.where(act, want, fb), err_msg=f"fallback {name}")
        # A row tile without an active row writes "no winner" partials (-inf, BIG); in place (no packing).
        act = np.arange(rows) < t  # only the first tile
        mv, mi = fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, active=jnp.asarray(act),
                                    partials=True)
        assert np.isneginf(np.asarray(mv)[:, t:]).all() and (np.asarray(mi)[:, t:] == common.BIG).all()
        with pytest.raises(ValueError, match="active"):
            fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, active=jnp.ones(rows + 1, bool))
        if not pack:  # one vocabulary part: no combine launch, the fallback is applied in jnp
            one = dataclasses.replace(cfg, v_steps=fv.cdiv(vocab, cfg.v_tile))
            fb = np.arange(rows, dtype=np.int32)
            got = np.asarray(fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=one,
                                                active=jnp.asarray(masks["random"]), fallback=jnp.asarray(fb)))
            np.testing.assert_array_equal(got, np.where(masks["random"], want, fb))
        fb = jnp.zeros((rows,), jnp.int32)
        for bad in (dict(), dict(active=jnp.ones(rows, bool), capacity=rows),
                    dict(active=jnp.ones(rows, bool), partials=True)):
            with pytest.raises(ValueError, match="fallback"):
                fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, fallback=fb, **bad)

    @pytest.mark.parametrize("shape", [
        (37, 1001, 24, fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=3, k_tile=16)),
        pytest.param((15, 1000, 32, None), marks=pytest.mark.slow),
        pytest.param((25, 1337, 64, fv.FullVocabConfig(row_tile=16, v_tile=64, v_steps=4, k_tile=16, hold_lat=False,
                                                       flat=True, prefetch_base=True, lazy=True)),
                     marks=pytest.mark.slow),
    ], ids=["rows37-V1001", "rows15-default", "rows25-flat-lazy"])
    @pytest.mark.slow(interpret_only=True)
    def test_counted(self, shape):
        """``counter`` (the counted launch: the last program of a row tile combines its parts): the tokens of
        the pick with ``active`` and ``fallback`` for every mask kind, on random (not dyadic) bf16 inputs bit for
        bit (the same per-row computation, the combine's rule), and the counter entries zero again after each
        call, the others untouched, so the returned counter serves the next call (three chained calls, the
        vocabulary read in either order). Where no row is active the tokens are ``fallback`` itself."""
        rows, vocab, rank, cfg = shape
        base, lat, w2 = pick_inputs(rows, vocab, rank, jnp.bfloat16, seed=rows + 1)
        rng = np.random.default_rng(rows)
        t = (cfg or fv.default_config(rows, vocab, rank, jnp.bfloat16)).row_tile
        masks = _mask_kinds(rows, t, rng)
        flags = jnp.asarray([1, 5, 0, 0, 0, 0, 0, 0], jnp.int32)
        for name, act in masks.items():
            fb = jnp.asarray(rng.integers(0, vocab, rows).astype(np.int32))
            a = jnp.asarray(act, jnp.int32)
            cnt = flags
            for reverse in (False, True, False):
                kw = dict(interpret=self.INTERPRET, config=cfg, active=a, fallback=fb, reverse=reverse)
                want = np.asarray(fv.full_vocab_pick(base, lat, w2, **kw))
                got, cnt = fv.full_vocab_pick(base, lat, w2, counter=cnt, counter_at=2, **kw)
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
                np.testing.assert_array_equal(np.asarray(cnt), np.asarray(flags), err_msg=name)
            if name == "none":
                np.testing.assert_array_equal(np.asarray(got), np.asarray(fb))
        a, fb = jnp.ones(rows, jnp.int32), jnp.zeros(rows, jnp.int32)
        tiles = fv.cdiv(rows, t)
        for bad, match in ((dict(fallback=fb, counter=flags, counter_at=9 - tiles), "counter must be"),
                           (dict(fallback=fb, counter=flags.astype(jnp.float32)), "counter must be"),
                           (dict(fallback=fb, counter=flags, counter_at=-1), "counter must be"),
                           (dict(counter=flags, counter_at=2), "counter needs")):
            with pytest.raises(ValueError, match=match):
                fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, active=a, **bad)

    @pytest.mark.slow(interpret_only=True)
    def test_active_with_slot_stride(self):
        """``active`` with ``slot_stride=B`` (how refine calls it): packed rows read their own logits row."""
        N, B, V, r = 5, 6, 700, 16
        base, lat, w2 = pick_inputs(N * B, V, r, jnp.float32, seed=2, dyadic=True)
        lat = lat[: N * (B - 1)]
        cfg = fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=2)
        want = np.asarray(fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, slot_stride=B))
        act = np.random.default_rng(0).random(N * (B - 1)) < 0.25
        got = np.asarray(fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, slot_stride=B,
                                            active=jnp.asarray(act)))
        np.testing.assert_array_equal(got[act], want[act])


    @pytest.mark.parametrize("capacity", [16, *(pytest.param(c, marks=pytest.mark.slow) for c in (5, 20, 37, 64))])
    @pytest.mark.slow(interpret_only=True)
    def test_active_capacity(self, capacity):
        """``capacity``: the first ``capacity`` active rows (in row order) get the plain pick's tokens, on a
        grid of only ``ceil(capacity / row_tile)`` row tiles; active rows beyond it read BIG. With
        `dispatch.Table.capacity_config`'s fewer vocabulary tiles per program the tokens equal the all-rows
        config's BIT FOR BIT on random (not dyadic) bf16 inputs: only the vocabulary split differs."""
        n, B, vocab, rank = 8, 6, 4099, 40  # 40 draft rows (B not a power of two), a rank tail chunk
        rows = n * (B - 1)
        cfg = fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=4, k_tile=16)
        cap_cfg = dispatch.TABLE.capacity_config(cfg, vocab)
        assert cap_cfg.v_steps == 1 and dataclasses.replace(cap_cfg, v_steps=cfg.v_steps) == cfg
        base, lat, w2 = pick_inputs(n * B, vocab, rank, jnp.bfloat16, seed=capacity)
        lat = lat[:rows]
        want = np.asarray(fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, slot_stride=B))
        rng = np.random.default_rng(capacity)
        for frac in (0.1, 0.5, 1.0):
            act = rng.random(rows) < frac
            first = act & (np.cumsum(act) <= capacity)  # the rows the capacity holds
            got = np.asarray(fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cap_cfg, slot_stride=B,
                                                active=jnp.asarray(act), capacity=capacity))
            np.testing.assert_array_equal(got[first], want[first], err_msg=f"frac {frac}")
            assert (got[act & ~first] == common.BIG).all()  # active rows beyond the capacity: never computed
        with pytest.raises(ValueError, match="capacity needs active"):
            fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, slot_stride=B, capacity=4)
        with pytest.raises(ValueError, match="without partials"):
            fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, slot_stride=B,
                               active=jnp.asarray(act), capacity=4, partials=True)
        with pytest.raises(ValueError, match="capacity must be"):
            fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, slot_stride=B,
                               active=jnp.asarray(act), capacity=0)


    @pytest.mark.parametrize("rows,slots", [(37, 6), pytest.param(75, 15, marks=pytest.mark.slow)])
    @pytest.mark.slow(interpret_only=True)
    def test_pack_active_skips_final_slots(self, rows, slots):
        """``skip_slots`` (the certified mode's passes that know their number): rows ``q % slots < skip_slots``
        are never active, not even in a full pass or when ``fail`` names them (they still count in sum(fail));
        the rest as without it; the kernel equals its jnp spelling."""
        rng = np.random.default_rng(rows)
        slot = np.arange(rows) % slots
        for skip in (1, 3, slots - 1):
            for frac, fallen, limit in ((0.2, False, rows), (0.3, False, 2), (0.1, True, rows)):
                f = rng.random(rows) < frac
                fail = jnp.asarray(f)
                got = fv.pack_active(fail, jnp.asarray(fallen), limit=limit, skip_slots=skip, slots=slots,
                                     interpret=self.INTERPRET)
                want = pack_active_ref(fail, jnp.asarray(fallen), limit=limit, skip_slots=skip, slots=slots)
                for name, g, w in zip(("pos", "src", "act_p", "act", "flags"), got, want):
                    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name} skip {skip}")
                pos, src, act_p, act, flags = (np.asarray(a) for a in got)
                full = fallen or f.sum() > limit
                assert bool(flags[0]) == full and int(flags[1]) == f.sum()
                np.testing.assert_array_equal(act, (f | full) & (slot >= skip))
                np.testing.assert_array_equal(src[: act.sum()], np.flatnonzero(act))
                assert act_p.sum() == act.sum()

    @pytest.mark.slow  # fast: the oracle in test_pack_active_skips_final_slots
    @pytest.mark.parametrize("rows", [1, 37, 40, 1000, 3840])
    def test_pack_active(self, rows):
        """`pack_active` == its jnp spelling (the packed order, the inverse map, the counts, the full flag) on
        random failing rows, at both sides of the fallback ``limit`` and with the call fallen back; the packed
        order is a permutation that puts the active rows first, in row order."""
        rng = np.random.default_rng(rows)
        for frac, fallen, limit in ((0.0, False, 5), (0.05, False, rows), (0.3, False, 2), (0.5, True, rows),
                                    (1.0, False, rows)):
            fail = jnp.asarray(rng.random(rows) < frac)
            got = fv.pack_active(fail, jnp.asarray(fallen), limit=limit, interpret=self.INTERPRET)
            want = pack_active_ref(fail, jnp.asarray(fallen), limit=limit)
            for name, g, w in zip(("pos", "src", "act_p", "act", "flags"), got, want):
                assert g.dtype == jnp.int32 and g.shape == w.shape, name
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name} frac {frac}")
            pos, src, act_p, act, flags = (np.asarray(a) for a in got)
            assert pos.shape == act.shape == (rows,) and flags.shape == (8,)
            full, n_fail = bool(flags[0]), int(flags[1])
            f = np.asarray(fail)
            assert n_fail == f.sum() and full == (fallen or f.sum() > limit) and not flags[2:].any()
            np.testing.assert_array_equal(act, f | full)
            assert sorted(src.tolist()) == list(range(src.shape[0])) and (src[pos] == np.arange(rows)).all()
            np.testing.assert_array_equal(src[: act.sum()], np.flatnonzero(act))  # active first, in row order
            assert act_p.sum() == act.sum() and act_p[: act.sum()].all()
            # fallen given as the flags a kernel wrote (element 0 counts), and fail as int32: the same result
            again = fv.pack_active(jnp.asarray(f.astype(np.int32)), jnp.asarray([int(fallen), 7, 0, 0, 0, 0, 0, 0],
                                                                                 jnp.int32),
                                   limit=limit, interpret=self.INTERPRET)
            for g, w in zip(again, got):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
            # counters (the counted scan's row-tile counters): the same five outputs and a sixth of zeros
            with_cnt = fv.pack_active(fail, jnp.asarray(fallen), limit=limit, interpret=self.INTERPRET, counters=3)
            for g, w in zip(with_cnt[:5], got):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
            assert with_cnt[5].dtype == jnp.int32 and with_cnt[5].shape == (4,) and not np.asarray(with_cnt[5]).any()
        with pytest.raises(ValueError, match="counters must be"):
            fv.pack_active(fail, jnp.asarray(False), limit=1, counters=-1, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="limit must be"):
            fv.pack_active(fail, jnp.asarray(False), limit=-1, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="skip_slots"):
            fv.pack_active(fail, jnp.asarray(False), limit=1, skip_slots=15, slots=15, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="need fail"):
            fv.pack_active(fail[None], jnp.asarray(False), limit=1, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="fallen must be"):
            fv.pack_active(fail, jnp.zeros((2,), bool), limit=1, interpret=self.INTERPRET)

    @pytest.mark.slow(interpret_only=True)
    def test_scan_failing(self):
        """`scan_failing`: the failing rows (every row once the pass is full: more than ``limit`` fail, or the call
        has fallen back) get the all-rows pick's tokens BIT FOR BIT on random bf16 inputs (`Table.capacity_config`'s
        split when few rows fail, the all-rows split when the pass is full), the others ``fallback``; the flags
        [full, n_fail] as `pack_active` counts them. 40 draft rows (B=6), V=4099, a rank with a tail chunk.
        Two launches: the last program of a row tile combines its parts and writes through the packed order; with
        the run-time split only the live parts arrive."""
        n, B, vocab, rank = 8, 6, 4099, 40
        rows = n * (B - 1)
        cfg = fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=4, k_tile=16)
        cap_cfg = dispatch.TABLE.capacity_config(cfg, vocab)
        base, lat, w2 = pick_inputs(n * B, vocab, rank, jnp.bfloat16, seed=5)
        lat = lat[:rows]
        want = np.asarray(fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, slot_stride=B))
        rng = np.random.default_rng(5)
        fb = rng.integers(0, vocab, rows).astype(np.int32)
        limit = 10
        cases = ((0.0, False), (0.1, False), (0.2, False), (0.6, False), (0.0, True))
        for (frac, fallen), split in zip(cases * 2, [cfg.v_steps] * 5 + [None] * 5):  # run-time split, or one
            fail = rng.random(rows) < frac
            tok, flags = fv.scan_failing(base, lat, w2, jnp.asarray(fail), jnp.asarray(fallen), jnp.asarray(fb),
                                         limit=limit, interpret=self.INTERPRET, config=cap_cfg, slot_stride=B,
                                         v_steps_full=split)
            is_full = fallen or fail.sum() > limit
            msg = f"frac {frac} fallen {fallen} v_steps_full {split}"
            assert int(flags[1]) == fail.sum() and bool(flags[0]) == is_full, msg
            expect = want if is_full else np.where(fail, want, fb)
            np.testing.assert_array_equal(np.asarray(tok), expect, err_msg=msg)
        # the certified mode's passes that know their number: final slots skipped (even in a full pass); the other
        # rows' tokens as above
        slot = np.arange(rows) % (B - 1)
        for (frac, fallen), skip in zip(cases, (2, 1, 3, 4, 2)):
            fail = rng.random(rows) < frac
            tok, flags = fv.scan_failing(base, lat, w2, jnp.asarray(fail), jnp.asarray(fallen), jnp.asarray(fb),
                                         limit=limit, interpret=self.INTERPRET, config=cap_cfg, slot_stride=B,
                                         v_steps_full=cfg.v_steps, skip_slots=skip)
            is_full = fallen or fail.sum() > limit
            msg = f"frac {frac} fallen {fallen} skip {skip}"
            assert int(flags[1]) == fail.sum() and bool(flags[0]) == is_full, msg
            scanned = (fail | is_full) & (slot >= skip)
            np.testing.assert_array_equal(np.asarray(tok), np.where(scanned, want, fb), err_msg=msg)
        with pytest.raises(ValueError, match="skip_slots needs slot_stride"):
            fv.scan_failing(base[:rows], lat, w2, jnp.asarray(fail), jnp.asarray(False), jnp.asarray(fb), limit=limit,
                            interpret=self.INTERPRET, config=cap_cfg, skip_slots=1)
        with pytest.raises(ValueError, match="fallback must be"):
            fv.scan_failing(base, lat, w2, jnp.asarray(fail), jnp.asarray(False), jnp.asarray(fb[:-1]), limit=limit,
                            interpret=self.INTERPRET, config=cap_cfg, slot_stride=B)


class TestFullVocabPickInterpret(TestFullVocabPick):
    INTERPRET = True


class TestFullVocabLowering:
    """Every kernel lowers to Triton for an H200 at serving shapes (catches what interpret mode accepts)."""

    @pytest.mark.parametrize("rows,dtype", [(15, jnp.bfloat16), (3840, jnp.bfloat16), (240, jnp.float32)])
    def test_lowers_at_serving_shapes(self, rows, dtype):
        V, r = 151936, 256
        args = (jax.ShapeDtypeStruct((rows, V), dtype), jax.ShapeDtypeStruct((rows, r), dtype),
                jax.ShapeDtypeStruct((V, r), dtype))
        f = functools.partial(fv.full_vocab_pick, config=fv.default_config(rows, V, r, dtype))
        hlo = lower_triton(f, *args).as_text()
        assert hlo.count(TRITON_CALL) == 2
        assert "xpress_full_vocab_fused" in hlo

    @pytest.mark.parametrize("n,lazy", [
        pytest.param(16, True, id="16-lazy"),
        *(pytest.param(n, lazy, id=f"{n}-{'lazy' if lazy else 'eager'}", marks=pytest.mark.slow)
          for n in (1, 4, 16, 64, 256) for lazy in (False, True) if (n, lazy) != (16, True)),
    ])
    def test_served_configs_lower(self, n, lazy):
        """The measured configs refine serves (`xpress_jax.dispatch`), eager and lazy, build for an H200."""
        V, r, B = 151936, 256, 16
        rows = n * (B - 1)
        cfg = dispatch.plan(n, B, V, r, 0, jnp.bfloat16).full_vocab
        cfg = dataclasses.replace(cfg, lazy=lazy)
        args = (jax.ShapeDtypeStruct((n * B, V), jnp.bfloat16), jax.ShapeDtypeStruct((rows, r), jnp.bfloat16),
                jax.ShapeDtypeStruct((V, r), jnp.bfloat16))
        f = functools.partial(fv.full_vocab_pick, config=cfg, slot_stride=B)
        assert lower_triton(f, *args).as_text().count(TRITON_CALL) == 2
        if lazy and dispatch.TABLE.entry(rows).switches.alternate:  # what refine alternates
            f = functools.partial(fv.full_vocab_pick, config=cfg, slot_stride=B, reverse=True)
            assert lower_triton(f, *args).as_text().count(TRITON_CALL) == 2
        if lazy and n <= 4:  # the L2 hints (`KEEP_POLICIES`) where refine may serve them
            for keep in fv.KEEP_POLICIES:
                f = functools.partial(fv.full_vocab_pick, config=cfg, slot_stride=B, reverse=n == 1, keep=keep)
                assert lower_triton(f, *args).as_text().count(TRITON_CALL) == 2
        if lazy:  # a pass that skips the final slots: 2/3 of the rows through row_ids
            ids = jax.ShapeDtypeStruct((rows * 2 // 3,), jnp.int32)
            f = lambda b_, l_, w_, i_: fv.full_vocab_pick(b_, l_, w_, config=cfg, slot_stride=B, row_ids=i_)
            hlo = lower_triton(f, *args, ids).as_text()
            assert hlo.count(TRITON_CALL) == 2 and triton_operands(hlo, "xpress_full_vocab_fused") == 4


    @pytest.mark.parametrize("n", [1, 16, 256])
    def test_active_lowers(self, n):
        """With ``active`` the served configs still build for an H200 (the cond in the kernel lowers), with one
        more operand (the mask; packing, with ``capacity``, is `test_capacity_lowers`); without it the call
        has exactly the three operands of the plain kernel (the served default path is unchanged)."""
        V, r, B = 151936, 256, 16
        rows = n * (B - 1)
        cfg = dispatch.plan(n, B, V, r, 0, jnp.bfloat16).full_vocab
        S = jax.ShapeDtypeStruct
        args = (S((n * B, V), jnp.bfloat16), S((rows, r), jnp.bfloat16), S((V, r), jnp.bfloat16))
        for active, n_ops in ((None, 3), (S((rows,), jnp.bool_), 4)):
            f = lambda b, l, w, *a: fv.full_vocab_pick(b, l, w, config=cfg, slot_stride=B, active=a[0] if a else None)
            hlo = lower_triton(f, *args, *([active] if active is not None else [])).as_text()
            assert hlo.count(TRITON_CALL) == 2
            assert triton_operands(hlo, "xpress_full_vocab_fused") == n_ops


    @pytest.mark.parametrize("n", [1, 4])
    def test_counted_lowers(self, n):
        """The counted launch (``counter``: the certified mode's one pick per pass at N <= 4) builds for an H200
        from the served configs: one Triton call (no combine launch) with six operands (the kernel's three, the
        mask, the tokens and the counter, both aliased)."""
        V, r, B = 151936, 256, 16
        rows = n * (B - 1)
        cfg = dispatch.plan(n, B, V, r, 0, jnp.bfloat16).full_vocab
        S = jax.ShapeDtypeStruct
        args = (S((n * B, V), jnp.bfloat16), S((rows, r), jnp.bfloat16), S((V, r), jnp.bfloat16),
                S((rows,), jnp.int32), S((rows,), jnp.int32), S((8,), jnp.int32))
        f = lambda b, l, w, a, fb, c: fv.full_vocab_pick(b, l, w, config=cfg, slot_stride=B, active=a, fallback=fb,
                                                         counter=c, counter_at=2, reverse=n == 1)
        hlo = lower_triton(f, *args).as_text()
        assert hlo.count(TRITON_CALL) == 1
        assert triton_operands(hlo, "xpress_full_vocab_counted") == 6

    @pytest.mark.parametrize("n", [16, 64, 256])
    def test_capacity_lowers(self, n):
        """The certified mode's packed launch (``capacity`` = ceil(N/8) blocks of rows, `Table.capacity_config`)
        builds for an H200 from the served configs: a grid of ceil(capacity / row_tile) row tiles, and one
        row tile alone gets a whole wave of programs (or every vocabulary tile)."""
        V, r, B = 151936, 256, 16
        rows, cap = n * (B - 1), -(-n // 8) * (B - 1)
        cfg = dispatch.TABLE.capacity_config(dispatch.plan(n, B, V, r, 0, jnp.bfloat16).full_vocab, V)
        vtiles = -(-V // cfg.v_tile)
        assert -(-vtiles // cfg.v_steps) >= min(dispatch.TABLE.sms, vtiles)
        S = jax.ShapeDtypeStruct
        args = (S((n * B, V), jnp.bfloat16), S((rows, r), jnp.bfloat16), S((V, r), jnp.bfloat16), S((rows,), jnp.bool_))
        f = lambda b, l, w, a: fv.full_vocab_pick(b, l, w, config=cfg, slot_stride=B, active=a, capacity=cap)
        hlo = lower_triton(f, *args).as_text()
        assert hlo.count(TRITON_CALL) == 2
        assert triton_operands(hlo, "xpress_full_vocab_fused") == 5  # base, packed lat, w2, row map, active


    @pytest.mark.parametrize("n", [16, 64, 256])
    def test_scan_failing_lowers(self, n):
        """The certified mode's scan of its failing rows builds for an H200 from the served configs: two launches,
        the packing (fail, fallen) and the counted pick (base, lat, w2, row map, active, the full flag where the
        splits differ, the tokens and the row-tile counters, both aliased): no combine launch."""
        V, r, B = 151936, 256, 16
        rows = n * (B - 1)
        served = dispatch.plan(n, B, V, r, 0, jnp.bfloat16).full_vocab
        cfg = dispatch.TABLE.capacity_config(served, V)
        S = jax.ShapeDtypeStruct
        args = (S((n * B, V), jnp.bfloat16), S((rows, r), jnp.bfloat16), S((V, r), jnp.bfloat16), S((rows,), jnp.bool_),
                S((), jnp.bool_), S((rows,), jnp.int32))
        f = lambda b, l, w, fail, fallen, fb, **kw: fv.scan_failing(b, l, w, fail, fallen, fb, limit=-(-n // 8) * (B - 1),
                                                                    config=cfg, slot_stride=B,
                                                                    v_steps_full=served.v_steps, **kw)
        for kw in ({}, dict(skip_slots=3)):  # + the passes that know their number
            hlo = lower_triton(functools.partial(f, **kw), *args).as_text()
            assert hlo.count(TRITON_CALL) == 2 and "xpress_pick_combine" not in hlo
            assert triton_operands(hlo, "xpress_pack_active") == 2
            assert triton_operands(hlo, "xpress_full_vocab_counted") == (8 if served.v_steps != cfg.v_steps else 7)


@pytest.mark.slow(interpret_only=True)
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_slot_stride_reads_draft_rows_of_the_whole_logits(dtype):
    """slot_stride=B on logits.reshape(N*B, V) == the pick on logits[:, 1:] (slot 0 never read)."""
    rng = np.random.default_rng(11)
    N, B, V, r = 3, 6, 1337, 32
    logits = rng.normal(size=(N, B, V)).astype(np.float32)
    logits[:, 0] = 1e4  # slot 0 would win every row if it were read
    lat = rng.normal(size=(N * (B - 1), r)).astype(np.float32)
    w2 = (rng.normal(size=(V, r)) * 0.3).astype(np.float32)
    logits, lat, w2 = (jnp.asarray(a, dtype) for a in (logits, lat, w2))
    cfg = fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=3, k_tile=16, hold_lat=False)
    interpret = not common.gpu_supported()  # compiled on a GPU
    want = fv.full_vocab_pick(logits[:, 1:].reshape(-1, V), lat, w2, config=cfg, interpret=interpret)
    got = fv.full_vocab_pick(logits.reshape(-1, V), lat, w2, config=cfg, interpret=interpret,
                             slot_stride=B)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
