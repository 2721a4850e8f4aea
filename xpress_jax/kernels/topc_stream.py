"""Top-C pick over vocab-sorted (row, candidate) pairs: ``w2`` read about once per pass, whatever the row count.

The same tokens as `topc_pick.topc_pick` (the top-C rule: the largest ``s = float(dtype(base_c + dtype(bias)))``,
NaN as -inf, then the larger base logit, then the lowest vocab id), with the bias summed in the same order.

- `prepare` (once per call): the ``P = rows * C`` pairs sorted by vocab id (stable: equal ids keep their pair
  order), as ``order`` (each sorted pair's flat index ``row * C + j``) and ``ids`` (its vocab id), [P] int32 each.
- `topc_stream_pick` (each pass): the bias kernel, a program per ``p_tile`` consecutive sorted pairs: it gathers
  their w2 rows (ascending ids: neighbouring programs read neighbouring rows, each row leaves HBM about once) and
  their rows' latents (``lat`` is small and stays in L2), sums each bias in float32 over the rank in ``k_tile``
  chunks, rounds it to the logits' dtype and stores it at the pair's own place ``order[p]`` of a flat [P] array;
  then the winner kernel reads each row's C biases, base logits and ids in place and keeps the best by the rule.

Exactness: `topc_pick` sums ``jnp.sum(w * x, axis=1)`` over [c_tile, k_tile] blocks, chunk after chunk. The bias
kernel sums [p_tile, k_tile] blocks the same way, so with ``p_tile = c_tile``, the same ``k_tile``, ``num_warps``
and ``num_stages`` (`like_topc`) each bias is the same float32 value, and the tokens are the same.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import common
from .common import BIG, best3, cdiv, iota, k_chunk, merge3, next_pow2, score

__all__ = ["StreamConfig", "StreamPrepared", "like_topc", "prepare", "topc_stream_pick"]


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """Static block sizes (hashable: a jit static arg).

    p_tile: sorted pairs per bias program (power of two). k_tile: rank chunk (power of two; 0 = the whole rank;
    `common.k_chunk`). num_warps, num_stages: the bias kernel's. row_tile, c_tile: the winner kernel's
    [row_tile, c_tile] blocks (powers of two); winner_warps: its warps.
    """

    p_tile: int = 64
    k_tile: int = 0
    num_warps: int = 4
    num_stages: int = 1
    row_tile: int = 16
    c_tile: int = 128
    winner_warps: int = 4

    def check(self) -> None:
        for name in ("p_tile", "row_tile", "c_tile"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        if self.k_tile < 0 or (self.k_tile and self.k_tile & (self.k_tile - 1)):
            raise ValueError(f"k_tile={self.k_tile} must be 0 or a power of two")


def like_topc(c_tile: int, k_tile: int, num_warps: int, num_stages: int) -> StreamConfig:
    """The config whose biases equal those of a `topc_pick.TopCConfig` with these fields (same block shape and
    warps: the same float32 sums)."""
    return StreamConfig(p_tile=c_tile, k_tile=k_tile, num_warps=num_warps, num_stages=num_stages)


class StreamPrepared(NamedTuple):
    """`prepare`'s result: the pairs sorted by vocab id. ``order`` [P] int32: the flat pair index ``row * C + j``
    of each sorted pair; ``ids`` [P] int32: its vocab id (ascending)."""

    order: jax.Array
    ids: jax.Array


@jax.jit
def prepare(cand: jax.Array) -> StreamPrepared:
    """[rows, C] candidate ids -> the pairs sorted by vocab id (stable), once per call."""
    if cand.ndim != 2:
        raise ValueError(f"cand must be [rows, C]; got {cand.shape}")
    flat = cand.reshape(-1).astype(jnp.int32)
    ids, order = jax.lax.sort((flat, jax.lax.iota(jnp.int32, flat.shape[0])), num_keys=1, is_stable=True)
    return StreamPrepared(order=order, ids=ids)


def _bias_kernel(order_ref, ids_ref, lat_ref, w_ref, out_ref, *, p: int, c: int, rank: int, p_tile: int,
                 k_tile: int, dtype, skip_slots: tuple | None):
    """Program i: sorted pairs [i * p_tile, (i+1) * p_tile); out_ref[order[p]] = dtype(w2[ids[p]] . lat[row])."""
    i = pl.program_id(0)
    lane = iota(p_tile)
    ok = i * p_tile + lane < p
    o = plt.load(order_ref.at[pl.ds(i * p_tile, p_tile)], mask=ok, other=0)
    ids = jnp.where(ok, plt.load(ids_ref.at[pl.ds(i * p_tile, p_tile)], mask=ok, other=0), 0)
    row = jnp.where(ok, o // c, 0)
    if skip_slots is not None:  # rows of the final slots: no load, no store
        per, first = skip_slots
        ok = ok & (row % per >= first)
    acc = jnp.zeros((p_tile,), jnp.float32)
    for kk in range(cdiv(rank, k_tile)):  # static: the rank is small (256); the tail chunk masked
        kc = kk * k_tile + iota(k_tile)
        m = ok[:, None] & (kc < rank)[None, :]
        w = plt.load(w_ref.at[ids[:, None], kc[None, :]], mask=m, other=0.0)  # [p_tile, k_tile] row gather
        x = plt.load(lat_ref.at[row[:, None], kc[None, :]], mask=m, other=0.0)  # the pairs' latents
        acc = acc + jnp.sum(w.astype(jnp.float32) * x.astype(jnp.float32), axis=1)
    # Masked lanes store to their own slot past the P pairs: never two lanes of one store at one address.
    pos = jnp.where(ok, o, p + lane)
    plt.store(out_ref.at[pos], acc.astype(dtype), mask=ok)


def _winner_kernel(bias_ref, base_ref, cand_ref, *refs, m_rows: int, c: int, row_tile: int, c_tile: int, dtype,
                   has_rows: bool, sampled: bool):
    """Program i: output rows [i * row_tile, ...): each (input row ``rows_ref[q]`` or q) row's winner over its C
    candidates, in [row_tile, c_tile] blocks. ``sampled``: the operands end with seeds [rows] int32 and inv_t [1]
    float32, and the score of the rule is the sampling key (`common.sample_key`)."""
    refs = list(refs)
    rows_ref = refs.pop(0) if has_rows else None
    seeds_ref, inv_t_ref = (refs.pop(0), refs.pop(0)) if sampled else (None, None)
    (o_ref,) = refs
    q = pl.program_id(0) * row_tile + iota(row_tile)
    qok = q < m_rows
    src = jnp.where(qok, plt.load(rows_ref.at[q], mask=qok, other=0), 0) if has_rows else jnp.where(qok, q, 0)
    if sampled:
        seed = plt.load(seeds_ref.at[src], mask=qok, other=0)
        inv_t = inv_t_ref[0]

    def step(t, carry):
        cc = t * c_tile + iota(c_tile)
        ok = qok[:, None] & (cc < c)[None, :]
        idx = (src[:, None], cc[None, :])
        bias = plt.load(bias_ref.at[src[:, None] * c + cc[None, :]], mask=ok, other=0.0)
        b = plt.load(base_ref.at[idx], mask=ok, other=0.0)
        ids = plt.load(cand_ref.at[idx], mask=ok, other=0)
        s = jnp.where(ok, score(b, bias, dtype), -jnp.inf)
        if sampled:
            s = jnp.where(ok, common.sample_key(s, inv_t, common.gumbel(seed[:, None], ids)), -jnp.inf)
        bf = b.astype(jnp.float32)
        bf = jnp.where(ok & (bf == bf), bf, -jnp.inf)  # NaN base (and masked lanes) rank as -inf
        return merge3(*carry, *best3(s, bf, jnp.where(ok, ids, BIG), axis=1))

    init = (jnp.full((row_tile,), -jnp.inf, jnp.float32), jnp.full((row_tile,), -jnp.inf, jnp.float32),
            jnp.full((row_tile,), BIG, jnp.int32))
    n_t = cdiv(c, c_tile)
    _, _, bidx = step(0, init) if n_t == 1 else jax.lax.fori_loop(0, n_t, step, init)
    o_ref[...] = bidx


@functools.partial(jax.jit, static_argnames=("interpret", "config", "skip_slots"))
def topc_stream_pick(
    base_c: jax.Array,
    cand: jax.Array,
    lat: jax.Array,
    w2: jax.Array,
    prepared: StreamPrepared | None = None,
    *,
    interpret: bool = False,
    config: StreamConfig | None = None,
    lat_add: jax.Array | None = None,
    row_ids: jax.Array | None = None,
    skip_slots: tuple[int, int] | None = None,
    seeds: jax.Array | None = None,
    inv_t: jax.Array | None = None,
) -> jax.Array:
    """[rows,C], [rows,C] int, [rows,r], [V,r] -> [rows] int32: `topc_pick.topc_pick`'s tokens.

    ``prepared``: `prepare` (cand) (None: sorted here; pass it to sort once for many passes).
    ``lat_add`` ([rows, r] float32, with ``lat`` float32): the latent is ``round(lat + lat_add)`` to the logits'
    dtype (`xpress_jax.reference.LatentSum`), formed once per pass in XLA (the same values).
    ``row_ids`` ([M] int32 in [0, rows)): the winners of these rows only, in this order.
    ``skip_slots`` (static ``(slots, s)``): rows with ``row % slots < s`` are not scored (a pass whose first s
    draft slots of each block are final); ``row_ids`` must then hold none of them (their winners are unspecified).
    ``seeds`` ([rows] int32, by input row) and ``inv_t`` (float32 scalar, 1 / T; 0 = greedy): the sampled pick,
    `topc_pick.topc_pick`'s with the same ``seeds`` (the top-C rule on the key ``s * inv_t + gumbel(seed, id)``).
    """
    if base_c.ndim != 2 or cand.shape != base_c.shape or lat.ndim != 2 or lat.shape[0] != base_c.shape[0]:
        raise ValueError(f"need base_c [rows,C], cand [rows,C], lat [rows,r]; got {base_c.shape=} {cand.shape=} "
                         f"{lat.shape=}")
    rows, c = base_c.shape
    rank = lat.shape[1]
    dtype = jnp.dtype(base_c.dtype)
    if w2.ndim != 2 or w2.shape[1] != rank:
        raise ValueError(f"w2 must be [V, {rank}]; got {w2.shape}")
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise TypeError(f"top-C stream pick: dtype {dtype.name} not supported (bf16, f16, f32)")
    if w2.dtype != dtype:
        raise ValueError(f"dtypes must agree: {base_c.dtype=} {w2.dtype=}")
    if lat_add is not None:
        if lat_add.shape != lat.shape or lat.dtype != jnp.float32 or lat_add.dtype != jnp.float32:
            raise ValueError(f"lat_add needs lat and lat_add both float32 [rows, r]; got {lat.shape} {lat.dtype}, "
                             f"{lat_add.shape} {lat_add.dtype}")
        # The barrier keeps the sum a fusion of its own (the two terms' producers never fold the rounding in).
        u, d = jax.lax.optimization_barrier((lat, lat_add))
        lat = (u + d).astype(dtype)
    elif lat.dtype != dtype:
        raise ValueError(f"dtypes must agree: {base_c.dtype=} {lat.dtype=}")
    if rows < 1 or c < 1 or rank < 1:
        raise ValueError(f"top-C stream pick needs rows, C, r >= 1; got {rows}, {c}, {rank}")
    if row_ids is not None and (row_ids.ndim != 1 or row_ids.shape[0] < 1 or row_ids.dtype != jnp.int32):
        raise ValueError(f"row_ids must be [M >= 1] int32; got {row_ids.shape} {row_ids.dtype}")
    if skip_slots is not None and (len(skip_slots) != 2 or not 0 <= skip_slots[1] < skip_slots[0]):
        raise ValueError(f"skip_slots must be (slots, s) with 0 <= s < slots; got {skip_slots!r}")
    cfg = config or StreamConfig()
    cfg.check()
    if prepared is None:
        prepared = prepare(cand)
    p = rows * c
    if prepared.order.shape != (p,) or prepared.ids.shape != (p,):
        raise ValueError(f"prepared must be prepare(cand) of these {rows}x{c} candidates; got "
                         f"{prepared.order.shape}, {prepared.ids.shape}")
    noise = None
    if seeds is not None or inv_t is not None:
        common.check_noise(seeds, inv_t, None, rows, "input row")
        noise = (seeds.astype(jnp.int32), jnp.reshape(jnp.asarray(inv_t, jnp.float32), (1,)))
    bias = _biases(prepared, lat, w2, c=c, cfg=cfg, dtype=dtype, interpret=interpret, skip_slots=skip_slots)
    return _winners(bias, base_c, cand.astype(jnp.int32), row_ids, cfg=cfg, dtype=dtype, interpret=interpret,
                    noise=noise)


def _biases(prepared, lat, w2, *, c, cfg, dtype, interpret, skip_slots):
    """The bias kernel's launch: [P + p_tile] in ``dtype``, pair (row, j) at ``row * C + j``."""
    p = prepared.order.shape[0]
    rank = lat.shape[1]
    kernel = functools.partial(_bias_kernel, p=p, c=c, rank=rank, p_tile=cfg.p_tile,
                               k_tile=k_chunk(cfg.k_tile, rank), dtype=dtype, skip_slots=skip_slots)
    return common.pallas_call(
        kernel, name="xpress_topc_stream_bias", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        interpret=interpret, grid=(cdiv(p, cfg.p_tile),), in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.no_block_spec, out_shape=jax.ShapeDtypeStruct((p + cfg.p_tile,), dtype),
    )(prepared.order, prepared.ids, lat, w2)


