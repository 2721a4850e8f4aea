"""Awkward shapes through the config selection serving uses (`xpress_jax.dispatch`), interpret mode.

Every kernel is reached the way `refine` reaches it: `Ops.pallas(...)` and the configs
`dispatch.plan` picks, at ranks that are not
powers of two (24, 40, 48, 96, 192, and an odd 37), odd vocabularies, small and odd block
sizes (B = 2, 3, 7), C = 1 and C = V, and row counts on both sides of every dispatch
boundary of `dispatch.TABLE` (draft rows: the full-vocab configs at 15/30/60/240/960, the latent's
XLA (split in interpret mode) / fused switch, the selection's 240-row switch). Kernel == jnp reference on fresh random inputs:
token ids exactly, except rows where another float32 summation order could flip a near tie
(`helpers.near_tie_rows`); "dyadic" inputs (exact dot products in any order, many real ties)
demand exact equality on every row.

Cost: small V and H wherever the property does not need a big one; the expensive sides of
boundaries (hundreds of rows) and most cases of each sweep are marked `slow` (`-m slow`), each
parametrized test keeping one case in the default run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from helpers import make_head, make_inputs, near_tie_rows, pick_inputs, sequential_greedy
from xpress_jax import dispatch
from xpress_jax import reference as ref
from xpress_jax.kernels import common, full_vocab, latent
from xpress_jax.ops import Ops

DTYPES = [jnp.bfloat16, jnp.float32]
ODD_RANK = 37
RANKS = [24, 40, 48, 96, 192, ODD_RANK]
V_ODD = 1001  # > one 384-column part of the small-row table configs: several parts, a vocab tail

#: Kernel-level tests run compiled on a supported GPU, in interpret mode elsewhere (the refine-level
#: ones always compare the interpret-mode refine with the XLA one).
INTERPRET = not common.gpu_supported()
OPS = Ops.pallas(INTERPRET)
slow = pytest.mark.slow
_BF, _F32 = jnp.bfloat16, jnp.float32


def _name(dt):
    return jnp.dtype(dt).name


def rank_dtype_params(*fast: str):
    """Every awkward rank in both dtypes: the ids in ``fast`` in the default run, the rest `slow`."""
    return [pytest.param(rank, dt, id=f"{rank}-{_name(dt)}", marks=() if f"{rank}-{_name(dt)}" in fast else slow)
            for rank in RANKS for dt in DTYPES]


def _table_limits():
    """Draft-row limits of `dispatch.TABLE` where the full-vocab config changes."""
    t = dispatch.TABLE.entries
    return [a.max_rows for a, b in zip(t, t[1:]) if a.full_vocab != b.full_vocab]


def fv_config(rows, vocab, rank, dtype):
    """The full-vocab config the dispatch serves at this many draft rows."""
    return dispatch.plan(rows, 2, vocab, rank, 0, dtype).full_vocab


def _latent_limits(kind):
    """The last draft-row count at which the table's latent is ``kind``."""
    return max(r.max_rows for r in dispatch.TABLE.entries if r.latent == kind)


LAT_XLA_ROWS = _latent_limits("xla")  # 960 (N = 64 at B = 16); above it the fused kernel
# No 16-bit entry serves the split variant (XLA's latent is faster up to N = 64); interpret-mode plans
# (`kernels_everywhere`) run it wherever the table says XLA, so the tests below exercise it up to LAT_XLA_ROWS.


# (N, B) with N*(B-1) draft rows on both sides of every full-vocab table boundary (15/30/60/240/960),
# small and odd B among them; the slow ones are the hundreds-of-rows sides.
FV_BOUNDARY = [
    pytest.param(5, 4, id="rows15-B4", marks=slow), pytest.param(8, 3, id="rows16-B3", marks=slow),
    pytest.param(10, 4, id="rows30-B4", marks=slow), pytest.param(31, 2, id="rows31-B2", marks=slow),
    pytest.param(10, 7, id="rows60-B7", marks=slow), pytest.param(61, 2, id="rows61-B2"),
    pytest.param(40, 7, id="rows240-B7", marks=slow), pytest.param(241, 2, id="rows241-B2", marks=slow),
    pytest.param(160, 7, id="rows960-B7", marks=slow), pytest.param(31, 32, id="rows961-B32", marks=slow),
]


