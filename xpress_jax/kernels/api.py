"""Picks the kernel implementation of each refine step (`ops`), as `xpress_jax.refine` consumes it.

The ops object has the static methods of `xpress_jax.refine._JnpOps` (the jnp
oracle): ``latent_pass``, ``full_vocab_pick``, ``select_candidates``,
``topc_prepare``, ``topc_pick``. Each is a Pallas-Triton kernel here, with
block configs chosen from the shapes (static at trace time) by the measurements
in benchmarks/RESULTS.md. Float64 inputs fall back to the jnp oracle inside
each kernel wrapper.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from . import full_vocab, latent, select, topc_pick
from .common import gpu_supported

__all__ = ["ops", "gpu_supported", "full_vocab_config", "topc_config"]

#: Full-vocab pick configs by draft-row count (upper bound of the bucket): the fastest agreeing
#: configs of dev_pick_sweep (a removed script; RESULTS.md "Full-vocab pick") on an H200 (2026-11-30), all the fused readout-matmul +
#: add/argmax kernel (the bias never reaches HBM) with the lazy epilogue (elementwise running best,
#: one lane reduction per program). v_steps sizes the grid in whole waves of 132 programs at
#: N = 16 / 64 / 256 (1 / 12 / 5 waves). One pass's pick at N = 1 / 4 / 16 / 64 / 256:
#: 31.8 / 40.5 / 71.2 / 263.0 / 873.2 µs (eager epilogue, earlier grids: 33.1 / 42.6 / 87.5 / 311.1 / 1082.5).
_FULL_VOCAB_TABLE = (
    (15, dict(row_tile=16, v_tile=128, v_steps=3, k_tile=64, num_warps=4, num_stages=4, hold_lat=False,
              flat=True, prefetch_base=True, lazy=True)),
    (60, dict(row_tile=64, v_tile=64, v_steps=6, k_tile=64, num_warps=4, num_stages=4, hold_lat=False,
              flat=True, prefetch_base=True, lazy=True)),
    (240, dict(row_tile=128, v_tile=64, v_steps=36, k_tile=0, num_warps=8, num_stages=3, hold_lat=True,
               prefetch_base=True, lazy=True)),
    (960, dict(row_tile=128, v_tile=64, v_steps=12, k_tile=0, num_warps=8, num_stages=3, hold_lat=True,
               prefetch_base=True, lazy=True)),
    (None, dict(row_tile=128, v_tile=64, v_steps=108, k_tile=0, num_warps=8, num_stages=3, hold_lat=True,
                prefetch_base=True, lazy=True)),
)


def full_vocab_config(rows: int, vocab: int, rank: int, dtype) -> full_vocab.FullVocabConfig:
    """The config for the full-vocab pick at these shapes (16-bit dtypes: the measured table).

    Any rank, vocab and row count: the kernel masks rank, vocab and row tails; a table config
    whose shared memory would not fit at this rank (ranks well above 256) is shrunk by
    `full_vocab.fit_shared_memory`. The result always passes `FullVocabConfig.check_shape`.
    """
    import jax.numpy as jnp

    if jnp.dtype(dtype).itemsize > 2:  # float32 (exactness runs): the kernel's own heuristic
        cfg = full_vocab.default_config(rows, vocab, rank, dtype)
    else:
        kw = next(kw for limit, kw in _FULL_VOCAB_TABLE if limit is None or rows <= limit)
        cfg = full_vocab.fit_shared_memory(full_vocab.FullVocabConfig(**kw), rank, dtype)
    cfg.check_shape(rows, vocab, rank, dtype)
    return cfg


#: Up to this many blocks XLA's fused latent (jnp) beats the split kernel (dev_latent, removed; RESULTS.md "Latent pass"; H200:
#: N=1 -0.7 vs 1.9 µs net, N=4 0.8 vs 3.5; from N=16 on the kernel wins: 6.8 vs 8.5).
LATENT_XLA_MAX_N = 4


def topc_config(rows: int, c: int, rank: int, dtype) -> topc_pick.TopCConfig:
    """Top-C pick config: 128-candidate tiles, 64-wide rank chunks, 8 warps (best at N=1..256 on an H200)."""
    d = topc_pick.default_config(rows, c, rank, dtype)
    cfg = dataclasses.replace(d, c_tile=128, c_steps=max(1, d.c_steps // 2), k_tile=64, num_warps=8)
    cfg.check_shape(rows, c, rank, dtype)
    return cfg


@functools.lru_cache(maxsize=None)
def ops(*, interpret: bool = False, steps: tuple[str, ...] | None = None):
    """The ops class; ``steps`` (names from `xpress_jax.refine.KERNEL_STEPS`) limits which run as kernels."""
    from xpress_jax.refine import _JnpOps

    cls = _pallas_ops(interpret)
    if steps is None:
        return cls
    table = {"latent": ("latent_pass",),
             "pick": ("full_vocab_pick", "full_vocab_pick_logits", "topc_prepare", "topc_pick"),
             "select": ("select_candidates", "select_candidates_logits")}
    chosen = {m: getattr(cls, m) for step in steps for m in table[step]}
    return type(f"PallasOps[{'+'.join(steps)}]", (_JnpOps,), {"name": f"{cls.name}:{'+'.join(steps)}", **chosen})


@functools.lru_cache(maxsize=None)
def _pallas_ops(interpret: bool):
    from xpress_jax.refine import _JnpOps

    class PallasOps(_JnpOps):
        name = "pallas-interpret" if interpret else "pallas"

        @staticmethod
        def full_vocab_pick(base, lat, w2):
            cfg = full_vocab_config(base.shape[0], base.shape[1], lat.shape[1], base.dtype)
            return full_vocab.full_vocab_pick(base, lat, w2, config=cfg, interpret=interpret)

        @staticmethod
        def full_vocab_pick_logits(logits, lat, w2):
            N, B, V = logits.shape
            cfg = full_vocab_config(lat.shape[0], V, lat.shape[1], logits.dtype)
            return full_vocab.full_vocab_pick(logits.reshape(N * B, V), lat, w2, config=cfg,
                                              interpret=interpret, slot_stride=B)

        @staticmethod
        def select_candidates(base, c, slot_stride=0):
            # 16-element blocks measured faster than 32 at 240 and 3840 rows (dev_select, removed; RESULTS.md "Top-C selection"; H200).
            rows = base.shape[0] // slot_stride * (slot_stride - 1) if slot_stride else base.shape[0]
            kw = dict(block=16) if rows >= 240 else {}
            return select.select_candidates(base, c, interpret=interpret, slot_stride=slot_stride, **kw)

        @classmethod
        def select_candidates_logits(cls, logits, c):
            # The draft rows of the whole logits, read in place (slot_stride): no logits[:, 1:] copy.
            # H200, top-512 refine: N=64 1174 -> 999 µs, N=256 3856 -> 3145 µs against selecting on
            # the copy, same tokens (dev_variants "pallas-select-copy", removed; RESULTS.md).
            N, B, V = logits.shape
            return cls.select_candidates(logits.reshape(N * B, V), c, slot_stride=B)

        @staticmethod
        def latent_pass(params, xh, blk, prev_ids):
            if blk.shape[0] <= LATENT_XLA_MAX_N and not interpret:  # interpret (tests) always runs the kernel
                return _JnpOps.latent_pass(params, xh, blk, prev_ids)
            return latent.latent_pass(params, xh, blk, prev_ids, interpret=interpret)

        @staticmethod
        def topc_prepare(w2, cand):
            # The pick kernel gathers the candidates' rows from w2 itself (float64: the jnp w2[cand]).
            return _JnpOps.topc_prepare(w2, cand) if w2.dtype == jnp.float64 else w2

        @staticmethod
        def topc_pick(base_c, cand, lat, prepared):
            if prepared.ndim == 3:  # float64: w2[cand], the jnp path
                return _JnpOps.topc_pick(base_c, cand, lat, prepared)
            cfg = topc_config(base_c.shape[0], base_c.shape[1], lat.shape[1], base_c.dtype)
            return topc_pick.topc_pick(base_c, cand, lat, prepared, config=cfg, interpret=interpret)

    return PallasOps
