"""Full-vocabulary greedy pick on Pallas Mosaic GPU (Hopper, sm90): TMA + wgmma.

Not dispatched: `xpress_jax.ops` runs the Pallas-Triton pick (`xpress_jax.kernels.full_vocab`) until this kernel is
measured compiled on an H100/H200 against it (`tests/kernels/test_kernel_full_vocab_mosaic.py` checks it in Mosaic
GPU's interpret mode and lowers it for CUDA, JAX >= 0.11).

Computes ``argmax_v float(dtype(base[v] + dtype(lat @ w2[v])))`` per row (the dot accumulated in float32 and
rounded once, the sum formed in float32 and rounded once; NaN ranks as -inf, +inf wins, the lowest vocab id among
equal scores), the spec being `xpress_jax.reference.full_vocab_pick`. Inputs: ``base`` [rows, V], ``lat`` [rows, r],
``w2`` [V, r], all bfloat16 or all float16. The [rows, V] scores are never stored.

Design. One `plgpu.kernel` launch over the grid ``(row tiles, parts)`` (row tiles first, so the CTAs that run
together share the same ``w2`` tiles through L2). A CTA owns a row tile and a *part*: ``v_steps`` consecutive vocab
tiles of ``v_tile`` ids (`_split` picks the parts so the grid fills whole waves of the SMs). It

1. copies its latent tile [row_tile, r] into shared memory once (TMA);
2. streams, per vocab tile, the ``w2`` tile [v_tile, r] and the ``base`` tile [rows, v_tile] by TMA into
   ``stages``-deep shared-memory ring buffers (`plgpu.emit_pipeline`);
3. per tile: ``acc = lat_tile @ w2_tile.T`` on wgmma (the ``w2`` buffer read through a transposed view; float32
   accumulator in registers), then the epilogue, elementwise on the wgmma register layout:
   ``s = float32(dtype(base + dtype(acc)))``, ids >= V set to -inf, and a running best (score, id) per (row, column
   lane): ``s > best`` (NaN never wins; a lane's later tiles hold larger ids, so an equal score keeps the earlier id);
4. after its last tile reduces the lanes once (the row max, then the lowest id holding it) and writes the part's
   (score, id) per row to ``[parts, rows_pad]`` outputs (shared memory, then TMA).

The parts are combined in XLA (`combine_parts`): the largest score, the lowest id among equal ones. A row whose scores
are all -inf or NaN gets id 0, like ``jnp.argmax`` (the running ids start at each lane's first id).

Options (`MosaicFullVocabConfig`): ``eager`` reduces every tile to one (score, id) per row at once (two row
reductions per tile, [row_tile] carries: fewer registers); ``compute_wgs=2`` warp-specializes
(`plgpu.emit_pipeline_warp_specialized`): a memory warpgroup issues the TMA copies and two compute warpgroups each
own ``row_tile`` rows of a ``2 * row_tile``-row CTA tile and share every ``w2`` tile (half the ``w2`` traffic per
row, and one warpgroup's epilogue runs while the other's wgmma does). With one compute warpgroup a tile's epilogue
does not overlap the next tile's wgmma; the TMA copies of the next ``stages - 1`` tiles do.

Shapes. ``r`` must be a multiple of 64 (a 128-byte swizzled row chunk of the wgmma operands) in [64, `MAX_RANK`];
rows >= 1 and V >= 1 are any. ``lat`` is padded to whole row tiles in XLA (rows x r: cheap). The ``base`` tile is
tiled (1, 64) in shared memory (``base_tile_rows=1``), so TMA reads any row count in place, its rows past ``rows``
zero filled (those rows are dropped); its columns must come in whole 64s and ``w2``'s rows in whole 8s (the tiled
TMA views of gmem), so a V that is not a multiple of 64 pads ``base`` (and one not a multiple of 8 ``w2``) in XLA:
a copy, never at V=151936 = 64 x 2374. Ids past V in the last tile are masked; a part shorter than ``v_steps``
tiles re-reads its last tile (clamped index, masked).

Shared memory per CTA (bf16; `smem_bytes`): ``cta_rows*r*2`` (latent) + ``stages*(v_tile*r*2 + cta_rows*v_tile*2)``.
The default (64 rows, v_tile 128, 2 stages) at r=256: 32 KiB + 2 x (64 + 16) KiB = 192 KiB of 227 KiB, one CTA per
SM. Registers (lazy epilogue): the float32 accumulator plus the running best and id, three [row_tile, v_tile]
arrays over 128 threads: 192 per thread at 64 x 128.

Limits: float16/bfloat16 only (a float32 wgmma would be tf32, not the spec's float32 dot); the plain greedy pick
only (no sampling, row maps, active masks or slot strides: those stay with the Pallas-Triton kernel,
`xpress_jax.kernels.full_vocab`). ``interpret=True`` runs the kernel in Mosaic GPU's interpret mode on a CPU (slow;
it checks the kernel's logic, not its lowering).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["MosaicFullVocabConfig", "MAX_RANK", "full_vocab_pick", "full_vocab_parts", "combine_parts",
           "default_config", "smem_bytes"]

_BIG = 2**31 - 1
_SMEM_LIMIT = 227 * 1024  # an H100/H200 CTA's opt-in shared memory
_H100_SMS = 132
#: The largest rank: the latent tile and one w2 tile stay within shared memory at the smallest tiles.
MAX_RANK = 512
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class MosaicFullVocabConfig:
    """Static tile sizes (hashable: a jit static argument).

    row_tile: rows per compute warpgroup (64 or 128: one or two wgmma M blocks).
    v_tile: vocab ids per pipeline step (the wgmma N): 64, 128 or 192.
    stages: depth of the TMA ring buffers (>= 1; 2 double-buffers).
    parts: vocab parts (CTAs per row tile); 0 picks them from ``sms`` so the grid fills whole waves.
    sms: streaming multiprocessors assumed when ``parts`` is 0 (H100 SXM: 132).
    base_tile_rows: the base tile's shared-memory tiling, (base_tile_rows, 64) with the 128-byte swizzle: 1 reads
      any row count in place; 8 (the wgmma operand tiling) needs rows padded to a multiple of 8 (a copy of base).
    compute_wgs: 1: one warpgroup does everything (`plgpu.emit_pipeline`); 2: warp-specialized
      (`plgpu.emit_pipeline_warp_specialized`): a memory warpgroup issues the copies and two compute warpgroups
      each own ``row_tile`` rows of a CTA tile of ``2 * row_tile`` rows, sharing each w2 tile.
    eager: reduce each tile to one (score, id) per row at once (two row reductions per tile, [row_tile] carries)
      instead of keeping a running best per (row, lane) and reducing once per part (fewer registers, more work).
    """

    row_tile: int = 64
    v_tile: int = 128
    stages: int = 2
    parts: int = 0
    sms: int = _H100_SMS
    base_tile_rows: int = 1
    compute_wgs: int = 1
    eager: bool = False

    def check(self, rank: int) -> None:
        if self.row_tile not in (64, 128):
            raise ValueError(f"row_tile={self.row_tile} must be 64 or 128")
        if self.v_tile not in (64, 128, 192):  # 256 (a legal wgmma N) takes minutes to lower in JAX 0.11.2
            raise ValueError(f"v_tile={self.v_tile} must be 64, 128 or 192")
        if self.stages < 1:
            raise ValueError(f"stages={self.stages} must be >= 1")
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"compute_wgs={self.compute_wgs} must be 1 or 2")
        if self.base_tile_rows not in (1, 8):
            raise ValueError(f"base_tile_rows={self.base_tile_rows} must be 1 or 8")
        if self.parts < 0 or self.sms < 1:
            raise ValueError(f"parts={self.parts} must be >= 0 and sms={self.sms} >= 1")
        need = smem_bytes(self, rank)
        if need > _SMEM_LIMIT:
            raise ValueError(f"{self} at rank={rank} needs {need // 1024} KiB of shared memory per CTA, more than "
                             f"the {_SMEM_LIMIT // 1024} KiB of an H100/H200 (lower stages or v_tile)")


def smem_bytes(cfg: MosaicFullVocabConfig, rank: int, itemsize: int = 2) -> int:
    """Shared memory of one CTA: the latent tiles, the ring buffers, the part's outputs and barriers (estimate)."""
    cta_rows = cfg.row_tile * cfg.compute_wgs
    ring = cfg.stages * (cfg.v_tile * rank + cta_rows * cfg.v_tile) * itemsize
    return cta_rows * rank * itemsize + ring + cta_rows * 8 + 1024