def test_full_vocab_boundaries_cover_the_table():
    """FV_BOUNDARY straddles every limit of the table (so a new limit needs new cases here)."""
    rows = {p.values[0] * (p.values[1] - 1) for p in FV_BOUNDARY}
    for limit in _table_limits():
        assert {limit, limit + 1} <= rows, limit
    # and the two sides really get different configs
    for limit in _table_limits():
        lo = fv_config(limit, V_ODD, 24, jnp.bfloat16)
        hi = fv_config(limit + 1, V_ODD, 24, jnp.bfloat16)
        assert lo != hi, limit


def _check_full_vocab(n, b, vocab, rank, dtype, seed):
    """OPS.full_vocab_pick (the serving call: whole logits, slot_stride) vs the jnp reference."""
    rows = n * (b - 1)
    for dyadic in (False, True):
        base, lat, w2 = pick_inputs(rows, vocab, rank, dtype, seed=seed, dyadic=dyadic)
        # whole logits [N, B, V]: slot 0 holds huge values that must never be read
        logits = jnp.concatenate([jnp.full((n, 1, vocab), 1e4, dtype), base.reshape(n, b - 1, vocab)], axis=1)
        got = np.asarray(OPS.full_vocab_pick(logits, lat, w2)[0])
        want = np.asarray(ref.full_vocab_pick(base, lat, w2))
        assert got.shape == (rows,) and got.dtype == np.int32
        if dyadic:
            np.testing.assert_array_equal(got, want)
        else:
            near = near_tie_rows(base, lat, w2, want)
            assert near.mean() < 0.1, f"{near.sum()} near ties of {rows}: the check would be vacuous"
            np.testing.assert_array_equal(got[~near], want[~near])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=slow)], ids=_name)
@pytest.mark.parametrize("n,b", FV_BOUNDARY)
@pytest.mark.slow
def test_full_vocab_at_table_boundaries(n, b, dtype):
    """Both sides of every draft-row boundary of the served table, rank 24 (not a power of two).

    The table serves 16-bit dtypes; float32 takes the kernel's own heuristic (not the table), so its
    cases are `slow` (float32 runs in test_full_vocab_ranks)."""
    _check_full_vocab(n, b, V_ODD, 24, dtype, seed=n * b)


@pytest.mark.parametrize("rank,dtype", rank_dtype_params("37-float32"))
@pytest.mark.parametrize("n,b", [pytest.param(1, 16, id="N1-B16"), pytest.param(2, 3, id="N2-B3", marks=slow)])
def test_full_vocab_ranks(n, b, rank, dtype):
    """Every awkward rank at the configs served for <= 60 draft rows: N=1 holds the latent and dots the whole rank
    (a masked tail chunk up to the next power of two), N = 2..4 are flat (rank chunks of 64)."""
    _check_full_vocab(n, b, 613, rank, dtype, seed=rank)


@slow
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("n,b", [pytest.param(5, 7, id="rows30"), pytest.param(17, 16, id="rows255"),
                                 pytest.param(9, 108, id="rows963")])
def test_full_vocab_ranks_sweep(n, b, rank, dtype):
    _check_full_vocab(n, b, V_ODD, rank, dtype, seed=rank + n)


def test_full_vocab_configs_pass_their_shape_check():
    """Whatever the dispatch hands out passes check_shape (at any rank, also far above serving)."""
    for dtype in DTYPES:
        for rows in (1, 15, 16, 60, 61, 240, 241, 960, 961, 3840):
            for rank in RANKS + [1, 256, 1024, 4096]:
                cfg = fv_config(rows, 151936, rank, dtype)
                cfg.check_shape(rows, 151936, rank, dtype)
                assert cfg.smem_bytes(rank, dtype) <= full_vocab.SMEM_LIMIT


