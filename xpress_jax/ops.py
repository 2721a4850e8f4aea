"""`Ops`: one implementation of the refine steps, as a frozen dataclass of step functions.

`refine` runs the data path of `xpress_jax.refine` with the `Ops` its ``backend`` names:
``Ops.xla(...)`` (the jnp reference, `xpress_jax.reference`) or ``Ops.pallas(...)``
(the Pallas-Triton kernels of `xpress_jax.kernels`, configs from `xpress_jax.dispatch`).

Documented internal entry point (benchmarks, experiments): build a mixed implementation with
`dataclasses.replace` and run it with `xpress_jax.refine.refine_with`::

    from xpress_jax.ops import Ops
    from xpress_jax.refine import refine_with
    mixed = dataclasses.replace(Ops.pallas(), latent=Ops.xla(platform="gpu").latent)
    draft = refine_with(mixed, head, logits, h, anchors)

The steps (static shapes; ``rows`` = N * (B-1) draft rows):

- ``select(logits [N,B,V], c) -> (cand [rows,c] int32, base_c [rows,c], start [rows] int32)``:
  each draft slot's C largest base logits and its full-vocab argmax (the block's start).
- ``topc_prepare(w2, cand) -> prepared``: once per call; what ``topc_pick`` reads for the
  candidates' w2 rows (XLA: ``w2[cand]``; the kernel gathers them itself, so ``w2``). The two
  belong together: replace both or neither.
- ``topc_pick(base_c, cand, lat [rows,r], prepared) -> [rows] int32``: the top-C winner.
- ``full_vocab_prepare(w2) -> prepared``: once per call; what ``full_vocab_pick`` reads for the
  readout (``w2`` itself for XLA and the kernels; weight-derived data for `xpress_jax.exact`).
  Replace it together with ``full_vocab_pick``.
- ``full_vocab_pick(logits [N,B,V], lat [rows,r], prepared, active=None, fallback=None) -> [rows] int32``:
  the full-vocab winner. ``active`` ([rows] bool, or int32 with nonzero = active, a device value; used
  by the certified mode): only those rows' tokens are wanted, the others are unspecified. The kernel
  skips row tiles without an active row and reads int32 ``active`` as it is; the jnp path ignores it
  and picks every row. ``fallback`` ([rows] int32, with ``active``): inactive rows return it (every
  path). ``q`` (keyword, a Python int or None; the certified mode's unrolled passes): the 0-based pass
  this pick serves; the Pallas steps may then read ``w2`` in another order or with L2 hints, as
  ``full_vocab_pass_pick`` does (the same tokens); the jnp path ignores it.
- ``full_vocab_pass_pick``: ``None``, or a `PassPick`: ``full_vocab_pick`` told which pass it serves.
  ``run(logits, lat, prepared, q) -> (tokens [N*(B-1-s)] int32, s)``, ``q`` the 0-based pass number (a
  Python int, known where the passes are unrolled): the tokens of draft slots ``s..B-2`` of every block
  for some ``0 <= s <= min(q, B-1)`` of its choosing, each the token ``full_vocab_pick`` gives it. The
  draft slots before ``q`` are final after pass ``q`` (SEMANTICS: slot b reads slots < b only), so their
  rows may be skipped; the order in which ``w2`` is read may change too. An unrolled full-vocab refine
  calls it for every pass (``q = 0`` computes every row) and keeps the skipped slots' tokens, but only
  while ``PassPick.pick is full_vocab_pick``: replacing ``full_vocab_pick`` alone turns it off.
  The Pallas steps skip rows from `dispatch.SKIP_FINAL_SLOTS_MIN_ROWS` draft rows where that saves row tiles
  of the pick (`dispatch.pass_pick_rows`) and read
  ``w2`` in the other order on passes 2, 4, ... up to `dispatch.FULL_VOCAB_ALTERNATE_MAX_ROWS` draft rows.
- ``gated_pick``: ``None``, or a `PassPick` whose ``run(logits, lat, prepared, active, fallback, flags, q=None)
  -> (tokens, flags)`` gives ``full_vocab_pick(logits, lat, prepared, active=active, fallback=fallback, q=q)``'s
  tokens and ``flags`` (int32 [8], entries from 2 zero: the certified mode's pass flags) back with the same
  values, in a launch that writes nothing where no row is active; used only while ``PassPick.pick is
  full_vocab_pick``. The Pallas steps: the counted pick (`kernels.full_vocab.full_vocab_pick`'s ``counter``;
  the flags hold its counters) where the plan's config has at most 6 row tiles, else the pick and its combine.
- ``topc_pass_pick``: the same for ``topc_pick``: ``None`` or a `PassPick` whose ``run(base_c, cand, lat,
  prepared, q, n) -> (tokens [N*(B-1-s)] int32, s)`` (``n`` = N blocks: B-1 = rows // N); used only while
  ``PassPick.pick is topc_pick``. The Pallas steps skip from `dispatch.TOPC_SKIP_FINAL_SLOTS_MIN_ROWS` rows.
- ``latent(params, xh [N,B,r], blk [N,B] int32, prev_ids [N] int32, split=False) -> [N,B-1,r]``. With
  ``split=True`` it may return a `reference.LatentSum` instead, the residual's two float32 terms, for
  ``topc_pick`` to add and round itself; the Pallas steps do so where XLA computes the latent, up to
  `dispatch.SPLIT_LATENT_MAX_ROWS` draft rows (one launch fewer per pass). Every ``topc_pick`` accepts
  either form; no other step gets a `LatentSum`.
- ``split_latent`` (a bool, not a step): whether `xpress_jax.refine` asks ``latent`` for ``split=True``
  (in top-C passes only: the fused full-vocab pick measured slower with the terms).
- ``hidden(params, h [N,B,H]) -> xh [N,B,r]``: once per call, the pass-invariant hidden half of
  ``in_proj``. ``None``: `xpress_jax.head.hidden_input`; on GPUs (`Ops.xla("gpu")`, compiled `Ops.pallas`)
  `reference.hidden_input_gpu`, the same sums spelled so that XLA:GPU avoids two slow fusions.
- ``start(logits [N,B,V]) -> [rows] int32``: the full-vocab argmax of the base logits (where a
  full-vocab refine starts). The Pallas steps use the selection's argmax output from
  `dispatch.FULL_VOCAB_START_SELECT_MIN_ROWS` draft rows.
- ``full_vocab_best(logits, lat, prepared) -> (score [rows] f32, id [rows] int32)`` and
  ``topc_best(base_c, cand, lat, prepared) -> (score, base, id)``: the picks with the winner's
  values, for callers that combine winners across devices (`xpress_jax.sharded`).
- ``candidates_best(base_c, cand, lat, prepared, skip=None) -> (score [rows] f32, id [rows] int32)``: the
  candidates' winner by the **full-vocab** rule (largest score, lowest id; the base logit plays no
  part), ``prepared`` from ``topc_prepare``: what the certified exact mode (`xpress_jax.exact`)
  scores each pass. ``skip`` (a device bool scalar): when true the result is unspecified (the
  kernel reads nothing; the jnp path ignores it and computes). ``None`` where an implementation
  lacks it (the vocabulary-sharded steps).
- ``certify(base_c, cand, lat, prepared, tau, max_norm, mex, valid, fallen, limit=None) -> (best_id, fail,
  act, flags)``: the certified mode's whole candidates step (`xpress_jax.exact`): ``candidates_best``
  (skipped when ``fallen``), then each row's decision by the bound; the Pallas steps make it one launch
  after the pick. ``fail`` = valid rows the bound does not certify (none once ``fallen``); ``act``, with
  a ``limit``, = ``fail | full``, ``full = fallen | (sum(fail) > limit)`` (else ``fail``); ``flags``,
  with a ``limit``, = int32 [8] ``[full, sum(fail), 0, ...]`` (`reference.make_flags`), else None.
  ``fail``/``act`` are bool or int32 0/1 (the kernels write int32, which the full-vocab kernels read as
  it is). ``fallen`` here and in the steps below is a device flag: a bool scalar or int32 flags
  (element 0; `kernels.common.flag_operand`). ``None``: the certified mode spells it with
  ``candidates_best`` and jnp (same decisions).
- ``scan_failing(logits, lat, prepared, fail, fallen, fallback, limit) -> (tokens, flags)``: the
  certified mode's scan of its failing rows (`xpress_jax.exact`): ``full = fallen | (sum(fail) >
  limit)``; the rows ``fail | full`` get ``full_vocab_pick``'s token, the others ``fallback``;
  ``flags`` = int32 [8] ``[full, sum(fail), 0, ...]``. The Pallas steps: up to
  `dispatch.SCAN_FAILING_MAX_ROWS` draft rows, one launch that packs those rows first, one fused
  pick in packed order and one combine back
  (`kernels.full_vocab.scan_failing`); above, a packed launch of at most ``limit`` failing rows and an
  all-rows launch (active only when ``full``). ``None`` where the steps have no packed launch.
  ``q`` (keyword, a Python int or None; the certified mode's unrolled passes): the 0-based pass number;
  the rows of draft slots ``< q`` (final: see ``full_vocab_pass_pick``) are then never scanned, not even
  when ``full``, and get ``fallback`` (the caller keeps their tokens); they count in ``sum(fail)``.
- ``full_vocab_capacity(N, B, V, r, dtype, limit) -> int | None``: ``limit`` where ``scan_failing``
  saves work over one ``full_vocab_pick`` of the active rows, None where it saves nothing (one row
  tile holds every row); the field is None where the steps pick every row whatever they are told
  (the jnp steps): the certified mode then makes one pick per pass.
- ``pruned_pick(logits, lat, prepared, pruned, guess, fallen) -> (tokens [rows] int32, need [rows] int32,
  exact_frac [] float32, V)``: the pruned mode's pick (`xpress_jax.exact`, "The pruned mode"): the
  ``full_vocab_pick`` tokens, scoring exactly only the vocab tiles that an int8 copy of ``w2``
  (``pruned``: `xpress_jax.exact.prepare_pruned`) cannot exclude against a threshold from each row's
  ``guess`` id; ``need`` = per row, the ids its bound could not exclude (the winner among them);
  ``exact_frac`` = the fraction of vocab tiles scored exactly; ``fallen``: score every tile (the plain scan). The jnp spelling
  computes every score and masks the excluded tiles (its tokens depend on the bound being sound);
  ``None`` where the steps have none (the vocabulary-sharded steps).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from . import reference as ref
from .dispatch import SPLIT_LATENT_MAX_ROWS, TABLE_XLA_LATENT_MAX_ROWS
from .head import TOKEN_TABLE

__all__ = ["Ops", "PassPick", "PLATFORMS"]

#: Platforms `Ops.xla` accepts ("gpu" selects the GPU spelling of the readout; same values).
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class PassPick:
    """`Ops.full_vocab_pass_pick` and `Ops.topc_pass_pick` (module doc): ``run(..., q) -> (tokens, s)``, used
    only together with the pick it was built for, ``pick``."""

    pick: Callable[..., Any]
    run: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Ops:
    """One implementation of the per-pass steps (see the module doc for each signature)."""

    name: str
    select: Callable[..., Any]
    topc_prepare: Callable[..., Any]
    topc_pick: Callable[..., Any]
    full_vocab_prepare: Callable[..., Any]
    full_vocab_pick: Callable[..., Any]
    latent: Callable[..., Any]
    start: Callable[..., Any]
    full_vocab_best: Callable[..., Any]
    topc_best: Callable[..., Any]
    candidates_best: Callable[..., Any] | None = None
    full_vocab_capacity: Callable[..., Any] | None = None
    certify: Callable[..., Any] | None = None
    scan_failing: Callable[..., Any] | None = None
    hidden: Callable[..., Any] | None = None
    pruned_pick: Callable[..., Any] | None = None
    split_latent: bool = False
    full_vocab_pass_pick: PassPick | None = None
    topc_pass_pick: PassPick | None = None
    gated_pick: PassPick | None = None

    def pass_pick(self, topc: bool = False) -> PassPick | None:
        """``topc_pass_pick`` (``topc``) or ``full_vocab_pass_pick`` where it belongs to this `Ops`' own
        ``topc_pick`` / ``full_vocab_pick``, else None."""
        pp, pick = ((self.topc_pass_pick, self.topc_pick) if topc else (self.full_vocab_pass_pick, self.full_vocab_pick))
        return pp if pp is not None and pp.pick is pick else None

    @staticmethod
    def xla(platform: str = "cpu") -> "Ops":
        """The jnp reference for every step. ``platform`` (decided by the caller, once): on
        ``"gpu"`` the full-vocab readout dot writes its 16-bit result directly (same values,
        `reference.readout`) and the hidden input is `reference.hidden_input_gpu` (same sums); it
        changes nothing else. One object per platform (a static jit arg)."""
        if platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
        return _xla_ops(platform)

    @staticmethod
    def pallas(interpret: bool = False) -> "Ops":
        """The Pallas-Triton kernels, each step's config from `xpress_jax.dispatch.plan` at trace
        time. Where the plan says XLA (float64; the latent at tiny N) the step runs the jnp
        reference. ``interpret=True`` runs the kernels in interpret mode (CPU tests) and runs a
        kernel wherever one exists (the plan's ``kernels_everywhere``). One object per mode."""
        return _pallas_ops(bool(interpret))


@functools.lru_cache(maxsize=None)
def _xla_ops(platform: str) -> Ops:
    return Ops(
        name="xla",
        select=_xla_select,
        topc_prepare=ref.topc_gather,
        topc_pick=_xla_topc_pick,
        full_vocab_prepare=same,
        full_vocab_pick=functools.partial(_xla_full_vocab_pick, direct_readout=platform == "gpu"),
        latent=_xla_latent,
        start=ref.full_vocab_start,
        full_vocab_best=functools.partial(_xla_full_vocab_best, direct_readout=platform == "gpu"),
        topc_best=ref.topc_pick_best,
        candidates_best=_xla_candidates_best,
        certify=_xla_certify,
        hidden=ref.hidden_input_gpu if platform == "gpu" else None,
        pruned_pick=functools.partial(_xla_pruned_pick, direct_readout=platform == "gpu"),
    )


@functools.lru_cache(maxsize=None)
def _pallas_ops(interpret: bool) -> Ops:
    pick = functools.partial(_pallas_full_vocab, interpret=interpret, best=False)
    tpick = functools.partial(_pallas_topc, interpret=interpret, best=False)
    return Ops(
        name="pallas-interpret" if interpret else "pallas",
        select=functools.partial(_pallas_select, interpret=interpret),
        topc_prepare=_pallas_topc_prepare,
        topc_pick=tpick,
        full_vocab_prepare=same,
        full_vocab_pick=pick,
        latent=functools.partial(_pallas_latent, interpret=interpret),
        start=functools.partial(_pallas_start, interpret=interpret),
        full_vocab_best=functools.partial(_pallas_full_vocab, interpret=interpret, best=True),
        topc_best=functools.partial(_pallas_topc, interpret=interpret, best=True),
        candidates_best=functools.partial(_pallas_topc, interpret=interpret, best=True, ties="id"),
        full_vocab_capacity=functools.partial(_pallas_full_vocab_capacity, interpret=interpret),
        certify=functools.partial(_pallas_certify, interpret=interpret),
        scan_failing=functools.partial(_pallas_scan_failing, interpret=interpret),
        # Interpret mode runs on a CPU: the plain spelling there (the GPU one is for XLA:GPU's fusions).
        hidden=None if interpret else ref.hidden_input_gpu,
        pruned_pick=functools.partial(_pallas_pruned_pick, interpret=interpret),
        split_latent=True,
        full_vocab_pass_pick=PassPick(pick, functools.partial(_pallas_pass_pick, interpret=interpret)),
        topc_pass_pick=PassPick(tpick, functools.partial(_pallas_topc_pass_pick, interpret=interpret)),
        gated_pick=PassPick(pick, functools.partial(_pallas_gated_pick, interpret=interpret)),
    )


def same(w2):
    """The identity ``full_vocab_prepare``: the pick reads ``w2`` itself."""
    return w2


# ----------------------------------------------------------------------------- XLA steps
def _xla_select(logits, c):
    return ref.select_candidates(ref.draft_rows(logits), c)


def _xla_latent(params, xh, blk, prev_ids, split=False):
    # ``split`` is a request the jnp step need not follow: its picks would only add the terms back.
    return ref.latent_pass(params, xh, blk, prev_ids)


def _xla_topc_pick(base_c, cand, lat, w2c):
    return ref.topc_pick(base_c, cand, ref.latent_value(lat, base_c.dtype), w2c)


def _xla_full_vocab_pick(logits, lat, w2, active=None, fallback=None, *, direct_readout: bool, q=None):
    # Every row is picked: XLA has nothing to skip without a conditional (the step's spec allows it).
    return with_fallback(ref.full_vocab_pick(ref.draft_rows(logits), lat, w2, direct_readout=direct_readout),
                         active, fallback)


def with_fallback(tok, active, fallback):
    """``tok`` where ``active``, else ``fallback`` (``fallback`` None: ``tok``)."""
    return tok if fallback is None else jnp.where(active, tok, fallback.astype(tok.dtype))


def _xla_certify(base_c, cand, lat, w2c, tau, max_norm, mex, valid, fallen, limit=None):
    best, best_id = ref.candidates_best(base_c, cand, lat, w2c)
    return ref.certify_rows(best, best_id, lat, tau, max_norm, mex, valid, fallen, limit, base_c.dtype)


def _xla_candidates_best(base_c, cand, lat, w2c, skip=None):
    # Computed whatever ``skip`` says: the step's result is then unspecified, any value will do.
    return ref.candidates_best(base_c, cand, lat, w2c)


def _xla_pruned_pick(logits, lat, w2, prepared, guess, fallen, *, direct_readout: bool):
    return ref.pruned_pick(ref.draft_rows(logits), lat, w2, prepared.q, prepared.scale, prepared.err,
                           prepared.max_norm, guess, fallen, direct_readout=direct_readout)


def _xla_full_vocab_best(logits, lat, w2, *, direct_readout: bool):
    return ref.full_vocab_best(ref.draft_rows(logits), lat, w2, direct_readout=direct_readout)


# ----------------------------------------------------------------------------- Pallas steps
def _plan(n, b, v, r, c, dtype, interpret):
    from . import dispatch

    return dispatch.plan(n, b, v, r, c, dtype, kernels_everywhere=interpret)


def _pallas_select(logits, c, *, interpret):
    from .kernels import select

    n, b, v = logits.shape
    p = _plan(n, b, v, 1, c, logits.dtype, interpret)
    if p.select is None:
        return _xla_select(logits, c)
    # The draft rows of the whole logits, read in place (slot_stride): no logits[:, 1:] copy
    # (RESULTS.md "Top-C selection", evening: N=256 3856 -> 3145 µs per refine).
    return select.select_candidates(logits.reshape(n * b, v), c, slot_stride=b, interpret=interpret, **p.select)


def _pallas_start(logits, *, interpret):
    """`Ops.start`: from `dispatch.FULL_VOCAB_START_SELECT_MIN_ROWS` draft rows the selection's argmax output
    (``c=1``; its rule is `reference.full_vocab_start`'s: NaN as -inf, the lowest id among equal values, -0.0
    equal to +0.0), below it XLA's argmax (`reference.full_vocab_start`), which is faster there."""
    from . import dispatch

    n, b, _ = logits.shape
    if n * (b - 1) < dispatch.FULL_VOCAB_START_SELECT_MIN_ROWS:
        return ref.full_vocab_start(logits)
    return _pallas_select(logits, 1, interpret=interpret)[2]


def _pallas_topc_prepare(w2, cand):
    # The pick kernel gathers the candidates' rows from w2 itself; float64 (the jnp path): w2[cand].
    return ref.topc_gather(w2, cand) if jnp.dtype(w2.dtype) == jnp.float64 else w2


def _pallas_topc(base_c, cand, lat, prepared, skip=None, *, interpret, best, ties="base"):
    """`topc_pick` (``best=False``: ids, the combine kernel) or `topc_best` (``best=True``: the
    splits' (score, base, id) winners from the kernel, combined by the same rule in XLA), or, with
    ``ties="id"``, `candidates_best` (the splits' (score, id) winners by the full-vocab rule). ``skip``:
    the kernel's skip flag (the jnp path ignores it)."""
    from .kernels import topc_pick

    by_id = ties == "id"
    lat_add = None
    if isinstance(lat, ref.LatentSum):  # the residual's terms: the kernel adds them, the jnp path here
        lat, lat_add = (ref.latent_value(lat, base_c.dtype), None) if prepared.ndim == 3 else lat
    if prepared.ndim == 3:  # float64: w2[cand], the jnp path
        if by_id:
            return _xla_candidates_best(base_c, cand, lat, prepared)
        return (ref.topc_pick_best if best else ref.topc_pick)(base_c, cand, lat, prepared)
    rows, c = base_c.shape
    v, r = prepared.shape
    # The plan by draft rows: N = rows, B = 2 gives the same row count.
    p = _plan(rows, 2, v, r, c, base_c.dtype, interpret)
    out = topc_pick.topc_pick(base_c, cand, lat, prepared, config=p.topc, interpret=interpret, partials=best,
                              ties=ties, skip=skip, lat_add=lat_add)
    if by_id:
        return ref.best_by_score(out[0], out[2], axis=0)
    return ref.best_by_topc_rule(*out, axis=0) if best else out


def _pallas_certify(base_c, cand, lat, prepared, tau, max_norm, mex, valid, fallen, limit=None, *, interpret):
    """`certify`: the pick kernel and the certify launch (`kernels.topc_pick.certify`); the jnp
    spelling where the plan has no kernel (float64) or ``limit`` needs more rows than one program holds."""
    from .kernels import topc_pick

    rows, c = base_c.shape
    if prepared.ndim == 3 or (limit is not None and rows > topc_pick.CERTIFY_SINGLE_ROWS):
        best, best_id = _pallas_topc(base_c, cand, lat, prepared, fallen, interpret=interpret, best=True, ties="id")
        return ref.certify_rows(best, best_id, lat, tau, max_norm, mex, valid, fallen, limit, base_c.dtype)
    v, r = prepared.shape
    p = _plan(rows, 2, v, r, c, base_c.dtype, interpret)
    return topc_pick.certify(base_c, cand, lat, prepared, tau, max_norm, mex, valid, fallen, slack=ref.SLACK, limit=limit,
                             interpret=interpret, config=p.topc)


def _pallas_full_vocab(logits, lat, w2, active=None, fallback=None, *, interpret, best, capacity=None, q=None):
    """`full_vocab_pick` (``best=False``: ids, the combine kernel) or `full_vocab_best` (``best=True``:
    the parts' (score, id) winners from the kernel, combined by the same rule in XLA). ``active``:
    the kernel's active rows, unpacked (row tiles without one return at once); with ``capacity`` (not
    part of the step's contract: `_pallas_scan_failing`'s two-launch scan only) the first ``capacity``
    active rows packed into a launch of their own (the plan's config with `dispatch.capacity_config`'s
    ``v_steps``: the same scores). The jnp path ignores both. ``q`` (the pass number, where the caller
    knows it): `_pass_order`'s vocabulary order and L2 hint, as the pass pick has them."""
    from . import dispatch
    from .kernels import full_vocab

    n, b, v = logits.shape
    p = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret)
    if p.full_vocab is None:
        if best:
            return ref.full_vocab_best(ref.draft_rows(logits), lat, w2)
        return with_fallback(ref.full_vocab_pick(ref.draft_rows(logits), lat, w2), active, fallback)
    cfg = p.full_vocab if capacity is None else dispatch.capacity_config(p.full_vocab, v)
    reverse, keep = _pass_order(n * (b - 1), q, cfg)
    out = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=cfg, interpret=interpret,
                                     slot_stride=b, partials=best, active=active, capacity=capacity,
                                     fallback=fallback, reverse=reverse, keep=keep)
    return ref.best_by_score(*out, axis=0) if best else out


