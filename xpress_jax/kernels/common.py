"""Shared Pallas-Triton plumbing (compiler params, GPU support) and the in-kernel helpers of every kernel.

This package imports nothing from the rest of `xpress_jax`: `xpress_jax.dispatch` picks the configs and
`xpress_jax.ops` calls the wrappers.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # deprecated since JAX 0.11: a JAX without it still runs xpress_jax, on its XLA path
    from jax.experimental.pallas import triton as plt
    TRITON_IMPORT_ERROR: Exception | None = None
except ImportError as e:  # pragma: no cover (exercised in a child process by the tests)
    plt = None
    TRITON_IMPORT_ERROR = e

__all__ = ["pallas_call", "compiler_params", "triton_available", "plt", "gpu_supported", "BIG", "MIN_DOT",
           "SMEM_LIMIT", "Target", "HOPPER", "TARGETS", "SMEM_SMALLEST", "target_of", "iota", "cdiv", "next_pow2",
           "k_chunk", "score", "best", "merge", "flag_operand", "flags_row", "src_row", "best3", "merge3",
           "check_noise", "mix32", "noise_seed", "gumbel", "GUMBEL_MAX", "sample_key", "online_lse", "finish_lse"]

#: Index of a lane that must never win (masked columns, padded parts); also int32's largest value.
BIG = 2**31 - 1

#: Smallest dimension of a tensor-core dot (Triton's ``tl.dot`` wants M, N, K >= 16 on NVIDIA GPUs).
MIN_DOT = 16

#: Shared memory one program may use on an H100/H200 (227 KB, the opt-in maximum per block): the default limit of
#: the configs' ``check_shape``.
SMEM_LIMIT = 227 * 1024

#: The smallest per-block shared memory of the GPUs the kernels accept (sm86/sm89/sm120: 99 KB): the limit of a GPU
#: whose compute capability no `TARGETS` record names.
SMEM_SMALLEST = 99 * 1024


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU family the configs are fitted to (hashable: part of a dispatch table).

    name: the GPUs, for messages. capability: the compute capability (major, minor). smem: shared memory one
    program may use (the opt-in maximum per block, bytes). sms: streaming multiprocessors of a typical member (the
    device's own count replaces it where JAX reports one, `target_of`)."""

    name: str
    capability: tuple[int, int]
    smem: int
    sms: int

    @property
    def family(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"


#: The H100/H200 (sm90): the only family whose table was measured (`xpress_jax.dispatch.TABLE`).
HOPPER = Target("H100/H200", (9, 0), SMEM_LIMIT, 132)

#: The known families by compute capability. Only `HOPPER` is measured; the others get heuristic tables.
TARGETS = {t.family: t for t in (
    HOPPER,
    Target("B200/GB200", (10, 0), 227 * 1024, 148),
    Target("A100/A30", (8, 0), 163 * 1024, 108),
    Target("Jetson Orin", (8, 7), 163 * 1024, 16),
    Target("RTX 30xx/A10/A40", (8, 6), SMEM_SMALLEST, 84),
    Target("RTX 40xx/L4/L40", (8, 9), SMEM_SMALLEST, 58),
    Target("RTX 50xx", (12, 0), SMEM_SMALLEST, 170),
)}


def target_of(device: Any) -> Target | None:
    """The `Target` of a JAX device: None off an NVIDIA GPU; its family's record by compute capability (an unknown
    one: `SMEM_SMALLEST`), with the SM count the device reports (``core_count``) where it has one."""
    if getattr(device, "platform", None) != "gpu" or "nvidia" not in str(getattr(device, "device_kind", "")).lower():
        return None
    try:
        major, minor = (int(x) for x in str(getattr(device, "compute_capability")).split(".")[:2])
    except (AttributeError, TypeError, ValueError):
        return None
    known = TARGETS.get(f"sm{major}{minor}")
    t = known or Target(str(getattr(device, "device_kind", "NVIDIA GPU")), (major, minor), SMEM_SMALLEST,
                        HOPPER.sms)
    sms = getattr(device, "core_count", None)
    if isinstance(sms, int) and sms > 0 and sms != t.sms:
        t = dataclasses.replace(t, sms=sms)
    return t


def flag_operand(x: Any, name: str = "flag") -> jax.Array:
    """A device flag as the kernels read it (``ref[0] != 0``): an int32 [k] array passes as it is (flags another
    kernel wrote: no XLA op between the two); a bool or integer scalar (or [1] array) becomes ``int32 [1]``."""
    x = jnp.asarray(x)
    if x.dtype == jnp.int32 and x.ndim == 1 and x.shape[0] >= 1:
        return x
    if jnp.size(x) != 1 or not (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer)):
        raise ValueError(f"{name} must be a bool or int scalar, or int32 [k] flags; got {jnp.shape(x)} {x.dtype}")
    return (jnp.reshape(x, (1,)) != 0).astype(jnp.int32)