def test_full_vocab_check_shape_refuses_what_cannot_run():
    ok = full_vocab.FullVocabConfig(row_tile=16, v_tile=64, k_tile=64, hold_lat=False)
    ok.check_shape(15, 1000, 24, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"row_tile=8 must be >= 16"):
        dataclasses.replace(ok, row_tile=8).check_shape(15, 1000, 24, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"k_tile=8 must be 0 or >= 16"):
        dataclasses.replace(ok, k_tile=8).check_shape(15, 1000, 24, jnp.bfloat16)
    held = full_vocab.FullVocabConfig(row_tile=128, v_tile=64, k_tile=0, num_stages=3, hold_lat=True)
    held.check_shape(240, 151936, 256, jnp.bfloat16)  # the served N=16 config at r=256 fits
    with pytest.raises(ValueError, match="shared memory"):
        held.check_shape(240, 151936, 1024, jnp.bfloat16)
    with pytest.raises(ValueError, match="rank >= 1"):
        ok.check_shape(15, 1000, 0, jnp.bfloat16)
    # the kernel wrapper checks the config against the shapes before tracing the kernel
    base, lat, w2 = pick_inputs(15, 300, 24, jnp.float32, seed=0)
    with pytest.raises(ValueError, match="row_tile=8"):
        full_vocab.full_vocab_pick(base, lat, w2, config=dataclasses.replace(ok, row_tile=8),
                                   interpret=INTERPRET)


def test_rank_chunks_are_tensor_core_sized():
    """The fused kernel's rank chunk is a power of two >= 16 for every rank (a masked tail, not k=8 or 1)."""
    for rank in RANKS + [1, 7, 16, 256, 300]:
        for k_tile in (0, 16, 64, 128):
            kc = common.k_chunk(k_tile, rank, full_vocab.MIN_DOT)
            assert kc >= 16 and kc & (kc - 1) == 0 and (not k_tile or kc <= k_tile), (rank, k_tile, kc)
            assert common.cdiv(rank, kc) * kc - rank < kc  # the tail chunk holds part of the rank


# ---------------------------------------------------------------------------- top-C pick


def _check_topc(rows, vocab, c, rank, dtype, seed):
    """OPS.topc_prepare + OPS.topc_pick (the dispatch's config) vs the jnp reference, candidates as refine makes them."""
    for dyadic in (False, True):
        base, lat, w2 = pick_inputs(rows, vocab, rank, dtype, seed=seed, dyadic=dyadic)
        cand, base_c, _ = ref.select_candidates(base, c)
        got = np.asarray(OPS.topc_pick(base_c, cand, lat, OPS.topc_prepare(w2, cand))[0])
        want = np.asarray(ref.topc_pick(base_c, cand, lat, ref.topc_gather(w2, cand)))
        assert got.shape == (rows,) and got.dtype == np.int32
        if dyadic:
            np.testing.assert_array_equal(got, want)
        else:
            near = near_tie_rows(base_c, lat, w2, want, cand=cand)
            np.testing.assert_array_equal(got[~near], want[~near])


@pytest.mark.parametrize("rank,dtype", rank_dtype_params("37-float32"))
def test_topc_ranks(rank, dtype):
    """Awkward ranks (64-wide chunks, a masked tail), C=37 (a tail tile), 2 rows (N=2, B=2)."""
    _check_topc(2, 211, 37, rank, dtype, seed=rank)


@pytest.mark.parametrize("rows,c,dtype", [
    pytest.param(6, 1, jnp.bfloat16, id="rows6-B3-C1-bf16", marks=slow),
    pytest.param(14, 211, jnp.float32, id="rows14-B8-CV-f32"),
    pytest.param(6, 211, jnp.bfloat16, id="rows6-B3-CV-bf16", marks=slow),
    pytest.param(14, 1, jnp.float32, id="rows14-B8-C1-f32", marks=slow)])
@pytest.mark.slow
def test_topc_c_edges(rows, c, dtype):
    """C = 1 and C = V (odd V=211: two 128-candidate tiles, the second partial), rank 40."""
    _check_topc(rows, 211, c, 40, dtype, seed=rows + c)


# ---------------------------------------------------------------------------- selection


def _check_select(n, b, vocab, c, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, b, vocab))
    x[:, 1:, ::7] = np.round(x[:, 1:, ::7])  # some exact ties, also at the C-th place
    logits = jnp.asarray(x, dtype)
    got = OPS.select(logits, c)
    want = ref.select_candidates(logits[:, 1:].reshape(n * (b - 1), vocab), c)
    cand, vals, arg = (np.asarray(a) for a in got)
    rc, rv, ra = (np.asarray(a) for a in want)
    np.testing.assert_array_equal(np.sort(cand, axis=1), np.sort(rc, axis=1))
    np.testing.assert_array_equal(np.sort(vals.astype(np.float32), axis=1), np.sort(rv.astype(np.float32), axis=1))
    np.testing.assert_array_equal(arg, ra)


