"""The certified exact mode: ``refine(..., topc=0, full_vocab="certified")``, the scan's tokens at close to top-C cost.

Once per call each draft row gets its C largest base logits (the candidates), ``tau`` (the C-th largest)
and ``M = max_v ||w2[v]|| (1 + 2^-9)`` (`prepare_certified`). Each pass scores the candidates exactly and
takes their winner by the full-vocab rule; every other id's score is at most ``R(fl(tau + R(||lat|| M)))``
(with rounding slack, through the score's own roundings). A row whose bound stays below the winner's score
(or ties it where every lower id is a candidate) is *certified*: its token is the candidates' winner. The
failing rows are scanned by the full-vocab pick; when more than ``scan_blocks * (B-1)`` rows fail in one
pass, the call falls back: that pass and every later one scan every row (a sticky device flag). Unrolled,
pass ``q`` leaves out the draft slots before ``q`` (final). No conditional and no wait for the host: the
kernels read the decisions as device values.

The tokens are the scan's on the same backend, but where the candidates' kernel and the scan sum a dot in
different float32 orders and two scores lie within those ulps (a near tie). The bound, its margins, the
argument, and when the mode pays or falls back: docs/certified.md.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import reference as ref
from .dispatch import TABLE
from .head import acc_dtype
from .modes import Call, Loop, Mode, write_slots
from .ops import Ops
from .reference import SLACK, certify_rows

__all__ = ["SLACK", "certify_rows", "lowest_missing", "FULL_VOCAB", "Auto", "Certified", "CertifiedStats",
           "CertifiedPrepared", "resolve_full_vocab", "prepare_certified", "CertifiedMode"]

_RAD = 2.0 ** -9

#: The measured table's thresholds: the defaults of `Certified.blocks` and `Auto.min_blocks`.
THRESHOLDS = TABLE.thresholds

#: The spellings of `refine`'s ``full_vocab`` (how ``topc=0`` is computed; a `Certified` also works).
FULL_VOCAB = ("scan", "certified")


@dataclasses.dataclass(frozen=True)
class Certified:
    """Settings of ``full_vocab="certified"`` (frozen: a static jit argument). None changes a token.

    candidates: C, the candidates scored exactly per draft row each pass (clamped to V). A larger C
      certifies more rows (a lower ``tau``) at a higher cost per pass.
    scan_blocks: how many blocks' worth of failing rows (B-1 rows each) a pass scans in the packed launch;
      a pass with more scans every row, and the call falls back. ``None``: ``ceil(N / d)``, d the steps'
      table's ``scan_blocks_divisor`` (`dispatch.Thresholds`: 8); ``0``, or at least N: any failing row falls
      back.
    """

    candidates: int = 512
    scan_blocks: int | None = None

    def __post_init__(self):
        c = self.candidates
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
            raise ValueError(f"Certified: candidates must be an int >= 1, got {c!r}")
        s = self.scan_blocks
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0):
            raise ValueError(f"Certified: scan_blocks must be None or an int >= 0, got {s!r}")

    def blocks(self, n: int, divisor: int = THRESHOLDS.scan_blocks_divisor) -> int:
        """The scan_blocks used at N blocks (``divisor``: the default's, ``ceil(N / divisor)``)."""
        return -(-n // divisor) if self.scan_blocks is None else int(self.scan_blocks)


@dataclasses.dataclass(frozen=True)
class Auto:
    """``RefineServer(full_vocab="auto")``: the scan's tokens, certified where that pays, the scan elsewhere.

    A per-bucket policy of the server (plain `refine` keeps no state between calls). Buckets of fewer than
    ``min_blocks`` blocks always scan (there the certified mode does not beat the scan: docs/performance.md;
    the default is the measured table's `dispatch.Thresholds.auto_min_blocks`).
    Larger buckets start certified; every ``check_every``-th certified call keeps its `CertifiedStats`, read
    by a later call once the device has finished it (never waiting). If its fraction of fallen-back passes
    exceeds ``max_fallback`` the bound does not prune for this head and traffic: the bucket scans for the
    next ``retry_after`` calls, then tries the certified mode again. Costs: two executables per large bucket.
    """

    min_blocks: int = THRESHOLDS.auto_min_blocks
    check_every: int = 16
    retry_after: int = 256
    max_fallback: float = 0.5
    certified: Certified = Certified()

    def __post_init__(self):
        for name in ("min_blocks", "check_every", "retry_after"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Auto: {name} must be an int >= 1, got {v!r}")
        if not 0 <= self.max_fallback <= 1:
            raise ValueError(f"Auto: max_fallback must lie in [0, 1], got {self.max_fallback!r}")
        if not isinstance(self.certified, Certified):
            raise ValueError(f"Auto: certified must be an xpress_jax.exact.Certified, got {self.certified!r}")


def resolve_full_vocab(full_vocab) -> Certified | None:
    """``"scan"`` -> None (the plain full scan), ``"certified"`` -> ``Certified()``, a `Certified` -> itself;
    anything else raises ValueError naming ``full_vocab``."""
    if isinstance(full_vocab, Certified):
        return full_vocab
    if isinstance(full_vocab, str) and full_vocab in FULL_VOCAB:
        return None if full_vocab == "scan" else Certified()
    raise ValueError(f"full_vocab must be one of {FULL_VOCAB} or an xpress_jax.exact.Certified, got {full_vocab!r}")


class CertifiedPrepared(NamedTuple):
    max_norm: jax.Array  # [] accumulation dtype: M = max_v ||w2[v]|| (1 + 2^-9), the dot-error margin folded in


class CertifiedStats(NamedTuple):
    """Per-call counters of the certified mode (float32 scalars; `refine(..., return_stats=True)`), valid rows."""

    rows_certified: jax.Array  # certified rows / rows tried (the rows of the passes that scored candidates; 1 if none)
    passes_certified: jax.Array  # fraction of the K passes in which every row certified (no scan at all)
    passes_row_scan: jax.Array  # fraction of passes that scanned their failing rows, at most scan_blocks * (B-1)
    passes_full_scan: jax.Array  # fraction of passes from the fallback on (every row scanned)


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den`` of int32 counts as float32, exactly 1 where equal and 0 where ``num`` is 0 (XLA on GPUs
    may divide float32 approximately)."""
    q = num.astype(jnp.float32) / den.astype(jnp.float32)
    return jnp.where(num == den, 1.0, jnp.where(num == 0, 0.0, q)).astype(jnp.float32)


def _check_rank(r: int, acc) -> None:
    u = float(jnp.finfo(acc).eps) / 2
    if r * u > 2.0 ** -12:
        raise ValueError(f"rank r={r} is too large for the rounding margins in {jnp.dtype(acc)} (need r*u <= 2^-12)")


def prepare_certified(w2: jax.Array) -> CertifiedPrepared:
    """[V, r] -> `CertifiedPrepared`: ``M = max_v ||w2[v]|| (1 + 2^-9)`` in the accumulation dtype.

    Weights only: `refine` computes it every call (one read of ``w2``) unless given it as
    ``certified_prepared``; `RefineServer` computes it at start-up and at every reload. Refuses ranks too
    large for the margins (``r u > 2^-12``)."""
    acc = acc_dtype(w2.dtype)
    _check_rank(w2.shape[1], acc)
    w = w2.astype(acc)
    return CertifiedPrepared(jnp.max(jnp.sqrt(jnp.sum(w * w, axis=1))) * (1 + _RAD))


def lowest_missing(cand: jax.Array) -> jax.Array:
    """[rows, C] distinct ids -> [rows] int32: each row's lowest id that is not among them."""
    rows, c = cand.shape
    present = jnp.zeros((rows, c + 1), bool).at[jnp.arange(rows)[:, None], jnp.minimum(cand, c)].set(True)
    return jnp.argmin(present, axis=1).astype(jnp.int32)  # the first False (column c: all of 0..c-1 present)


class _CallData(NamedTuple):
    cand: jax.Array  # [rows, C] int32
    base_c: jax.Array  # [rows, C]
    start: jax.Array  # [rows] int32: the full-vocab argmax of the base logits
    cprep: object  # ops.topc_prepare(w2, cand)
    fprep: object  # ops.full_vocab_prepare(w2)
    tau: jax.Array | None  # [rows] accumulation dtype: the C-th largest base logit (None: C = V)
    max_norm: jax.Array | None  # [] M
    mex: jax.Array | None  # [rows] int32: the lowest id that is not a candidate (None: C = V)


def _call_data(ops: Ops, logits: jax.Array, w2: jax.Array, c: int, prepared: CertifiedPrepared | None = None):
    if ops.candidates_best is None:
        raise ValueError(f"full_vocab='certified' needs Ops with candidates_best; {ops.name!r} has none "
                         "(the vocabulary-sharded steps do not support it)")
    acc = acc_dtype(logits.dtype)
    _check_rank(w2.shape[1], acc)
    cand, base_c, start = ops.select(logits, c)
    tau = max_norm = mex = None
    if c < logits.shape[2]:
        tau = jnp.min(ref.clean(base_c).astype(acc), axis=1)
        max_norm = (prepare_certified(w2) if prepared is None else prepared).max_norm
        mex = lowest_missing(cand)
    return _CallData(cand, base_c, start, ops.topc_prepare(w2, cand), ops.full_vocab_prepare(w2), tau, max_norm, mex)


def _decide(ops: Ops, d: _CallData, lat: jax.Array, dtype, valid, fallen, limit=None):
    """``ops.certify`` (or its jnp spelling where the steps have none): (best_id [rows] int32, fail [rows],
    act [rows], flags) as ``ops.certify`` returns them. ``fallen`` (a device flag): the candidates' kernel
    reads nothing, ``best_id`` is unspecified and no row fails."""
    if d.tau is None:  # every id is a candidate: every row is certified
        _, best_id = ops.candidates_best(d.base_c, d.cand, lat, d.cprep, skip=fallen)
        none = jnp.zeros(best_id.shape, bool)
        if limit is None:
            return best_id, none, none, None
        was = ref.flag_value(fallen)
        return best_id, none, none | was, ref.make_flags(was, 0)
    if ops.certify is not None:
        return ops.certify(d.base_c, d.cand, lat, d.cprep, d.tau, d.max_norm, d.mex, valid, fallen, limit)
    best, best_id = ops.candidates_best(d.base_c, d.cand, lat, d.cprep, skip=fallen)
    return certify_rows(best, best_id, lat, d.tau, d.max_norm, d.mex, valid, fallen, limit, dtype)


class CertifiedMode(Mode):
    """The certified mode for `xpress_jax.refine.run_passes` (the protocol of `xpress_jax.modes`). State: ``(flags
    int32 [8], (rows tried, rows certified, outcomes int32 [3]))``; ``finish`` returns the tokens, with
    ``return_stats`` also the `CertifiedStats`. Rows of invalid blocks never count. ``prepared``:
    `prepare_certified` of this ``w2`` (None: computed here)."""

    def __init__(self, call: Call, num_passes: int, cfg: Certified, prepared: CertifiedPrepared | None, loop: Loop,
                 return_stats: bool = False, with_passes: bool = False):
        ops, logits = call.ops, call.logits
        N, B, V = logits.shape
        self.num_passes, self.return_stats = num_passes, return_stats
        r = call.params["w1"].shape[1]
        k_sub = cfg.blocks(N, ops.thresholds.scan_blocks_divisor)
        self.limit = k_sub * (B - 1) if 0 < k_sub < N else 0  # more failing rows in a pass: the call falls back
        self.d = _call_data(ops, logits, call.params["w2"], min(int(cfg.candidates), V), prepared)  # once per call
        # A packed scan of the failing rows, where the steps have one that saves work (else one pick).
        self.packed = bool(self.limit and ops.scan_failing and ops.full_vocab_capacity
                           and ops.full_vocab_capacity(N, B, V, r, logits.dtype, self.limit) is not None)
        self.row_valid = jnp.repeat(call.valid, B - 1)
        self.n_valid = jnp.sum(self.row_valid, dtype=jnp.int32)
        zero = jnp.zeros((), jnp.int32)
        state = (jnp.zeros((8,), jnp.int32), (zero, zero, jnp.zeros((3,), jnp.int32)))
        super().__init__(call, self.d.start, loop, state, with_passes)

    def pass_(self, carry, q):
        # flags: int32 [8] = [fallen, the last pass's failing rows, 0, ...], as the kernels write and read it
        # (`kernels.common.flag_operand`): between two kernels of the certified mode no XLA op runs.
        blk, (flags, (tried, certified, outcomes)) = carry
        c, d, ops = self.call, self.d, self.call.ops
        s = 0 if q is None else q  # the draft slots before s are final
        kw = {} if q is None else {"q": q}
        fallen = ref.flag_value(flags)
        lat = self.latent(blk)
        # The final slots are decided too (a mask per pass would put XLA ops between the kernels); the scans
        # skip them.
        best_id, fail, act, decided = _decide(ops, d, lat, c.logits.dtype, self.row_valid, flags,
                                              None if self.packed else self.limit)
        if self.packed:  # the failing rows (every row of a slot >= s if the pass is full) scanned, the others best_id
            tok, flags = ops.scan_failing(c.logits, lat, d.fprep, fail, flags, best_id, self.limit, **kw)
        elif ops.gated_pick is not None:  # the same pick in a launch that runs nothing where no row is active
            tok, flags = ops.gated_pick(c.logits, lat, d.fprep, act, best_id, decided, **kw)
        else:  # one pick: its active rows (act = fail | full) get its token, the others best_id
            tok, flags = ops.full_vocab_pick(c.logits, lat, d.fprep, active=act, fallback=best_id, **kw)[0], decided
        full, n_fail = flags[0] != 0, flags[1]  # full: this pass scanned every row
        outcome = jnp.where(full, 2, jnp.where(n_fail == 0, 0, 1))  # certified / rows scanned / fallen back
        tried = tried + jnp.where(fallen, 0, self.n_valid)
        certified = certified + jnp.where(fallen, 0, self.n_valid - n_fail)
        outcomes = outcomes + (jnp.arange(3) == outcome).astype(jnp.int32)
        blk = write_slots(blk, tok.reshape(self.n, self.slots)[:, s:].reshape(-1), s, c.d2t)
        return blk, (flags, (tried, certified, outcomes))

    def finish(self, carry, passes):
        if self.return_stats:
            return self.tokens(carry[0]), self.stats(carry[1])
        return super().finish(carry, passes)

    def stats(self, state) -> CertifiedStats:
        _, (tried, certified, outcomes) = state
        # The passes from B-1 on, which the numbered loop does not run (every draft slot final), count as certified.
        settled = max(self.num_passes - self.slots, 0) if self.loop.numbered else 0
        if settled:
            outcomes = outcomes.at[0].add(settled)
        frac = _ratio(outcomes, jnp.int32(self.num_passes))
        return CertifiedStats(rows_certified=jnp.where(tried > 0, _ratio(certified, jnp.maximum(tried, 1)), 1.0),
                              passes_certified=frac[0], passes_row_scan=frac[1], passes_full_scan=frac[2])