def flags_row(full: jax.Array, n_fail: jax.Array) -> jax.Array:
    """In a kernel: the int32 [8] flags ``[full, n_fail, 0, ...]`` a kernel writes for the next one."""
    k = iota(8)
    return jnp.where(k == 0, full.astype(jnp.int32), jnp.where(k == 1, n_fail, 0))


def triton_available() -> bool:
    """Whether this JAX has the Pallas-Triton backend (``jax.experimental.pallas.triton``) the kernels are written
    for."""
    return plt is not None


def compiler_params(num_warps: int = 4, num_stages: int = 1) -> Any:
    """Always pass these: on JAX 0.10.2 a pallas_call without them lowers to Mosaic GPU."""
    if plt is None:
        raise RuntimeError(f"the Pallas kernels need jax.experimental.pallas.triton, which this JAX "
                           f"{jax.__version__} does not have ({TRITON_IMPORT_ERROR}); use backend='xla' or 'auto'")
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel: Callable, *, name: str, num_warps: int = 4, num_stages: int = 1,
                interpret: bool = False, **kwargs: Any) -> Callable:
    """`pl.pallas_call` with Triton compiler params and a profile name always set."""
    return pl.pallas_call(kernel, name=name, compiler_params=compiler_params(num_warps, num_stages),
                          interpret=interpret, **kwargs)


def gpu_supported(devices: Sequence[Any] | None = None) -> bool:
    """True only on an NVIDIA GPU of compute capability >= 8.0 with Pallas-Triton in this JAX; the first of
    ``devices`` (default ``jax.devices()``) decides. Such a GPU without Pallas-Triton: False, and one warning."""
    if devices is None:
        return _default_gpu_supported()
    return _supported(list(devices)) and _triton_or_warn()