@pytest.mark.parametrize("n,b", [pytest.param(239, 2, id="rows239-B2", marks=slow),
                                 pytest.param(40, 7, id="rows240-B7", marks=slow)])
def test_select_at_the_240_row_switch(n, b):
    """Both sides of the dispatch's block=16 switch (rows >= 240), odd V, C no power of two."""
    _check_select(n, b, 301, 37, jnp.bfloat16, seed=n)


@pytest.mark.parametrize("c,dtype", [
    pytest.param(513, jnp.bfloat16, id="C513-bf16", marks=slow),
    pytest.param(2049, jnp.float32, id="C2049-f32", marks=slow),
    pytest.param(512, jnp.float32, id="C512-f32", marks=slow), pytest.param(2048, jnp.bfloat16, id="C2048-bf16", marks=slow),
    pytest.param(5003, jnp.bfloat16, id="CV-bf16", marks=slow)])
def test_select_at_the_large_c_switches(c, dtype):
    """Both sides of `dispatch.Table.select_config`'s switches (C > 512: bigger cap and more groups; C > 2048:
    8-element blocks) at an odd V=5003, where the groups outnumber the blocks (the bound is loose, the
    finish may take its whole-row path: exact either way)."""
    _check_select(1, 3, 5003, c, dtype, seed=c)


@pytest.mark.parametrize("n,b,c,dtype", [
    pytest.param(2, 2, 1, jnp.bfloat16, id="B2-C1-bf16", marks=slow),
    pytest.param(1, 3, 301, jnp.float32, id="B3-CV-f32"),
    pytest.param(1, 7, 1, jnp.float32, id="B7-C1-f32", marks=slow),
    pytest.param(1, 7, 301, jnp.bfloat16, id="B7-CV-bf16", marks=slow)])
@pytest.mark.slow
def test_select_small_blocks_and_c_edges(n, b, c, dtype):
    _check_select(n, b, 301, c, dtype, seed=b + c)


# ---------------------------------------------------------------------------- latent pass


def _latent_inputs(n, b, vocab, rank, m, dtype, seed):
    from test_kernel_latent import _params

    rng = np.random.default_rng(seed)
    params = _params(rng, b, vocab, rank, m, dtype)
    xh = jnp.asarray(rng.standard_normal((n, b, rank)).astype(np.float32)).astype(dtype)
    blk = jnp.asarray(rng.integers(0, vocab, (n, b)), jnp.int32)
    prev = jnp.asarray(rng.integers(0, vocab, (n,)), jnp.int32)
    return params, xh, blk, prev


def _check_latent(n, b, rank, dtype, m=40, vocab=97, seed=0):
    from test_kernel_latent import assert_close

    params, xh, blk, prev = _latent_inputs(n, b, vocab, rank, m, dtype, seed)
    want = ref.latent_pass(params, xh, blk, prev)
    out = OPS.latent(params, xh, blk, prev)
    assert out.shape == (n, b - 1, rank)
    assert_close(out, want)
    if not INTERPRET and n * (b - 1) <= LAT_XLA_ROWS:  # compiled, the dispatch took XLA's latent: the kernel too
        assert_close(latent.latent_pass(params, xh, blk, prev, config=latent.default_config(n, dtype, "split",
                                                                                              rank=rank)), want)


@pytest.mark.parametrize("rank,dtype", rank_dtype_params("37-float32"))
@pytest.mark.slow
def test_latent_ranks(rank, dtype):
    """The split variant (interpret-mode plans up to LAT_XLA_ROWS draft rows) at every awkward rank, 2 blocks
    of B = 3 (compiled on a GPU, 4 rows take XLA's latent, and the test runs the split kernel itself)."""
    _check_latent(2, 3, rank, dtype, seed=rank)


@pytest.mark.parametrize("rank", [24, pytest.param(ODD_RANK, marks=slow), pytest.param(192, marks=slow)])
@pytest.mark.parametrize("b,dtype", [pytest.param(2, _F32, id="2-float32"),
                                     pytest.param(7, _BF, id="7-bfloat16", marks=slow),
                                     pytest.param(2, _BF, id="2-bfloat16", marks=slow),
                                     pytest.param(7, _F32, id="7-float32", marks=slow)])
