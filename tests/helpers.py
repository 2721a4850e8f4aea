"""Numeric helpers of the tests: small heads and inputs, oracles, statistics, compile counting, lowering for a GPU.

A plain module (``from helpers import ...``); `conftest.py` holds the pytest hooks and fixtures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj

# Small enough for 2 CPU cores, large enough that refinement changes most draft tokens.
SMALL = dict(vocab_size=611, hidden_size=48, block_size=8, rank=24, mlp_hidden=40, topc=37, max_num_reqs=8)


def chi2(counts: np.ndarray, probs: np.ndarray, z: float = 3.719) -> tuple[float, float]:
    """(Pearson's statistic, its upper critical value) of ``counts`` against ``probs`` (any shape, flattened); cells
    expecting fewer than 5 are pooled; a count where the probability is 0 gives inf. The critical value is Wilson and
    Hilferty's approximation of the chi-square quantile at the standard normal's upper quantile ``z`` (3.719: 1e-4)."""
    counts, probs = np.asarray(counts, np.float64).reshape(-1), np.asarray(probs, np.float64).reshape(-1)
    if np.any(counts[probs == 0] > 0):
        return np.inf, 0.0
    e = counts.sum() * probs
    small = e < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(e[~small], e[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    df = len(obs) - 1
    crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return float(np.sum((obs - exp) ** 2 / exp)), float(crit)


#: Every XLA compile of this process, by event name (`serving` counts them).
COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **kw: COMPILES.append(name) if "backend_compile" in name else None
)


@contextlib.contextmanager
def serving():
    """No trace (raises) and counts XLA compiles: ``with serving() as n: ...; assert n() == 0``."""
    start = len(COMPILES)
    with jax.no_tracing():
        yield lambda: len(COMPILES) - start


def make_head(cfg: xj.HeadConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.25):
    return xj.init_params(cfg, jax.random.key(seed), dtype=dtype, std=std, mix_std=0.5)


def make_inputs(cfg: xj.HeadConfig, n: int, seed: int = 1, dtype=jnp.float32, logit_std: float = 1.0):
    """Random drafter outputs: logits [N,B,V], h [N,B,H], anchors [N], prev_ids [N]."""
    k = jax.random.split(jax.random.key(seed), 4)
    B, V, H = cfg.block_size, cfg.vocab_size, cfg.hidden_size
    logits = (jax.random.normal(k[0], (n, B, V), jnp.float32) * logit_std).astype(dtype)
    h = jax.random.normal(k[1], (n, B, H), jnp.float32).astype(dtype)
    anchors = jax.random.randint(k[2], (n,), 0, V, jnp.int32)
    prev = jax.random.randint(k[3], (n,), 0, V, jnp.int32)
    return logits, h, anchors, prev


def sequential_greedy(params, logits, h, anchors, prev_ids):
    """Oracle for Jacobi exactness: decode the draft slot by slot, each pick seeing the final earlier slots."""
    from xpress_jax.head import hidden_input, latent
    from xpress_jax import reference as R

    N, B, V = logits.shape
    xh = hidden_input(params, h)
    blk = np.zeros((N, B), np.int32)
    blk[:, 0] = np.asarray(anchors)
    for b in range(1, B):
        prev = jnp.concatenate([prev_ids[:, None].astype(jnp.int32), jnp.asarray(blk[:, :-1])], axis=1)
        lat = latent(params, xh, prev)  # [N, B-1, r]
        blk[:, b] = np.asarray(R.full_vocab_pick(logits[:, b], lat[:, b - 1], params["w2"]))
    return blk[:, 1:]


# --- Pick kernels (full vocab and top-C): inputs and the near-tie bound -----------------------


def pick_inputs(rows: int, vocab: int, rank: int, dtype, seed: int, dyadic: bool = False):
    """(base [rows, V], lat [rows, r], w2 [V, r]) for a pick kernel.

    Normal inputs, or ``dyadic``: lat in {-4..4}/8, w2 in {-4..4}/16, so every partial sum of
    lat . w2 row is a multiple of 2^-7 below 2^5, exact in float32 in any order; base in
    {-8..8}/4 gives many tied scores.
    """
    k = jax.random.split(jax.random.key(seed), 3)
    if dyadic:
        base = (jax.random.randint(k[0], (rows, vocab), -8, 9) / 4).astype(dtype)
        lat = (jax.random.randint(k[1], (rows, rank), -4, 5) / 8).astype(dtype)
        w2 = (jax.random.randint(k[2], (vocab, rank), -4, 5) / 16).astype(dtype)
    else:
        base = jax.random.normal(k[0], (rows, vocab), jnp.float32).astype(dtype)
        lat = jax.random.normal(k[1], (rows, rank), jnp.float32).astype(dtype)
        w2 = (0.1 * jax.random.normal(k[2], (vocab, rank), jnp.float32)).astype(dtype)
    return base, lat, w2


def nonfinite_pick_inputs(seed: int = 3, rows: int = 6, vocab: int = 512, rank: int = 16):
    """float32 numpy (base [rows, V], lat [rows, r], w2 [V, r]) with non-finite base logits: row 0 has 50 NaNs,
    row 1 a +inf at id 300, row 2 is all NaN, row 3 all -inf but one NaN, row 4 all NaN but one -inf, row 5
    finite but one -inf. Rows 1-4 must pick 300, 0, 0, 0 under the rules (NaN = -inf, +inf wins, lowest id)."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(rows, vocab)).astype(np.float32) * 2
    base[0, rng.integers(0, vocab, 50)] = np.nan
    base[1, 300] = np.inf
    base[2] = np.nan
    base[3] = -np.inf
    base[3, 400] = np.nan
    base[4, :] = np.nan
    base[4, 77] = -np.inf
    base[5, 7] = -np.inf
    w2 = rng.normal(size=(vocab, rank)).astype(np.float32)
    lat = rng.normal(size=(rows, rank)).astype(np.float32)
    return base, lat, w2


def to_f64(x) -> np.ndarray:
    return np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x).astype(np.float64)


