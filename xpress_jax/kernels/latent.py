"""Latent pass of the XPress head: the Pallas-Triton kernels, their wrapper and config.

One pass turns the current block into the draft slots' latents::

    prev[n, 0] = prev_ids[n];  prev[n, b] = blk[n, b-1]            (b >= 1)
    x[n, b]    = xh[n, b] + w1[prev[n, b]] @ in_proj_token          [N, B, r]
    u[n, k, c] = sum_{j <= k} mix[k, j, c] * x[n, j, c]             (folded causal mixer)
    lat[n, k]  = u[n, k] + (silu(u[n, k] @ mlp_gate) * (u[n, k] @ mlp_up)) @ mlp_down
    return lat[:, 1:]                                               [N, B-1, r]

``xh`` is the pass-invariant hidden half of ``in_proj``. Precision as the jnp reference (`xpress_jax.head.latent`):
matmul operands in the params' dtype ``cd`` with float32 accumulation; the elementwise work in float32.

``variant="fused"``: grid ``cdiv(N, blocks_per_program)``; each program owns whole blocks (B rounded up to a power
of two rows each, padding masked): the ids, ``x`` (K tiled by ``k_block``), the mixer, then SwiGLU tiled over the
hidden dim by ``h_block``; slots 1..B-1 are scattered to the output.

``variant="split"`` spreads the weights over many programs in three kernels: ``xpress_latent_pass_mix`` (ids, ``x``
and the mixer for ``col_block`` rank columns: ``u`` float32 and in ``cd``), ``xpress_latent_pass_gateup`` (``act =
silu(u @ gate) * (u @ up)`` in ``cd``) and ``xpress_latent_pass_down`` (``lat = u + act @ down``), one row per
draft row n*(B-1) + slot-1.

The float32 sums are grouped unlike XLA's, so the latent is not bit-identical to the reference (the tests' bounds:
float32 1e-6 relative, 16-bit 1 ulp on >= 99.9% of elements). Float64 is refused (``TypeError``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import common
from .common import plt, MIN_DOT, SMEM_LIMIT, next_pow2

__all__ = ["LatentConfig", "VARIANTS", "default_config", "latent_pass"]

_HI = jax.lax.Precision.HIGHEST


VARIANTS = ("fused", "split")

@dataclasses.dataclass(frozen=True)
class LatentConfig:
    """Static block configuration of the latent kernel (hashable: a jit static arg).

    variant: one of `VARIANTS`. blocks_per_program: blocks per program (fused; split: stage 1; `_dot_bpp`).
      k_block: K chunk of every dot. h_block: SwiGLU hidden chunk. col_block (split): rank columns per program of
      stages 1 and 3. row_block (split): rows per program of stages 2 and 3 (0: from the row count). Powers of two
      >= 16 (row_block 0 too). num_warps, num_stages: Triton parameters (all stages)."""

    blocks_per_program: int = 1
    k_block: int = 64
    h_block: int = 64
    num_warps: int = 8
    num_stages: int = 2
    variant: str = "fused"
    col_block: int = 32
    row_block: int = 0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r} must be one of {VARIANTS}")
        for name in ("blocks_per_program", "k_block", "h_block", "num_warps", "num_stages", "col_block", "row_block"):
            v, lo = getattr(self, name), 0 if name == "row_block" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} must be an int >= {lo}")
            if name != "num_stages" and v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
            if name in ("k_block", "h_block", "col_block", "row_block") and 0 < v < 16:
                raise ValueError(f"{name}={v} must be >= 16 (tensor-core dot minimum; row_block 0: auto)")

    def check_shape(self, rank: int, dtype: Any, smem_limit: int = SMEM_LIMIT, target: str = "H100/H200") -> None:
        """Refuse (ValueError) a fused config whose rank-wide tiles (`smem_bytes`) exceed ``smem_limit`` bytes per
        program on the ``target`` GPU (default: an H100/H200's, `SMEM_LIMIT`)."""
        if self.variant == "fused" and self.smem_bytes(rank, dtype) > smem_limit:
            raise ValueError(
                f"latent variant='fused' at rank={rank}, {jnp.dtype(dtype).name}: its rank-wide weight tiles "
                f"need ~{self.smem_bytes(rank, dtype) // 1024} KB of shared memory, more than the "
                f"{smem_limit // 1024} KB a {target} program may use; use variant='split' or smaller k_block/h_block")

    def smem_bytes(self, rank: int, dtype: Any) -> int:
        """Fused variant: estimate of its dot operands' shared memory (one K chunk of in_proj_token plus the gate,
        up and down tiles of one hidden chunk, all rank-wide)."""
        rp = max(16, next_pow2(rank))
        return (min(self.k_block, rp) * rp + 3 * rp * self.h_block) * jnp.dtype(dtype).itemsize


def default_config(n: int, dtype: Any, variant: str | None = None, rank: int = 256,
                   smem_limit: int = SMEM_LIMIT) -> LatentConfig:
    """Block config for N blocks of ``dtype``; ``variant=None``: fused where it fits in ``smem_limit`` bytes of
    shared memory, else split (`xpress_jax.dispatch` decides where each serves)."""
    if variant is None:
        fused = default_config(n, dtype, "fused", rank)
        return fused if fused.smem_bytes(rank, dtype) <= smem_limit else default_config(n, dtype, "split", rank)
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} must be one of {VARIANTS}")
    f32 = jnp.dtype(dtype).itemsize >= 4
    if variant != "fused":
        return LatentConfig(variant=variant, blocks_per_program=1, k_block=32 if f32 else 64, h_block=32,
                            col_block=32, row_block=0, num_warps=4, num_stages=2)
    if f32:
        return LatentConfig(blocks_per_program=1, k_block=32, h_block=32, num_warps=8, num_stages=2)
    return LatentConfig(blocks_per_program=1, k_block=64, h_block=64, num_warps=8, num_stages=2)


