"""The one timing routine every benchmark here uses (device time of a jitted, chained function)."""

from __future__ import annotations

import statistics
import time

import jax

__all__ = ["time_jitted"]


def time_jitted(fn, args, reps: int = 5):
    """Compile and warm up ``fn(*args)``, then time ``reps`` calls with a host clock around
    dispatch + ``block_until_ready``.

    Returns (the first call's output, median seconds per call, compile seconds). ``fn``
    should chain many calls of the measured step (each depending on the previous one) so
    that launch latency and host overhead are amortised; divide by the chain length.
    """
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(fn(*args))  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return out, statistics.median(ts), compile_s