def _pallas_gated_pick(logits, lat, w2, active, fallback, flags, *, interpret, q=None):
    """`Ops.gated_pick`'s ``run``: `_pallas_full_vocab`'s tokens (with ``active`` and ``fallback``, pass ``q``'s
    order and hint) and ``flags`` back. The counted launch (its counters in ``flags[2:]``) where the plan's
    config has at most 6 row tiles and `dispatch.CERTIFIED_COUNTED_PICK` is on, else the pick and its combine."""
    from . import dispatch
    from .kernels import full_vocab

    n, b, v = logits.shape
    p = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret)
    cfg = p.full_vocab
    if (cfg is None or not dispatch.CERTIFIED_COUNTED_PICK or flags.shape != (8,) or flags.dtype != jnp.int32
            or full_vocab.cdiv(lat.shape[0], cfg.row_tile) > 6):
        return _pallas_full_vocab(logits, lat, w2, active, fallback, interpret=interpret, best=False, q=q), flags
    reverse, keep = _pass_order(n * (b - 1), q, cfg)
    return full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=cfg, interpret=interpret,
                                      slot_stride=b, active=active, fallback=fallback, reverse=reverse, keep=keep,
                                      counter=flags, counter_at=2)


def _pallas_pass_pick(logits, lat, w2, q, *, interpret, skip=None, keep="served"):
    """`Ops.full_vocab_pass_pick`'s ``run``: pass ``q``'s full-vocab pick. The rows of draft slots ``s..``
    (``s`` from `dispatch.pass_pick_rows`) through the kernel's ``row_ids``, in the plan's all-rows config
    (so each row's token is the one the all-rows pick gives it, bit for bit), ``w2`` read in descending
    order on odd ``q`` up to `dispatch.FULL_VOCAB_ALTERNATE_MAX_ROWS` draft rows. ``skip`` (benchmarks): True
    skips the final slots wherever it can, False never (None: `dispatch.pass_pick_rows`' rule). ``keep``
    (benchmarks): the kernel's ``keep`` (`full_vocab.KEEP_POLICIES`; "served": `dispatch.full_vocab_keep`)."""
    from . import dispatch
    from .kernels import full_vocab

    n, b, v = logits.shape
    rows = n * (b - 1)
    p = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret)
    if p.full_vocab is None:
        return _pallas_full_vocab(logits, lat, w2, interpret=interpret, best=False), 0
    s = dispatch.pass_pick_rows(n, b, q, p.full_vocab.row_tile, min_rows=dispatch.SKIP_FINAL_SLOTS_MIN_ROWS,
                                everywhere=interpret if skip is None else skip)
    if skip is False and s < b - 1:
        s = 0
    if s == b - 1:  # every draft slot is final: nothing to pick
        return jnp.zeros((0,), jnp.int32), s
    reverse, served = _pass_order(rows, q, p.full_vocab)
    ids = None
    if s:  # draft row m*(B-1) + j of slot j >= s, block by block (static)
        ids = _slot_rows(n, b, s)
    if keep == "served":
        keep = served
    tok = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=p.full_vocab, interpret=interpret,
                                     slot_stride=b, reverse=reverse, row_ids=ids, keep=keep)
    return tok, s