def _dot_bpp(bpp: int, bp: int) -> int:
    """Blocks per program actually used: a program's rows (the dots' M) at least `MIN_DOT` (B <= 8)."""
    return max(bpp, MIN_DOT // bp)


# In-kernel pieces of the fused kernel and split stage 1: rows are ``bpp`` blocks of ``bp`` (B padded) slots.


def _and(a, b):
    """Combine two optional (broadcastable) masks; None = all true."""
    return b if a is None else a if b is None else a & b


def _load(ref_at, mask):
    """`plt.load` with ``other=0`` only where a mask is needed."""
    return plt.load(ref_at, mask=mask, other=0 if mask is not None else None)


def _block_rows(block0, *, n: int, b: int, bp: int, bpp: int):
    """(row iota [R], slot [R], clamped block index [R], valid [R]) of blocks block0 .. block0+bpp-1."""
    ri = jnp.arange(bpp * bp, dtype=jnp.int32)
    slot = ri % bp
    blk_i = block0 + ri // bp
    valid = (slot < b) & (blk_i < n)
    return ri, slot, jnp.where(valid, blk_i, 0), valid


def _pred_ids(ids_ref, prev_ref, slot, blk_c, valid, *, b: int, v: int):
    """Predecessor ids [R]: slot 0 <- prev_ids[n], slot s >= 1 <- blk[n, s-1]; clipped like jnp.take(mode="clip")."""
    from_blk = valid & (slot >= 1)
    pid_blk = plt.load(ids_ref.at[jnp.where(from_blk, blk_c * b + slot - 1, 0)], mask=from_blk, other=0)
    pid_prev = plt.load(prev_ref.at[blk_c], mask=valid & (slot == 0), other=0)
    return jnp.clip(jnp.where(slot == 0, pid_prev, pid_blk), 0, v - 1)


def _out_rows(slot, blk_c, valid, *, n: int, b: int):
    """(keep, out row) of slots 1..B-1: row n*(B-1) + slot-1. Masked lanes point one past the end: never written on
    the GPU, dropped by interpret mode's scatter (an in-bounds dummy row could take a real row's write)."""
    keep = valid & (slot >= 1)
    return keep, jnp.where(keep, blk_c * (b - 1) + slot - 1, n * (b - 1))


def _x_rows(ids, xrow, valid, col, col_ok, xh_ref, w1_ref, wt_ref, *, r: int, kb: int, col_tail: bool):
    """``x[:, col] = xh + w1[ids] @ in_proj_token[:, col]`` in float32 [R, len(col)], K tiled by kb."""
    f32 = jnp.float32
    xh = plt.load(xh_ref.at[xrow[:, None], col[None, :]], mask=valid[:, None] & col_ok[None, :], other=0)
    kk = jnp.arange(kb, dtype=jnp.int32)
    k_tail = r % kb != 0

    def k_step(i, acc):
        kc = i * kb + kk  # [kb]
        e = _load(w1_ref.at[ids[:, None], kc[None, :]], (kc < r)[None, :] if k_tail else None)  # [R, kb]
        w = _load(wt_ref.at[kc[:, None], col[None, :]],
                  _and((kc < r)[:, None] if k_tail else None, col_ok[None, :] if col_tail else None))  # [kb, C]
        return acc + jnp.dot(e, w, precision=_HI, preferred_element_type=f32)

    acc = jax.lax.fori_loop(0, pl.cdiv(r, kb), k_step, jnp.zeros(xh.shape, f32))
    return xh.astype(f32) + acc


def _mix_rows(x, slot, col, col_ok, mix_ref, *, b: int, bp: int, bpp: int, col_tail: bool, unroll: bool = False):
    """Folded causal mixer in float32, j = 0, 1, ... in order: ``u[k] = sum_j mix[k, j] * x[j]`` per channel;
    ``unroll``: straight-line code (the same sums; the B loads of mix are independent)."""
    f32 = jnp.float32
    rows, cb = x.shape
    kslot = jnp.arange(bp, dtype=jnp.int32)
    mix_mask = _and((kslot < b)[:, None] if bp != b else None, col_ok[None, :] if col_tail else None)

    def mix_step(j, u):
        mj = _load(mix_ref.at[kslot[:, None], j, col[None, :]], mix_mask).astype(f32)  # [bp, C]
        if bpp == 1:
            xj = jnp.sum(jnp.where(slot[:, None] == j, x, 0.0), axis=0)  # [C]: row j of a value
            return u + mj * xj[None, :]
        x3 = x.reshape(bpp, bp, cb)
        xj = jnp.sum(jnp.where(slot.reshape(bpp, bp, 1) == j, x3, 0.0), axis=1)  # [bpp, C]
        return u + (mj[None, :, :] * xj[:, None, :]).reshape(rows, cb)

    u = jnp.zeros((rows, cb), f32)
    if not unroll:
        return jax.lax.fori_loop(0, b, mix_step, u)
    for j in range(b):
        u = mix_step(j, u)
    return u


def _swiglu_rows(u, col, col_ok, wg_ref, wu_ref, wd_ref, *, m: int, hb: int, col_tail: bool, cd):
    """``lat = cd(u + cd(silu(cd(u) @ gate) * (cd(u) @ up)) @ down)`` over the rank columns ``col``, hidden tiled
    by hb."""
    f32 = jnp.float32
    uc = u.astype(cd)
    hh = jnp.arange(hb, dtype=jnp.int32)
    h_tail = m % hb != 0

    def h_step(i, acc):
        hc = i * hb + hh  # [hb]
        gu_mask = _and(col_ok[:, None] if col_tail else None, (hc < m)[None, :] if h_tail else None)
        wg = _load(wg_ref.at[col[:, None], hc[None, :]], gu_mask)  # [rp, hb]
        wu = _load(wu_ref.at[col[:, None], hc[None, :]], gu_mask)
        gate = jnp.dot(uc, wg, precision=_HI, preferred_element_type=f32)  # [R, hb]
        up = jnp.dot(uc, wu, precision=_HI, preferred_element_type=f32)
        act = (jax.nn.silu(gate) * up).astype(cd)
        d_mask = _and((hc < m)[:, None] if h_tail else None, col_ok[None, :] if col_tail else None)
        wd = _load(wd_ref.at[hc[:, None], col[None, :]], d_mask)  # [hb, rp]
        return acc + jnp.dot(act, wd, precision=_HI, preferred_element_type=f32)

    acc = jax.lax.fori_loop(0, pl.cdiv(m, hb), h_step, jnp.zeros(u.shape, f32))
    return (u + acc).astype(cd)


def _latent_kernel(
    ids_ref,  # [N*B] int32, blk flattened
    prev_ref,  # [N] int32
    xh_ref,  # [N*B, r] cd
    w1_ref,  # [V, r] cd
    wt_ref,  # [r, r] cd (in_proj_token)
    mix_ref,  # [B, B, r] cd (mix[k, j, c])
    wg_ref,  # [r, M] cd
    wu_ref,  # [r, M] cd
    wd_ref,  # [M, r] cd
    o_ref,  # [N*(B-1), r] cd
    *,
    n: int,
    b: int,
    bp: int,
    bpp: int,
    v: int,
    r: int,
    rp: int,
    m: int,
    mp: int,
    kb: int,
    hb: int,
):
    _, slot, blk_c, valid = _block_rows(pl.program_id(0) * bpp, n=n, b=b, bp=bp, bpp=bpp)
    col = jnp.arange(rp, dtype=jnp.int32)  # [rp]
    col_ok = col < r
    tail = rp != r

    ids = _pred_ids(ids_ref, prev_ref, slot, blk_c, valid, b=b, v=v)  # [R]
    xrow = jnp.where(valid, blk_c * b + slot, 0)
    x = _x_rows(ids, xrow, valid, col, col_ok, xh_ref, w1_ref, wt_ref, r=r, kb=kb, col_tail=tail)  # [R, rp]
    u = _mix_rows(x, slot, col, col_ok, mix_ref, b=b, bp=bp, bpp=bpp, col_tail=tail)
    lat = _swiglu_rows(u, col, col_ok, wg_ref, wu_ref, wd_ref, m=m, hb=hb, col_tail=tail, cd=o_ref.dtype)

    keep, orow = _out_rows(slot, blk_c, valid, n=n, b=b)
    plt.store(o_ref.at[orow[:, None], col[None, :]], lat, mask=keep[:, None] & col_ok[None, :])


def _split_mix_kernel(
    ids_ref,  # [N*B] int32, blk flattened
    prev_ref,  # [N] int32
    xh_ref,  # [N*B, r] cd
    w1_ref,  # [V, r] cd
    wt_ref,  # [r, r] cd (in_proj_token)
    mix_ref,  # [B, B, r] cd (mix[k, j, c])
    u_ref,  # [N*(B-1), r] float32: u of slots 1..B-1
    *uc_refs,  # () or ([N*(B-1), r] cd): u rounded to cd (omitted for float32 params)
    n: int,
    b: int,
    bp: int,
    bpp: int,
    v: int,
    r: int,
    cb: int,
    kb: int,
):
    """Split stage 1, grid (cdiv(N, bpp), cdiv(r, cb)): x and the mixer for ``cb`` rank columns."""
    cd = w1_ref.dtype
    _, slot, blk_c, valid = _block_rows(pl.program_id(0) * bpp, n=n, b=b, bp=bp, bpp=bpp)
    col = pl.program_id(1) * cb + jnp.arange(cb, dtype=jnp.int32)  # [cb]
    col_ok = col < r
    c_tail = r % cb != 0

    ids = _pred_ids(ids_ref, prev_ref, slot, blk_c, valid, b=b, v=v)  # [R]
    xrow = jnp.where(valid, blk_c * b + slot, 0)
    x = _x_rows(ids, xrow, valid, col, col_ok, xh_ref, w1_ref, wt_ref, r=r, kb=kb, col_tail=c_tail)  # [R, cb]

    u = _mix_rows(x, slot, col, col_ok, mix_ref, b=b, bp=bp, bpp=bpp, col_tail=c_tail, unroll=True)

    keep, orow = _out_rows(slot, blk_c, valid, n=n, b=b)
    smask = keep[:, None] & col_ok[None, :]
    plt.store(u_ref.at[orow[:, None], col[None, :]], u, mask=smask)
    for uc_ref in uc_refs:
        plt.store(uc_ref.at[orow[:, None], col[None, :]], u.astype(cd), mask=smask)


def _tile_rows(rb: int, rows: int):
    """Split stages 2-3: (row_ok, load row, store row) of this program's rb rows (past the end: row 0 / rows)."""
    ri = pl.program_id(0) * rb + jnp.arange(rb, dtype=jnp.int32)
    row_ok = ri < rows
    return row_ok, jnp.where(row_ok, ri, 0), jnp.where(row_ok, ri, rows)


def _split_gateup_kernel(
    uc_ref,  # [rows, r] cd (float32 params: the float32 u)
    wg_ref,  # [r, M] cd
    wu_ref,  # [r, M] cd
    act_ref,  # [rows, M] cd
    *,
    rows: int,
    r: int,
    m: int,
    rb: int,
    hb: int,
    kb: int,
):
    """Split stage 2, grid (cdiv(rows, rb), cdiv(M, hb)): act = silu(u @ gate) * (u @ up), hb hidden columns."""
    f32 = jnp.float32
    cd = act_ref.dtype
    row_ok, rl, srow = _tile_rows(rb, rows)
    hc = pl.program_id(1) * hb + jnp.arange(hb, dtype=jnp.int32)
    h_ok = hc < m
    h_tail = m % hb != 0
    kk = jnp.arange(kb, dtype=jnp.int32)
    k_tail = r % kb != 0

    def k_step(i, carry):
        g, up = carry
        kc = i * kb + kk  # [kb]
        a = _load(uc_ref.at[rl[:, None], kc[None, :]], (kc < r)[None, :] if k_tail else None).astype(cd)
        wmask = _and((kc < r)[:, None] if k_tail else None, h_ok[None, :] if h_tail else None)
        wg = _load(wg_ref.at[kc[:, None], hc[None, :]], wmask)  # [kb, hb]
        wu = _load(wu_ref.at[kc[:, None], hc[None, :]], wmask)
        return (g + jnp.dot(a, wg, precision=_HI, preferred_element_type=f32),
                up + jnp.dot(a, wu, precision=_HI, preferred_element_type=f32))

    zero = jnp.zeros((rb, hb), f32)
    gate, up = jax.lax.fori_loop(0, pl.cdiv(r, kb), k_step, (zero, zero))
    act = (jax.nn.silu(gate) * up).astype(cd)
    plt.store(act_ref.at[srow[:, None], hc[None, :]], act, mask=row_ok[:, None] & h_ok[None, :])


def _split_down_kernel(
    u_ref,  # [rows, r] float32
    act_ref,  # [rows, M] cd
    wd_ref,  # [M, r] cd
    o_ref,  # [rows, r] cd
    *,
    rows: int,
    r: int,
    m: int,
    rb: int,
    cb: int,
    kb: int,
):
    """Split stage 3, grid (cdiv(rows, rb), cdiv(r, cb)): lat = u + act @ down, cb rank columns."""
    f32 = jnp.float32
    cd = o_ref.dtype
    row_ok, rl, srow = _tile_rows(rb, rows)
    col = pl.program_id(1) * cb + jnp.arange(cb, dtype=jnp.int32)
    col_ok = col < r
    c_tail = r % cb != 0
    kk = jnp.arange(kb, dtype=jnp.int32)
    k_tail = m % kb != 0

    def k_step(i, acc):
        kc = i * kb + kk  # [kb]
        a = _load(act_ref.at[rl[:, None], kc[None, :]], (kc < m)[None, :] if k_tail else None)  # [rb, kb]
        w = _load(wd_ref.at[kc[:, None], col[None, :]],
                  _and((kc < m)[:, None] if k_tail else None, col_ok[None, :] if c_tail else None))  # [kb, cb]
        return acc + jnp.dot(a, w, precision=_HI, preferred_element_type=f32)

    acc = jax.lax.fori_loop(0, pl.cdiv(m, kb), k_step, jnp.zeros((rb, cb), f32))
    u = _load(u_ref.at[rl[:, None], col[None, :]], col_ok[None, :] if c_tail else None)  # [rb, cb] f32
    lat = (u + acc).astype(cd)
    plt.store(o_ref.at[srow[:, None], col[None, :]], lat, mask=row_ok[:, None] & col_ok[None, :])


def _auto_row_block(rows: int) -> int:
    """Rows per split stage-2/3 program: about 8 row tiles, 16..64 rows each."""
    return min(64, max(16, next_pow2(-(-rows // 8))))


def _latent_split(xh, blk, prev_ids, w1, wt, mix, wg, wu, wd, *, cfg: LatentConfig, interpret: bool):
    """The split variants (traced inside `_latent_pallas`): -> [N*(B-1), r] cd."""
    n, b = blk.shape
    v, r = w1.shape
    m = wg.shape[1]
    cd = w1.dtype
    f32 = jnp.float32
    rows = n * (b - 1)
    rp = max(16, next_pow2(r))
    mp = max(16, next_pow2(m))
    bp = next_pow2(b)
    bpp = _dot_bpp(cfg.blocks_per_program, bp)
    cb = min(cfg.col_block, rp)
    kb1 = min(cfg.k_block, rp)
    with_uc = jnp.dtype(cd) != jnp.dtype(f32)
    u_shape = jax.ShapeDtypeStruct((rows, r), f32)
    call = functools.partial(common.pallas_call, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                             interpret=interpret)
    mix_call = call(functools.partial(_split_mix_kernel, n=n, b=b, bp=bp, bpp=bpp, v=v, r=r, cb=cb, kb=kb1),
                    name="xpress_latent_pass_mix", grid=(pl.cdiv(n, bpp), pl.cdiv(r, cb)),
                    out_shape=(u_shape, jax.ShapeDtypeStruct((rows, r), cd)) if with_uc else (u_shape,))
    outs = mix_call(blk.reshape(n * b).astype(jnp.int32), prev_ids.astype(jnp.int32), xh.reshape(n * b, r),
                    w1, wt, mix)
    u = outs[0]
    uc = outs[1] if with_uc else u

    rb = min(cfg.row_block or _auto_row_block(rows), max(16, next_pow2(rows)))
    hb = min(cfg.h_block, mp)
    act = call(functools.partial(_split_gateup_kernel, rows=rows, r=r, m=m, rb=rb, hb=hb, kb=kb1),
               name="xpress_latent_pass_gateup", grid=(pl.cdiv(rows, rb), pl.cdiv(m, hb)),
               out_shape=jax.ShapeDtypeStruct((rows, m), cd))(uc, wg, wu)
    return call(functools.partial(_split_down_kernel, rows=rows, r=r, m=m, rb=rb, cb=cb, kb=min(cfg.k_block, mp)),
                name="xpress_latent_pass_down", grid=(pl.cdiv(rows, rb), pl.cdiv(r, cb)),
                out_shape=jax.ShapeDtypeStruct((rows, r), cd))(u, act, wd)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _latent_pallas(xh, blk, prev_ids, w1, wt, mix, wg, wu, wd, *, cfg: LatentConfig, interpret: bool):
    n, b = blk.shape
    v, r = w1.shape
    m = wg.shape[1]
    cd = w1.dtype
    rp = max(16, next_pow2(r))
    mp = max(16, next_pow2(m))
    bp = next_pow2(b)
    kb = min(cfg.k_block, rp)
    hb = min(cfg.h_block, mp)
    bpp = _dot_bpp(cfg.blocks_per_program, bp)
    if cfg.variant != "fused":
        return _latent_split(xh, blk, prev_ids, w1, wt, mix, wg, wu, wd, cfg=cfg,
                             interpret=interpret).reshape(n, b - 1, r)
    call = common.pallas_call(
        functools.partial(_latent_kernel, n=n, b=b, bp=bp, bpp=bpp, v=v, r=r, rp=rp, m=m, mp=mp, kb=kb, hb=hb),
        name="xpress_latent_pass", out_shape=jax.ShapeDtypeStruct((n * (b - 1), r), cd), grid=(pl.cdiv(n, bpp),),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret)
    out = call(blk.reshape(n * b).astype(jnp.int32), prev_ids.astype(jnp.int32), xh.reshape(n * b, r),
               w1, wt, mix, wg, wu, wd)
    return out.reshape(n, b - 1, r)


def latent_pass(
    params: Mapping[str, jax.Array],
    xh: jax.Array,
    blk: jax.Array,
    prev_ids: jax.Array,
    *,
    interpret: bool = False,
    config: LatentConfig | None = None,
) -> jax.Array:
    """[N,B,r], [N,B] int32, [N] int32 -> [N, B-1, r]: the draft slots' latents (`xpress_jax.reference.latent_pass`).

    ``config`` default: `default_config`. Float64 params raise ``TypeError``."""
    w1 = params["w1"]
    n, b = blk.shape
    v, r = w1.shape
    if tuple(xh.shape) != (n, b, r):
        raise ValueError(f"xh.shape={tuple(xh.shape)} must be (N, B, r)={(n, b, r)}")
    if tuple(prev_ids.shape) != (n,):
        raise ValueError(f"prev_ids.shape={tuple(prev_ids.shape)} must be (N,)=({n},)")
    if tuple(params["mix"].shape) != (b, b, r):
        raise ValueError(f"params['mix'].shape={tuple(params['mix'].shape)} must be (B, B, r)={(b, b, r)}")
    cd = jnp.dtype(w1.dtype)
    if jnp.dtype(xh.dtype) != cd:
        raise TypeError(f"xh.dtype={jnp.dtype(xh.dtype)} must equal the params' dtype {cd}")
    if n == 0 or b < 2:
        return jnp.zeros((n, max(b - 1, 0), r), cd)
    if cd not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise TypeError(f"latent kernel: params dtype {cd.name} is not supported (bf16, f16, f32); "
                        "xpress_jax routes float64 to xpress_jax.reference.latent_pass")
    cfg = config if config is not None else default_config(n, cd, rank=r)
    cfg.check_shape(r, cd)
    return _latent_pallas(
        xh, blk, prev_ids, w1, params["in_proj_token"], params["mix"], params["mlp_gate"],
        params["mlp_up"], params["mlp_down"], cfg=cfg, interpret=bool(interpret))