def _winners(bias, base_c, cand, row_ids, *, cfg, dtype, interpret, noise=None):
    """The winner kernel's launch: [M] int32 (M = len(row_ids), else rows); blocks of row_tile, the last padded.
    ``noise``: (seeds, inv_t [1]) of the sampled pick."""
    rows, c = base_c.shape
    m_rows = rows if row_ids is None else row_ids.shape[0]
    c_tile = min(cfg.c_tile, next_pow2(c))
    row_tile = min(cfg.row_tile, next_pow2(m_rows))
    operands = (bias, base_c, cand) + (() if row_ids is None else (row_ids,)) + (noise or ())
    kernel = functools.partial(_winner_kernel, m_rows=m_rows, c=c, row_tile=row_tile, c_tile=c_tile, dtype=dtype,
                               has_rows=row_ids is not None, sampled=noise is not None)
    grid = cdiv(m_rows, row_tile)
    out = common.pallas_call(
        kernel, name="xpress_topc_stream_winner", num_warps=cfg.winner_warps, interpret=interpret,
        grid=(grid,), in_specs=[pl.no_block_spec] * len(operands),
        out_specs=pl.BlockSpec((row_tile,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((grid * row_tile,), jnp.int32),
    )(*operands)
    return out if grid * row_tile == m_rows else out[:m_rows]