def _slot_rows(n: int, b: int, s: int) -> np.ndarray:
    """The draft rows of slots s..B-2 of every block, block by block ([N*(B-1-s)] int32; static)."""
    return (np.arange(n)[:, None] * (b - 1) + np.arange(s, b - 1)[None, :]).reshape(-1).astype(np.int32)


def _pallas_topc_pass_pick(base_c, cand, lat, prepared, q, n, *, interpret, skip=None, keep="served"):
    """`Ops.topc_pass_pick`'s ``run``: pass ``q``'s top-C pick of draft slots ``s..`` (``s`` from
    `dispatch.pass_pick_rows`, one program per row) through the kernel's ``row_ids``, in the plan's
    all-rows config: each row's token is the one the all-rows pick gives it, bit for bit. ``skip`` as in
    `_pallas_pass_pick`; ``keep`` (benchmarks): the kernel's L2 hints (``(hot splits, policy, policy)`` or None;
    "served": `dispatch.topc_keep` of all the draft rows, the same in every pass)."""
    from . import dispatch
    from .kernels import topc_pick

    rows, c = base_c.shape
    b = rows // n + 1
    s = dispatch.pass_pick_rows(n, b, q, 1, min_rows=dispatch.TOPC_SKIP_FINAL_SLOTS_MIN_ROWS,
                                everywhere=interpret if skip is None else skip)
    if skip is False and s < b - 1:
        s = 0
    if s == b - 1:  # every draft slot is final: nothing to pick
        return jnp.zeros((0,), jnp.int32), s
    if prepared.ndim == 3:  # float64: the jnp path picks every row
        return _pallas_topc(base_c, cand, lat, prepared, interpret=interpret, best=False), 0
    v, r = prepared.shape
    p = _plan(rows, 2, v, r, c, base_c.dtype, interpret)
    if keep == "served":
        splits = -(-c // (p.topc.c_tile * p.topc.c_steps))
        keep = dispatch.topc_keep(rows, c, r, jnp.dtype(prepared.dtype).itemsize, splits)
    if s == 0 and keep is None:  # every row
        return _pallas_topc(base_c, cand, lat, prepared, interpret=interpret, best=False), 0
    lat_add = None
    if isinstance(lat, ref.LatentSum):  # the residual's terms: the kernel adds them
        lat, lat_add = lat
    tok = topc_pick.topc_pick(base_c, cand, lat, prepared, config=p.topc, interpret=interpret, lat_add=lat_add,
                              row_ids=_slot_rows(n, b, s) if s else None, keep=keep)
    return tok, s


def _pallas_pruned_pick(logits, lat, w2, prepared, guess, fallen, *, interpret):
    """`pruned_pick`: `kernels.pruned.pruned_pick` with `kernels.pruned.pruned_config` of the plan's
    full-vocab config (the same row, vocab and rank tiles: the scan's scores bit for bit); the jnp
    spelling where the plan has no kernel."""
    from .kernels import pruned

    n, b, v = logits.shape
    p = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret)
    if p.full_vocab is None:
        return _xla_pruned_pick(logits, lat, w2, prepared, guess, fallen, direct_readout=False)
    cfg = pruned.pruned_config(p.full_vocab, lat.shape[1], logits.dtype)
    return pruned.pruned_pick(logits.reshape(n * b, v), lat, w2, prepared.q, prepared.scale, prepared.err,
                              prepared.max_norm, guess, fallen, config=cfg, slot_stride=b, interpret=interpret)


