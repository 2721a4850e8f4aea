"""Top-C pick kernel (xpress_jax.kernels.topc_pick) against the jnp oracle hook pair.

`TestTopCPick` runs the kernel for real (GPU only); its twin `TestTopCPickInterpret`
runs the same tests on CPU in interpret mode; `TestTopCLowering` lowers it for an
H200 on CPU.

Exactness: the kernel sums each candidate's dot in its own order (the oracle is
an XLA einsum), so a bias within an ulp of a rounding boundary may round the
other way. Picks are demanded equal on every row that is not such a near tie
(`helpers.near_tie_rows`), and on every row of "dyadic" inputs whose dot products are
exact in any order (these also produce many genuine ties).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TRITON_CALL, lower_triton, near_tie_rows, pick_inputs

from xpress_jax import dispatch
from xpress_jax import reference as R
from xpress_jax.kernels import common
from xpress_jax.kernels import topc_pick as tp

DTYPES = [jnp.float32, jnp.bfloat16]

# (rows, V, C, r, config): rows = N*(B-1) with N=1,B=16 / N=5,B=6 / N=3,B=16; C = 100 and 512.
SHAPES = [
    (15, 1000, 100, 32, None),
    (25, 5000, 512, 64, tp.TopCConfig(c_tile=64, c_steps=3, k_tile=16)),  # 3 splits, the last partial
    (45, 3000, 100, 32, tp.TopCConfig(c_tile=32, c_steps=4)),  # 1 split, tail masked
]


def _candidates(base, c, seed):
    """The C largest base logits as refine takes them, then shuffled: candidate order is arbitrary."""
    base_c, cand = jax.lax.top_k(base, c)
    perm = jax.random.permutation(jax.random.key(seed), c)
    return base_c[:, perm], cand[:, perm].astype(jnp.int32)


def _inputs(rows, vocab, c, rank, dtype, seed, dyadic=False):
    base, lat, w2 = pick_inputs(rows, vocab, rank, dtype, seed, dyadic)
    base_c, cand = _candidates(base, c, seed)
    return base_c, cand, lat, w2


def _reference(base_c, cand, lat, w2):
    return np.asarray(R.topc_pick(base_c, cand, lat, R.topc_gather(w2, cand)))


def _shape_dtypes(fast: str):
    """Every shape and dtype: the case ``fast`` in the default run, the rest `slow`."""
    out = []
    for sh in SHAPES:
        for dt in DTYPES:
            name = f"rows{sh[0]}-V{sh[1]}-C{sh[2]}-r{sh[3]}-{jnp.dtype(dt).name}"
            out.append(pytest.param(sh, dt, id=name, marks=() if name == fast else pytest.mark.slow))
    return out


SHAPE_DTYPES = _shape_dtypes("rows15-V1000-C100-r32-float32")


class TestTopCPick:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not common.gpu_supported():
            pytest.skip("needs a CUDA GPU; TestTopCPickInterpret runs these tests on CPU")

    def pick(self, base_c, cand, lat, w2, config=None):
        return tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=config)

    @pytest.mark.parametrize("shape,dtype", SHAPE_DTYPES)
    def test_matches_reference(self, shape, dtype):
        rows, vocab, c, rank, config = shape
        args = _inputs(rows, vocab, c, rank, dtype, seed=rows + c)
        ref = _reference(*args)
        got = np.asarray(self.pick(*args, config))
        assert got.dtype == np.int32 and got.shape == (rows,)
        base_c, cand, lat, w2 = args
        near = near_tie_rows(base_c, lat, w2, ref, cand=cand)
        assert near.mean() < 0.1, f"{near.sum()} near ties of {rows}: the check would be vacuous"
        np.testing.assert_array_equal(got[~near], ref[~near])
        args = _inputs(rows, vocab, c, rank, dtype, seed=rows, dyadic=True)
        np.testing.assert_array_equal(np.asarray(self.pick(*args, config)), _reference(*args))

    @pytest.mark.slow  # fast: the served configs in refine (test_kernel_shapes.py::test_topc_ranks)
    @pytest.mark.parametrize("rows", [30, 31])
    def test_served_configs_at_their_boundary(self, rows):
        """The configs refine serves (`dispatch.plan`) on either side of the small-tile entries (30 rows), at C = 1, a C
        that is not a multiple of the tile, and C = V, with a rank that needs a masked tail chunk: the ids of
        the jnp oracle on every row that is not a near tie, and on every row of dyadic inputs."""
        vocab, rank, dtype = 300, 20, jnp.bfloat16
        for c in (1, 33, vocab):
            cfg = dispatch.plan(rows, 2, vocab, rank, c, dtype).topc
            assert cfg.c_steps == 1
            args = _inputs(rows, vocab, c, rank, dtype, seed=rows + c)
            ref = _reference(*args)
            got = np.asarray(self.pick(*args, cfg))
            near = near_tie_rows(args[0], args[2], args[3], ref, cand=args[1])
            np.testing.assert_array_equal(got[~near], ref[~near])
            dy = _inputs(rows, vocab, c, rank, dtype, seed=rows + c, dyadic=True)
            np.testing.assert_array_equal(np.asarray(self.pick(*dy, cfg)), _reference(*dy))

    @pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, id="float32"),
                                       pytest.param(jnp.bfloat16, id="bfloat16", marks=pytest.mark.slow)])
    def test_ties_and_nonfinite(self, dtype):
        # rows = 5 blocks of B=6; C=100 candidates in tiles of 16, 2 tiles per split -> 4 splits, the last partial.
        rows, vocab, c, rank = 25, 1000, 100, 16
        cfg = tp.TopCConfig(c_tile=16, c_steps=2, k_tile=8)
        rng = np.random.default_rng(0)
        special = [1, 2, 3, 5, 9, 20, 40, 50, 77, 200, 400, 500, 600, 700] + list(range(800, 809))  # placed below
        pool = np.setdiff1d(np.arange(vocab), special)
        cand = np.stack([rng.permutation(pool)[:c] for _ in range(rows)]).astype(np.int32)
        base_c = np.full((rows, c), -5.0, np.float32)
        lat = np.zeros((rows, rank), np.float32)
        w2 = np.zeros((vocab, rank), np.float32)
        inf, nan = np.inf, np.nan
        expect = {}

        # Ties broken by vocab id, not by candidate position: id 9 sits after id 700.
        cand[0, [2, 90]] = [700, 9]; base_c[0, [2, 90]] = 2; expect[0] = 9
        cand[1, [0, 99]] = [5, 3]; base_c[1, [0, 99]] = 2; expect[1] = 3  # tie at the last position (tail tile)
        cand[2, [10, 40, 70]] = [600, 400, 500]; base_c[2, [10, 40, 70]] = 2; expect[2] = 400  # across splits
        cand[3, 99] = 77; base_c[3, 99] = 3; expect[3] = 77  # the winner is the last candidate
        cand[4, [1, 2]] = [1, 2]; base_c[4, 1] = nan; base_c[4, 2] = 1; expect[4] = 2  # NaN never wins
        cand[5, [60, 6]] = [600, 200]; base_c[5, [60, 6]] = inf; expect[5] = 200  # +inf, lowest id
        base_c[6] = -inf; expect[6] = int(cand[6].min())  # all -inf -> lowest-id candidate
        base_c[7] = nan; expect[7] = int(cand[7].min())  # all NaN -> lowest-id candidate
        base_c[8] = -inf; base_c[8, 0] = nan; base_c[8, 50] = -1e30; expect[8] = int(cand[8, 50])
        # Rounding tie: 1 + 2^-10 rounds to 1 in bf16 (tie -> id 20), stays larger in float32 (id 40).
        cand[9, [3, 80]] = [40, 20]; base_c[9, [3, 80]] = 1.0; lat[9, 0] = 2.0**-10; w2[40, 0] = 1.0
        expect[9] = 20 if dtype == jnp.bfloat16 else 40
        # inf * 0 in the dot -> NaN bias; +inf base + -inf bias -> NaN: all scores -inf -> the largest base (50).
        cand[10, 5] = 50; base_c[10, 5] = inf; lat[10, 1] = inf; w2[50, 1] = -1.0; expect[10] = 50
        # Equal scores, different base logits: the larger base logit wins (vLLM's sorted candidates),
        # not the lowest id. 1.0 + 0.5 == 1.5 + 0: exact in both dtypes; 800 and 801 in different splits.
        cand[11, [5, 70]] = [800, 801]; base_c[11, [5, 70]] = [1.0, 1.5]; lat[11, 0] = 1.0; w2[800, 0] = 0.5
        expect[11] = 801
        # Tied only after rounding to bf16 (1 + 2^-10 -> 1.0 == 0.5 + 0.5): the larger base logit (805) wins in
        # bf16; in float32 805 is strictly larger anyway. The lowest-id rule would give 804 in bf16.
        cand[12, [3, 40]] = [804, 805]; base_c[12, [3, 40]] = [0.5, 1.0]; lat[12, 0] = 1.0
        w2[804, 0] = 0.5; w2[805, 0] = 2.0**-10
        expect[12] = 805
        # Three-way score tie, two of them also tied on the base logit: the larger base, then the lower id
        # (808 sits before 807).
        cand[13, [0, 33, 64]] = [806, 808, 807]; base_c[13, [0, 33, 64]] = [1.0, 1.5, 1.5]; lat[13, 0] = 1.0
        w2[806, 0] = 0.5
        expect[13] = 807
        base_c[14:] = rng.integers(0, 4, (rows - 14, c))  # massive ties: the lowest id of the max
        for r in range(14, rows):
            expect[r] = int(cand[r][base_c[r] == base_c[r].max()].min())
        for r in range(rows):  # keep ids distinct within a row (a real candidate set)
            assert len(set(cand[r].tolist())) == c, r
        args = tuple(jnp.asarray(a).astype(dtype) for a in (base_c,)) + (jnp.asarray(cand),) + tuple(
            jnp.asarray(a).astype(dtype) for a in (lat, w2))
        want = np.array([expect[r] for r in range(rows)])
        np.testing.assert_array_equal(_reference(*args), want)  # the oracle obeys the rules as stated
        np.testing.assert_array_equal(np.asarray(self.pick(*args, cfg)), want)

    @pytest.mark.slow(interpret_only=True)
    def test_ties_by_id(self):
        """``ties="id"`` (the full-vocab rule over the candidates, what the certified exact mode scores): equal
        scores go to the lowest id, not the larger base logit; ids and partials' scores as
        `reference.candidates_best` on dyadic inputs (many genuine ties, exact in any summation order)."""
        cfg = tp.TopCConfig(c_tile=16, c_steps=2, k_tile=8)  # 4 splits over C=100, the last partial
        base_c, cand, lat, w2 = _inputs(25, 1000, 100, 16, jnp.float32, seed=7, dyadic=True)
        # Row 0: the best score 3.5 twice, base 3.0 + 0.5 (the lower id) and 3.5 + 0: the rules differ.
        lo, hi = sorted(np.asarray(cand[0, [7, 70]]).tolist())
        p_lo, p_hi = (7, 70) if int(cand[0, 7]) == lo else (70, 7)
        base_c = base_c.at[0, p_lo].set(3.0).at[0, p_hi].set(3.5)
        lat = lat.at[0].set(0.0).at[0, 0].set(1.0)
        w2 = w2.at[lo, 0].set(0.5).at[hi, 0].set(0.0)
        score, want = R.candidates_best(base_c, cand, lat, R.topc_gather(w2, cand))
        got = tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=cfg, ties="id")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        mv, mb, mi = tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=cfg, ties="id",
                                  partials=True)
        s, i = R.best_by_score(mv, mi, axis=0)
        np.testing.assert_array_equal(np.asarray(i), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(score))
        assert (np.asarray(mb) == 0).all()
        assert int(want[0]) == lo and int(self.pick(base_c, cand, lat, w2, cfg)[0]) == hi
        with pytest.raises(ValueError, match="ties"):
            tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, ties="lowest")

    @pytest.mark.slow  # fast: the certified mode's candidates step (tests/refine/test_certified.py) passes skip
    def test_skip(self):
        """``skip`` (a device scalar): false (bool or int) gives the plain pick; true makes every program return at
        once with "no winner" partials (-inf, -inf, BIG), so every row's result is BIG; with several splits
        (the combine kernel) and with one."""
        base_c, cand, lat, w2 = _inputs(7, 500, 70, 24, jnp.float32, seed=9)
        for cfg in (tp.TopCConfig(c_tile=16, c_steps=2, k_tile=16), tp.TopCConfig(c_tile=128, c_steps=1)):
            for ties in ("base", "id"):
                want = np.asarray(tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=cfg, ties=ties))
                for off in (jnp.bool_(False), jnp.int32(0)):
                    got = tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=cfg, ties=ties, skip=off)
                    np.testing.assert_array_equal(np.asarray(got), want)
                for on in (jnp.bool_(True), jnp.int32(5)):
                    got = tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=cfg, ties=ties, skip=on)
                    assert (np.asarray(got) == common.BIG).all()
            mv, mb, mi = tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=cfg, partials=True,
                                      skip=jnp.asarray([True]))
            assert np.isneginf(np.asarray(mv)).all() and np.isneginf(np.asarray(mb)).all()
            assert (np.asarray(mi) == common.BIG).all()
        with pytest.raises(ValueError, match="skip"):
            tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, skip=jnp.zeros(2, bool))

    @pytest.mark.slow  # fast: row_ids with keep and skip in test_l2_hints_are_the_same_pick
    @pytest.mark.parametrize("dtype", [pytest.param(jnp.bfloat16, id="bfloat16"),
                                       pytest.param(jnp.float32, id="float32")])
    def test_row_ids(self, dtype):
        """``row_ids`` picks only the listed rows (any order, repeats allowed), each the id (and with ``partials``
        the per-split winners) the all-rows pick gives it with the same config: both tie rules, with the
        residual's terms (``lat_add``) and with ``skip``; bad ids are refused."""
        rows = 25
        base_c, cand, lat, w2 = _inputs(rows, 900, 70, 40, dtype, seed=21)
        ids = np.random.default_rng(3).choice(rows, 11).astype(np.int32)
        ids[:3] = [rows - 1, 0, rows - 1]
        rid = jnp.asarray(ids)
        lat32 = lat.astype(jnp.float32)
        add = jnp.asarray(np.random.default_rng(4).standard_normal(lat.shape).astype(np.float32) * 0.05)
        for cfg in (tp.TopCConfig(c_tile=16, c_steps=2, k_tile=16), tp.TopCConfig(c_tile=128, c_steps=1)):
            kw = dict(interpret=self.INTERPRET, config=cfg)
            for ties in ("base", "id"):
                want = np.asarray(tp.topc_pick(base_c, cand, lat, w2, ties=ties, **kw))
                np.testing.assert_array_equal(np.asarray(tp.topc_pick(base_c, cand, lat, w2, ties=ties, row_ids=rid,
                                                                      **kw)), want[ids])
                parts = tp.topc_pick(base_c, cand, lat, w2, ties=ties, partials=True, **kw)
                got = tp.topc_pick(base_c, cand, lat, w2, ties=ties, partials=True, row_ids=rid, **kw)
                for a, b in zip(got, parts):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:, ids])
            want = np.asarray(tp.topc_pick(base_c, cand, lat32, w2, lat_add=add, **kw))
            got = tp.topc_pick(base_c, cand, lat32, w2, lat_add=add, row_ids=rid, **kw)
            np.testing.assert_array_equal(np.asarray(got), want[ids])
            got = tp.topc_pick(base_c, cand, lat, w2, row_ids=rid, skip=jnp.bool_(True), **kw)
            assert (np.asarray(got) == common.BIG).all() and got.shape == (len(ids),)
        assert len(set(want[ids].tolist())) > 1
        for bad in (jnp.asarray(ids, jnp.float32), jnp.zeros((0,), jnp.int32), rid[None]):
            with pytest.raises(ValueError, match="row_ids"):
                tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, row_ids=bad)

    @pytest.mark.slow(interpret_only=True)
    def test_l2_hints_are_the_same_pick(self):
        """``keep`` (L2 eviction hints on the w2 gathers; splits ``j < hot`` one policy, the rest another, a whole
        program per branch) gives the per-split winners of the plain pick, with a rank tail chunk, with ``skip``
        and ``row_ids``; a bad ``keep`` is refused."""
        base_c, cand, lat, w2 = _inputs(21, 700, 90, 40, jnp.bfloat16, seed=31)
        cfg = tp.TopCConfig(c_tile=16, c_steps=2, k_tile=16)  # 3 splits; rank 40 = 2 chunks + a tail
        kw = dict(interpret=self.INTERPRET, config=cfg)
        want = tp.topc_pick(base_c, cand, lat, w2, partials=True, **kw)
        ids = np.asarray(tp.topc_pick(base_c, cand, lat, w2, **kw))
        rid = jnp.asarray([20, 3, 3, 0], jnp.int32)
        for keep in ((1, "evict_last", "evict_first"), (2, "evict_last", None), (0, None, "evict_normal"),
                     (3, "evict_first", "evict_first")):
            got = tp.topc_pick(base_c, cand, lat, w2, partials=True, keep=keep, **kw)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(keep))
            got = tp.topc_pick(base_c, cand, lat, w2, keep=keep, row_ids=rid, skip=jnp.bool_(False), **kw)
            np.testing.assert_array_equal(np.asarray(got), ids[np.asarray(rid)])
        for bad in ((1, "evict_later", None), (True, None, None), (1, None)):
            with pytest.raises(ValueError, match="keep"):
                tp.topc_pick(base_c, cand, lat, w2, keep=bad, **kw)

    def test_float64_is_refused(self):
        """The kernel refuses float64 (TypeError naming the dtype); refine routes it to the reference."""
        with jax.enable_x64(True):
            base_c, cand, lat, w2 = _inputs(15, 300, 20, 8, jnp.float64, seed=3)
            with pytest.raises(TypeError, match="float64"):
                tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET)

    def test_bad_arguments(self):
        base_c, cand, lat, w2 = _inputs(15, 300, 20, 8, jnp.float32, seed=4)
        with pytest.raises(ValueError, match="c_tile"):
            self.pick(base_c, cand, lat, w2, tp.TopCConfig(c_tile=24))
        with pytest.raises(ValueError, match="w2"):
            tp.topc_pick(base_c, cand, lat, w2[:, :4], interpret=self.INTERPRET)