def near_tie_rows(base, lat, w2, winner, cand=None) -> np.ndarray:
    """Rows where another float32 summation order could change the pick.

    ``base`` [rows, K] holds the scored columns' base logits: the whole vocabulary (``cand``
    None) or the candidates ``cand`` [rows, K] (vocab ids). Bounds every achievable score in
    [lo, hi] (accumulation error <= (r+2) u sum|terms|, then the monotone roundings) and flags
    a row unless the oracle's winner beats every other column in every realisation (lo > hi,
    or >= when the other column has the larger vocab id).
    """
    import ml_dtypes

    dt = {jnp.dtype(jnp.float32): np.float32, jnp.dtype(jnp.bfloat16): ml_dtypes.bfloat16}[jnp.dtype(base.dtype)]
    b, x, w = to_f64(base), to_f64(lat), to_f64(w2)
    if cand is None:
        ids = np.broadcast_to(np.arange(b.shape[1])[None, :], b.shape)
        bias, mag = x @ w.T, np.abs(x) @ np.abs(w).T
    else:
        ids = np.asarray(cand)
        wc = w[ids]  # [rows, K, r]
        bias, mag = np.einsum("ncr,nr->nc", wc, x), np.einsum("ncr,nr->nc", np.abs(wc), np.abs(x))
    err = 2 * (x.shape[1] + 2) * 2.0**-24 * mag

    def score(bb):
        with np.errstate(invalid="ignore", over="ignore"):
            s = (b.astype(np.float32) + bb.astype(np.float32).astype(dt).astype(np.float32)).astype(dt)
        s = s.astype(np.float64)
        return np.where(np.isnan(s), -np.inf, s)

    with np.errstate(invalid="ignore"):
        lo, hi = score(bias - err), score(bias + err)
    pos = np.argmax(ids == winner[:, None], axis=1)  # the winner's column
    w_lo = np.take_along_axis(lo, pos[:, None], axis=1)
    beats = (w_lo > hi) | ((w_lo >= hi) & (ids > winner[:, None])) | (ids == winner[:, None])
    return ~beats.all(axis=1)


def run_on_host_devices(args: list[str], n: int = 4, timeout: int = 1800) -> str:
    """Run ``python *args`` in a child process whose JAX sees ``n`` CPU host devices
    (``--xla_force_host_platform_device_count``: the pytest process has already started JAX with
    one), with the repository and tests/ importable. Asserts success; returns its stdout."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip())
    env["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


#: The custom-call target of a Triton kernel in lowered HLO.
TRITON_CALL = "__gpu$xla.gpu.triton"


def triton_operand_counts(hlo: str, name: str) -> list[int]:
    """The operand counts of every Triton custom call whose function is named ``name`` in the lowered text."""
    return [len(re.search(r"triton\((.*?)\)", line).group(1).split(","))
            for line in hlo.splitlines() if TRITON_CALL in line and f'name = "{name}"' in line]


def triton_operands(hlo: str, name: str) -> int:
    """The operand count of the first Triton custom call whose function is named ``name``."""
    counts = triton_operand_counts(hlo, name)
    if not counts:
        raise AssertionError(f"no Triton call named {name}")
    return counts[0]


def lower_triton(f: Callable, *args: Any, **kwargs: Any):
    """Lower ``jax.jit(f)(*args)`` for CUDA (an H200) on a CPU-only machine: the Lowered. Catches kernels that run in
    interpret mode but would not build on the GPU."""
    from jax.experimental.pallas import triton as plt

    def low():
        return jax.jit(f, **kwargs).trace(*args).lower(lowering_platforms=("cuda",))

    if not hasattr(plt, "get_gpu_info"):  # JAX 0.10.x lowers without a GPU
        return low()
    ad = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=ad)
    with jax.sharding.use_abstract_mesh(mesh):
        return low()


def with_columns(table, **columns):
    """A `xpress_jax.dispatch.Table` with these `Entry` fields (or `Switches` fields) set in every entry."""
    from xpress_jax.dispatch import Switches

    names = {f.name for f in dataclasses.fields(Switches)}
    switches = {k: v for k, v in columns.items() if k in names}
    rest = {k: v for k, v in columns.items() if k not in names}
    return table.replace(entries=tuple(
        dataclasses.replace(e, switches=dataclasses.replace(e.switches, **switches), **rest)
        for e in table.entries))