def test_latent_small_blocks(b, rank, dtype):
    _check_latent(2, b, rank, dtype, seed=rank + b)


@pytest.mark.parametrize("n", [pytest.param(LAT_XLA_ROWS, id="rows_xla_max", marks=slow),
                               pytest.param(LAT_XLA_ROWS + 1, id="rows_xla_max+1", marks=slow)])
def test_latent_at_dispatch_boundaries(n):
    """Both sides of the latent's draft-row switches, B = 2 (one draft row per block)."""
    _check_latent(n, 2, 40, jnp.bfloat16, seed=n)


@pytest.mark.slow
def test_latent_fused_at_awkward_shapes():
    """The fused variant (served above LAT_XLA_ROWS draft rows) at an odd rank and B = 3 (fast stand-in for N = 65)."""
    from test_kernel_latent import assert_close

    for rank, b in ((ODD_RANK, 3), (48, 7)):
        params, xh, blk, prev = _latent_inputs(3, b, 97, rank, 40, jnp.bfloat16, rank)
        out = latent.latent_pass(params, xh, blk, prev, interpret=INTERPRET,
                                 config=latent.default_config(3, jnp.bfloat16, "fused", rank=rank))
        assert_close(out, ref.latent_pass(params, xh, blk, prev))


def test_latent_dispatch_compiled():
    """Compiled (GPU) dispatch: up to LAT_XLA_ROWS draft rows XLA's latent, above it the kernel."""
    ops = Ops.pallas(False)
    for n in (1, 64, 65):  # B = 16: 15, 960, 975 draft rows
        args = _latent_inputs(n, 16, 97, 24, 40, jnp.bfloat16, 0)
        jaxpr = str(jax.make_jaxpr(ops.latent)(*args))
        assert ("pallas_call" in jaxpr) == (n * 15 > LAT_XLA_ROWS), n


def test_latent_check_shape():
    """The fused variant stages rank-wide weight tiles: refused where they cannot fit, and the
    default config falls back to the split variant there."""
    fused = latent.default_config(256, jnp.bfloat16, "fused")
    fused.check_shape(256, jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        fused.check_shape(1024, jnp.bfloat16)
    assert latent.default_config(256, jnp.bfloat16, rank=1024).variant == "split"
    assert latent.default_config(256, jnp.bfloat16, rank=256).variant == "fused"
    latent.default_config(256, jnp.bfloat16, rank=1024).check_shape(1024, jnp.bfloat16)


# ---------------------------------------------------------------------------- refine


def _cfg(rank, b, vocab=V_ODD, topc=0):
    return xj.HeadConfig(vocab_size=vocab, hidden_size=24, block_size=b, rank=rank, mlp_hidden=40, topc=topc,
                         max_num_reqs=256)


refine_jit = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)




@pytest.mark.interpret_refine
@pytest.mark.parametrize("rank,b,n,topc,dtype", [
    pytest.param(40, 7, 2, 0, _BF, id="r40-B7-rows12-full-bf16"),
    pytest.param(24, 3, 8, 0, _F32, id="r24-B3-rows16-full-f32", marks=slow),  # f32: not the table
    pytest.param(24, 3, 8, 0, _BF, id="r24-B3-rows16-full-bf16", marks=slow),
    pytest.param(ODD_RANK, 2, 3, 13, _BF, id="r37-B2-top13-bf16", marks=slow),
    pytest.param(48, 7, 2, V_ODD, _F32, id="r48-B7-topV-f32", marks=slow),
    pytest.param(40, 7, 2, 0, _F32, id="r40-B7-rows12-full-f32", marks=slow),
    pytest.param(ODD_RANK, 2, 3, 13, _F32, id="r37-B2-top13-f32", marks=slow),
    pytest.param(48, 7, 2, V_ODD, _BF, id="r48-B7-topV-bf16", marks=slow),
    pytest.param(192, 3, 31, 0, _BF, id="r192-B3-rows62-full-bf16", marks=slow),
])
@pytest.mark.slow
def test_refine_pallas_equals_xla(rank, b, n, topc, dtype):
    cfg = _cfg(rank, b, topc=topc)
    params = make_head(cfg, dtype=dtype)
    x = make_inputs(cfg, n, seed=rank + n, dtype=dtype)
    want = np.asarray(refine_jit(params, *x, num_passes=3, topc=topc, backend="xla"))
    got = np.asarray(refine_jit(params, *x, num_passes=3, topc=topc, backend="pallas", interpret=True))
    assert np.mean(want != np.asarray(jnp.argmax(x[0][:, 1:], -1))) > 0.2, "refinement changes too few tokens"
    np.testing.assert_array_equal(got, want)