class TestTopCPickInterpret(TestTopCPick):
    INTERPRET = True


class TestTopCLowering:
    """The kernel lowers to Triton for an H200 at serving shapes."""

    @pytest.mark.parametrize("rows", [pytest.param(15, marks=pytest.mark.slow), pytest.param(60, marks=pytest.mark.slow), 3840])
    def test_lowers_at_serving_shapes(self, rows):
        """The kernel heuristic's config and the one refine serves (`dispatch.plan`) both build."""
        V, C, r, dt = 151936, 512, 256, jnp.bfloat16
        S = jax.ShapeDtypeStruct
        args = (S((rows, C), dt), S((rows, C), jnp.int32), S((rows, r), dt), S((V, r), dt))
        for cfg in (tp.default_config(rows, C, r, dt), dispatch.plan(rows, 2, V, r, C, dt).topc):
            splits = -(-C // (cfg.c_tile * cfg.c_steps))
            hlo = lower_triton(functools.partial(tp.topc_pick, config=cfg), *args).as_text()
            assert hlo.count(TRITON_CALL) == (1 if splits == 1 else 2)
            assert "xpress_topc_pick" in hlo
        # A single split is one launch; several add the combine kernel.
        one = tp.TopCConfig(c_tile=64, c_steps=8, k_tile=128)
        hlo = lower_triton(functools.partial(tp.topc_pick, config=one), *args).as_text()
        assert hlo.count(TRITON_CALL) == 1
        # A pass that skips the final slots: the served config over 2/3 of the rows through row_ids.
        cfg = dispatch.plan(rows, 2, V, r, C, dt).topc
        f = lambda b_, c_, l_, w_, i_: tp.topc_pick(b_, c_, l_, w_, config=cfg, row_ids=i_)
        hlo = lower_triton(f, *args, S((max(1, rows * 2 // 3),), jnp.int32)).as_text()
        assert "xpress_topc_pick" in hlo

    @pytest.mark.parametrize("rows", [240, 960])
    def test_l2_hints_lower(self, rows):
        """With ``keep`` the served config still builds for an H200 (both branches, evict_last and evict_first
        gathers), also with ``row_ids`` and ``skip``."""
        V, C, r, dt = 151936, 512, 256, jnp.bfloat16
        S = jax.ShapeDtypeStruct
        args = (S((rows, C), dt), S((rows, C), jnp.int32), S((rows, r), dt), S((V, r), dt))
        cfg = dispatch.plan(rows, 2, V, r, C, dt).topc
        keep = (1, "evict_last", "evict_first")
        hlo = lower_triton(functools.partial(tp.topc_pick, config=cfg, keep=keep), *args).as_text()
        assert "xpress_topc_pick" in hlo
        f = lambda b_, c_, l_, w_, i_, s_: tp.topc_pick(b_, c_, l_, w_, config=cfg, keep=keep, row_ids=i_, skip=s_)
        assert "xpress_topc_pick" in lower_triton(f, *args, S((rows // 2,), jnp.int32), S((), jnp.bool_)).as_text()

    @pytest.mark.parametrize("rows", [15, 3840])
    def test_skip_lowers(self, rows):
        """With ``skip`` the kernel still builds for an H200 (`pl.when` on the flag), with one more operand;
        without it, the four operands of the plain kernel (the served path is unchanged)."""
        V, C, r, dt = 151936, 512, 256, jnp.bfloat16
        S = jax.ShapeDtypeStruct
        args = (S((rows, C), dt), S((rows, C), jnp.int32), S((rows, r), dt), S((V, r), dt))
        cfg = tp.default_config(rows, C, r, dt)
        for skip, n_ops in ((None, 4), (S((), jnp.bool_), 5)):
            f = lambda *a: tp.topc_pick(*a[:4], config=cfg, ties="id", partials=True, skip=a[4] if len(a) > 4 else None)
            hlo = lower_triton(f, *args, *([skip] if skip is not None else [])).as_text()
            line = next(ln for ln in hlo.splitlines() if TRITON_CALL in ln and 'name = "xpress_topc_pick"' in ln)
            assert len(line.split(TRITON_CALL + "(")[1].split(")")[0].split(",")) == n_ops
