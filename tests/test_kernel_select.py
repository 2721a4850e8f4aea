"""`pallas_kernels.select`: top-C candidates + full-vocab argmax, against the jnp oracle (lax.top_k)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels import select as sel

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


V, C = 3001, 100  # V no multiple of any block, C no power of two
SMALL = dict(groups=128, unroll=2, cap=256, chunk=128, gather_unroll=2, scan_chunk=512)  # blocks scaled to V


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


def _paths(x: np.ndarray, c: int, groups: int, cap: int) -> list[str]:
    """Which finish path each row takes (numpy model of the bound): fast, ties (M < c), row (M > cap)."""
    x = np.where(np.isnan(x), -np.inf, x)
    v = x.shape[1]
    pad = np.full((x.shape[0], -(-v // groups) * groups), -np.inf)
    pad[:, :v] = x
    gm = pad.reshape(x.shape[0], -1, groups).max(axis=1)
    bound = np.sort(gm, axis=1)[:, ::-1][:, c - 1] if c <= groups else np.full(x.shape[0], -np.inf)
    m = (x > bound[:, None]).sum(axis=1) + (c > groups) * np.isneginf(x).sum(axis=1)
    return ["ties" if n < c else "row" if n > cap else "fast" for n in m]


def test_mixed_rows_cover_every_path():
    paths = _paths(_mixed_rows(seed=1), C, SMALL["groups"], SMALL["cap"])
    assert {"fast", "ties", "row"} <= set(paths), paths
    assert paths[12] == "row" and paths[4] == paths[5] == "ties" and paths[0] == "fast"


def _assert_matches_oracle(got, base, c):
    cand, vals, arg = (np.asarray(a) for a in got)
    rc, rv, ra = (np.asarray(a) for a in sel.select_candidates_reference(base, c))
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


class TestSelect:
    """Kernels vs oracle; skipped without a CUDA GPU (the subclass below runs them on CPU)."""

    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _device(self):
        if self.INTERPRET:
            if jax.default_backend() != "cpu":
                pytest.skip("interpret tests run on CPU")
        elif not common.gpu_supported():
            pytest.skip("needs a CUDA GPU (sm80+)")

    def run(self, base, c, **cfg):
        got = sel.select_candidates(base, c, interpret=self.INTERPRET, **cfg)
        _assert_matches_oracle(got, base, c)
        return got

    # one segment per row (stats and bound fused) and several (a separate bound kernel)
    @pytest.mark.parametrize("segments", [None, 1])
    @pytest.mark.parametrize("dtype", [BF16, F32])
    def test_matches_oracle_on_every_kind_of_row(self, dtype, segments):
        base = jnp.asarray(_mixed_rows(seed=1), dtype)
        _, vals, arg = self.run(base, C, segments=segments, **SMALL)
        assert not np.isnan(np.asarray(vals, np.float32)).any()
        assert int(arg[6]) == 0 and int(arg[7]) == 0 and int(arg[10]) == V - 7 and int(arg[11]) == 5

    @pytest.mark.parametrize("dtype", [BF16, F32])
    def test_ties_straddling_the_boundary_lowest_ids_win(self, dtype):
        # per row: 40 nines and 300 fives at random ids, the rest below: C=100 takes the 40 nines
        # and the 60 lowest-id fives (not any 60 of them).
        rng = np.random.default_rng(7)
        x = np.tile(rng.uniform(-5, 4, V), (15, 1))
        perm = np.stack([rng.permutation(V) for _ in range(15)])
        for i in range(15):
            x[i, perm[i, :40]] = 9.0
            x[i, perm[i, 40:340]] = 5.0
        cand, _, _ = self.run(jnp.asarray(x, dtype), C, **SMALL)
        for i in range(15):
            want = set(perm[i, :40].tolist()) | set(np.sort(perm[i, 40:340])[:60].tolist())
            assert set(np.asarray(cand[i]).tolist()) == want

    @pytest.mark.parametrize("dtype", [BF16, F16])
    def test_45_rows_default_config(self, dtype):
        rng = np.random.default_rng(3)
        x = rng.standard_normal((45, 2500))
        x[::3] = np.round(x[::3] * 4) / 4
        self.run(jnp.asarray(x, dtype), 77)

    def test_serving_blocks_many_segments(self):
        # default blocks (G=1024, cap=2048, chunk=8192), 20 stats segments: the bound kernel loops
        base = jnp.asarray(np.random.default_rng(6).standard_normal((15, 40000)), BF16)
        self.run(base, 512, unroll=1)

    def test_c_equals_v(self):
        base = jnp.asarray(np.round(np.random.default_rng(4).standard_normal((15, 700)) * 2), BF16)
        self.run(base, 700, groups=64, unroll=2, cap=1024, chunk=128, scan_chunk=128)  # c > groups: no bound, everything buffered

    def test_small_vocab_one_chunk(self):
        base = jnp.asarray(np.random.default_rng(8).standard_normal((15, 37)), F32)
        self.run(base, 37)  # V < groups: empty groups, bound = the minimum
        self.run(base, 1)

    def test_x64_mode(self):
        with jax.enable_x64(True):  # int32 arithmetic must not widen inside the kernels
            self.run(jnp.asarray(_mixed_rows(seed=2), F32), C, **SMALL)

    def test_float64_uses_the_oracle(self):
        with jax.enable_x64(True):
            base = jnp.asarray(np.round(np.random.default_rng(1).standard_normal((3, 300))), jnp.float64)
            self.run(base, 50)

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


@pytest.mark.parametrize("rows,segments,x64", [(15, None, False), (15, 1, False), (3840, None, False), (15, None, True)])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_lowers_to_triton_for_h200(rows, segments, x64, dtype):
    """Every kernel lowers to Triton IR at serving shapes (V=151936, c=512); no XLA fallback."""
    kw = {} if segments is None else {"segments": segments}
    f = functools.partial(sel.select_candidates, c=512, **kw)
    with jax.enable_x64(x64):
        hlo = common.lower_triton(f, jax.ShapeDtypeStruct((rows, 151936), dtype)).as_text()
    fused = rows >= 528 or segments == 1
    names = ["select_finish", "select_gather"] + (["select_stats_bound"] if fused else ["select_stats", "select_bound"])
    assert hlo.count("__gpu$xla.gpu.triton") == len(names)
    for n in names:
        assert f'"{n}"' in hlo or n in hlo, n
    assert "topk" not in hlo.lower() and "sort" not in hlo.lower()