def _pass_order(rows: int, q, config) -> tuple[bool, str | None]:
    """(reverse, keep) of the full-vocab pick of pass ``q`` (None: unknown, ascending and no hint) in
    ``config``: descending on odd passes up to `dispatch.FULL_VOCAB_ALTERNATE_MAX_ROWS` draft rows, and
    `dispatch.full_vocab_keep`'s hint: what `_pallas_pass_pick` does (neither changes a token)."""
    from . import dispatch

    if q is None:
        return False, None
    cap = dispatch.FULL_VOCAB_ALTERNATE_MAX_ROWS
    return q % 2 == 1 and (cap is None or rows <= cap), dispatch.full_vocab_keep(config, rows)


def _final_slots(b: int, q) -> int:
    """The draft slots final before pass ``q`` that a scan skips (0: none, also where ``q`` is None or every
    slot is final: the caller runs no scan then)."""
    return q if q is not None and 0 < q < b - 1 else 0


def _pallas_scan_failing(logits, lat, w2, fail, fallen, fallback, limit, *, interpret, q=None):
    """`scan_failing` (module doc). Up to `dispatch.SCAN_FAILING_MAX_ROWS` draft rows:
    `kernels.full_vocab.scan_failing` with `dispatch.capacity_config`'s split while few rows fail and the
    plan's own split (read at run time) once the pass is full. Above: the packed launch of at most
    ``limit`` failing rows (`_pallas_full_vocab` with ``capacity``) and the all-rows launch, whose
    programs return at once unless the pass is full. Either way a row's token is the plan's pick's
    (the same per-row computation; only the vocabulary split differs). ``q``: the pass number; the
    draft slots before it are skipped (`_final_slots`), in the one launch by the packing, in the
    all-rows launch through the kernel's ``row_ids`` (as the pass pick skips them), which takes the pass
    pick's L2 hint (the loop split where the config holds the latent); the one launch takes it over the
    split read at run time where `dispatch.CERTIFIED_SCAN_KEEP` says so, and is counted (two launches, no
    combine: ``scan_failing``'s ``counted``) where `dispatch.CERTIFIED_COUNTED_SCAN` says so."""
    from . import dispatch
    from .kernels import full_vocab

    n, b, v = logits.shape
    rows = n * (b - 1)
    fv = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret).full_vocab
    if fv is None:
        raise ValueError("scan_failing: no full-vocab kernel serves this dtype (full_vocab_capacity is None there)")
    s = _final_slots(b, q)
    if rows <= dispatch.SCAN_FAILING_MAX_ROWS:
        return full_vocab.scan_failing(logits.reshape(n * b, v), lat, w2, fail, fallen, fallback, limit=int(limit),
                                       config=dispatch.capacity_config(fv, v), v_steps_full=fv.v_steps,
                                       interpret=interpret, slot_stride=b, skip_slots=s,
                                       keep=_pass_order(rows, q, fv)[1] if dispatch.CERTIFIED_SCAN_KEEP else None,
                                       counted=dispatch.CERTIFIED_COUNTED_SCAN)
    fail = fail != 0
    n_fail = jnp.sum(fail, dtype=jnp.int32)
    full = ref.flag_value(fallen) | (n_fail > limit)
    pick = functools.partial(_pallas_full_vocab, logits, lat, w2, interpret=interpret, best=False)
    few = pick(active=fail & ~full, capacity=int(limit))
    if s:  # the slots that are not final, through row_ids; programs return at once unless the pass is full
        ids = _slot_rows(n, b, s)
        reverse, keep = _pass_order(rows, q, fv)
        tok = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fv, interpret=interpret,
                                         slot_stride=b, row_ids=ids, active=jnp.broadcast_to(full, ids.shape),
                                         reverse=reverse, keep=keep)
        every = fallback.astype(jnp.int32).at[ids].set(tok, unique_indices=True)
    else:
        every = pick(active=jnp.broadcast_to(full, (rows,)), q=q)
    return jnp.where(full, every, jnp.where(fail, few, fallback)), ref.make_flags(full, n_fail)


