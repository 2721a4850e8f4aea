"""Picks the kernel implementation of each refine step (`ops`), as `xpress_jax.refine` consumes it.

The ops object has the same four static methods as `xpress_jax.refine._JnpOps`
(the jnp oracle): ``latent_pass``, ``full_vocab_pick``, ``select_candidates``,
``topc_pick``. Each is the Pallas kernel when one is registered here, else the
jnp reference.
"""

from __future__ import annotations

import functools

from .common import gpu_supported

__all__ = ["ops", "gpu_supported"]


@functools.lru_cache(maxsize=None)
def ops(*, interpret: bool = False):
    from xpress_jax.refine import _JnpOps

    class PallasOps(_JnpOps):
        name = "pallas-interpret" if interpret else "pallas"

    return PallasOps