def default_config(rows: int, vocab: int, rank: int) -> MosaicFullVocabConfig:
    """The H100 defaults, with fewer stages where the rank would overflow shared memory."""
    cfg = MosaicFullVocabConfig()
    while cfg.stages > 1 and smem_bytes(cfg, rank) > _SMEM_LIMIT:
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    if smem_bytes(cfg, rank) > _SMEM_LIMIT:
        cfg = dataclasses.replace(cfg, v_tile=64)
    return cfg


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(cfg: MosaicFullVocabConfig, row_tiles: int, v_tiles: int) -> tuple[int, int]:
    """(parts, v_steps): ``v_tiles`` vocab tiles cut into parts of ``v_steps`` tiles each (the last may be short).

    ``cfg.parts`` = 0: the fewest parts whose grid (row_tiles x parts CTAs, one CTA per SM at the default shared
    memory) fills at least 90% of its last wave of ``cfg.sms`` CTAs, or else the best fill up to 8 waves."""
    if cfg.parts:
        parts = min(cfg.parts, v_tiles)
    else:
        best, parts = -1.0, 1
        lo = min(v_tiles, max(1, _cdiv(cfg.sms, row_tiles)))  # a small vocabulary: one tile per part
        for p in range(lo, min(v_tiles, max(lo, _cdiv(8 * cfg.sms, row_tiles))) + 1):
            ctas = row_tiles * p
            fill = ctas / (_cdiv(ctas, cfg.sms) * cfg.sms)
            if fill > best + 1e-9:
                best, parts = fill, p
            if fill >= 0.9:
                break
    v_steps = _cdiv(v_tiles, parts)
    return _cdiv(v_tiles, v_steps), v_steps