@functools.lru_cache(maxsize=None)
def _default_gpu_supported() -> bool:
    try:
        return _supported(jax.devices()) and _triton_or_warn()
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=None)
def _triton_or_warn() -> bool:
    if plt is None:
        warnings.warn(f"xpress_jax: this JAX ({jax.__version__}) has no Pallas-Triton backend "
                      f"(jax.experimental.pallas.triton: {TRITON_IMPORT_ERROR}); refine runs its XLA path on this GPU "
                      "(the same tokens, slower). JAX releases before it was removed keep the kernels.",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def _supported(devs: list) -> bool:
    d = devs[0] if devs else None
    if getattr(d, "platform", None) != "gpu" or "nvidia" not in str(getattr(d, "device_kind", "")).lower():
        return False
    try:
        return float(getattr(d, "compute_capability")) >= 8.0
    except (AttributeError, TypeError, ValueError):
        return False


# In-kernel helpers.
def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def k_chunk(k_tile: int, rank: int, min_tile: int = 1) -> int:
    """The rank chunk used: a power of two in [``min_tile``, ``k_tile``] (0: no limit), at most the rank rounded up;
    a rank it does not divide ends in a masked tail chunk (zeros add nothing)."""
    full = max(min_tile, next_pow2(rank))
    return min(k_tile, full) if k_tile else full


def src_row(q, slot_stride: int):
    """The row of the whole logits [N*B, V] that draft row q = n*(B-1) + b' reads (slot_stride = B): n*B + 1 + b'
    (slot 0 is never read), so no caller copies logits[:, 1:]; slot_stride = 0: q itself."""
    if not slot_stride:
        return q
    return (q // (slot_stride - 1)) * slot_stride + 1 + q % (slot_stride - 1)


def iota(n: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def score(base: jax.Array, bias: jax.Array, dtype) -> jax.Array:
    """float32 of ``dtype(float32(base) + float32(bias))`` with NaN -> -inf."""
    s = (base.astype(jnp.float32) + bias.astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    return jnp.where(s != s, -jnp.inf, s)


def best(s: jax.Array, ids: jax.Array, axis: int):
    """Max of ``s`` along ``axis`` and the lowest id attaining it (``ids`` = BIG never wins)."""
    m = jnp.max(s, axis=axis)
    idx = jnp.min(jnp.where(s == jnp.expand_dims(m, axis), ids, BIG), axis=axis)
    return m, idx


def best3(s: jax.Array, b: jax.Array, ids: jax.Array, axis: int):
    """The winner along ``axis`` by the top-C rule: (max score, max base logit among those, lowest id among those)."""
    m = jnp.max(s, axis=axis)
    tied = s == jnp.expand_dims(m, axis)
    mb = jnp.max(jnp.where(tied, b, -jnp.inf), axis=axis)
    k = jnp.min(jnp.where(tied & (b == jnp.expand_dims(mb, axis)), ids, BIG), axis=axis)
    return m, mb, k


def merge3(best, bbase, bidx, m, mb, k):
    """Keep the better of two (score, base logit, id) triples: larger score, larger base, lower id."""
    take = (m > best) | ((m == best) & ((mb > bbase) | ((mb == bbase) & (k < bidx))))
    return jnp.where(take, m, best), jnp.where(take, mb, bbase), jnp.where(take, k, bidx)


def merge(best, bidx, m, idx):
    """Keep the larger value; on equal values the lower id (order-independent)."""
    take = (m > best) | ((m == best) & (idx < bidx))
    return jnp.where(take, m, best), jnp.where(take, idx, bidx)


# Sampling noise (docs/semantics.md, "Sampling"): a counter-based function of (key, draft row, vocab id), the same
# jnp spelling in XLA and in every kernel, so a kernel recomputes the same value in every pass and never stores it.
# int32 arithmetic only (multiplies wrap in both XLA and Triton; shifts are logical).
_M1, _M2, _GOLDEN = 0x85EBCA6B - 2**32, 0xC2B2AE35 - 2**32, 0x9E3779B9 - 2**32


def _srl(x: jax.Array, n: int) -> jax.Array:
    return jax.lax.shift_right_logical(x, jnp.full_like(x, n))


def mix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer on int32 bits: a bijection whose every output bit depends on every input bit."""
    x = x ^ _srl(x, 16)
    x = x * jnp.int32(_M1)
    x = x ^ _srl(x, 13)
    x = x * jnp.int32(_M2)
    return x ^ _srl(x, 16)


def noise_seed(k0: jax.Array, k1: jax.Array, row: jax.Array) -> jax.Array:
    """int32 key words ``k0``, ``k1`` and int32 draft rows -> each row's int32 seed ``mix32(mix32(row * G + k0) ^ k1)``
    (G = 0x9E3779B9), computed once per call."""
    return mix32(mix32(row * jnp.int32(_GOLDEN) + k0) ^ k1)


def gumbel(seed: jax.Array, vid: jax.Array) -> jax.Array:
    """The float32 Gumbel noise of vocab ids ``vid`` in the rows of ``seed`` (int32, broadcast together):
    ``-log(-log(u))``, ``u = (2 m + 1) / 2**24`` with m the top 23 bits of ``mix32(seed ^ vid * G)``.

    ``u`` lies in [2**-24, 1 - 2**-24] (exact in float32), so neither log sees 0 and the noise lies in
    [-2.82, `GUMBEL_MAX`]: the official runtime's clamps (1e-20) never act."""
    h = mix32(seed ^ (vid * jnp.int32(_GOLDEN)))
    m = _srl(h, 9)
    u = (m * 2 + 1).astype(jnp.float32) * jnp.float32(2.0**-24)
    return -jnp.log(-jnp.log(u))


#: The largest value `gumbel` can return: ``-log(-log(1 - 2**-24))`` (about 16.64; rounded up).
GUMBEL_MAX = 16.7


def check_noise(seeds: Any, inv_t: Any, proposal: Any, rows: int, by: str) -> None:
    """Refuse (ValueError) a sampled pick's bad arguments: ``seeds`` [rows] int32 (one per ``by``), ``inv_t`` a float
    scalar, ``proposal`` None, "logprob" or "scores"."""
    if proposal not in (None, "logprob", "scores"):
        raise ValueError(f"proposal must be None, 'logprob' or 'scores'; got {proposal!r}")
    if seeds is None or inv_t is None:
        raise ValueError("the sampled pick needs both seeds ([rows] int32) and inv_t (a float32 scalar)")
    if seeds.shape != (rows,) or not jnp.issubdtype(seeds.dtype, jnp.integer):
        raise ValueError(f"seeds must be [rows={rows}] int32 (by {by}); got {seeds.shape} {seeds.dtype}")
    if jnp.size(inv_t) != 1 or not jnp.issubdtype(jnp.asarray(inv_t).dtype, jnp.floating):
        raise ValueError(f"inv_t must be a float scalar (1 / temperature); got {jnp.shape(inv_t)} "
                         f"{jnp.asarray(inv_t).dtype}")


def sample_key(s: jax.Array, inv_t: jax.Array, g: jax.Array) -> jax.Array:
    """The value a sampled pick maximises: ``s * inv_t + g`` (``inv_t`` = 1 / temperature, float32), or the score
    ``s`` itself where ``inv_t`` is 0 (temperature 0: greedy, the same ties). ``s``: float32 (NaN already -inf)."""
    return jnp.where(inv_t > 0, s * inv_t + g, s)


def online_lse(m: jax.Array, l: jax.Array, x: jax.Array, axis: int = -1):
    """One step of a running ``logsumexp`` (in a kernel, or across parts in XLA): the max ``m`` and the sum ``l`` of
    ``exp(. - m)`` so far, and values ``x`` (reduced along ``axis``) -> the updated (m, l). An infinite max shifts by
    0 (+inf: the sum becomes +inf; -inf: it stays 0), so no ``inf - inf`` is formed."""
    m_new = jnp.maximum(m, jnp.max(x, axis=axis))
    shift = jnp.where(jnp.abs(m_new) < jnp.inf, m_new, 0.0)
    return m_new, l * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - jnp.expand_dims(shift, axis)), axis=axis)


def finish_lse(mm: jax.Array, ml: jax.Array, inv_t: jax.Array) -> jax.Array:
    """`online_lse`'s (max, sum) pairs [parts, rows] -> [rows] ``logsumexp`` over every part (in XLA); +inf where
    ``inv_t`` is 0 (the greedy pick: no distribution)."""
    top = jnp.max(mm, axis=0)
    shift = jnp.where(jnp.abs(top) < jnp.inf, top, 0.0)  # as in online_lse
    total = jnp.sum(ml * jnp.exp(mm - shift[None]), axis=0)
    return jnp.where(inv_t > 0, jnp.log(total) + shift, jnp.inf)
