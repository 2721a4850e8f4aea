"""All K top-C passes of refine in one kernel launch: `topc_all_passes`.

The per-pass path (`xpress_jax.refine._refine` in top-C mode) launches, for every
pass, the latent kernel(s) and the top-C pick kernel(s), and passes the block's
tokens and latents through HBM between them. Here one program owns whole blocks
for all K passes (no grid-wide barrier exists, so a block can never be shared by
programs) and keeps its tokens on chip::

    tok = blk0[n]                                     # [Bp] int32, in registers
    repeat K times (Jacobi: every draft slot reads the previous pass's tokens):
        prev[0] = prev_ids[n]; prev[b] = tok[b-1]      # an iota/where/sum shift
        x   = xh[n] + w1[prev] @ in_proj_token         # float32 accumulation
        u   = mix (x)                                  # folded causal mixer, float32
        lat = cd(u + down(silu(cd(u) @ gate) * (cd(u) @ up)))
        for every draft slot b >= 1, over its C candidates c (c_tile at a time):
            s[c] = float(cd(base_c[c] + cd(w2[cand[c]] . lat[b])))  # float32 dot
            tok[b] = the cand of the largest s, lowest vocab id on ties, NaN = -inf
    blk[n] = tok                                       # written once

It is the per-pass jnp path (`reference`: `_JnpOps.latent_pass` + `topc_pick` in a
``fori_loop``) in one launch, with the precision of `pallas_kernels.latent`'s fused
kernel (operands in the params' dtype ``cd``, float32 accumulation, float32
elementwise, ``u`` and the SwiGLU activation rounded to ``cd`` as dot operands, the
latent rounded to ``cd``) and of `pallas_kernels.topc_pick` (the candidate bias a
float32 sum rounded to ``cd``, the sum rounded to ``cd`` before comparing).

Layout: grid ``cdiv(N, bpp)``; a program holds ``R = bpp * Bp`` rows (``Bp`` = B
rounded up to a power of two; padded slots and blocks past N are masked). The
latent is computed exactly as `latent._latent_kernel` does (K chunks of
``k_block``, mixer j = 0..B-1 in order, SwiGLU hidden chunks of ``h_block``); it is
written inline, since that kernel has no shared per-block helper. Scoring runs
over ``cdiv(C, c_tile)`` candidate tiles of all R rows at once, each tile's w2 rows
gathered in rank chunks of ``k_tile``:

* ``score="fma"``: ``bias[i, c] = sum_k w2[cand[i, c], k] * lat[i, k]`` as a float32
  multiply-and-sum on [R, c_tile, k_tile] (a batched mat-vec: nothing for the tensor
  cores).
* ``score="dot"``: the gathered rows [R*c_tile, k_tile] times lat^T [k_tile, R] on
  the tensor cores, keeping the diagonal blocks (R times the needed FLOPs, which
  tensor cores have to spare; the w2 tile becomes a dot operand, which Triton can
  software-pipeline through shared memory).

Cost model (serving shapes, bf16; a prediction, see benchmarks/dev_fused_passes.py):
per block and pass the w2 rows of 15 x 512 candidates are 3.9 MB, all streamed
through the one SM that owns the block, after ~1 MB of latent weights (~8-10 us per
pass, as the fused latent kernel at small N). One SM moves about (bytes in flight) /
(memory latency): 64-128 KB in flight at ~1 us is 64-128 GB/s, i.e. ~30-60 us per
pass, the same at every N up to one block per SM (132 on an H200); beyond that the
kernel is HBM-bound like the per-pass pick. The per-pass path spreads each pass over
many programs (~15-20 us per pass at N=1, launches included). So one launch cannot
win at small N; it may draw level or win slightly from N ~ 64-132 on, where both
paths are bandwidth-bound and it saves the K latent launches and the HBM round trips
of latents and tokens. `use_single_launch` follows the measured `SINGLE_LAUNCH_N`.

Exactness vs the per-pass path: the same operations and roundings; float32 sums
are grouped differently (as in the latent and pick kernels), so a latent or bias
within an ulp of a rounding boundary can round the other way, and a near tie can
flip a token (which then cascades into later slots). Float64 params run
`reference` (the per-pass jnp path; no float64 kernel). Candidate ids must lie in
[0, V) (as `topc_pick`); predecessor ids are clipped to [0, V) (as the latent pass).
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
from .full_vocab import _BIG, _best, _merge, _score
from .latent import _block_rows, _load, _mix_rows, _swiglu_rows, _x_rows

__all__ = [
    "PassesConfig",
    "SCORES",
    "SINGLE_LAUNCH_N",
    "default_config",
    "reference",
    "topc_all_passes",
    "use_single_launch",
]

_HI = jax.lax.Precision.HIGHEST

#: Forms of the candidate scoring (`PassesConfig.score`).
SCORES = ("fma", "dot")

#: Inclusive N range in which refine should call `topc_all_passes` instead of the
#: per-pass kernels; None = never. Set only from an H200 run of
#: benchmarks/dev_fused_passes.py (which prints the measured range); not set by guess.
#: Measured 2026-11-30 (H200, JAX 0.11.2, K-pass loop alone, best single-launch variant
#: vs per-pass Pallas, µs): N=1 781 vs 83, N=4 715 vs 109, N=16 812 vs 264, N=64 814 vs 542,
#: N=132 965 vs 919, N=256 1887 vs 1484 -> never faster: one SM per block streams its
#: candidates' w2 rows (3.9 MB per pass) alone, while the per-pass kernels spread a pass
#: over every SM. End to end (top-512 refine): 842 vs 120 µs at N=1, 4136 vs 3793 at N=256.
SINGLE_LAUNCH_N: tuple[int, int] | None = None


def use_single_launch(n: int) -> bool:
    """True if the measured range `SINGLE_LAUNCH_N` says one launch beats K per-pass launches at N blocks."""
    return SINGLE_LAUNCH_N is not None and SINGLE_LAUNCH_N[0] <= n <= SINGLE_LAUNCH_N[1]


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class PassesConfig:
    """Static block configuration of `topc_all_passes` (hashable: a jit static arg).

    blocks_per_program: blocks per program (0 = auto: enough for >= 16 rows, the
      tensor-core dot minimum, i.e. ``max(1, 16 // Bp)``).
    k_block, h_block: K chunk of ``w1[prev] @ in_proj_token`` and SwiGLU hidden chunk
      (as `latent.LatentConfig`); powers of two >= 16.
    c_tile: candidates per scoring step (per row); power of two.
    k_tile: rank chunk of the scoring step (0 = the padded rank); power of two.
    score: one of `SCORES` (see the module doc).
    prefetch: 0 = a step loads its candidate ids, then gathers their w2 rows; 1 = the ids
      (and base logits) are loaded one step ahead, so a step's gather depends only on the
      loop carry and Triton's pipeliner (num_stages >= 3) can issue it a step earlier;
      2 = ids two steps ahead and the w2 tiles one step ahead, held in registers.
    num_warps, num_stages: Triton compiler params.
    """

    blocks_per_program: int = 0
    k_block: int = 64
    h_block: int = 64
    c_tile: int = 8
    k_tile: int = 64
    score: str = "dot"
    prefetch: int = 1
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.prefetch not in (0, 1, 2):
            raise ValueError(f"prefetch={self.prefetch!r} must be 0, 1 or 2")
        if self.score not in SCORES:
            raise ValueError(f"score={self.score!r} must be one of {SCORES}")
        for name in ("blocks_per_program", "k_block", "h_block", "c_tile", "k_tile", "num_warps", "num_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be a non-negative int")
        for name in ("k_block", "h_block", "c_tile", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        for name in ("blocks_per_program", "k_block", "h_block", "c_tile", "k_tile", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        for name in ("k_block", "h_block"):
            if getattr(self, name) < 16:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 16 (tensor-core dot minimum)")
        if 0 < self.k_tile < 16:
            raise ValueError(f"k_tile={self.k_tile} must be 0 (whole rank) or >= 16")


def default_config(n: int, b: int, dtype: Any) -> PassesConfig:
    """Block config for N blocks of B slots (tune with benchmarks/dev_fused_passes.py).

    From an offline sm_90a compile (Triton 3.9 + ptxas, not XLA's own Triton) at
    B=16, r=256, M=512, C=512, 6 passes (shared memory / registers, no spills):

    * bf16: the latent tiles of `latent.default_config`'s fused variant (k_block =
      h_block = 64); tensor-core scoring of R x c_tile = 128 gathered w2 rows x 64 rank
      columns per step (4 async copies of 16 KB), candidate ids one step ahead
      (``prefetch=1``) and 3 pipeline stages, so Triton keeps two steps of w2 rows
      (128 KB) in flight: 199 KB, 182 registers. (2 stages: the gather of step t+1 is
      issued after step t's math and waited for at once, 64 KB in flight, 133 KB;
      without ``prefetch=1`` a third stage only prefetches the ids. 4 stages: 240 KB,
      over the H200's 227 KB.) R = 32 rows halves c_tile.
    * float32: the latent's 32-wide chunks and FMA scoring (4 candidates x 32 columns;
      a float32 dot tile spills), 2 stages: 117 KB, 191 registers.
    """
    bp = _next_pow2(b)
    rows = max(1, 16 // bp) * bp
    if jnp.dtype(dtype).itemsize >= 4:
        return PassesConfig(blocks_per_program=0, k_block=32, h_block=32, c_tile=4, k_tile=32, score="fma",
                            prefetch=1, num_warps=8, num_stages=2)
    return PassesConfig(blocks_per_program=0, k_block=64, h_block=64, c_tile=max(1, 128 // rows), k_tile=64,
                        score="dot", prefetch=1, num_warps=8, num_stages=3)


def reference(params: Mapping[str, jax.Array], xh: jax.Array, blk0: jax.Array, prev_ids: jax.Array,
              base_c: jax.Array, cand: jax.Array, *, num_passes: int) -> jax.Array:
    """The per-pass jnp path (the loop of `xpress_jax.refine._refine`, top-C mode) -> blk [N, B] int32."""
    from xpress_jax.refine import _JnpOps

    n, b = blk0.shape
    w2c = _JnpOps.topc_prepare(params["w2"], cand)
    prev_ids = prev_ids.astype(jnp.int32)

    def one_pass(_, blk):
        lat = _JnpOps.latent_pass(params, xh, blk, prev_ids).reshape(n * (b - 1), -1)
        return blk.at[:, 1:].set(_JnpOps.topc_pick(base_c, cand, lat, w2c).reshape(n, b - 1))

    return jax.lax.fori_loop(0, num_passes, one_pass, blk0.astype(jnp.int32))


def _passes_kernel(
    blk_ref,  # [N*B] int32: the start block, flattened
    prev_ref,  # [N] int32
    xh_ref,  # [N*B, r] cd
    w1_ref,  # [V, r] cd
    wt_ref,  # [r, r] cd (in_proj_token)
    mix_ref,  # [B, B, r] cd (mix[k, j, c])
    wg_ref,  # [r, M] cd
    wu_ref,  # [r, M] cd
    wd_ref,  # [M, r] cd
    w2_ref,  # [V, r] cd
    base_ref,  # [N*(B-1), C] cd
    cand_ref,  # [N*(B-1), C] int32
    zero_ref,  # [K] int32 zeros (see `one_pass`)
    o_ref,  # [R] int32 block of [programs, R]: the final tokens of this program's rows
    *,
    n: int,
    b: int,
    bp: int,
    bpp: int,
    v: int,
    r: int,
    rp: int,
    m: int,
    c: int,
    kb: int,
    hb: int,
    ct: int,
    kt: int,
    score: str,
    prefetch: int,
    num_passes: int,
):
    f32 = jnp.float32
    cd = w1_ref.dtype
    rows = bpp * bp
    pid = pl.program_id(0)

    ri, slot, blk_c, valid = _block_rows(pid * bpp, n=n, b=b, bp=bp, bpp=bpp)
    draft = valid & (slot >= 1)  # rows that get a token each pass
    col = jnp.arange(rp, dtype=jnp.int32)  # [rp]
    col_ok = col < r
    r_tail = rp != r

    # Pass-invariant per-row values.
    tok0 = plt.load(blk_ref.at[jnp.where(valid, blk_c * b + slot, 0)], mask=valid, other=0)  # [R]
    prev0 = plt.load(prev_ref.at[blk_c], mask=valid & (slot == 0), other=0)  # [R]
    xrow = jnp.where(valid, blk_c * b + slot, 0)
    crow = jnp.where(draft, blk_c * (b - 1) + slot - 1, 0)  # row of base_c / cand
    shift = ri[:, None] - 1 == ri[None, :]  # [R, R]: row i reads row i-1 (same block for slot >= 1)

    nk = rp // kt
    cc0 = jnp.arange(ct, dtype=jnp.int32)
    kc0 = jnp.arange(kt, dtype=jnp.int32)
    w2_tail = r_tail  # rank columns past r (kt divides rp)

    def latent(tok, col):
        """The block's latents [R, rp] in cd for predecessors from ``tok`` (``col``: the rank columns)."""
        # 1. predecessors: slot 0 <- prev_ids[n]; slot s >= 1 <- tok[s-1] (a value shift: no slicing).
        sh = jnp.sum(jnp.where(shift, tok[None, :], 0), axis=1)  # [R]
        ids = jnp.clip(jnp.where(slot == 0, prev0, sh), 0, v - 1)

        # 2-4. x = xh + w1[ids] @ in_proj_token; the folded causal mixer; SwiGLU + residual (as the
        # latent kernel, the same code). Padded rank columns come out 0.
        x = _x_rows(ids, xrow, valid, col, col_ok, xh_ref, w1_ref, wt_ref, r=r, kb=kb, col_tail=r_tail)
        u = _mix_rows(x, slot, col, col_ok, mix_ref, b=b, bp=bp, bpp=bpp, col_tail=r_tail)
        return _swiglu_rows(u, col, col_ok, wg_ref, wu_ref, wd_ref, m=m, hb=hb, col_tail=r_tail, cd=cd)  # [R, rp]

    def pick(lat):
        """Each draft row's best candidate [R] int32 (_BIG on rows that are not draft rows)."""
        if nk == 1:
            chunks = [lat]
        else:  # rank chunks of a value: a masked sum over a reshape (value slicing does not lower)
            lat3 = lat.astype(f32).reshape(rows, nk, kt)
            sel = jnp.arange(nk, dtype=jnp.int32)[None, :, None]
            chunks = [jnp.sum(jnp.where(sel == q, lat3, 0.0), axis=1).astype(cd) for q in range(nk)]
        chunks_f = [ch.astype(f32) for ch in chunks]

        def meta(t):
            """Step t's candidate ids, base logits and mask, [R, ct] each (masked lanes: id 0, base 0)."""
            cc = t * ct + cc0  # [ct]
            ok = draft[:, None] & (cc < c)[None, :]  # [R, ct]
            cidx = (crow[:, None], jnp.where(cc < c, cc, 0)[None, :])
            return plt.load(cand_ref.at[cidx], mask=ok, other=0), plt.load(base_ref.at[cidx], mask=ok, other=0)

        def gather(ids):
            """The candidates' w2 rows, one tile per rank chunk: [R, ct, kt] (fma) or [R*ct, kt] (dot)."""
            tiles = []
            for q in range(nk):
                kc = q * kt + kc0  # [kt]
                if score == "fma":
                    tiles.append(_load(w2_ref.at[ids[:, :, None], kc[None, None, :]],
                                       (kc < r)[None, None, :] if w2_tail else None))
                else:
                    tiles.append(_load(w2_ref.at[ids.reshape(rows * ct)[:, None], kc[None, :]],
                                       (kc < r)[None, :] if w2_tail else None))
            return tuple(tiles)

        def best_of(t, ids, bse, tiles, carry):
            bias = jnp.zeros((rows, ct), f32)
            for q, w in enumerate(tiles):
                if score == "fma":
                    bias = bias + jnp.sum(w.astype(f32) * chunks_f[q][:, None, :], axis=2)
                else:
                    p = jax.lax.dot_general(w, chunks[q], (((1,), (1,)), ((), ())), precision=_HI,
                                            preferred_element_type=f32)  # [R*ct, R]
                    diag = ri[:, None, None] == ri[None, None, :]  # [R, 1, R]
                    bias = bias + jnp.sum(jnp.where(diag, p.reshape(rows, ct, rows), 0.0), axis=2)
            ok = draft[:, None] & ((t * ct + cc0) < c)[None, :]
            s = jnp.where(ok, _score(bse, bias.astype(cd), cd), -jnp.inf)
            best, idx = _best(s, jnp.where(ok, ids, _BIG), axis=1)
            return _merge(*carry, best, idx)

        init = (jnp.full((rows,), -jnp.inf, f32), jnp.full((rows,), _BIG, jnp.int32))
        steps = pl.cdiv(c, ct)
        if prefetch == 0:  # everything of step t loaded in step t

            def c_step(t, carry):
                ids, bse = meta(t)
                return best_of(t, ids, bse, gather(ids), carry)

            best, idx = jax.lax.fori_loop(0, steps, c_step, init)
        elif prefetch == 1:  # ids/base one step ahead: step t's gather depends only on the loop carry

            def c_step(t, carry):
                best, idx, ids, bse = carry
                nxt = meta(t + 1)  # past the end: fully masked
                return (*best_of(t, ids, bse, gather(ids), (best, idx)), *nxt)

            best, idx, _, _ = jax.lax.fori_loop(0, steps, c_step, (*init, *meta(0)))
        else:  # ids/base two steps ahead, the w2 tiles one step ahead (in registers)

            def c_step(t, carry):
                best, idx, ids, bse, ids1, bse1, tiles = carry
                tiles1 = gather(ids1)
                nxt = meta(t + 2)
                return (*best_of(t, ids, bse, tiles, (best, idx)), ids1, bse1, *nxt, tiles1)

            ids0, bse0 = meta(0)
            carry = (*init, ids0, bse0, *meta(1), gather(ids0))
            best, idx = jax.lax.fori_loop(0, steps, c_step, carry)[:2]
        return idx

    def one_pass(p, tok):
        # ``col + zero_ref[p]`` (always ``col``) makes every address tensor of the latent's weight
        # loads depend on the pass, so the compiler cannot hoist them out of the pass loop and keep
        # them live in registers across all K passes (offline sm_90a compile of the serving shapes:
        # 250 -> 177 registers; one pass alone needs 128).
        colp = col + plt.load(zero_ref.at[p])
        return jnp.where(draft, pick(latent(tok, colp)), tok)  # Jacobi: all slots from the previous tokens

    o_ref[...] = jax.lax.fori_loop(0, num_passes, one_pass, tok0)


@functools.partial(jax.jit, static_argnames=("num_passes", "cfg", "interpret"))
def _passes_pallas(blk0, prev_ids, xh, w1, wt, mix, wg, wu, wd, w2, base_c, cand, *, num_passes: int,
                   cfg: PassesConfig, interpret: bool):
    n, b = blk0.shape
    v, r = w1.shape
    m = wg.shape[1]
    c = base_c.shape[1]
    rp = max(16, _next_pow2(r))
    bp = _next_pow2(b)
    bpp = cfg.blocks_per_program or max(1, 16 // bp)
    kb = min(cfg.k_block, rp)
    hb = min(cfg.h_block, max(16, _next_pow2(m)))
    kt = min(cfg.k_tile or rp, rp)
    ct = min(cfg.c_tile, _next_pow2(c))
    programs = pl.cdiv(n, bpp)
    rows = bpp * bp
    kernel = functools.partial(
        _passes_kernel, n=n, b=b, bp=bp, bpp=bpp, v=v, r=r, rp=rp, m=m, c=c, kb=kb, hb=hb, ct=ct, kt=kt,
        score=cfg.score, prefetch=cfg.prefetch, num_passes=num_passes)
    out = common.pallas_call(
        kernel,
        name="xpress_topc_all_passes",
        out_shape=jax.ShapeDtypeStruct((programs, rows), jnp.int32),
        grid=(programs,),
        in_specs=[pl.no_block_spec] * 13,
        out_specs=pl.BlockSpec((None, rows), lambda i: (i, 0)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=interpret,
    )(blk0.reshape(n * b).astype(jnp.int32), prev_ids.astype(jnp.int32), xh.reshape(n * b, r),
      w1, wt, mix, wg, wu, wd, w2, base_c, cand.astype(jnp.int32), jnp.zeros((num_passes,), jnp.int32))
    return out.reshape(programs * bpp, bp)[:n, :b]


def topc_all_passes(
    params: Mapping[str, jax.Array],
    xh: jax.Array,
    blk0: jax.Array,
    prev_ids: jax.Array,
    base_c: jax.Array,
    cand: jax.Array,
    *,
    num_passes: int,
    interpret: bool = False,
    config: PassesConfig | None = None,
) -> jax.Array:
    """K top-C Jacobi passes in one launch -> the final block [N, B] int32 (slot 0 = blk0's anchor).

    Args:
      params: the head's params (uses w1, in_proj_token, mix, mlp_gate/up/down, w2).
      xh: [N, B, r] the pass-invariant hidden input (`xpress_jax.head.hidden_input`).
      blk0: [N, B] int32 start block: slot 0 the anchor, slots 1.. the start tokens.
      prev_ids: [N] int32 the token before each anchor.
      base_c, cand: [N*(B-1), C] each draft row's candidate base logits (params' dtype)
        and vocab ids (in [0, V); row n*(B-1) + b-1 is block n's slot b).
      num_passes: K >= 0 (static).
      config: a `PassesConfig`, else `default_config`.

    Same tokens as `reference` (the per-pass jnp path) up to float32 summation order
    (see the module doc). Float64 params run `reference`.
    """
    w1 = params["w1"]
    n, b = blk0.shape
    v, r = w1.shape
    if isinstance(num_passes, bool) or not isinstance(num_passes, int) or num_passes < 0:
        raise ValueError(f"num_passes={num_passes!r} must be a non-negative int")
    if tuple(xh.shape) != (n, b, r):
        raise ValueError(f"xh.shape={tuple(xh.shape)} must be (N, B, r)={(n, b, r)}")
    if tuple(prev_ids.shape) != (n,):
        raise ValueError(f"prev_ids.shape={tuple(prev_ids.shape)} must be (N,)=({n},)")
    if tuple(params["mix"].shape) != (b, b, r):
        raise ValueError(f"params['mix'].shape={tuple(params['mix'].shape)} must be (B, B, r)={(b, b, r)}")
    if base_c.ndim != 2 or base_c.shape[0] != n * max(b - 1, 0) or tuple(cand.shape) != tuple(base_c.shape):
        raise ValueError(f"base_c and cand must both be [N*(B-1), C] = [{n * max(b - 1, 0)}, C]; "
                         f"got {tuple(base_c.shape)=} {tuple(cand.shape)=}")
    if base_c.shape[1] < 1:
        raise ValueError(f"base_c.shape={tuple(base_c.shape)}: need C >= 1 candidates")
    cd = jnp.dtype(w1.dtype)
    for name, x in (("xh", xh), ("base_c", base_c), ("w2", params["w2"])):
        if jnp.dtype(x.dtype) != cd:
            raise TypeError(f"{name}.dtype={jnp.dtype(x.dtype)} must equal the params' dtype {cd}")
    blk0 = blk0.astype(jnp.int32)
    if n == 0 or b < 2 or num_passes == 0:
        return blk0
    if cd == jnp.float64:
        return reference(params, xh, blk0, prev_ids, base_c, cand, num_passes=num_passes)
    cfg = config if config is not None else default_config(n, b, cd)
    return _passes_pallas(
        blk0, prev_ids, xh, w1, params["in_proj_token"], params["mix"], params["mlp_gate"], params["mlp_up"],
        params["mlp_down"], params["w2"], base_c, cand, num_passes=num_passes, cfg=cfg, interpret=bool(interpret))