def _operand_transforms(dtype):
    """Tiling (8 rows x 128 bytes) and the 128-byte swizzle: the shared-memory form of a wgmma operand."""
    swizzle = 128
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _epilogue(acc, base_smem, v0, carry, *, vocab, dtype, eager):
    """One vocab tile's scores folded into the running best. ``acc``: the float32 [m, v_tile] dot (wgmma layout),
    ``base_smem``: the [m, v_tile] base tile, ``v0``: the tile's first vocab id (ids >= V are masked)."""
    layout = plgpu.Layout.WGMMA
    m, v_tile = acc.shape
    b = plgpu.load(base_smem, layout=layout).astype(jnp.float32)
    s = (b + acc.astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    cols = v0 + plgpu.broadcasted_iota(jnp.int32, (m, v_tile), 1, layout=layout)
    best, bid = carry
    if eager:  # per row: the tile's max and its lowest id, merged into [m] carries
        s = jnp.where((cols < vocab) & (s == s), s, -jnp.inf)  # NaN as -inf before the max
        tmax = jnp.max(s, axis=1)
        tid = jnp.min(jnp.where(s == lax.broadcast_in_dim(tmax, s.shape, [0]), cols, _BIG), axis=1)
        take = tmax > best  # later tiles hold larger ids: an equal max keeps the earlier id
        return jnp.where(take, tmax, best), jnp.where(take, tid, bid)
    s = jnp.where(cols < vocab, s, -jnp.inf)
    better = s > best  # per (row, lane); NaN compares false: never taken
    return jnp.where(better, s, best), jnp.where(better, cols, bid)


def _init_carry(m, v_tile, first_id, eager):
    """The running best before the first tile: -inf at each lane's (or row's) lowest id of the part, so a row
    with no finite score ends at the part's first id (``jnp.argmax`` of all -inf: id 0)."""
    layout = plgpu.Layout.WGMMA
    if eager:
        row = layout.reduce(1)
        return (plgpu.layout_cast(jnp.full((m,), -jnp.inf, jnp.float32), row),
                plgpu.layout_cast(jnp.full((m,), first_id, jnp.int32), row))
    lanes = plgpu.broadcasted_iota(jnp.int32, (m, v_tile), 1, layout=layout)
    return plgpu.layout_cast(jnp.full((m, v_tile), -jnp.inf, jnp.float32), layout), first_id + lanes


def _finish(carry, val_smem, id_smem, val_out, id_out, eager):
    """The part's winner per row (the largest score, its lowest id) written to ``val_out``/``id_out`` (gmem)."""
    best, bid = carry
    if eager:
        m, k = best, bid
    else:
        m = jnp.max(best, axis=1)
        k = jnp.min(jnp.where(best == lax.broadcast_in_dim(m, best.shape, [0]), bid, _BIG), axis=1)
    val_smem[...] = m
    id_smem[...] = k
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(val_smem, val_out)
    plgpu.copy_smem_to_gmem(id_smem, id_out)
    plgpu.wait_smem_to_gmem(0)


def _in_specs(cfg, rank, dtype, rt, first, v_tiles, cta_rows):
    """The pipelined operands: the w2 tile [v_tile, r] (the wgmma operand tiling) and the base tile
    [cta_rows, v_tile]. The tile index is clamped to the last tile: a short last part re-reads it, masked."""
    base_transforms = (plgpu.TilingTransform((cfg.base_tile_rows, 64)), plgpu.SwizzleTransform(128))
    tile = lambda t: jnp.minimum(first + t, v_tiles - 1)  # noqa: E731
    return [
        plgpu.BlockSpec((cfg.v_tile, rank), lambda t: (tile(t), 0), transforms=_operand_transforms(dtype)),
        plgpu.BlockSpec((cta_rows, cfg.v_tile), lambda t: (rt, tile(t)), transforms=base_transforms),
    ]


def _kernel(base_ref, lat_ref, w2_ref, val_ref, id_ref, lat_smem, val_smem, id_smem, bar, *, cfg, vocab, v_steps,
            v_tiles):
    """One compute warpgroup: `plgpu.emit_pipeline` (TMA ring buffers), wgmma and the epilogue in turn."""
    row_tile, v_tile, eager = cfg.row_tile, cfg.v_tile, cfg.eager
    dtype = base_ref.dtype
    rt = lax.axis_index("rt")
    part = lax.axis_index("part")
    r0 = rt * row_tile
    first = part * v_steps  # this part's first vocab tile

    plgpu.copy_gmem_to_smem(lat_ref.at[pl.ds(r0, row_tile)], lat_smem, bar)
    plgpu.barrier_wait(bar)

    def step(idx, w2_smem, base_smem, carry):
        def mma(acc_ref):
            plgpu.wgmma(acc_ref, lat_smem, w2_smem.transpose((1, 0)))
            return acc_ref[...]  # waits for the wgmma

        acc = pl.run_scoped(mma, plgpu.ACC((row_tile, v_tile), jnp.float32))
        return _epilogue(acc, base_smem, (first + idx[0]) * v_tile, carry, vocab=vocab, dtype=dtype, eager=eager)

    pipeline = plgpu.emit_pipeline(
        step,
        grid=(v_steps,),
        in_specs=_in_specs(cfg, lat_ref.shape[1], dtype, rt, first, v_tiles, row_tile),
        max_concurrent_steps=cfg.stages,
        init_carry=_init_carry(row_tile, v_tile, first * v_tile, eager),
    )
    carry = pipeline(w2_ref, base_ref)
    rows = pl.ds(r0, row_tile)
    _finish(carry, val_smem, id_smem, val_ref.at[part, rows], id_ref.at[part, rows], eager)


def _kernel_ws(base_ref, lat_ref, w2_ref, val_ref, id_ref, lat_smem, val_smem, id_smem, bar, *, cfg, vocab, v_steps,
               v_tiles):
    """Warp-specialized: a memory warpgroup issues the TMA copies; ``compute_wgs`` compute warpgroups each own
    ``row_tile`` rows of the CTA's tile and share every w2 tile, so one's epilogue overlaps another's wgmma."""
    row_tile, v_tile, eager, wgs = cfg.row_tile, cfg.v_tile, cfg.eager, cfg.compute_wgs
    dtype = base_ref.dtype
    rt = lax.axis_index("rt")
    part = lax.axis_index("part")
    wg = lax.axis_index("wg")
    r0 = rt * (row_tile * wgs)
    first = part * v_steps
    my_rows = pl.ds(wg * row_tile, row_tile)

    def step(idx, w2_smem, base_smem, carry):
        def mma(acc_ref):
            plgpu.wgmma(acc_ref, lat_smem.at[wg], w2_smem.transpose((1, 0)))
            return acc_ref[...]

        acc = pl.run_scoped(mma, plgpu.ACC((row_tile, v_tile), jnp.float32))
        return _epilogue(acc, base_smem.at[my_rows], (first + idx[0]) * v_tile, carry, vocab=vocab, dtype=dtype,
                         eager=eager)

    def compute_context(run):
        plgpu.copy_gmem_to_smem(lat_ref.at[pl.ds(r0 + wg * row_tile, row_tile)], lat_smem.at[wg], bar.at[wg])
        plgpu.barrier_wait(bar.at[wg])
        carry = run(_init_carry(row_tile, v_tile, first * v_tile, eager))
        rows = pl.ds(r0 + wg * row_tile, row_tile)
        _finish(carry, val_smem.at[wg], id_smem.at[wg], val_ref.at[part, rows], id_ref.at[part, rows], eager)

    pipeline = plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(v_steps,),
        memory_registers=40,
        in_specs=_in_specs(cfg, lat_ref.shape[1], dtype, rt, first, v_tiles, row_tile * wgs),
        max_concurrent_steps=cfg.stages,
        wg_axis="wg",
        num_compute_wgs=wgs,
        compute_context=compute_context,
    )
    pipeline(w2_ref, base_ref)


