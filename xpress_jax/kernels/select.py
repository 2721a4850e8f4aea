"""Top-C candidate selection per draft slot (+ the row's full-vocab argmax) as Pallas-Triton kernels.

For base logits ``[rows, V]`` and ``1 <= c <= V``: ``cand`` [rows, c] int32 (the ids of the row's ``c`` largest
logits, in no particular order), ``base_c`` [rows, c] (their logits, exact; NaN reads as -inf) and ``argmax``
[rows] int32 (the block's starting token). Rules as the oracle `xpress_jax.reference.select_candidates`
(``lax.top_k`` + ``jnp.argmax``): NaN counts as -inf; membership follows ``lax.top_k``'s total order on the bits
(``-0.0`` below ``+0.0``), the lowest ids among values tied at the c-th place; the argmax compares values
(``-0.0 == +0.0``), lowest id on ties; a row of all -inf/NaN has argmax 0.

Algorithm (exact for any input: bound, gather, finish), on order-preserving int32 keys
(``key = bits ^ (sign ? 0x7FFF[FFFF] : 0)``, NaN -> key(-inf)):

1. ``bstats`` (grid rows x segments, one read of the logits) keeps the max key of every ``block`` contiguous
   elements, the row's max and its first block (the argmax). Blocks fall in ``G`` groups (block b in group
   ``b % G``); ``L`` = the c-th largest group maximum is a lower bound of the c-th largest key (``bbound``
   combines the segments where a row has several).
2. ``bgather`` (grid rows x segments) compacts the ids of the blocks whose max is above ``L``, then reads only
   those blocks and compacts their elements with ``key > L`` into a per-segment buffer, in vocab order. No
   atomics: each segment owns its slice, so the result is deterministic.
3. ``finish`` (grid rows), ``M = count(key > L)``: if ``c <= M <= cap``, a 16-way threshold search over the M
   buffered keys finds the c-th largest key ``t``; the elements above ``t`` go in, then the first ones equal to
   ``t`` in vocab order. If ``M < c`` (heavy ties) the buffer goes in, then the first elements equal to ``L`` in
   a scan of the row. If ``M > cap`` (adversarial rows) the search runs over the whole row.

float64 is refused (``TypeError``). Interpret mode only: masked scatter lanes aim at a trash slot (outputs padded
by one, sliced off). ``slot_stride=B``: ``base`` is the whole logits [N*B, V] (`common.src_row`).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import common
from .common import plt, BIG, next_pow2, src_row

__all__ = ["SelectConfig", "select_candidates"]

_SENT = -(2**31)  # key of masked lanes: below every real key (NaN is keyed as -inf)
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class SelectConfig:
    """Block sizes (powers of two) and launch shape; hashable, a static jit argument.

    groups: G, the number of groups of blocks whose maxima give the bound (block b in group ``b % G``).
    block: elements per block: the unit of the maxima and of the gather's reads.
    stats_blocks / stats_unroll: stats issues ``stats_unroll`` loads of ``stats_blocks`` blocks per
      loop step (it halves the unroll, then the blocks down to 64, to reach ``segments``).
    scan_blocks: block maxima per step in the gather's first phase (which blocks to read).
    gather_blocks: blocks per load (and per compaction) in the gather's second phase.
    cap: buffer capacity, the most elements above the bound that the fast finish handles.
    scan_chunk: elements per block in the finish's row scans (ties at the bound, flooded rows).
    num_warps / gather_warps / finish_warps: warps of stats and bound / gather / finish.
    segments: programs per row in stats and gather (None: the power of two at or below
      ``target_programs / rows``; fewer when a row has fewer loop steps).
    """

    groups: int = 2048
    num_warps: int = 8
    gather_warps: int = 4
    block: int = 32
    stats_blocks: int = 512
    stats_unroll: int = 1
    scan_blocks: int = 1024
    gather_blocks: int = 64
    cap: int = 1024
    scan_chunk: int = 2048
    finish_warps: int = 16
    segments: int | None = None
    target_programs: int = 512

    def __post_init__(self):
        for f in ("groups", "cap", "scan_chunk", "block", "stats_blocks", "stats_unroll", "scan_blocks",
                  "gather_blocks"):
            v = getattr(self, f)
            lo = 1 if "unroll" in f or "block" in f else 16
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or v & (v - 1):
                raise ValueError(f"{f}={v!r} must be a power of two >= {lo}")
        if self.segments is not None and (not isinstance(self.segments, int) or self.segments < 1):
            raise ValueError(f"segments={self.segments!r} must be a positive int or None")
        if 16 * self.cap > _MAX_TENSOR:  # the finish's [16, cap] tensor
            raise ValueError(f"cap={self.cap} is too large: cap <= {_MAX_TENSOR // 16} (Triton's largest tensor)")
        if self.segments is not None and next_pow2(self.segments) > _max_segments(self):  # its [segments, cap] mask
            raise ValueError(f"segments={self.segments} with cap={self.cap}: segments <= {_max_segments(self)}")


#: Triton's largest tensor, in elements: the finish holds a [next_pow2(segments), cap] mask, and a
#: [16, cap] one in its threshold search.
_MAX_TENSOR = 1 << 20


def _max_segments(cfg: SelectConfig) -> int:
    """The most segments per row whose [segments, cap] mask Triton can hold (a power of two)."""
    return max(1, _MAX_TENSOR // cfg.cap)


def _want_segments(rows: int, cfg: SelectConfig) -> int:
    if cfg.segments is not None:
        return cfg.segments
    return min(_max_segments(cfg), 1 << max(0, (cfg.target_programs // max(rows, 1)).bit_length() - 1))


def _split(nsteps: int, want: int) -> tuple[int, int]:
    """(segments, loop steps per segment): about ``want`` segments (fewer if the row is short)."""
    per = max(1, nsteps // max(want, 1))
    return -(-nsteps // per), per


# ----------------------------------------------------------------------------- keys
def _key_consts(dtype):
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return dict(bits=32, int_t=jnp.int32, mask=0x7FFFFFFF, inf=0x7F800000)
    inf = 0x7F80 if dtype == jnp.bfloat16 else 0x7C00
    return dict(bits=16, int_t=jnp.int16, mask=0x7FFF, inf=inf)


def _neg_inf_key(k) -> int:
    return ((k["inf"] | (1 << (k["bits"] - 1))) - (1 << k["bits"])) ^ k["mask"]  # of -inf's sign-extended bits


def _to_key(x, dtype):
    """Order-preserving int32 key; NaN -> key(-inf). (-0.0 keys as -1, below +0.0's 0.)"""
    k = _key_consts(dtype)
    b = lax.bitcast_convert_type(x, k["int_t"]).astype(jnp.int32)
    key = b ^ ((b >> 31) & k["mask"])
    return jnp.where((b & k["mask"]) > k["inf"], _neg_inf_key(k), key)


def _from_key(key, dtype):
    k = _key_consts(dtype)
    b = key ^ ((key >> 31) & k["mask"])
    return lax.bitcast_convert_type(b.astype(k["int_t"]), jnp.dtype(dtype))


def _canon(key):
    """Value order for the argmax: -0.0 (key -1) counts as +0.0 (key 0)."""
    return jnp.where(key == -1, 0, key)


def _narrow(count_ge, lo, hi, cnt_hi, c):
    """Exact c-th largest key by 16-way search.

    Invariant: ``count_ge(lo) >= c > count_ge(hi) == cnt_hi``. Returns ``(t, cnt_gt)`` with
    ``t`` the c-th largest key and ``cnt_gt = count(key > t) < c``. int32 arithmetic wraps, so
    ranges up to 2**32 - 1 (any f32 keys) are fine: offsets are unsigned (logical shift).
    """
    j16 = jnp.arange(16, dtype=jnp.int32)

    def cond(st):
        lo, hi, _ = st
        return lo + 1 < hi

    def body(st):
        lo, hi, cnt_hi = st
        step = jnp.maximum(lax.shift_right_logical(hi - lo, jnp.int32(4)), 1)
        cnt = count_ge(lo + step * j16)  # [16], non-increasing, cnt[0] >= c
        jstar = _isum(cnt >= c) - 1
        nxt = jstar + 1
        t_next = lo + step * nxt
        cnt_next = _isum(jnp.where(j16 == nxt, cnt, 0))
        use = (nxt < 16) & (t_next < hi)
        return lo + step * jstar, jnp.where(use, t_next, hi), jnp.where(use, cnt_next, cnt_hi)

    lo, hi, cnt_hi = lax.while_loop(cond, body, (lo, hi, cnt_hi))
    return lo, cnt_hi


def _isum(x, axis=None):
    """int32 sum (also under x64, where jnp.sum would widen to int64)."""
    return jnp.sum(x.astype(jnp.int32), axis=axis, dtype=jnp.int32)


def _icumsum(x):
    return jnp.cumsum(x.astype(jnp.int32), dtype=jnp.int32)


def _count_ge_vec(k):
    return lambda thr: _isum(k[None, :] >= thr[:, None], axis=1)


def _bound(gm, c, groups):
    """c-th largest of the group maxima (canonical keys) as a bound valid for exact keys."""
    if c > groups:
        return jnp.int32(_SENT)
    la, _ = _narrow(_count_ge_vec(gm), jnp.min(gm), jnp.max(gm) + 1, jnp.int32(0), c)
    # canonical 0 also stands for -0.0 (exact key -1): lower the bound so it stays valid.
    return jnp.where(la == 0, -1, la)


def _draft_rows(base_rows: int, slot_stride: int) -> int:
    return base_rows if not slot_stride else base_rows // slot_stride * (slot_stride - 1)


# ----------------------------------------------------------------------------- kernels
def _finish_kernel(L_ref, hi_ref, cnt_ref, st_ref, bk_ref, bi_ref, x_ref, cand_ref, val_ref, *,
                   v, c, cap, nseg, ch, dtype, trash, slot_stride=0):
    # L_ref/hi_ref [rows]; cnt_ref/st_ref [rows, S]; bk_ref/bi_ref [rows, S, cap+1]; x_ref [rows, V]
    # st: per segment, an element index at or before the segment's first element equal to L (BIG: none)
    # cand_ref [rows, c or c+1] int32, val_ref [rows, c or c+1] dtype (slot c = trash in interpret mode)
    r = pl.program_id(0)
    xr = src_row(r, slot_stride)
    L = L_ref[r]
    hi0 = hi_ref[r]
    j = jnp.arange(cap, dtype=jnp.int32)
    lane = jnp.arange(ch, dtype=jnp.int32)
    nch = -(-v // ch)
    sp = next_pow2(nseg)
    sidx = jnp.arange(sp, dtype=jnp.int32)
    cnt = plt.load(cnt_ref.at[r, sidx], mask=sidx < nseg, other=0)  # [sp] per-segment counts above L
    M = _isum(cnt)

    def out(pos, ids, keys, mask):
        pos = jnp.where(mask, pos, trash)
        plt.store(cand_ref.at[r, pos], ids, mask=mask)
        plt.store(val_ref.at[r, pos], _from_key(keys, dtype), mask=mask)

    def load_keys(ci):
        col = ci * ch + lane
        ok = col < v
        x = plt.load(x_ref.at[xr, pl.ds(ci * ch, ch)], mask=ok, other=0)
        return col, jnp.where(ok, _to_key(x, dtype), _SENT)

    @pl.when(M <= cap)
    def _():
        # lane j of the compacted buffer: segment seg = #segments ending at or before j, offset j - pre
        before = _icumsum(cnt)[:, None] <= j[None, :]  # [sp, cap]
        seg = _isum(before, axis=0)
        pre = _isum(jnp.where(before, cnt[:, None], 0), axis=0)
        valid = j < M
        seg = jnp.where(valid, seg, 0)
        ofs = jnp.where(valid, j - pre, 0)
        k = plt.load(bk_ref.at[r, seg, ofs], mask=valid, other=_SENT)
        ids = plt.load(bi_ref.at[r, seg, ofs], mask=valid, other=0)

        @pl.when(M >= c)
        def _():  # the usual case: everything above t is buffered
            t, n_gt = _narrow(_count_ge_vec(k), L + 1, hi0, jnp.int32(0), c)
            eq = k == t
            keep = (k > t) | (eq & (_icumsum(eq) <= c - n_gt))
            out(_icumsum(keep) - 1, ids, k, keep)

        @pl.when(M < c)
        def _():  # t == L: all M buffered elements, then the first c - M ties at L in vocab order
            out(j, ids, k, valid)
            need = c - M
            start = jnp.min(plt.load(st_ref.at[r, sidx], mask=sidx < nseg, other=BIG))  # no tie before

            def cond(st):
                ci, found = st
                return (ci < nch) & (found < need)

            def body(st):
                ci, found = st
                col, kk = load_keys(ci)
                eq = kk == L
                rank = found + _icumsum(eq)
                keep = eq & (rank <= need)
                out(M + rank - 1, col, kk, keep)
                return ci + 1, found + _isum(eq)

            lax.while_loop(cond, body, (jnp.minimum(start, v) // ch, jnp.int32(0)))

    @pl.when(M > cap)
    def _():  # adversarial row: exact search over the whole row, then one compaction pass
        def count_ge(thr):
            def body(ci, acc):
                _, kk = load_keys(ci)
                return acc + _isum(kk[None, :] >= thr[:, None], axis=1)

            return lax.fori_loop(0, nch, body, jnp.zeros((16,), jnp.int32))

        t, n_gt = _narrow(count_ge, L, hi0, jnp.int32(0), c)
        need = c - n_gt

        def cond(st):
            ci, kept, _ = st
            return (ci < nch) & (kept < c)

        def body(st):
            ci, kept, eq_seen = st
            col, kk = load_keys(ci)
            eq = kk == t
            keep = (kk > t) | (eq & (eq_seen + _icumsum(eq) <= need))
            out(kept + _icumsum(keep) - 1, col, kk, keep)
            return ci + 1, kept + _isum(keep), eq_seen + _isum(eq)

        lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0), jnp.int32(0)))


# ----------------------------------------------------------------------------- kernels (blocks)
def _barrier(interpret):
    """Orders this program's global writes before its later reads (a no-op when interpreted)."""
    if not interpret:
        plt.debug_barrier()


def _block_keys(x, dtype):
    """[tb, bs] logits -> [tb] canonical key of each row's max (NaN as -inf; -0.0 as +0.0), in integer work: on
    the sign-extended bits ``b`` the max key is ``max(b)`` if some ``b >= 0``, else the key of ``min(b)``. Positive
    NaN is left out of the max; negative NaN only decides ``min(b)`` when the row holds nothing else."""
    k = _key_consts(dtype)
    b = lax.bitcast_convert_type(x, k["int_t"]).astype(jnp.int32)
    bmax = jnp.max(jnp.where(b > k["inf"], _SENT, b), axis=1)
    bmin = jnp.min(b, axis=1)
    neg_inf_key = _neg_inf_key(k)
    low = jnp.where(bmin < 0, jnp.maximum(bmin ^ k["mask"], neg_inf_key), neg_inf_key)  # all NaN -> -inf
    return _canon(jnp.where(bmax >= 0, bmax, low))


def _blocks_bound(bm_ref, x_ref, r, xr, m, b, *, v, nb, bs, g, c, dtype):
    """(L, hi0, argmax) of row r from its block maxima; m/b: the row's max key and first block holding it.

    ``xr``: the row of ``x_ref`` that draft row ``r`` reads (`common.src_row`)."""
    lane = jnp.arange(g, dtype=jnp.int32)

    def body(i, gm):  # group j = blocks j, j + G, j + 2G, ...
        idx = i * g + lane
        k = plt.load(bm_ref.at[r, idx], mask=idx < nb, other=0).astype(jnp.int32)
        return jnp.maximum(gm, jnp.where(idx < nb, k, _SENT))

    gm = lax.fori_loop(0, -(-nb // g), body, jnp.full((g,), _SENT, jnp.int32))
    col = b * bs + jnp.arange(bs, dtype=jnp.int32)
    ok = col < v
    x = plt.load(x_ref.at[xr, pl.ds(b * bs, bs)], mask=ok, other=0)
    k = jnp.where(ok, _canon(_to_key(x, dtype)), _SENT)
    arg = jnp.min(jnp.where(k == m, col, BIG))  # first element of the first block holding the max
    return _bound(gm, c, g), m + 1, arg


def _bstats_kernel(x_ref, *out_refs, v, nb, bs, tb, unroll, per, g, c, fused, dtype, interpret, slot_stride=0):
    # x_ref [rows, V] (whole); one loop step reads `unroll` tiles of tb blocks of bs elements
    # bm_ref [rows, nsteps * tb * unroll] (whole): canonical key of each block's max (past nb: key(-inf))
    # fused: L, hi0, arg: 0-d blocks of [rows]; else smax / sblk: 0-d blocks of [rows, S]
    r = pl.program_id(0)
    s = pl.program_id(1)
    xr = src_row(r, slot_stride)
    bm_ref = out_refs[0]
    kdt = _key_consts(dtype)["int_t"]
    bix = jnp.arange(tb, dtype=jnp.int32)
    lane = jnp.arange(bs, dtype=jnp.int32)
    step = tb * unroll
    nsteps = -(-nb // step)
    c0 = s * per
    c1 = jnp.minimum(c0 + per, nsteps)

    def body(ci, carry, masked):
        am, ab = carry
        blks = [ci * step + u * tb + bix for u in range(unroll)]
        cols = [b[:, None] * bs + lane[None, :] for b in blks]
        if masked:  # all loads first: bytes in flight
            xs = [plt.load(x_ref.at[xr, col], mask=col < v, other=-jnp.inf) for col in cols]
        else:
            xs = [x_ref[xr, col] for col in cols]
        for u, (b, x) in enumerate(zip(blks, xs)):
            kb = _block_keys(x, dtype)
            bm_ref[r, pl.ds(ci * step + u * tb, tb)] = kb.astype(kdt)
            if masked:
                kb = jnp.where(b < nb, kb, _SENT)
            gt = kb > am  # strict: the earliest block keeps the tile row
            am, ab = jnp.where(gt, kb, am), jnp.where(gt, b, ab)
        return am, ab

    init = (jnp.full((tb,), _SENT, jnp.int32), jnp.zeros((tb,), jnp.int32))
    full = jnp.minimum(c1, nsteps - 1)  # every step but the last reads whole blocks inside the row
    carry = lax.fori_loop(c0, full, functools.partial(body, masked=False), init)
    am, ab = lax.fori_loop(jnp.maximum(full, c0), c1, functools.partial(body, masked=True), carry)
    m = jnp.max(am)
    b = jnp.min(jnp.where(am == m, ab, BIG))
    if fused:
        _, L_ref, hi_ref, arg_ref = out_refs
        _barrier(interpret)
        L, hi, arg = _blocks_bound(bm_ref, x_ref, r, xr, m, b, v=v, nb=nb, bs=bs, g=g, c=c, dtype=dtype)
        L_ref[()] = L
        hi_ref[()] = hi
        arg_ref[()] = arg
    else:
        _, smax_ref, sblk_ref = out_refs
        smax_ref[()] = m
        sblk_ref[()] = b


def _bbound_kernel(bm_ref, smax_ref, sblk_ref, x_ref, L_ref, hi_ref, arg_ref, *, nseg, v, nb, bs, g, c, dtype,
                   slot_stride=0):
    # bm_ref [rows, *], smax_ref / sblk_ref [rows, S], x_ref [rows, V] (whole); L / hi0 / arg: 0-d blocks
    r = pl.program_id(0)
    sidx = jnp.arange(next_pow2(nseg), dtype=jnp.int32)
    smax = plt.load(smax_ref.at[r, sidx], mask=sidx < nseg, other=_SENT)
    sblk = plt.load(sblk_ref.at[r, sidx], mask=sidx < nseg, other=BIG)
    m = jnp.max(smax)
    b = jnp.min(jnp.where(smax == m, sblk, BIG))  # segments in order: the first block
    L, hi, arg = _blocks_bound(bm_ref, x_ref, r, src_row(r, slot_stride), m, b, v=v, nb=nb, bs=bs, g=g, c=c,
                               dtype=dtype)
    L_ref[()] = L
    hi_ref[()] = hi
    arg_ref[()] = arg


def _bgather_kernel(L_ref, bm_ref, x_ref, bl_ref, bk_ref, bi_ref, cnt_ref, st_ref, *,
                    v, nb, bs, pb, tbs, tb2, cap, dtype, interpret, slot_stride=0):
    # L_ref [rows]; bm_ref [rows, *]; x_ref [rows, V]; segment s owns blocks [s * pb, (s + 1) * pb)
    # bl_ref [rows, S, pb+1]: the ids of the segment's blocks whose max is above L (slot pb = trash)
    # bk_ref/bi_ref [rows, S, cap+1] (slot cap = trash); cnt_ref/st_ref: 0-d blocks of [rows, S]
    r = pl.program_id(0)
    s = pl.program_id(1)
    xr = src_row(r, slot_stride)
    T = L_ref[r]
    b0 = s * pb
    b1 = jnp.minimum(b0 + pb, nb)

    # 1. which blocks to read (in order), and the first block that may hold an element equal to L
    li = jnp.arange(tbs, dtype=jnp.int32)

    def scan(i, carry):
        nsel, fb = carry
        blk = b0 + i * tbs + li
        ok = blk < b1
        kb = jnp.where(ok, plt.load(bm_ref.at[r, blk], mask=ok, other=0).astype(jnp.int32), _SENT)
        selb = kb > T
        pos = jnp.where(selb, nsel + _icumsum(selb) - 1, pb)
        plt.store(bl_ref.at[r, s, pos], blk, mask=selb)
        return nsel + _isum(selb), jnp.minimum(fb, jnp.min(jnp.where(kb >= T, blk, BIG)))

    nsel, fb = lax.fori_loop(0, -(-pb // tbs), scan, (jnp.int32(0), jnp.int32(BIG)))
    _barrier(interpret)

    # 2. read those blocks; compact their elements above L, in vocab order
    j0 = jnp.arange(tb2, dtype=jnp.int32)
    lane = jnp.arange(bs, dtype=jnp.int32)

    def body(i, off):
        j = i * tb2 + j0
        okj = j < nsel
        bid = plt.load(bl_ref.at[r, s, j], mask=okj, other=0)
        col = bid[:, None] * bs + lane[None, :]
        ok = okj[:, None] & (col < v)
        x = plt.load(x_ref.at[xr, col], mask=ok, other=0)
        k = jnp.where(ok, _to_key(x, dtype), _SENT)
        sel = k > T
        rc = _isum(sel, axis=1)
        pos = off + (_icumsum(rc) - rc)[:, None] + jnp.cumsum(sel.astype(jnp.int32), axis=1, dtype=jnp.int32) - 1
        w = sel & (pos < cap)
        pos = jnp.where(w, pos, cap)
        plt.store(bk_ref.at[r, s, pos], k, mask=w)
        plt.store(bi_ref.at[r, s, pos], col, mask=w)
        return off + _isum(rc)

    off = lax.fori_loop(0, (nsel + tb2 - 1) // tb2, body, jnp.int32(0))
    cnt_ref[()] = off
    st_ref[()] = jnp.where(fb < BIG, fb * bs, BIG)


# ----------------------------------------------------------------------------- wrapper
# 0-d blocks of [rows, S] and of [rows] on a (rows, S) grid, and of [rows] on a (rows,) grid.
_SCALAR2 = pl.BlockSpec((None, None), lambda r, s: (r, s))
_SCALAR2_1D = pl.BlockSpec((None,), lambda r, s: (r,))
_SCALAR1 = pl.BlockSpec((None,), lambda r: (r,))


def _tile_for(nunits: int, tile: int, unroll: int, want: int, min_tile: int) -> tuple[int, int]:
    """(tile, unroll) <= the configured ones (unroll halved first, then tile down to ``min_tile``) so
    that the row still splits into ``want`` segments of whole steps."""
    while -(-nunits // (tile * unroll)) < want and (unroll > 1 or tile > min_tile):
        if unroll > 1:
            unroll //= 2
        else:
            tile //= 2
    return tile, unroll


@functools.partial(jax.jit, static_argnames=("c", "cfg", "interpret", "slot_stride"))
def _select_pallas(base, *, c: int, cfg: SelectConfig, interpret: bool, slot_stride: int = 0):
    """The three stages (``slot_stride`` validated by `select_candidates`)."""
    v = base.shape[1]
    rows = _draft_rows(base.shape[0], slot_stride)
    dtype = jnp.dtype(base.dtype)
    want = _want_segments(rows, cfg)
    g, cap, bs = cfg.groups, cfg.cap, cfg.block
    i32 = jnp.int32
    kdt = _key_consts(dtype)["int_t"]
    call = functools.partial(common.pallas_call, interpret=interpret, num_warps=cfg.num_warps)
    anyspec = pl.no_block_spec
    nb = -(-v // bs)

    # 1. block maxima (+ bound)
    tb, su = _tile_for(nb, min(cfg.stats_blocks, next_pow2(nb)), cfg.stats_unroll, want, min(64, cfg.stats_blocks))
    nsteps = -(-nb // (tb * su))
    s1, per1 = _split(nsteps, want)
    fused = s1 == 1
    kern = functools.partial(_bstats_kernel, v=v, nb=nb, bs=bs, tb=tb, unroll=su, per=per1, g=g, c=c, fused=fused,
                             dtype=dtype, interpret=interpret, slot_stride=slot_stride)
    bm_shape = jax.ShapeDtypeStruct((rows, nsteps * tb * su), kdt)
    if fused:
        bm, L, hi0, arg = call(
            kern, name="select_bstats_bound", grid=(rows, 1), in_specs=[anyspec],
            out_specs=[anyspec] + [_SCALAR2_1D] * 3,
            out_shape=[bm_shape] + [jax.ShapeDtypeStruct((rows,), i32)] * 3,
        )(base)
    else:
        bm, smax, sblk = call(
            kern, name="select_bstats", grid=(rows, s1), in_specs=[anyspec],
            out_specs=[anyspec, _SCALAR2, _SCALAR2],
            out_shape=[bm_shape] + [jax.ShapeDtypeStruct((rows, s1), i32)] * 2,
        )(base)
        L, hi0, arg = call(
            functools.partial(_bbound_kernel, nseg=s1, v=v, nb=nb, bs=bs, g=g, c=c, dtype=dtype,
                              slot_stride=slot_stride),
            name="select_bbound", grid=(rows,),
            in_specs=[anyspec] * 4, out_specs=[_SCALAR1] * 3,
            out_shape=[jax.ShapeDtypeStruct((rows,), i32)] * 3,
        )(bm, smax, sblk, base)

    # 2. gather the elements above the bound from the blocks whose max is above it
    pb = -(-nb // want)
    s3 = -(-nb // pb)
    _, bk, bi, cnt, st = common.pallas_call(
        functools.partial(_bgather_kernel, v=v, nb=nb, bs=bs, pb=pb, tbs=min(cfg.scan_blocks, next_pow2(pb)),
                          tb2=min(cfg.gather_blocks, next_pow2(pb)), cap=cap, dtype=dtype, interpret=interpret,
                          slot_stride=slot_stride),
        name="select_bgather", grid=(rows, s3), interpret=interpret, num_warps=cfg.gather_warps,
        in_specs=[anyspec] * 3, out_specs=[anyspec] * 3 + [_SCALAR2, _SCALAR2],
        out_shape=[jax.ShapeDtypeStruct((rows, s3, pb + 1), i32)] + [jax.ShapeDtypeStruct((rows, s3, cap + 1), i32)] * 2
        + [jax.ShapeDtypeStruct((rows, s3), i32)] * 2,
    )(L, bm, base)
    nseg = cnt.shape[1]

    # 3. finish
    width = c + 1 if interpret else c
    cand, vals = common.pallas_call(
        functools.partial(_finish_kernel, v=v, c=c, cap=cfg.cap, nseg=nseg, ch=cfg.scan_chunk, dtype=dtype,
                          trash=c if interpret else 0, slot_stride=slot_stride),
        name="select_finish", grid=(rows,), interpret=interpret, num_warps=cfg.finish_warps,
        in_specs=[pl.no_block_spec] * 7, out_specs=[pl.no_block_spec, pl.no_block_spec],
        out_shape=[jax.ShapeDtypeStruct((rows, width), jnp.int32), jax.ShapeDtypeStruct((rows, width), dtype)],
    )(L, hi0, cnt, st, bk, bi, base)
    if width != c:
        cand, vals = cand[:, :c], vals[:, :c]
    return cand, vals, arg


def select_candidates(base: jax.Array, c: int, *, interpret: bool = False, slot_stride: int = 0, **config):
    """Per row of ``base`` [rows, V]: (cand [rows, c] int32, base_c [rows, c], argmax [rows] int32) (module doc).

    ``config``: `SelectConfig` fields. ``slot_stride=B`` (static, >= 2): ``base`` is the whole logits [N*B, V]; the
    result is that of ``logits[:, 1:]`` (N*(B-1) rows) without the copy."""
    if base.ndim != 2:
        raise ValueError(f"base must be [rows, V], got shape {tuple(base.shape)}")
    if isinstance(slot_stride, bool) or not isinstance(slot_stride, numbers.Integral):
        raise ValueError(f"slot_stride must be an int, got {slot_stride!r}")
    slot_stride = int(slot_stride)
    if slot_stride and (slot_stride < 2 or base.shape[0] % slot_stride):
        raise ValueError(f"slot_stride={slot_stride} needs slot_stride >= 2 and base [N*slot_stride, V]; "
                         f"got base shape {tuple(base.shape)}")
    rows, v = base.shape
    if isinstance(c, bool) or not isinstance(c, numbers.Integral):
        raise TypeError(f"c must be an int, got {c!r}")
    c = int(c)
    if not 1 <= c <= v:
        raise ValueError(f"c={c} must be in [1, V={v}]")
    cfg = SelectConfig(**config)
    if jnp.dtype(base.dtype) not in _KERNEL_DTYPES:
        raise TypeError(f"selection kernel: dtype {jnp.dtype(base.dtype).name} is not supported (bf16, f16, f32); "
                        "xpress_jax routes float64 to xpress_jax.reference.select_candidates")
    if rows == 0:
        return jnp.zeros((0, c), jnp.int32), jnp.zeros((0, c), base.dtype), jnp.zeros((0,), jnp.int32)
    return _select_pallas(base, c=c, cfg=cfg, interpret=interpret, slot_stride=slot_stride)