def _pallas_full_vocab_capacity(n, b, v, r, dtype, limit, *, interpret):
    """``limit`` where the packed launch saves work, None where the plan's full-vocab step is the jnp
    reference (float64) or one row tile of its config holds every row (nothing to skip)."""
    fv = _plan(n, b, v, r, 0, dtype, interpret).full_vocab
    if not limit or fv is None or n * (b - 1) <= fv.row_tile:
        return None
    return limit


def _pallas_latent(params, xh, blk, prev_ids, split=False, *, interpret):
    """The plan's latent: the Pallas kernel, or XLA's (`reference.latent_pass`) where the plan says so
    (and with a token table up to `dispatch.TABLE_XLA_LATENT_MAX_ROWS` draft rows). ``split``: XLA's
    latent returns its residual's terms (`reference.LatentSum`) for the top-C pick kernel to add, up to
    `dispatch.SPLIT_LATENT_MAX_ROWS` draft rows (measured faster only there), except in float64 (whose
    picks are the jnp steps). An XLA latent that is not split puts its mixer behind an optimization
    barrier up to `dispatch.MIXER_BARRIER_MAX_ROWS` draft rows (the same values)."""
    from . import dispatch
    from .kernels import latent

    n, b = blk.shape
    v, r = params["w1"].shape
    dtype = params["w1"].dtype
    p = _plan(n, b, v, r, 0, dtype, interpret)
    if p.latent is None or (TOKEN_TABLE in params and n * (b - 1) <= TABLE_XLA_LATENT_MAX_ROWS):
        # with a token table, it reads the table
        split = split and n * (b - 1) <= SPLIT_LATENT_MAX_ROWS and jnp.dtype(dtype) != jnp.float64
        barrier = not split and n * (b - 1) <= (dispatch.MIXER_BARRIER_MAX_ROWS or 0)
        return ref.latent_pass(params, xh, blk, prev_ids, split=split, barrier=barrier)
    return latent.latent_pass(params, xh, blk, prev_ids, config=p.latent, interpret=interpret)
