"""XLA compile options for the executables that run `refine`.

On a GPU, XLA runs a refine as a CUDA graph whose kernels it orders one after another by default. With
``xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` it derives the graph's edges from the buffers each
kernel reads and writes, so independent kernels run at once: the same kernels and sums (the same tokens),
faster top-C refines, more temporary memory (docs/performance.md; H200: ``python -m
benchmarks.bench_refine --xla-options both``). `RefineServer` compiles with `compiler_options()`; in your
own jit pass ``compiler_options=xj.compiler_options()`` to the top-level ``jax.jit`` (or set ``XLA_FLAGS=
--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` when refine is part of a larger jitted step).
"""

from __future__ import annotations

import functools
import types
import warnings
from typing import Mapping

import jax
import jax.numpy as jnp

__all__ = ["GPU_COMPILER_OPTIONS", "compiler_options", "check_compiler_options"]

#: What `compiler_options` returns on a GPU (when this XLA knows every option; see there).
GPU_COMPILER_OPTIONS: Mapping[str, str] = types.MappingProxyType(
    {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"})

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@functools.lru_cache(maxsize=None)
def _known(name: str, value: str) -> bool:
    """Whether this XLA accepts the compile option ``name=value`` (a one-op compile, once per process).
    False (with a warning) only where XLA says it has no such option; other failures are left to the
    real compile."""
    try:
        jax.jit(lambda x: x + 1).lower(jnp.zeros((), jnp.int32)).compile(compiler_options={name: value})
    except Exception as e:  # jaxlib's error class differs across versions
        if "no such compile option" in str(e).lower():
            warnings.warn(f"xpress_jax.compiler_options: this XLA (jax {jax.__version__}) has no compile option "
                          f"{name!r}; refine compiles without it (the same tokens, a little slower on a GPU)",
                          RuntimeWarning, stacklevel=3)
            return False
    return True


def compiler_options(platform: str | None = None) -> dict[str, str]:
    """The XLA compile options refine runs fastest with on ``platform`` (default: ``jax.default_backend()``):
    `GPU_COMPILER_OPTIONS` on ``"gpu"``/``"cuda"``/``"rocm"``, ``{}`` elsewhere; an option this XLA does
    not know is left out with a RuntimeWarning. The tokens are the same with or without them."""
    if platform is None:
        platform = jax.default_backend()
    if not isinstance(platform, str):
        raise TypeError(f"compiler_options(platform): platform must be a str such as 'gpu' or 'cpu', "
                        f"got {type(platform).__name__}")
    if platform.lower() not in _GPU_PLATFORMS:
        return {}
    return {k: v for k, v in GPU_COMPILER_OPTIONS.items() if _known(k, v)}


def check_compiler_options(options: Mapping | None, where: str) -> dict:
    """``options`` as a plain dict of str keys (None -> {}); a TypeError naming ``where`` otherwise."""
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise TypeError(f"{where}: compiler_options must be a mapping of XLA option names (str) to values, such as "
                        f"xpress_jax.compiler_options(), or None; got {options!r}")
    return dict(options)
