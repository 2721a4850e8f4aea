"""Top-C candidate selection per draft slot (+ the row's full-vocab argmax) as Pallas-Triton kernels.

Computes, for base logits ``[rows, V]`` and ``1 <= c <= V``:

* ``cand``  [rows, c] int32: the vocab ids of the row's ``c`` largest logits, in no particular order;
* ``base_c`` [rows, c] (logits' dtype): their logits (exact values; NaN reads as -inf);
* ``argmax`` [rows] int32: the row's full-vocab argmax (the block's starting token).

Rules (identical to the oracle ``select_candidates_reference`` = ``lax.top_k`` + ``jnp.argmax``):
NaN counts as -inf. Membership follows the total order of ``lax.top_k`` (on the bits: ``-0.0`` ranks
below ``+0.0``); among values tied at the c-th place the **lowest vocab ids** are taken. The argmax
compares values (``-0.0 == +0.0``), lowest id on ties; a row of all -inf/NaN has argmax 0.

Algorithm (exact for any input; "bound, gather, finish"):
logits become order-preserving int32 *keys* (bf16/f16: sign-extended 16-bit pattern, f32: 32-bit;
``key = bits ^ (sign ? 0x7FFF[FFFF] : 0)``, NaN -> key(-inf), so key order == lax.top_k order).

1. ``stats`` (grid rows x segments, reads the logits once): for ``G`` strided groups
   (element i is in group ``i % G``) the group's max key, and the row's argmax. When the row is one
   segment the same program also computes the bound below; otherwise ``bound`` (grid rows) combines
   the segments' group maxima.
   Bound: ``L`` = the c-th largest of the ``G`` group maxima. They are ``G`` distinct elements, so
   ``count(key >= L) >= c``: ``L`` is a lower bound of the row's c-th largest key ``t``. On smooth
   logits few elements lie above it (~700 for c=512, G=1024 on 151936 normal logits).
2. ``gather`` (grid rows x segments, reads the logits a second time): compacts every element with
   ``key > L`` (key, id) into a per-segment buffer, in vocab order (a count + cumsum per block),
   and counts per segment the elements above and equal to ``L``. No atomics: each segment owns its
   slice of the buffer, so the result is deterministic and interpret mode tests what the GPU runs.
3. ``finish`` (grid rows): with ``M = count(key > L)``:
   * ``c <= M <= cap`` (the usual case): the M elements are loaded into registers (vocab order);
     a 16-way threshold search over ``(L, max]`` (each round counts 16 thresholds at once and
     narrows the range 16x: ~2 rounds for bf16 logits, <= 8 for any f32) finds the exact c-th
     largest key ``t`` and ``count(key > t)``; elements above ``t`` all go in, then the first
     ``c - count(key > t)`` elements equal to ``t`` in vocab order (a cumsum: the lowest ids).
   * ``M < c`` (then ``t = L``; heavy ties): the M buffered elements go in, then the first
     ``c - M`` elements equal to ``L`` found by scanning the row in vocab order from the first
     segment holding one, stopping when enough are found.
   * ``M > cap`` (adversarial rows): one program does the 16-way threshold search over the whole
     row (full passes, each counting 16 thresholds), then one compaction pass. Exact, slower.

Passes over the logits: 2 in the usual case (stats, gather); the finish reads only ~M elements.
Why not radix histograms: Pallas-Triton has no shared-memory scratch or histogram op, so a 256-bin
digit pass costs ~256 compares per element; the group-max bound needs one max per element.

float64 (and any non-float dtype) falls back to the oracle (Triton keys here are at most 32 bits).
Interpret mode only: masked scatter lanes aim at a trash slot (outputs padded by one, sliced off).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import common

__all__ = ["SelectConfig", "select_candidates", "select_candidates_reference"]

_SENT = -(2**31)  # key of masked lanes: below every real key (NaN is keyed as -inf)
_BIG = 2**31 - 1
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# ----------------------------------------------------------------------------- reference
def select_candidates_reference(base: jax.Array, c: int):
    """The oracle: NaN -> -inf; ``lax.top_k`` (ties at the c-th value: lowest ids); ``argmax`` (lowest id).

    [rows, V] -> (cand [rows, c] int32, base_c [rows, c] base.dtype, argmax [rows] int32).
    """
    clean = jnp.where(jnp.isnan(base), jnp.array(-jnp.inf, base.dtype), base)
    base_c, cand = lax.top_k(clean, c)
    return cand.astype(jnp.int32), base_c, jnp.argmax(clean, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class SelectConfig:
    """Block sizes (powers of two) and launch shape; hashable, a static jit argument.

    groups: G, the number of strided groups whose maxima give the bound.
    unroll: stats issues ``unroll`` loads of G elements per loop step (bytes in flight).
    chunk: elements per block in gather (one count + cumsum per block).
    gather_unroll: gather issues ``gather_unroll`` loads of ``chunk`` elements per loop step.
    cap: buffer capacity, the most elements above the bound that the fast finish handles.
    scan_chunk: elements per block in the finish's row scans (ties at the bound, flooded rows).
    num_warps / gather_warps / finish_warps: warps of stats and bound / gather / finish.
    segments: programs per row in stats and gather (None: the power of two at or below
      ``target_programs / rows``; fewer when a row has fewer loop steps; gather halves its
      unroll, down to 1, to reach it).
    """

    groups: int = 1024
    unroll: int = 8
    num_warps: int = 8
    chunk: int = 1024
    gather_unroll: int = 8
    gather_warps: int = 4
    cap: int = 2048
    scan_chunk: int = 2048
    finish_warps: int = 16
    segments: int | None = None
    target_programs: int = 512

    def __post_init__(self):
        for f in ("groups", "cap", "chunk", "scan_chunk", "unroll", "gather_unroll"):
            v = getattr(self, f)
            lo = 1 if "unroll" in f else 16
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or v & (v - 1):
                raise ValueError(f"{f}={v!r} must be a power of two >= {lo}")
        if self.segments is not None and (not isinstance(self.segments, int) or self.segments < 1):
            raise ValueError(f"segments={self.segments!r} must be a positive int or None")


def _want_segments(rows: int, cfg: SelectConfig) -> int:
    if cfg.segments is not None:
        return cfg.segments
    return 1 << max(0, (cfg.target_programs // max(rows, 1)).bit_length() - 1)


def _split(nsteps: int, want: int) -> tuple[int, int]:
    """(segments, loop steps per segment): about ``want`` segments (fewer if the row is short)."""
    per = max(1, nsteps // max(want, 1))
    return -(-nsteps // per), per


def _gather_unroll(v: int, want: int, cfg: SelectConfig) -> int:
    """Largest power of two <= cfg.gather_unroll that still gives ``want`` segments of whole steps."""
    u = cfg.gather_unroll
    while u > 1 and -(-v // (cfg.chunk * u)) < want:
        u //= 2
    return u


# ----------------------------------------------------------------------------- keys
def _key_consts(dtype):
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return dict(bits=32, int_t=jnp.int32, mask=0x7FFFFFFF, inf=0x7F800000)
    inf = 0x7F80 if dtype == jnp.bfloat16 else 0x7C00
    return dict(bits=16, int_t=jnp.int16, mask=0x7FFF, inf=inf)


def _to_key(x, dtype):
    """Order-preserving int32 key; NaN -> key(-inf). (-0.0 keys as -1, below +0.0's 0.)"""
    k = _key_consts(dtype)
    b = lax.bitcast_convert_type(x, k["int_t"]).astype(jnp.int32)
    key = b ^ ((b >> 31) & k["mask"])
    neg_inf = (k["inf"] | (1 << (k["bits"] - 1))) - (1 << k["bits"])  # -inf bits, sign-extended
    neg_inf_key = neg_inf ^ k["mask"]
    return jnp.where((b & k["mask"]) > k["inf"], neg_inf_key, key)


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


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ----------------------------------------------------------------------------- kernels
def _stats_kernel(x_ref, *out_refs, v, g, unroll, per, c, fused, dtype):
    # x_ref [rows, V] (whole array); one loop step reads `unroll` blocks of G
    # fused:  L, hi0, arg: 0-d blocks of [rows]
    # else :  gm [rows, S, G] block (G,), smax / sarg: 0-d blocks of [rows, S]
    r = pl.program_id(0)
    s = pl.program_id(1)
    lane = jnp.arange(g, dtype=jnp.int32)
    step = g * unroll
    nsteps = -(-v // step)
    c0 = s * per
    c1 = jnp.minimum(c0 + per, nsteps)

    def body(ci, carry):
        acc_k, acc_i = carry
        cols = [ci * step + u * g + lane for u in range(unroll)]
        xs = [plt.load(x_ref.at[r, pl.ds(ci * step + u * g, g)], mask=col < v, other=0)
              for u, col in enumerate(cols)]  # all loads first: bytes in flight
        for col, x in zip(cols, xs):
            ka = jnp.where(col < v, _canon(_to_key(x, dtype)), _SENT)
            gt = ka > acc_k  # strict: the earliest element keeps the group
            acc_k, acc_i = jnp.where(gt, ka, acc_k), jnp.where(gt, col, acc_i)
        return acc_k, acc_i

    init = (jnp.full((g,), _SENT, jnp.int32), jnp.zeros((g,), jnp.int32))
    acc_k, acc_i = lax.fori_loop(c0, c1, body, init)
    m = jnp.max(acc_k)
    arg = jnp.min(jnp.where(acc_k == m, acc_i, _BIG))
    if fused:
        L_ref, hi_ref, arg_ref = out_refs
        L_ref[()] = _bound(acc_k, c, g)
        hi_ref[()] = m + 1
        arg_ref[()] = arg
    else:
        gm_ref, smax_ref, sarg_ref = out_refs
        gm_ref[...] = acc_k
        smax_ref[()] = m
        sarg_ref[()] = arg


def _bound_kernel(gm_ref, smax_ref, sarg_ref, L_ref, hi_ref, arg_ref, *, nseg, g, c, rows_per_step):
    # gm_ref [rows, S, G], smax_ref/sarg_ref [rows, S] (whole arrays); L/hi0/arg: 0-d blocks of [rows]
    r = pl.program_id(0)
    sp = _pow2(nseg)
    sidx = jnp.arange(sp, dtype=jnp.int32)
    smax = plt.load(smax_ref.at[r, sidx], mask=sidx < nseg, other=_SENT)
    sarg = plt.load(sarg_ref.at[r, sidx], mask=sidx < nseg, other=_BIG)
    m = jnp.max(smax)
    arg = jnp.min(jnp.where(smax == m, sarg, _BIG))  # segments in order: the lowest id

    u = jnp.arange(rows_per_step, dtype=jnp.int32)[:, None]
    lane = jnp.arange(g, dtype=jnp.int32)[None, :]

    def body(i, gm):
        seg = i * rows_per_step + u
        blk = plt.load(gm_ref.at[r, seg, lane], mask=(seg < nseg) & (lane >= 0), other=_SENT)
        return jnp.maximum(gm, jnp.max(blk, axis=0))

    gm = lax.fori_loop(0, -(-nseg // rows_per_step), body, jnp.full((g,), _SENT, jnp.int32))
    L_ref[()] = _bound(gm, c, g)
    hi_ref[()] = m + 1
    arg_ref[()] = arg


def _gather_kernel(L_ref, x_ref, bk_ref, bi_ref, cnt_ref, eqc_ref, *, v, ch, unroll, per, cap, dtype):
    # L_ref [rows]; x_ref [rows, V]; one loop step reads `unroll` blocks of `ch`
    # bk_ref/bi_ref [rows, S, cap+1] (slot cap = trash); cnt_ref/eqc_ref: 0-d blocks of [rows, S]
    r = pl.program_id(0)
    s = pl.program_id(1)
    T = L_ref[r]
    lane = jnp.arange(ch, dtype=jnp.int32)
    step = ch * unroll
    nsteps = -(-v // step)
    c0 = s * per
    c1 = jnp.minimum(c0 + per, nsteps)

    def body(ci, carry):
        cols = [ci * step + u * ch + lane for u in range(unroll)]
        xs = [plt.load(x_ref.at[r, pl.ds(ci * step + u * ch, ch)], mask=col < v, other=0)
              for u, col in enumerate(cols)]  # all loads first: bytes in flight
        for col, x in zip(cols, xs):
            off, eqv = carry
            k = jnp.where(col < v, _to_key(x, dtype), _SENT)
            sel = k > T
            n = _isum(sel)

            @pl.when(n > 0)
            def _():
                pos = off + _icumsum(sel) - 1
                w = sel & (pos < cap)
                pos = jnp.where(w, pos, cap)
                plt.store(bk_ref.at[r, s, pos], k, mask=w)
                plt.store(bi_ref.at[r, s, pos], col, mask=w)

            carry = off + n, eqv + (k == T).astype(jnp.int32)  # per lane: one reduction at the end
        return carry

    off, eqv = lax.fori_loop(c0, c1, body, (jnp.int32(0), jnp.zeros((ch,), jnp.int32)))
    cnt_ref[()] = off
    eqc_ref[()] = _isum(eqv)


def _finish_kernel(L_ref, hi_ref, cnt_ref, eqc_ref, bk_ref, bi_ref, x_ref, cand_ref, val_ref, *,
                   v, c, cap, nseg, seg_elems, ch, dtype, trash):
    # L_ref/hi_ref [rows]; cnt_ref/eqc_ref [rows, S]; bk_ref/bi_ref [rows, S, cap+1]; x_ref [rows, V]
    # cand_ref [rows, c or c+1] int32, val_ref [rows, c or c+1] dtype (slot c = trash in interpret mode)
    r = pl.program_id(0)
    L = L_ref[r]
    hi0 = hi_ref[r]
    j = jnp.arange(cap, dtype=jnp.int32)
    lane = jnp.arange(ch, dtype=jnp.int32)
    nch = -(-v // ch)
    sp = _pow2(nseg)
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
        x = plt.load(x_ref.at[r, pl.ds(ci * ch, ch)], mask=ok, other=0)
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
            eqc = plt.load(eqc_ref.at[r, sidx], mask=sidx < nseg, other=0)
            s0 = jnp.min(jnp.where(eqc > 0, sidx, nseg))  # first segment holding a tie

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

            lax.while_loop(cond, body, ((s0 * seg_elems) // ch, jnp.int32(0)))

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


# ----------------------------------------------------------------------------- wrapper
def _scalar_spec2():
    return pl.BlockSpec((None, None), lambda r, s: (r, s))


def _scalar_spec2_1d():
    return pl.BlockSpec((None,), lambda r, s: (r,))


def _scalar_spec1():
    return pl.BlockSpec((None,), lambda r: (r,))


@functools.partial(jax.jit, static_argnames=("c", "cfg", "interpret", "upto"))
def _select_pallas(base, *, c: int, cfg: SelectConfig, interpret: bool, upto: str = "finish"):
    """The three stages; ``upto="stats"|"gather"`` stops early and returns the intermediates (benchmarks)."""
    rows, v = base.shape
    dtype = jnp.dtype(base.dtype)
    g, cap, ch = cfg.groups, cfg.cap, cfg.chunk
    i32 = jnp.int32
    call = functools.partial(common.pallas_call, interpret=interpret, num_warps=cfg.num_warps)
    anyspec = pl.no_block_spec

    # 1. stats (+ bound)
    want = _want_segments(rows, cfg)
    s1, per1 = _split(-(-v // (g * cfg.unroll)), want)
    fused = s1 == 1
    kern = functools.partial(_stats_kernel, v=v, g=g, unroll=cfg.unroll, per=per1, c=c, fused=fused, dtype=dtype)
    if fused:
        L, hi0, arg = call(
            kern, name="select_stats_bound", grid=(rows, 1), in_specs=[anyspec],
            out_specs=[_scalar_spec2_1d() for _ in range(3)],
            out_shape=[jax.ShapeDtypeStruct((rows,), i32)] * 3,
        )(base)
    else:
        gm, smax, sarg = call(
            kern, name="select_stats", grid=(rows, s1), in_specs=[anyspec],
            out_specs=[pl.BlockSpec((None, None, g), lambda r, s: (r, s, 0)), _scalar_spec2(), _scalar_spec2()],
            out_shape=[jax.ShapeDtypeStruct((rows, s1, g), i32), jax.ShapeDtypeStruct((rows, s1), i32),
                       jax.ShapeDtypeStruct((rows, s1), i32)],
        )(base)
        L, hi0, arg = call(
            functools.partial(_bound_kernel, nseg=s1, g=g, c=c, rows_per_step=min(_pow2(s1), max(1, 8192 // g))),
            name="select_bound", grid=(rows,),
            in_specs=[anyspec] * 3, out_specs=[_scalar_spec1() for _ in range(3)],
            out_shape=[jax.ShapeDtypeStruct((rows,), i32)] * 3,
        )(gm, smax, sarg)
    if upto == "stats":
        return L, hi0, arg

    # 2. gather everything above the bound
    gu = _gather_unroll(v, want, cfg)
    s3, per3 = _split(-(-v // (ch * gu)), want)
    bk, bi, cnt, eqc = common.pallas_call(
        functools.partial(_gather_kernel, v=v, ch=ch, unroll=gu, per=per3, cap=cap, dtype=dtype),
        name="select_gather", grid=(rows, s3), interpret=interpret, num_warps=cfg.gather_warps, in_specs=[anyspec, anyspec],
        out_specs=[anyspec, anyspec, _scalar_spec2(), _scalar_spec2()],
        out_shape=[jax.ShapeDtypeStruct((rows, s3, cap + 1), i32)] * 2 + [jax.ShapeDtypeStruct((rows, s3), i32)] * 2,
    )(L, base)
    if upto == "gather":
        return L, hi0, arg, cnt, eqc, bk, bi

    # 3. finish
    width = c + 1 if interpret else c
    cand, vals = common.pallas_call(
        functools.partial(_finish_kernel, v=v, c=c, cap=cap, nseg=s3, seg_elems=per3 * gu * ch,
                          ch=cfg.scan_chunk, dtype=dtype,
                          trash=c if interpret else 0),
        name="select_finish", grid=(rows,), interpret=interpret, num_warps=cfg.finish_warps, in_specs=[anyspec] * 7, out_specs=[anyspec, anyspec],
        out_shape=[jax.ShapeDtypeStruct((rows, width), i32), jax.ShapeDtypeStruct((rows, width), dtype)],
    )(L, hi0, cnt, eqc, bk, bi, base)
    if width != c:
        cand, vals = cand[:, :c], vals[:, :c]
    return cand, vals, arg


def select_candidates(base: jax.Array, c: int, *, interpret: bool = False, **config):
    """Per row of ``base`` [rows, V]: (cand [rows, c] int32, base_c [rows, c], argmax [rows] int32).

    Pallas-Triton kernels for bf16/f16/f32 logits (``interpret=True`` runs them on CPU); any other
    dtype (float64) uses the jnp oracle. ``config``: fields of `SelectConfig`. See the module doc
    for the rules and the algorithm.
    """
    if base.ndim != 2:
        raise ValueError(f"base must be [rows, V], got shape {tuple(base.shape)}")
    rows, v = base.shape
    if isinstance(c, bool) or not isinstance(c, numbers.Integral):
        raise TypeError(f"c must be an int, got {c!r}")
    c = int(c)
    if not 1 <= c <= v:
        raise ValueError(f"c={c} must be in [1, V={v}]")
    cfg = SelectConfig(**config)
    if jnp.dtype(base.dtype) not in _KERNEL_DTYPES or rows == 0:
        return select_candidates_reference(base, c)
    return _select_pallas(base, c=c, cfg=cfg, interpret=interpret)