@pytest.mark.interpret_refine
@pytest.mark.parametrize("rank", [pytest.param(40, marks=slow), pytest.param(ODD_RANK, marks=slow)])
def test_jacobi_exactness_full_vocab_pallas_bf16(rank):
    """K >= B-1 full-vocab passes of the Pallas refine == the sequential greedy decode (bf16, rank not a power of two)."""
    cfg = _cfg(rank, 6, vocab=611)
    params = make_head(cfg, dtype=jnp.bfloat16)
    logits, h, a, p = make_inputs(cfg, 3, dtype=jnp.bfloat16)
    seq = sequential_greedy(params, logits, h, a, p)
    assert np.mean(seq != np.asarray(jnp.argmax(logits[:, 1:], axis=-1))) > 0.5, "test would be vacuous"
    B = cfg.block_size
    out = np.asarray(refine_jit(params, logits, h, a, p, num_passes=B - 1, topc=0, backend="pallas", interpret=True))
    np.testing.assert_array_equal(out, seq)
    # after pass K, slots 1..K are final
    out = np.asarray(refine_jit(params, logits, h, a, p, num_passes=2, topc=0, backend="pallas", interpret=True))
    np.testing.assert_array_equal(out[:, :2], seq[:, :2])
    # Unrolled, pass q picks only draft slots q.. (interpret mode skips the final slots wherever it can; passes
    # q >= B-1 pick nothing) and reads w2 in descending order on odd q: the same tokens as the loop.
    for k, want in ((2, out), (B - 1, seq), (B + 1, seq)):
        got = refine_jit(params, logits, h, a, p, num_passes=k, topc=0, backend="pallas", interpret=True, unroll=True)
        np.testing.assert_array_equal(np.asarray(got), want)


# ---------------------------------------------------------------------------- compiled refine (GPU)


@pytest.mark.parametrize("rank,b,n,topc", [
    pytest.param(40, 7, 2, 0, id="r40-B7-rows12-full"),
    pytest.param(24, 3, 8, 0, id="r24-B3-rows16-full"),
    pytest.param(ODD_RANK, 2, 3, 13, id="r37-B2-top13"),
    pytest.param(48, 7, 2, V_ODD, id="r48-B7-topV"),
    pytest.param(192, 3, 31, 0, id="r192-B3-rows62-full"),
    pytest.param(96, 16, 17, 1, id="r96-B16-rows255-top1"),
])
def test_compiled_refine_equals_xla_float32(rank, b, n, topc):
    """On a GPU: the compiled Pallas refine (the dispatch serving uses) == the XLA refine at awkward
    shapes, float32 (ties within float32 reassociation are ~2^-24 apart: none expected here), and
    K >= B-1 full-vocab passes == the sequential greedy decode."""
    if not common.gpu_supported():
        pytest.skip("needs a CUDA GPU (the interpret-mode twins are test_refine_pallas_equals_xla)")
    cfg = _cfg(rank, b, topc=topc)
    params = make_head(cfg, dtype=jnp.float32)
    x = make_inputs(cfg, n, seed=rank + n, dtype=jnp.float32)
    want = np.asarray(refine_jit(params, *x, num_passes=3, topc=topc, backend="xla"))
    got = np.asarray(refine_jit(params, *x, num_passes=3, topc=topc, backend="pallas"))
    drafter = np.asarray(jnp.argmax(x[0][:, 1:], -1))
    if topc == 1:  # one candidate: the drafter's own token, whatever the head says
        np.testing.assert_array_equal(want, drafter)
    else:
        assert np.mean(want != drafter) > 0.2, "refinement changes too few tokens"
    np.testing.assert_array_equal(got, want)
    if topc == 0:
        seq = sequential_greedy(params, *x)
        out = np.asarray(refine_jit(params, *x, num_passes=b - 1, topc=0, backend="pallas"))
        np.testing.assert_array_equal(out, seq)