def _check(base, lat, w2, cfg):
    if base.ndim != 2 or lat.ndim != 2 or w2.ndim != 2:
        raise ValueError(f"need base [rows, V], lat [rows, r], w2 [V, r]; got {base.shape}, {lat.shape}, {w2.shape}")
    rows, vocab = base.shape
    rank = lat.shape[1]
    if lat.shape[0] != rows or w2.shape != (vocab, rank):
        raise ValueError(f"shapes disagree: base {base.shape}, lat {lat.shape}, w2 {w2.shape}")
    dtype = jnp.dtype(base.dtype)
    if dtype not in _DTYPES or lat.dtype != dtype or w2.dtype != dtype:
        raise TypeError(f"the Mosaic GPU pick takes bfloat16 or float16 base, lat and w2 (one dtype); got "
                        f"{base.dtype}, {lat.dtype}, {w2.dtype}")
    if rows < 1 or vocab < 1:
        raise ValueError(f"need rows >= 1 and V >= 1, got {rows}, {vocab}")
    if rank % 64 or not 64 <= rank <= MAX_RANK:
        raise ValueError(f"the Mosaic GPU pick needs the rank r to be a multiple of 64 in [64, {MAX_RANK}] "
                         f"(128-byte swizzled wgmma operands); got r={rank}")
    cfg.check(rank)
    return rows, vocab, rank, dtype


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def full_vocab_parts(base: jax.Array, lat: jax.Array, w2: jax.Array, *, config: MosaicFullVocabConfig | None = None,
                     interpret: bool = False):
    """Stage 1 alone: each part's winner, ``(score [parts, rows_pad] float32, id [parts, rows_pad] int32)``
    (rows_pad: rows rounded up to whole row tiles; the padded rows hold no meaning)."""
    rows, vocab, rank = base.shape[0], base.shape[1], lat.shape[1]
    cfg = config or default_config(rows, vocab, rank)
    rows, vocab, rank, dtype = _check(base, lat, w2, cfg)
    cta_rows = cfg.row_tile * cfg.compute_wgs
    row_tiles = _cdiv(rows, cta_rows)
    rows_pad = row_tiles * cta_rows
    v_tiles = _cdiv(vocab, cfg.v_tile)
    parts, v_steps = _split(cfg, row_tiles, v_tiles)
    if rows_pad != rows:
        lat = jnp.pad(lat, ((0, rows_pad - rows), (0, 0)))
    # The tiled TMA views of gmem need whole tiles: base's columns in 64s (and base's rows in 8s when
    # base_tile_rows=8), w2's rows in 8s. Padding copies the array: never at V=151936 (64 x 2374).
    pad_v = -vocab % 64
    pad_r = -rows % cfg.base_tile_rows
    if pad_v or pad_r:
        base = jnp.pad(base, ((0, pad_r), (0, pad_v)))
    if vocab % 8:
        w2 = jnp.pad(w2, ((0, -vocab % 8), (0, 0)))
    transforms = _operand_transforms(dtype)
    wgs = cfg.compute_wgs
    lead = (wgs,) if wgs > 1 else ()
    kw = dict(num_threads=wgs + 1, thread_name="wg") if wgs > 1 else {}
    kernel = plgpu.kernel(
        functools.partial(_kernel_ws if wgs > 1 else _kernel, cfg=cfg, vocab=vocab, v_steps=v_steps,
                          v_tiles=v_tiles),
        out_type=(jax.ShapeDtypeStruct((parts, rows_pad), jnp.float32),
                  jax.ShapeDtypeStruct((parts, rows_pad), jnp.int32)),
        scratch_types=(
            plgpu.SMEM((*lead, cfg.row_tile, rank), dtype, transforms=transforms),
            plgpu.SMEM((*lead, cfg.row_tile), jnp.float32),
            plgpu.SMEM((*lead, cfg.row_tile), jnp.int32),
            plgpu.Barrier(num_arrivals=1, num_barriers=wgs),
        ),
        grid=(row_tiles, parts),
        grid_names=("rt", "part"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="xpress_full_vocab_mosaic",
        **kw,
    )
    return kernel(base, lat, w2)


def combine_parts(val: jax.Array, ids: jax.Array) -> jax.Array:
    """[parts, rows] (score, id) -> [rows] int32: the largest score, the lowest id among equal ones."""
    m = jnp.max(val, axis=0, keepdims=True)
    return jnp.min(jnp.where(val == m, ids, _BIG), axis=0).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def full_vocab_pick(base: jax.Array, lat: jax.Array, w2: jax.Array, *, config: MosaicFullVocabConfig | None = None,
                    interpret: bool = False) -> jax.Array:
    """[rows, V], [rows, r], [V, r] (bf16 or float16) -> [rows] int32: ``argmax_v float(dtype(base +
    dtype(lat @ w2.T)))``, lowest id on ties, NaN as -inf (the module docstring). ``config``: tile sizes (default
    `default_config`); ``interpret``: run in Mosaic GPU's interpret mode (CPU, slow, for tests)."""
    val, ids = full_vocab_parts(base, lat, w2, config=config, interpret=interpret)
    return combine_parts(val, ids)[: base.shape[0]]
