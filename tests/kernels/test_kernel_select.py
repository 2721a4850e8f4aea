"""`xpress_jax.kernels.select`: top-C candidates + full-vocab argmax, against the jnp oracle (lax.top_k)."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_triton
from xpress_jax import dispatch
from xpress_jax.kernels import common
from xpress_jax import reference as R
from xpress_jax.kernels import select as sel

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


V, C = 3001, 100  # V no multiple of any block, C no power of two
# scaled to V: 751 blocks of 4 (the last one partial), 256 groups of ~3 blocks, 8 blocks per gather load
SMALL = dict(groups=256, stats_unroll=2, cap=256, block=4, stats_blocks=16, scan_blocks=64,
             gather_blocks=8, scan_chunk=512)


def _mixed_rows(seed: int) -> np.ndarray:
    """15 rows [15, V] (float64, cast by the caller) that exercise every rule and kernel path."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((15, V))
    x[3] = np.round(x[3] * 2) / 2  # few distinct values: hundreds tied at the C-th place
    x[4] = np.round(x[4])  # coarser still (the tie class straddles the boundary widely)
    x[5] = np.sort(x[5])  # ascending: the top values sit at the end of the row
    x[6] = 1.5  # all equal: ids 0..C-1 win, argmax 0
    x[7] = np.where(np.arange(V) % 3 == 0, -0.0, 0.0)  # -0.0 ranks below +0.0 (top_k); argmax 0
    x[8][rng.random(V) < 0.3] = np.nan
    x[8][rng.random(V) < 0.2] = -np.inf
    x[9] = np.nan  # all NaN -> all -inf
    x[10] = np.where(rng.random(V) < 0.5, -np.inf, np.nan)
    x[10, V - 7] = -3.0  # one finite value, at the end: argmax V-7
    x[11, 5] = x[11, 9] = np.inf  # +inf wins, lowest id
    x[12, ::4] += 6.0  # one residue class floods the bound (> cap above it): exact whole-row path
    x[13, : V // 2] = np.sort(x[13, : V // 2])[::-1]  # descending first half
    return x


def _paths(x: np.ndarray, c: int, groups: int, cap: int, block: int = 1) -> list[str]:
    """Which finish path each row takes (numpy model of the bound): fast, ties (M < c), row (M > cap).

    block=1: the strided method (element i in group i % groups); else the blocks method (block b of
    ``block`` elements in group b % groups).
    """
    x = np.where(np.isnan(x), -np.inf, x)
    v = x.shape[1]
    if block > 1:
        nb = -(-v // block)
        pad = np.full((x.shape[0], nb * block), -np.inf)
        pad[:, :v] = x
        x_blocks = pad.reshape(x.shape[0], nb, block).max(axis=2)
        return _paths_from(x, x_blocks, c, groups, cap)
    return _paths_from(x, x, c, groups, cap)


def _paths_from(x, units, c, groups, cap):
    v = units.shape[1]
    pad = np.full((units.shape[0], -(-v // groups) * groups), -np.inf)
    pad[:, :v] = units
    gm = pad.reshape(units.shape[0], -1, groups).max(axis=1)
    bound = np.sort(gm, axis=1)[:, ::-1][:, c - 1] if c <= groups else np.full(x.shape[0], -np.inf)
    m = (x > bound[:, None]).sum(axis=1) + (c > groups) * np.isneginf(x).sum(axis=1)
    return ["ties" if n < c else "row" if n > cap else "fast" for n in m]


def test_mixed_rows_cover_every_path():
    b = SMALL
    paths = _paths(_mixed_rows(seed=1), C, b["groups"], b["cap"], b["block"])
    assert {"fast", "ties", "row"} <= set(paths), paths
    assert paths[5] == "row" and paths[4] == "ties" and paths[0] == paths[12] == "fast"  # sorted: a flood of blocks


def _serving_rows(rows: int = 4, seed: int = 3) -> np.ndarray:
    """bf16-rounded N(0, 2) rows at V = 151936: the benchmarks' synthetic logits (smooth rows)."""
    x = np.random.default_rng(seed).standard_normal((rows, 151936)) * 2
    return np.asarray(jnp.asarray(x, BF16), np.float32)


@pytest.mark.parametrize("c", [513, 768, 1024, 1500, 2048, 3000, 4096])
def test_dispatch_keeps_the_fast_finish_above_512(c):
    """The dispatch's selection config for C > 512 keeps smooth serving rows on the fast finish (numpy
    model of the bound), where the kernel's defaults (cap 1024, 2048 groups) send every row to the
    whole-row slow path from C = 1024 on (10-20x slower: docs/performance.md)."""
    x = _serving_rows()
    for row in dispatch.TABLE.entries:
        cfg = dataclasses.replace(sel.SelectConfig(), **dispatch.TABLE.select_config(row, c))
        assert _paths(x, c, cfg.groups, cfg.cap, cfg.block) == ["fast"] * len(x), (row.max_rows, cfg)
    d = sel.SelectConfig()
    if c >= 1024:
        assert set(_paths(x, c, d.groups, d.cap, d.block)) == {"row"}


def _assert_matches_oracle(got, base, c):
    cand, vals, arg = (np.asarray(a) for a in got)
    rc, rv, ra = (np.asarray(a) for a in R.select_candidates(base, c))
    rows = base.shape[0]
    assert cand.shape == (rows, c) and cand.dtype == np.int32
    assert vals.shape == (rows, c) and vals.dtype == np.dtype(base.dtype)
    assert arg.shape == (rows,) and arg.dtype == np.int32
    for i in range(rows):
        o, ro = np.argsort(cand[i]), np.argsort(rc[i])
        np.testing.assert_array_equal(cand[i][o], rc[i][ro], err_msg=f"row {i}: candidate sets differ")
        # compare bit patterns: -0.0 vs +0.0 and -inf must be exact
        np.testing.assert_array_equal(vals[i][o].view(np.uint8), rv[i][ro].view(np.uint8), err_msg=f"row {i}: values")
    np.testing.assert_array_equal(arg, ra, err_msg="argmax")


slow = pytest.mark.slow


def dtype_segments(*fast: str):
    """(dtype, segments) cross products: bf16 with several segments per row (a separate bound kernel) or f32 with
    one (stats and bound fused), and the other two corners; the ids in ``fast`` run by default, the rest `slow`."""
    cases = ((BF16, None, "bfloat16-None"), (F32, 1, "float32-1"), (BF16, 1, "bfloat16-1"), (F32, None, "float32-None"))
    return [pytest.param(d, s, id=i, marks=() if i in fast else slow) for d, s, i in cases]


DTYPE_SEGMENTS = dtype_segments("bfloat16-None", "float32-1")


class TestSelect:
    """Kernels vs oracle; skipped without a CUDA GPU (the subclass below runs them on CPU).

    Cost in interpret mode is one XLA compile (~1.5 s) per distinct (shape, config, dtype): the
    tests reuse the `_mixed_rows` shapes and `SMALLS` configs so one compile serves several tests.
    """

    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _device(self):
        if self.INTERPRET:
            if jax.default_backend() != "cpu":
                pytest.skip("interpret tests run on CPU")
        elif not common.gpu_supported():
            pytest.skip("needs a CUDA GPU (sm80+)")
        self.small = SMALL

    def run(self, base, c, **cfg):
        got = sel.select_candidates(base, c, interpret=self.INTERPRET, **cfg)
        _assert_matches_oracle(got, base, c)
        return got

    # one segment per row (stats and bound fused) and several (a separate bound kernel)
    @pytest.mark.slow(interpret_only=True)
    @pytest.mark.parametrize("dtype,segments", dtype_segments("float32-1"))
    def test_matches_oracle_on_every_kind_of_row(self, dtype, segments):
        base = jnp.asarray(_mixed_rows(seed=1), dtype)
        _, vals, arg = self.run(base, C, segments=segments, **self.small)
        assert not np.isnan(np.asarray(vals, np.float32)).any()
        assert int(arg[6]) == 0 and int(arg[7]) == 0 and int(arg[10]) == V - 7 and int(arg[11]) == 5

    @pytest.mark.parametrize("dtype", [BF16, pytest.param(F32, marks=slow)])
    def test_ties_straddling_the_boundary_lowest_ids_win(self, dtype):
        # per row: 40 nines and 300 fives at random ids, the rest below: C=100 takes the 40 nines
        # and the 60 lowest-id fives (not any 60 of them).
        rng = np.random.default_rng(7)
        x = np.tile(rng.uniform(-5, 4, V), (15, 1))
        perm = np.stack([rng.permutation(V) for _ in range(15)])
        for i in range(15):
            x[i, perm[i, :40]] = 9.0
            x[i, perm[i, 40:340]] = 5.0
        cand, _, _ = self.run(jnp.asarray(x, dtype), C, **self.small)
        for i in range(15):
            want = set(perm[i, :40].tolist()) | set(np.sort(perm[i, 40:340])[:60].tolist())
            assert set(np.asarray(cand[i]).tolist()) == want

    @pytest.mark.parametrize("dtype", [pytest.param(F16, id="float16"), pytest.param(BF16, id="bfloat16", marks=slow)])
    @pytest.mark.slow(interpret_only=True)
    def test_45_rows_default_config(self, dtype):
        rng = np.random.default_rng(3)
        x = rng.standard_normal((45, 2500))
        x[::3] = np.round(x[::3] * 4) / 4
        self.run(jnp.asarray(x, dtype), 77)

    @pytest.mark.slow(interpret_only=True)
    def test_serving_blocks_many_segments(self):
        # default block sizes, many stats segments (the bound kernel loops over them)
        base = jnp.asarray(np.random.default_rng(6).standard_normal((15, 40000)), BF16)
        self.run(base, 512, groups=1024, cap=2048, stats_blocks=64)

    @pytest.mark.slow(interpret_only=True)
    def test_c_equals_v(self):
        base = jnp.asarray(np.round(np.random.default_rng(4).standard_normal((15, 700)) * 2), BF16)
        # c > groups: no bound, everything buffered
        self.run(base, 700, groups=64, cap=1024, scan_chunk=128, block=4, stats_blocks=16, stats_unroll=2)

    @pytest.mark.parametrize("dtype,segments", DTYPE_SEGMENTS)
    @pytest.mark.slow(interpret_only=True)
    def test_block_and_segment_edges(self, dtype, segments):
        # hot elements (far above the rest) at the edges of blocks, loads, segments and the row; C cuts
        # through a class of equal hot values, so the lowest ids must win there too
        rng = np.random.default_rng(11)
        x = rng.uniform(-6.0, -1.0, (15, V))
        bs = self.small.get("block", 4)
        pb = -(-(-(-V // bs)) // 32)  # blocks per gather segment at 15 rows (32 segments)
        edges = sorted({0, 1, bs - 1, bs, 2 * bs - 1, 2 * bs, pb * bs - 1, pb * bs, 2 * pb * bs - 1,
                        8 * bs - 1, 8 * bs, 16 * bs, 128 - 1, 128, 1024 - 1, 1024, V - bs - 1, V - 2, V - 1})
        for i in range(15):
            hot = np.array(edges + sorted(rng.choice(V, 60 + 7 * i, replace=False).tolist()))
            x[i, hot] = rng.choice([1.0, 1.5, 2.0], hot.size)  # ties among the hot values
            if i % 3 == 0:
                x[i, edges] = 2.0  # the edges themselves tie at the top
        if dtype == F32:
            x[14, :] = -1e-30
            x[14, edges] = 3e-39  # subnormal maxima: block maxima and compares must not flush them
            x[14, edges[::2]] = 6e-39
        self.run(jnp.asarray(x, dtype), C, segments=segments, **self.small)

    @pytest.mark.parametrize("dtype,segments", dtype_segments("bfloat16-None"))
    @pytest.mark.slow(interpret_only=True)
    def test_slot_stride_reads_slots_1_to_b(self, dtype, segments):
        # logits [N, B, V] with N=3, B=6: the 15 draft rows (slots 1..5) are the mixed rows (every
        # finish path: fast, heavy ties at the bound, flooded row); slot 0 of each block holds huge
        # values, so reading it anywhere would change the ids, the values or the argmax.
        n, b = 3, 6
        drafts = _mixed_rows(seed=1)
        assert {"ties", "row"} <= set(_paths(drafts, C, self.small["groups"], self.small["cap"],
                                             self.small.get("block", 1)))
        rng = np.random.default_rng(5)
        logits = np.empty((n, b, V))
        logits[:, 0] = 1e4 + 100 * rng.standard_normal((n, V))
        logits[:, 1:] = drafts.reshape(n, b - 1, V)
        logits = jnp.asarray(logits, dtype)
        cfg = dict(self.small, segments=segments)
        got = sel.select_candidates(logits.reshape(n * b, V), C, interpret=self.INTERPRET, slot_stride=b, **cfg)
        want = self.run(logits[:, 1:].reshape(-1, V), C, **cfg)
        for g, w, what in zip(got, want, ("ids", "values", "argmax")):
            assert g.shape == w.shape and g.dtype == w.dtype, what
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8), err_msg=what)

    @pytest.mark.parametrize("c", [pytest.param(1024, marks=slow), 3000])
    @pytest.mark.slow(interpret_only=True)
    def test_dispatch_configs_above_512(self, c):
        """The configs `dispatch.Table.select_config` serves for large C (bigger cap, more groups, smaller
        blocks) give the oracle's candidates at V = 151936."""
        base = jnp.asarray(_serving_rows(rows=2), BF16)
        self.run(base, c, **dispatch.TABLE.select_config(dispatch.TABLE.entries[0], c))

    @slow
    def test_small_vocab_one_chunk(self):
        base = jnp.asarray(np.random.default_rng(8).standard_normal((15, 37)), F32)
        self.run(base, 37)  # V < groups: empty groups, bound = the minimum
        self.run(base, 1)

    @pytest.mark.slow(interpret_only=True)
    def test_x64_mode(self):
        with jax.enable_x64(True):  # int32 arithmetic must not widen inside the kernels
            self.run(jnp.asarray(_mixed_rows(seed=2), F32), C, **SMALL)

    def test_float64_is_refused(self):
        """The kernel refuses float64 (TypeError naming the dtype); refine routes it to the reference."""
        with jax.enable_x64(True):
            base = jnp.asarray(np.round(np.random.default_rng(1).standard_normal((3, 300))), jnp.float64)
            with pytest.raises(TypeError, match="float64"):
                sel.select_candidates(base, 50, interpret=self.INTERPRET)

    def test_no_rows(self):
        got = sel.select_candidates(jnp.zeros((0, 300), BF16), 50, interpret=self.INTERPRET)
        assert [tuple(a.shape) for a in got] == [(0, 50), (0, 50), (0,)]
        assert [a.dtype for a in got] == [jnp.int32, BF16, jnp.int32]

    def test_errors(self):
        base = jnp.zeros((15, 100), BF16)
        with pytest.raises(ValueError, match="c=101"):
            sel.select_candidates(base, 101, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="c=0"):
            sel.select_candidates(base, 0, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="cap=100"):
            sel.select_candidates(base, 10, interpret=self.INTERPRET, cap=100)
        with pytest.raises(ValueError, match=r"\[rows, V\]"):
            sel.select_candidates(base[0], 10, interpret=self.INTERPRET)
        with pytest.raises(TypeError, match="method"):  # the removed strided method's field
            sel.select_candidates(base, 10, interpret=self.INTERPRET, method="strided")
        for bad in (1, -3, 4):  # < 2, or 15 rows not a multiple of it
            with pytest.raises(ValueError, match="slot_stride"):
                sel.select_candidates(base, 10, interpret=self.INTERPRET, slot_stride=bad)


class TestSelectInterpret(TestSelect):
    INTERPRET = True


def test_keys_follow_top_k_order_over_all_bf16_values():
    bits = np.arange(2**16, dtype=np.uint16)
    x = jnp.asarray(bits.view(jnp.bfloat16))
    key = np.asarray(sel._to_key(x, jnp.bfloat16))
    clean = np.asarray(jnp.where(jnp.isnan(x), -jnp.inf, x), np.float64)
    by_key = clean[np.argsort(key, kind="stable")]
    assert np.all(by_key[1:] >= by_key[:-1]), "key order must be value order"
    assert key[0x8000] == -1 and key[0] == 0, "-0.0 ranks just below +0.0 (lax.top_k's order)"
    # round trip (NaN -> -inf)
    back = np.asarray(sel._from_key(jnp.asarray(key), jnp.bfloat16)).astype(np.float64)
    np.testing.assert_array_equal(back, clean)


@pytest.mark.parametrize("dtype,rows,segments,x64", [
    pytest.param(d, r, s, x, id=f"{jnp.dtype(d).name}-{r}-{s}-{x}",
                 marks=() if (d, r, s) in ((BF16, 15, 1), (F32, 3840, None)) else slow)
    for d in (BF16, F32) for r, s, x in ((15, None, False), (15, 1, False), (3840, None, False), (15, None, True))])
def test_lowers_to_triton_for_h200(rows, segments, x64, dtype):
    """Every kernel lowers to Triton IR at serving shapes (V=151936, c=512); no XLA fallback."""
    kw = {} if segments is None else {"segments": segments}
    f = functools.partial(sel.select_candidates, c=512, **kw)
    with jax.enable_x64(x64):
        hlo = lower_triton(f, jax.ShapeDtypeStruct((rows, 151936), dtype)).as_text()
    fused = rows >= 512 or segments == 1
    p = "select_b"
    names = ["select_finish", p + "gather"] + ([p + "stats_bound"] if fused else [p + "stats", p + "bound"])
    assert hlo.count("__gpu$xla.gpu.triton") == len(names)
    for n in names:
        assert f'"{n}"' in hlo or n in hlo, n
    assert "topk" not in hlo.lower() and "sort" not in hlo.lower()


@pytest.mark.parametrize("rows,c", [
    pytest.param(r, c, id=f"{r}-{c}", marks=() if (r, c) in ((15, 4096), (240, 3000)) else slow)
    for r in (2, 15, 240) for c in (1024, 3000, 4096)])
def test_large_c_configs_lower_to_triton(rows, c):
    """The large-C configs (cap up to 8192) lower at every row count: with few rows the segments per row
    are capped so that the finish's [segments, cap] mask stays inside Triton's 2^20-element tensor
    limit (2 rows at cap 8192 failed to build on the H200 before)."""
    f = functools.partial(sel.select_candidates, c=c, **dispatch.TABLE.select_config(dispatch.TABLE.entry(rows), c))
    hlo = lower_triton(f, jax.ShapeDtypeStruct((rows, 151936), BF16)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") >= 3


def test_config_refuses_what_triton_cannot_hold():
    with pytest.raises(ValueError, match="cap=131072 is too large"):
        sel.SelectConfig(cap=131072)
    with pytest.raises(ValueError, match="segments <= 128"):
        sel.SelectConfig(cap=8192, segments=200)
    sel.SelectConfig(cap=8192, segments=128)


def test_lowers_to_triton_with_slot_stride():
    """slot_stride=16 (whole logits [2*16, V], 15*2 draft rows): every kernel lowers, no copy of logits[:, 1:]."""
    f = functools.partial(sel.select_candidates, c=512, slot_stride=16)
    lowered = lower_triton(f, jax.ShapeDtypeStruct((2 * 16, 151936), BF16))
    hlo = lowered.as_text()
    p = "select_b"
    names = ["select_finish", p + "gather", p + "stats", p + "bound"]  # 30 rows: several segments per row
    assert hlo.count("__gpu$xla.gpu.triton") == len(names)
    for n in names:
        assert f'"{n}"' in hlo or n in hlo, n
    assert "slice" not in hlo.lower() and "topk" not in hlo.lower() and "sort" not in hlo.lower()
    cand, vals, arg = lowered.out_info
    assert cand.shape == vals.shape == (15 * 2, 512) and arg.shape == (15 * 2,)
