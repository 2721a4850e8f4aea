"""Hidden input of the XPress head (once per refine call): two Pallas-Triton kernels for small N.

What it computes (the jnp reference: `xpress_jax.head.hidden_input`)::

    hh[n, b] = cd(h[n, b] @ down_h)                              [N, B, r]
    g[n]     = cd(mean_b h[n, b])                                [N, H]   (the mean in float32)
    hg[n]    = cd(g[n] @ down_g)                                 [N, r]
    xh[n, b] = cd(concat(hh[n, b], hg[n]) @ in_proj_hidden)       [N, B, r]

Why kernels: at N=1 XLA spells ``g @ down_g`` (a [1, 4096] x [4096, 256] GEMV) as a multiply over a
materialised float32 [4096, 256] and a reduction (8.6 µs on an H200), and the whole hidden input takes 6
launches, ~14.6 µs of a 122 µs top-512 refine (benchmarks/RESULTS.md "Small-N latency", 2026-12-02).

1. ``xpress_hidden_cache``, grid ``(cdiv(N, bpp), cdiv(r, col_block))``: a program owns ``bpp`` blocks
   (``bpp * Bp`` rows, Bp = B rounded up to a power of two, padded slots masked) and ``col_block`` rank
   columns, and loops over H in ``k_block`` chunks: ``hh += h @ down_h`` and, from the same loaded
   chunk of ``h``, ``g`` (each block's slot sum / B in float32, rounded to ``cd``, broadcast back to the
   block's rows) and ``hg += g @ down_g``. It writes ``concat(hh, hg)`` [N*B, 2r] in ``cd``.
2. ``xpress_hidden_input``, grid ``(cdiv(N*B, row_block), cdiv(r, proj_col_block))``: ``xh = cd(cat @
   in_proj_hidden)``, K = 2r in ``k_block`` chunks.

Exactness: the float32 sums are grouped differently from XLA's (K chunks, the slot mean summed as a tree),
so a value next to a rounding boundary can round the other way (one bf16 ulp in ``hh``, ``g``, ``hg`` or
``xh``); the tests bound this as the latent kernel's are (tests/test_kernel_hidden.py) and check that refined
tokens are identical. Float64 is refused (``TypeError``); `xpress_jax` routes it to the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import common
from .common import next_pow2

__all__ = ["HiddenConfig", "hidden_input"]

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class HiddenConfig:
    """Static block configuration of the two hidden-input kernels (hashable: a jit static arg).

    blocks_per_program: blocks per stage-1 program (its rows = this * Bp, raised to 16 rows for B <= 8).
    col_block: rank columns per stage-1 program. k_block: H chunk of stage 1 and 2r chunk of stage 2.
    row_block / proj_col_block: stage 2's rows and columns per program.
    All powers of two >= 16 (the tensor-core dot minimum).
    """

    blocks_per_program: int = 1
    col_block: int = 16
    k_block: int = 128
    row_block: int = 16
    proj_col_block: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("blocks_per_program", "col_block", "k_block", "row_block", "proj_col_block", "num_warps",
                     "num_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        for name in ("blocks_per_program", "col_block", "k_block", "row_block", "proj_col_block", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        for name in ("col_block", "k_block", "row_block", "proj_col_block"):
            if getattr(self, name) < 16:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 16 (tensor-core dot minimum)")


def _cache_kernel(h_ref, dh_ref, dg_ref, o_ref, *, n: int, b: int, bp: int, bpp: int, hdim: int, r: int,
                  cb: int, kb: int):
    """Stage 1: concat(hh, hg) for ``bpp`` blocks and ``cb`` rank columns (module doc)."""
    f32 = jnp.float32
    cd = h_ref.dtype
    ri = jnp.arange(bpp * bp, dtype=jnp.int32)
    slot = ri % bp
    blk = pl.program_id(0) * bpp + ri // bp
    valid = (slot < b) & (blk < n)
    row = jnp.where(valid, blk * b + slot, 0)
    col = pl.program_id(1) * cb + jnp.arange(cb, dtype=jnp.int32)
    col_ok = col < r
    c_tail = r % cb != 0
    kk = jnp.arange(kb, dtype=jnp.int32)
    k_tail = hdim % kb != 0
    rows_n = bpp * bp

    def k_step(i, carry):
        acc_h, acc_g = carry
        kc = i * kb + kk
        k_ok = kc < hdim
        x = plt.load(h_ref.at[row[:, None], kc[None, :]], mask=valid[:, None] & k_ok[None, :], other=0)  # [R, kb]
        wmask = (k_ok[:, None] if k_tail else True) & (col_ok[None, :] if c_tail else True)
        wmask = None if (not k_tail and not c_tail) else wmask
        wh = plt.load(dh_ref.at[kc[:, None], col[None, :]], mask=wmask, other=0 if wmask is not None else None)
        wg = plt.load(dg_ref.at[kc[:, None], col[None, :]], mask=wmask, other=0 if wmask is not None else None)
        acc_h = acc_h + jnp.dot(x, wh, precision=_HI, preferred_element_type=f32)
        xf = x.astype(f32)
        if bpp == 1:
            g = jnp.broadcast_to((jnp.sum(xf, axis=0) / b)[None, :], (rows_n, kb))
        else:
            g = jnp.broadcast_to((jnp.sum(xf.reshape(bpp, bp, kb), axis=1) / b)[:, None, :],
                                 (bpp, bp, kb)).reshape(rows_n, kb)
        acc_g = acc_g + jnp.dot(g.astype(cd), wg, precision=_HI, preferred_element_type=f32)
        return acc_h, acc_g

    zero = jnp.zeros((rows_n, cb), f32)
    acc_h, acc_g = jax.lax.fori_loop(0, pl.cdiv(hdim, kb), k_step, (zero, zero))
    # Masked lanes store one past the end (never written; see the latent kernel).
    srow = jnp.where(valid, row, n * b)
    smask = valid[:, None] & col_ok[None, :]
    plt.store(o_ref.at[srow[:, None], col[None, :]], acc_h.astype(cd), mask=smask)
    plt.store(o_ref.at[srow[:, None], r + col[None, :]], acc_g.astype(cd), mask=smask)


def _proj_kernel(c_ref, w_ref, o_ref, *, rows: int, k: int, r: int, rb: int, cb: int, kb: int):
    """Stage 2: xh = cd(cat @ in_proj_hidden) for ``rb`` rows and ``cb`` columns."""
    f32 = jnp.float32
    ri = pl.program_id(0) * rb + jnp.arange(rb, dtype=jnp.int32)
    row_ok = ri < rows
    rl = jnp.where(row_ok, ri, 0)
    col = pl.program_id(1) * cb + jnp.arange(cb, dtype=jnp.int32)
    col_ok = col < r
    kk = jnp.arange(kb, dtype=jnp.int32)

    def k_step(i, acc):
        kc = i * kb + kk
        k_ok = kc < k
        a = plt.load(c_ref.at[rl[:, None], kc[None, :]], mask=k_ok[None, :], other=0)
        w = plt.load(w_ref.at[kc[:, None], col[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0)
        return acc + jnp.dot(a, w, precision=_HI, preferred_element_type=f32)

    acc = jax.lax.fori_loop(0, pl.cdiv(k, kb), k_step, jnp.zeros((rb, cb), f32))
    srow = jnp.where(row_ok, ri, rows)
    plt.store(o_ref.at[srow[:, None], col[None, :]], acc.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _hidden_pallas(h, dh, dg, wih, *, cfg: HiddenConfig, interpret: bool):
    n, b, hdim = h.shape
    r = dh.shape[1]
    cd = h.dtype
    bp = next_pow2(b)
    bpp = max(cfg.blocks_per_program, 16 // bp if bp < 16 else 1)
    cb = min(cfg.col_block, max(16, next_pow2(r)))
    kb = min(cfg.k_block, max(16, next_pow2(hdim)))
    cache = common.pallas_call(
        functools.partial(_cache_kernel, n=n, b=b, bp=bp, bpp=bpp, hdim=hdim, r=r, cb=cb, kb=kb),
        name="xpress_hidden_cache",
        out_shape=jax.ShapeDtypeStruct((n * b, 2 * r), cd),
        grid=(pl.cdiv(n, bpp), pl.cdiv(r, cb)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=interpret,
    )(h.reshape(n * b, hdim), dh, dg)
    rows = n * b
    rb = min(cfg.row_block, max(16, next_pow2(rows)))
    pcb = min(cfg.proj_col_block, max(16, next_pow2(r)))
    pkb = min(cfg.k_block, max(16, next_pow2(2 * r)))
    xh = common.pallas_call(
        functools.partial(_proj_kernel, rows=rows, k=2 * r, r=r, rb=rb, cb=pcb, kb=pkb),
        name="xpress_hidden_input",
        out_shape=jax.ShapeDtypeStruct((rows, r), cd),
        grid=(pl.cdiv(rows, rb), pl.cdiv(r, pcb)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=interpret,
    )(cache, wih)
    return xh.reshape(n, b, r)


def hidden_input(params: Mapping[str, jax.Array], h: jax.Array, *, config: HiddenConfig | None = None,
                 interpret: bool = False, **overrides: Any) -> jax.Array:
    """[N, B, H] -> [N, B, r]: ``xh``, the pass-invariant hidden half of ``in_proj`` (module doc).

    Same semantics as `xpress_jax.head.hidden_input`. ``config`` (default `HiddenConfig()`) and keyword
    overrides of its fields set the blocks. Float64 raises ``TypeError``; N = 0 returns an empty array.
    """
    dh, dg, wih = params["down_h"], params["down_g"], params["in_proj_hidden"]
    cd = jnp.dtype(params["w1"].dtype)
    if h.ndim != 3 or h.shape[2] != dh.shape[0]:
        raise ValueError(f"h.shape={tuple(h.shape)} must be (N, B, H) with H = down_h.shape[0] = {dh.shape[0]}")
    if jnp.dtype(h.dtype) != cd:
        raise TypeError(f"h.dtype={jnp.dtype(h.dtype)} must equal the params' dtype {cd}")
    if cd not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise TypeError(f"hidden-input kernel: params dtype {cd.name} is not supported (bf16, f16, f32); "
                        "xpress_jax routes float64 to xpress_jax.head.hidden_input")
    r = dh.shape[1]
    if h.shape[0] == 0 or h.shape[1] == 0:
        return jnp.zeros((h.shape[0], h.shape[1], r), cd)
    cfg = config if config is not None else HiddenConfig()
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    return _hidden_pallas(h, dh, dg, wih, cfg=cfg, interpret=bool(interpret))
