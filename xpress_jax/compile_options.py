"""XLA compile options for the executables that run `refine`.

On a GPU, XLA runs a refine as a CUDA graph (a "command buffer"). By default it orders the graph's
kernels one after another (the scheduling mode ``LHS``, the order of its latency-hiding scheduler).
With ``xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` it derives the graph's edges from the
buffers each kernel reads and writes, so kernels that do not depend on each other run at once: the
top-C selection beside the hidden-input GEMMs, the token-table gathers beside the mixer. The kernels
and their sums are the same, so the tokens are the same (0 differed in every measured cell).

Measured on an H200 (JAX 0.11.2, bf16, serving shapes, a served Pallas refine with a token table,
device µs per refine, chained; benchmarks/RESULTS.md, "XLA's command-buffer scheduling mode"):

============  ======  ======  ======  ======  =======
mode, N       1       4       16      64      256
============  ======  ======  ======  ======  =======
top-512 LHS   87.5    141.5   284.8   635.6   1793.7
CONCURRENT    76.7    133.0   263.9   604.9   1764.6
============  ======  ======  ======  ======  =======

Full-vocabulary mode is unchanged (within 3 µs: its passes are one chain of dependent kernels).
The price is memory: kernels that overlap hold their buffers at once. The executable's temporary
memory grows 19-39% in top-512 mode (4.8 -> 6.0 MB at N=1, 252 -> 300 MB at N=256) and 25-86% in
full-vocabulary mode (0.7 -> 1.2 MB at N=1, 42 -> 60 MB at N=256).

`RefineServer` compiles with `compiler_options()` unless told otherwise. To get the same in your
own jit::

    refine = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES,
                     compiler_options=xj.compiler_options())

(or ``jitted.lower(...).compile(compiler_options=xj.compiler_options())``). The options act on the
top-level jit only: when refine is part of a larger jitted step, pass them to that step's jit, or
set ``XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` for the whole process.
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
    """Whether this process's XLA accepts the compile option ``name=value``: compiles a one-op
    function with it on the default backend, once per process (XLA's debug options are the same
    message on every backend). False (with a warning) only where XLA says it has no such option;
    any other failure is left for the real compile to report."""
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
    """The XLA compile options refine runs fastest with on ``platform`` (default:
    ``jax.default_backend()``): `GPU_COMPILER_OPTIONS` on ``"gpu"`` (also ``"cuda"``, ``"rocm"``),
    ``{}`` elsewhere. An option this XLA does not know is left out with a RuntimeWarning (checked
    once per process). The tokens are the same with or without them; see the module docstring.

    Pass the result as ``jax.jit(..., compiler_options=...)`` or ``Lowered.compile(compiler_options=...)``.
    """
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
