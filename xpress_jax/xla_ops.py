"""The fast XLA spelling of the top-C steps `Ops.xla` runs, each beside its reference.

`xpress_jax.reference` spells every step as plain jnp and stays the oracle (the tests compare each step here with
the reference step `STEPS` names). A top-C refine splits into per-call and per-pass work:

- **once per call**: the candidates (`select_candidates`; reference `reference.select_candidates`) and the
  candidates' ``w2`` rows (`topc_prepare`; reference `reference.topc_gather`, the same function);
- **each pass**: the candidates' scores and the pick (`topc_pick`; reference `reference.topc_pick`, the same
  function: [rows, C] dots with the reference's arithmetic).

The reference selects with ``lax.top_k(base, C)`` over the whole vocabulary, which XLA spells as a sort of every row
of V (XLA:GPU for C this large, XLA:CPU for 16-bit floats); an XLA top-512 refine took 100 ms at N=256 on an H200,
11x its full-vocabulary scan. `select_candidates` returns the same candidates (the same set; ``method="top_k"`` also
the same order) from two much smaller selections:

1. **Group maxima** (one read of the logits). Each value gets an order-preserving integer key (`order_key`:
   ``lax.top_k``'s total order, ``-0.0`` below ``+0.0``, NaN as -inf); the row is cut into ``G = V / g`` groups of
   ``g`` consecutive ids (`group_size`) and each group keeps its largest key.
2. **The C best groups**, by (group maximum, lower group id first). They hold the row's C best elements: if element
   ``e`` (rank <= C) lies in group ``h``, every group ranked before ``h`` holds a distinct element ranked before
   ``e`` (its maximum), so at most C - 1 groups rank before ``h``.
3. **The C best of those C * g elements**, gathered in ascending id order, so that "lowest id first among ties" is
   "first position first".

Both selections pick exactly as ``lax.top_k``: the C largest keys, the lowest ids among keys tied at the C-th
place. Two spellings (``method``):

- ``"top_k"`` (CPU, TPU): ``lax.top_k`` on the two small arrays (float32 values: XLA:CPU runs a partial sort
  instead of a sort for float32), the groups sorted by id in between. Same candidates and order as the reference.
- ``"threshold"`` (GPU; no sort): the C-th largest key by a search over its bits
  (``radix_bits`` bits a step, each step one compare-and-count over the array), then a compaction: the elements
  above the threshold and the first ``need`` equal to it, found from a prefix count (a scan) by a binary
  search per candidate slot. Candidates in ascending id order.

The block's start (the full-vocab argmax, ``-0.0 == +0.0``, lowest id on ties) comes from the group maxima too:
the first group whose maximum equals the row's maximum as a value, then its first such element.

Group sizes at serving shapes (V=151936, C=512): g=16, G=9496 groups, 8192 elements in step 3; at
``bench_refine --small`` (V=4099, C=64): g=8, G=513, 512. Where V <= 2C the row is one stage (g=1).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import reference as ref

__all__ = ["METHODS", "PLATFORM_METHOD", "Step", "STEPS", "order_key", "key_value", "group_size",
           "select_candidates", "topc_prepare", "topc_pick"]

#: The spellings of `select_candidates` (module doc).
METHODS = ("top_k", "threshold")

#: The spelling `Ops.xla` uses on each platform. TPU: chosen, not measured (no TPU here).
PLATFORM_METHOD = {"cpu": "top_k", "gpu": "threshold", "tpu": "top_k"}


# ----------------------------------------------------------------------------- keys
def _key_type(dtype) -> tuple[int, Any]:
    """(bits, the int type of that width) of a floating dtype: its keys' type."""
    bits = jnp.dtype(dtype).itemsize * 8
    if bits not in (16, 32, 64):
        raise TypeError(f"select_candidates: no order key for dtype {jnp.dtype(dtype)}")
    return bits, {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[bits]


def order_key(x: jax.Array) -> jax.Array:
    """Order-preserving signed integer keys of NaN-free floats, of the floats' width (int16 for 16-bit floats):
    ``lax.top_k``'s total order (``-0.0`` keys as -1, below ``+0.0``'s 0; -inf above `_pad_key`)."""
    bits, kt = _key_type(x.dtype)
    b = lax.bitcast_convert_type(x, kt)
    return b ^ ((b >> (bits - 1)) & ((1 << (bits - 1)) - 1))  # negative: all bits but the sign flipped


def key_value(key: jax.Array, dtype) -> jax.Array:
    """The inverse of `order_key`: the values of real keys (not of pad keys)."""
    bits, kt = _key_type(dtype)
    return lax.bitcast_convert_type(key ^ ((key >> (bits - 1)) & ((1 << (bits - 1)) - 1)), jnp.dtype(dtype))


def _pad_key(kt) -> int:
    """The key of padding: the type's least value, below every real key (NaN is cleaned to -inf, and the least
    value's bit pattern is a NaN's)."""
    return int(jnp.iinfo(kt).min)


def _canon(key: jax.Array) -> jax.Array:
    """Value order for the argmax: ``-0.0`` (key -1) as ``+0.0`` (key 0)."""
    return jnp.where(key == -1, jnp.zeros((), key.dtype), key)


def group_size(v: int, c: int) -> int:
    """``g``, the power of two nearest sqrt(V / C) (it balances the G = V/g group maxima against the C * g
    elements of step 3), or 1 (one stage) where that is below 2 or leaves fewer than C groups."""
    g = 1 << max(0, round(math.log2(max(v / c, 1.0)) / 2))
    return g if g >= 2 and -(-v // g) >= c else 1


# ----------------------------------------------------------------------------- the selection
def select_candidates(base: jax.Array, c: int, *, method: str = "top_k", radix_bits: int = 4):
    """[rows, V] -> (cand [rows, C] int32, base_c [rows, C], argmax [rows] int32), as
    `reference.select_candidates` (its oracle): the same candidates with the same values, the same argmax.
    ``method`` (module doc): ``"top_k"`` returns them in the reference's order too; ``"threshold"`` in ascending
    id order, its bit search ``radix_bits`` (1, 2 or 4) bits a step."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if radix_bits not in (1, 2, 4):
        raise ValueError(f"radix_bits must be 1, 2 or 4, got {radix_bits!r}")
    rows, v = base.shape
    if not 1 <= c <= v:
        raise ValueError(f"c must be in [1, V={v}], got {c}")
    dtype = base.dtype
    cl = ref.clean(base)
    keys = order_key(cl)
    g = group_size(v, c)
    n_groups = -(-v // g)
    keys3 = jnp.pad(keys, ((0, 0), (0, n_groups * g - v)), constant_values=_pad_key(keys.dtype))
    keys3 = keys3.reshape(rows, n_groups, g)
    gmax = keys3 if g == 1 else jnp.max(keys3, axis=2)  # every group holds a real element: a real key
    gmax = gmax.reshape(rows, n_groups)
    start = _start(keys3, gmax)
    if method == "top_k":
        cand, base_c = _select_top_k(cl, gmax, c, g)
    else:
        cand, kc = _select_threshold(keys3, gmax, c, g, _key_type(dtype)[0], radix_bits)
        base_c = key_value(kc, dtype)
    return cand, base_c, start


def _start(keys3: jax.Array, gmax: jax.Array) -> jax.Array:
    """The full-vocab argmax (values compared as numbers, lowest id on ties) from the group maxima: the groups
    holding an element equal to the row's maximum are those whose maximum equals it as a value."""
    rows, n_groups, g = keys3.shape
    m = _canon(jnp.max(gmax, axis=1, keepdims=True))
    first = jnp.min(jnp.where(_canon(gmax) == m, lax.broadcasted_iota(jnp.int32, gmax.shape, 1), n_groups), axis=1)
    if g == 1:
        return first.astype(jnp.int32)
    grp = jnp.take_along_axis(keys3, first[:, None, None], axis=1)[:, 0, :]  # [rows, g]
    off = jnp.min(jnp.where(_canon(grp) == m, lax.broadcasted_iota(jnp.int32, grp.shape, 1), g), axis=1)
    return (first * g + off).astype(jnp.int32)


def _sort_dtype(dtype):
    """The dtype ``lax.top_k`` runs in: float32 for 16- and 32-bit floats (exact; XLA:CPU's partial sort), else
    the dtype itself."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _select_top_k(cl: jax.Array, gmax: jax.Array, c: int, g: int):
    """``method="top_k"``: ``lax.top_k`` on the group maxima, then on the C best groups' elements in id order."""
    rows, v = cl.shape
    dtype, sd = cl.dtype, _sort_dtype(cl.dtype)
    _, grp = lax.top_k(key_value(gmax, dtype).astype(sd), c)  # the C best groups, lower id first on ties
    if g == 1:
        return grp.astype(jnp.int32), jnp.take_along_axis(cl, grp, axis=1)
    n_groups = gmax.shape[1]
    # Pads (past V, in the last group only) read -inf: ranked after every real -inf by their larger ids.
    vals3 = jnp.pad(cl, ((0, 0), (0, n_groups * g - v)), constant_values=-jnp.inf).reshape(rows, n_groups, g)
    grp = jnp.sort(grp, axis=1)  # ascending ids: position order is id order
    buf = jnp.take_along_axis(vals3, grp[:, :, None], axis=1).reshape(rows, c * g)
    vals, pos = lax.top_k(buf.astype(sd), c)
    ids = jnp.take_along_axis(grp, pos // g, axis=1) * g + pos % g
    return ids.astype(jnp.int32), vals.astype(dtype)


def _select_threshold(keys3: jax.Array, gmax: jax.Array, c: int, g: int, bits: int, radix_bits: int):
    """``method="threshold"``: (cand [rows, C] int32 in ascending id order, their keys); ``bits``: the float's."""
    rows, n_groups, _ = keys3.shape
    grp = _threshold_positions(gmax, c, bits, radix_bits)
    if g == 1:
        return grp, jnp.take_along_axis(gmax, grp, axis=1)
    buf = jnp.take_along_axis(keys3, grp[:, :, None], axis=1).reshape(rows, c * g)
    pos = _threshold_positions(buf, c, bits, radix_bits)
    ids = jnp.take_along_axis(grp, pos // g, axis=1) * g + pos % g
    return ids.astype(jnp.int32), jnp.take_along_axis(buf, pos, axis=1)


def _unsigned(key: jax.Array, bits: int) -> jax.Array:
    """Keys as non-negative integers of ``bits`` bits (int32 for 16-bit keys, else unsigned), order kept, pads (and
    only pads) at 0."""
    if bits == 16:
        return key.astype(jnp.int32) + (1 << 15)
    ut = jnp.uint64 if bits == 64 else jnp.uint32
    return lax.bitcast_convert_type(key ^ jnp.asarray(_pad_key(key.dtype), key.dtype), ut)


def _threshold_positions(key: jax.Array, c: int, bits: int, radix_bits: int) -> jax.Array:
    """[rows, n] keys -> [rows, c] int32: the positions of the c largest keys (the lowest positions among keys
    tied at the c-th place), ascending."""
    rows, n = key.shape
    u = _unsigned(key, bits)
    t = _kth_largest(u, c, bits, radix_bits)  # [rows, 1]
    gt, eq = u > t, u == t
    need = c - jnp.sum(gt, axis=1, keepdims=True, dtype=jnp.int32)  # >= 1 ties at t go in
    if n < (1 << 15):  # one scan: both prefix counts packed in an int32 (each < 2^15)
        s = jnp.cumsum(gt.astype(jnp.int32) | (eq.astype(jnp.int32) << 16), axis=1)
        cgt, ceq = s & 0xFFFF, s >> 16
    else:
        cgt, ceq = jnp.cumsum(gt, axis=1, dtype=jnp.int32), jnp.cumsum(eq, axis=1, dtype=jnp.int32)
    # The selected: every key above t, then the first ``need`` equal to it. ``count[i]``: how many of them lie
    # at or before i (non-decreasing; it steps up by one at each selected position).
    count = cgt + jnp.minimum(ceq, need)
    # Slot j's position: the first i with count[i] > j, i.e. how many i have count[i] <= j: a binary search
    # (one gather of [rows, c] a step), not a scatter of [rows, n].
    j = lax.broadcasted_iota(jnp.int32, (rows, c), 1)
    pos = jnp.zeros((rows, c), jnp.int32)
    for b in reversed(range(max(n - 1, 1).bit_length())):
        p = pos + (1 << b)  # count[p - 1] <= j: the first p positions all hold counts <= j
        ok = (p <= n) & (jnp.take_along_axis(count, jnp.minimum(p, n) - 1, axis=1) <= j)
        pos = jnp.where(ok, p, pos)
    return pos


def _kth_largest(u: jax.Array, c: int, bits: int, radix_bits: int) -> jax.Array:
    """[rows, n] non-negative keys -> [rows, 1]: the c-th largest, ``radix_bits`` bits a step from the top: of the
    2^radix_bits - 1 next candidates (the prefix so far with the step's digit 1, 2, ...), the largest whose count of
    keys at or above it is >= c (the counts fall as the digit grows, so it is how many of them pass)."""
    ut = u.dtype
    t = jnp.zeros((u.shape[0], 1), ut)
    digits = jnp.arange(1, 1 << radix_bits, dtype=ut)
    for shift in range(bits - radix_bits, -1, -radix_bits):
        cand = t | (digits << shift)[None, :]  # [rows, D]
        cnt = jnp.sum(u[:, :, None] >= cand[:, None, :], axis=1, dtype=jnp.int32)  # [rows, D]
        k = jnp.sum(cnt >= c, axis=1, keepdims=True, dtype=jnp.int32)
        t = t | (k.astype(ut) << shift)
    return t


# ----------------------------------------------------------------------------- the passes
#: Once per call: the candidates' ``w2`` rows [rows, C, r] (the reference's gather).
topc_prepare = ref.topc_gather

#: Each pass: the reference's scores and pick over the gathered rows.
topc_pick = ref.topc_pick


class Step(NamedTuple):
    """A fast step and its oracle (the tests compare them on fresh inputs)."""

    fast: Callable[..., Any]
    reference: Callable[..., Any]


#: Every step `Ops.xla` takes from this module, with its reference.
STEPS = {
    "select": Step(select_candidates, ref.select_candidates),
    "topc_prepare": Step(topc_prepare, ref.topc_gather),
    "topc_pick": Step(topc_pick, ref.topc_pick),
}
