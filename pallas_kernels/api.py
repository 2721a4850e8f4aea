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

from . import full_vocab, latent, select, topc_pick
from .common import gpu_supported

__all__ = ["ops", "gpu_supported", "full_vocab_config", "topc_config"]

#: From this many draft rows on, the fused readout-matmul + argmax kernel is used in
#: full-vocab mode; below it the XLA dot + Pallas add/argmax kernel (dev_pick, H200).
FUSED_MIN_ROWS = 2048


def full_vocab_config(rows: int, vocab: int, rank: int, dtype) -> tuple[str, full_vocab.FullVocabConfig]:
    """(variant, config) for the full-vocab pick at these shapes."""
    if rows < FUSED_MIN_ROWS:
        return "add_argmax", full_vocab.default_config(rows, vocab, rank, dtype, "add_argmax")
    row_tile = 64
    programs = -(-rows // row_tile) * -(-vocab // 128)
    v_steps = 1
    while v_steps < 16 and programs // (2 * v_steps) >= 1024:
        v_steps *= 2
    return "fused", full_vocab.FullVocabConfig(row_tile=row_tile, v_tile=128, v_steps=v_steps, k_tile=128,
                                               num_warps=8, num_stages=2, hold_lat=False)


def topc_config(rows: int, c: int, rank: int, dtype) -> topc_pick.TopCConfig:
    """Top-C pick config: 128-candidate tiles, 64-wide rank chunks, 8 warps (best at N=1..256 on an H200)."""
    d = topc_pick.default_config(rows, c, rank, dtype)
    return dataclasses.replace(d, c_tile=128, c_steps=max(1, d.c_steps // 2), k_tile=64, num_warps=8)


@functools.lru_cache(maxsize=None)
def ops(*, interpret: bool = False, steps: tuple[str, ...] | None = None):
    """The ops class; ``steps`` (names from `xpress_jax.refine.KERNEL_STEPS`) limits which run as kernels."""
    from xpress_jax.refine import _JnpOps

    cls = _pallas_ops(interpret)
    if steps is None:
        return cls
    table = {"latent": ("latent_pass",), "pick": ("full_vocab_pick", "topc_prepare", "topc_pick"),
             "select": ("select_candidates",)}
    chosen = {m: getattr(cls, m) for step in steps for m in table[step]}
    return type(f"PallasOps[{'+'.join(steps)}]", (_JnpOps,), {"name": f"{cls.name}:{'+'.join(steps)}", **chosen})


@functools.lru_cache(maxsize=None)
def _pallas_ops(interpret: bool):
    from xpress_jax.refine import _JnpOps

    class PallasOps(_JnpOps):
        name = "pallas-interpret" if interpret else "pallas"

        @staticmethod
        def latent_pass(params, xh, blk, prev_ids):
            return latent.latent_pass(params, xh, blk, prev_ids, interpret=interpret)

        @staticmethod
        def full_vocab_pick(base, lat, w2):
            variant, cfg = full_vocab_config(base.shape[0], base.shape[1], lat.shape[1], base.dtype)
            return full_vocab.full_vocab_pick(base, lat, w2, variant=variant, config=cfg, interpret=interpret)

        @staticmethod
        def select_candidates(base, c):
            return select.select_candidates(base, c, interpret=interpret)

        @staticmethod
        def topc_prepare(w2, cand):
            return topc_pick.topc_prepare(w2, cand)

        @staticmethod
        def topc_pick(base_c, cand, lat, prepared):
            cfg = topc_config(base_c.shape[0], base_c.shape[1], lat.shape[1], base_c.dtype)
            return topc_pick.topc_pick(base_c, cand, lat, prepared, config=cfg, interpret=interpret)

    return PallasOps
