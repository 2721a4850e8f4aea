"""Shared Pallas-Triton plumbing: compiler params, interpret switch, CPU lowering check.

Everything Triton-specific lives in this package; `xpress_jax` only sees `api.ops()`.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

__all__ = ["pallas_call", "compiler_params", "lower_triton", "gpu_supported"]

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


def compiler_params(num_warps: int = 4, num_stages: int = 1) -> Any:
    """Always pass these: on JAX 0.10.2 a pallas_call without them lowers to Mosaic GPU."""
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel: Callable, *, name: str, num_warps: int = 4, num_stages: int = 1,
                interpret: bool = False, **kwargs: Any) -> Callable:
    """`pl.pallas_call` with Triton compiler params and a profile name always set."""
    return pl.pallas_call(
        kernel,
        name=name,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        **kwargs,
    )


@functools.lru_cache(maxsize=None)
def gpu_supported() -> bool:
    """True on a CUDA GPU of compute capability >= 8.0 (what the Triton kernels target)."""
    try:
        devs = jax.devices()
    except RuntimeError:
        return False
    if not devs or devs[0].platform != "gpu":
        return False
    cc = getattr(devs[0], "compute_capability", None)
    try:
        return cc is None or float(cc) >= 8.0
    except (TypeError, ValueError):
        return True


def lower_triton(f: Callable, *args: Any, **kwargs: Any):
    """Lower ``jax.jit(f)(*args)`` for CUDA on a CPU-only machine (an H200 as the target).

    Catches kernels that run in interpret mode but would not build on the GPU
    (unimplemented primitives, non-power-of-two blocks, ...). Returns the Lowered.
    """
    def low():
        return jax.jit(f, **kwargs).trace(*args).lower(lowering_platforms=("cuda",))

    if not hasattr(plt, "get_gpu_info"):  # JAX 0.10.x lowers without a GPU
        return low()
    ad = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=ad)
    with jax.sharding.use_abstract_mesh(mesh):
        return low()
