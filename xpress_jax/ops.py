"""`Ops`: one implementation of the refine steps, as a frozen dataclass of step functions.

Each step has one signature (below) and three implementations side by side: the jnp reference
(`xpress_jax.reference`, the tests' oracle), the fast XLA spelling (`xpress_jax.xla_ops`, what ``backend="xla"``
runs) and the Pallas-Triton kernels (`xpress_jax.kernels`, each step's config from `xpress_jax.dispatch` at trace
time). ``Ops.xla(platform)`` is the XLA path (``reference=True``: every step the reference's);
``Ops.pallas(interpret, table)`` the kernels, interpret mode and the table bound once, where the steps are built;
`Ops.for_dtype` gives the steps a call's dtype runs (float64: the jnp steps of `Ops.float64`), settled once per call
where `xpress_jax.refine` chooses them. A kernel step calls its kernel's wrapper, which calls ``pallas_call``.
`xpress_jax.refine.refine_with` runs any `Ops` (a static jit argument); mix them with `dataclasses.replace`::

    mixed = dataclasses.replace(Ops.pallas(), latent=Ops.xla(platform="gpu").latent)
    draft = refine_with(mixed, head, logits, h, anchors)

The steps (static shapes; ``rows`` = N * (B-1) draft rows, the draft slots of each block in order):

- ``select(logits [N,B,V], c) -> (cand [rows,c] int32, base_c [rows,c], start [rows] int32)``: each draft
  slot's C largest base logits and its full-vocab argmax.
- ``start(logits) -> [rows] int32``: the full-vocab argmax of the base logits.
- ``latent(params, xh [N,B,r], blk [N,B] int32, prev_ids [N] int32, terms=False) -> [N,B-1,r]``; with
  ``terms=True`` possibly a `reference.LatentSum` that only the top-C picks accept; ``latent_terms``: whether
  the modes ask for it (top-C passes).
- ``hidden(params, h [N,B,H]) -> xh [N,B,r]``: None means `xpress_jax.head.hidden_input`.
- The picks of a pass return the tokens of draft slots ``s..B-2`` of every block, ``[N*(B-1-s)] int32``, and
  ``s``: ``q`` (the 0-based pass, ``q < B-1``; None: every slot) lets a pick leave out the slots before
  ``s <= q``, which are final, and change the order it reads ``w2`` in, never a token:

  - ``topc_prepare(w2, cand) -> prepared`` (once per call; XLA: ``w2[cand]``, the kernel: ``w2``) and
    ``topc_pick(base_c, cand, lat [rows,r], prepared, q=None, slots=None) -> (tokens, s)`` (``slots``: B-1, the
    rows' layout): replace both or neither;
  - ``full_vocab_prepare(w2) -> prepared`` and ``full_vocab_pick(logits, lat, prepared, q=None, active=None,
    fallback=None) -> (tokens, s)``: with ``active`` (a device value; the kernel skips row tiles without an active
    row) every row, inactive rows returning ``fallback`` (``s`` = 0);
  - ``full_vocab_sample(logits, lat, prepared, seeds [rows] int32, inv_t, proposal=None, q=None) -> (tokens,
    extras, s)`` and ``topc_sample(base_c, cand, lat, prepared, seeds, inv_t, proposal=None, q=None,
    slots=None)``: the sampled picks (`xpress_jax.sampling`; ``lat`` None: the seed block, scored on the base
    logits); ``extras`` None, or with a ``proposal`` (token_score [rows] float32, lse [rows] float32, scores or
    None) (`reference.sample_extras`), every slot.
- ``full_vocab_best(logits, lat, prepared) -> (score [rows] f32, id)``, ``topc_best(base_c, cand, lat, prepared) ->
  (score, base, id)``: the picks with the winner's values (`xpress_jax.sharded` combines them).
- The certified mode's steps (`xpress_jax.exact`, docs/certified.md; None where an implementation lacks them):
  ``candidates_best(base_c, cand, lat, prepared, skip=None) -> (score, id)``, ``certify(base_c, cand, lat, prepared,
  tau, max_norm, mex, valid, fallen, limit=None) -> (best_id, fail, act, flags)``, ``scan_failing(logits, lat,
  prepared, fail, fallen, fallback, limit, q=None) -> (tokens, flags)``, ``full_vocab_capacity(N, B, V, r, dtype,
  limit) -> int | None``, ``gated_pick(logits, lat, prepared, active, fallback, flags, q=None) -> (tokens, flags)``
  (``full_vocab_pick``'s tokens from a launch that writes nothing where no row is active; ``flags`` int32 [8]).
- ``numbered``: the picks read the pass number (unrolled passes then run as a Python loop, each told its number).
- ``thresholds``: the `dispatch.Thresholds` the pass loop and the certified mode read (the table's for Pallas).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from . import dispatch
from . import reference as ref
from . import xla_ops
from .head import TOKEN_TABLE
from .kernels import full_vocab, latent, select, topc_pick
from .kernels.common import cdiv

__all__ = ["Ops", "PLATFORMS", "same"]

#: Platforms `Ops.xla` accepts ("gpu" selects the GPU spelling of the readout; same values).
PLATFORMS = ("cpu", "gpu", "tpu")


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
    full_vocab_sample: Callable[..., Any] | None = None
    topc_sample: Callable[..., Any] | None = None
    candidates_best: Callable[..., Any] | None = None
    full_vocab_capacity: Callable[..., Any] | None = None
    certify: Callable[..., Any] | None = None
    scan_failing: Callable[..., Any] | None = None
    gated_pick: Callable[..., Any] | None = None
    hidden: Callable[..., Any] | None = None
    latent_terms: bool = False
    numbered: bool = False
    float64: "Ops | None" = None
    thresholds: dispatch.Thresholds = dispatch.Thresholds()

    def for_dtype(self, dtype) -> "Ops":
        """The steps a call in ``dtype`` runs: `float64` (the jnp steps where the kernels have none) for float64
        where set, else these."""
        return self.float64 if self.float64 is not None and jnp.dtype(dtype) == jnp.float64 else self

    @staticmethod
    def xla(platform: str = "cpu", reference: bool = False) -> "Ops":
        """The jnp steps: `xpress_jax.xla_ops`'s fast top-C selection (the same candidates, in an order that may
        differ) and the reference's other steps; on ``"gpu"`` the GPU spellings of the readout and hidden input
        (the same values). ``reference=True``: every step the plain reference (`xpress_jax.reference`), the oracle."""
        if platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
        return _xla_ops(platform, bool(reference))

    @staticmethod
    def pallas(interpret: bool = False, table: dispatch.Table | None = None) -> "Ops":
        """The kernels with `dispatch.plan`'s configs over ``table`` (None: `dispatch.TABLE` in interpret mode, else
        `dispatch.device_table`, this GPU family's); ``interpret=True`` (CPU tests) runs a kernel wherever one exists.
        Float64 calls run `float64`'s jnp steps. One object per (mode, table)."""
        if table is None:
            table = dispatch.TABLE if interpret else dispatch.device_table()
        if not isinstance(table, dispatch.Table):
            raise TypeError(f"table must be a dispatch.Table, got {type(table).__name__}")
        return _pallas_ops(bool(interpret), table)


@functools.lru_cache(maxsize=None)
def _xla_ops(platform: str, reference: bool = False) -> Ops:
    gpu = platform == "gpu"
    select = _xla_select if reference else functools.partial(_xla_fast_select, method=xla_ops.PLATFORM_METHOD[platform])
    return Ops(
        name="xla-reference" if reference else "xla",
        select=select,
        topc_prepare=ref.topc_gather if reference else xla_ops.topc_prepare,
        topc_pick=_xla_topc_pick,
        full_vocab_prepare=same,
        full_vocab_pick=functools.partial(_xla_full_vocab_pick, direct_readout=gpu),
        latent=_xla_latent,
        start=ref.full_vocab_start,
        full_vocab_best=functools.partial(_xla_full_vocab_best, direct_readout=gpu),
        topc_best=ref.topc_pick_best,
        full_vocab_sample=_xla_sampled(functools.partial(_xla_full_vocab_sample, direct_readout=gpu)),
        topc_sample=_xla_sampled(ref.topc_sample),
        candidates_best=_xla_candidates_best,
        certify=_xla_certify,
        hidden=ref.hidden_input_gpu if gpu else None,
    )


@functools.lru_cache(maxsize=None)
def _pallas_ops(interpret: bool, table: dispatch.Table) -> Ops:
    kw = dict(interpret=interpret, table=table)
    # Interpret mode runs on a CPU: the plain spelling there (the GPU one is for XLA:GPU's fusions).
    hidden = None if interpret else functools.partial(ref.hidden_input_gpu, materialize=table.thresholds.materialize_xh)
    # Float64: the jnp steps (no kernel computes in it), the selection, start and latent as the table says.
    float64 = Ops(
        name="pallas-float64",
        select=functools.partial(_pallas_select, **kw),
        topc_prepare=ref.topc_gather,
        topc_pick=_xla_topc_pick,
        full_vocab_prepare=same,
        full_vocab_pick=functools.partial(_xla_full_vocab_pick, direct_readout=False),
        latent=functools.partial(_pallas_latent, **kw),
        start=functools.partial(_pallas_start, **kw),
        full_vocab_best=functools.partial(_xla_full_vocab_best, direct_readout=False),
        topc_best=ref.topc_pick_best,
        full_vocab_sample=_xla_sampled(functools.partial(_xla_full_vocab_sample, direct_readout=not interpret)),
        topc_sample=_xla_sampled(ref.topc_sample),
        candidates_best=_xla_candidates_best,
        certify=_xla_certify,
        hidden=hidden,
        numbered=True,
        thresholds=table.thresholds,
    )
    return Ops(
        name="pallas-interpret" if interpret else "pallas",
        select=functools.partial(_pallas_select, **kw),
        topc_prepare=_kernel_gathers,
        topc_pick=functools.partial(_pallas_topc_pick, **kw),
        full_vocab_prepare=same,
        full_vocab_pick=functools.partial(_pallas_full_vocab_pick, **kw),
        latent=functools.partial(_pallas_latent, **kw),
        start=functools.partial(_pallas_start, **kw),
        full_vocab_best=functools.partial(_pallas_full_vocab_best, **kw),
        topc_best=functools.partial(_pallas_topc_best, **kw),
        full_vocab_sample=functools.partial(_pallas_full_vocab_sample, **kw),
        topc_sample=functools.partial(_pallas_topc_sample, **kw),
        candidates_best=functools.partial(_pallas_topc_best, ties="id", **kw),
        full_vocab_capacity=functools.partial(_pallas_full_vocab_capacity, **kw),
        certify=functools.partial(_pallas_certify, **kw),
        scan_failing=functools.partial(_pallas_scan_failing, **kw),
        gated_pick=functools.partial(_pallas_gated_pick, **kw),
        hidden=hidden,
        latent_terms=True,
        numbered=True,
        float64=float64,
        thresholds=table.thresholds,
    )


def same(w2):  # the identity ``full_vocab_prepare``: the pick reads ``w2`` itself
    return w2


# ----------------------------------------------------------------------------- XLA steps
def _xla_select(logits, c):
    return ref.select_candidates(ref.draft_rows(logits), c)


def _xla_fast_select(logits, c, *, method):
    return xla_ops.select_candidates(ref.draft_rows(logits), c, method=method)


def _xla_latent(params, xh, blk, prev_ids, terms=False):  # ``terms``: a request the jnp step need not follow
    return ref.latent_pass(params, xh, blk, prev_ids)


def _xla_topc_pick(base_c, cand, lat, w2c, q=None, slots=None):  # every slot: ``q`` and ``slots`` unused
    return xla_ops.topc_pick(base_c, cand, ref.latent_value(lat, base_c.dtype), w2c), 0


def _xla_full_vocab_pick(logits, lat, w2, q=None, active=None, fallback=None, *, direct_readout: bool):
    return with_fallback(ref.full_vocab_pick(ref.draft_rows(logits), lat, w2, direct_readout=direct_readout),
                         active, fallback), 0


def _xla_full_vocab_sample(logits, lat, w2, seeds, inv_t, proposal=None, *, direct_readout: bool):
    return ref.full_vocab_sample(ref.draft_rows(logits), lat, w2, seeds, inv_t, proposal, direct_readout=direct_readout)


def _xla_sampled(step):
    """A jnp sampled pick as an `Ops` step: every row (``q`` and ``slots`` unused), so ``s`` = 0."""
    def run(*args, q=None, slots=None, **kw):
        return (*step(*args, **kw), 0)
    return run


def with_fallback(tok, active, fallback):
    return tok if fallback is None else jnp.where(active, tok, fallback.astype(tok.dtype))


def _xla_certify(base_c, cand, lat, w2c, tau, max_norm, mex, valid, fallen, limit=None):
    best, best_id = ref.candidates_best(base_c, cand, lat, w2c)
    return ref.certify_rows(best, best_id, lat, tau, max_norm, mex, valid, fallen, limit, base_c.dtype)


def _xla_candidates_best(base_c, cand, lat, w2c, skip=None):  # a skipped step's result is unspecified
    return ref.candidates_best(base_c, cand, lat, w2c)


def _xla_full_vocab_best(logits, lat, w2, *, direct_readout: bool):
    return ref.full_vocab_best(ref.draft_rows(logits), lat, w2, direct_readout=direct_readout)


# ----------------------------------------------------------------------------- Pallas steps
def _plan(n, b, v, r, c, dtype, interpret, table):
    return dispatch.plan(n, b, v, r, c, dtype, table=table, kernels_everywhere=interpret)


def _topc_config(table: dispatch.Table, rows: int, c: int, r: int, dtype) -> topc_pick.TopCConfig | None:
    """The table's top-C pick config for ``rows`` draft rows, checked at these shapes (None: no rows)."""
    if rows == 0:
        return None
    cfg = table.entry(rows).topc
    cfg.check_shape(rows, c, r, jnp.dtype(dtype))
    return cfg


def _latent_terms(lat):
    """(lat, lat_add) for the top-C kernel: a `reference.LatentSum`'s two terms (the kernel adds them), else
    (lat, None)."""
    return tuple(lat) if isinstance(lat, ref.LatentSum) else (lat, None)


def _slot_rows(n: int, b: int, s: int) -> np.ndarray:
    """The draft rows of slots s..B-2 of every block ([N*(B-1-s)] int32; static)."""
    return (np.arange(n)[:, None] * (b - 1) + np.arange(s, b - 1)[None, :]).reshape(-1).astype(np.int32)


def _pass_order(p: dispatch.Plan, q, config) -> tuple[bool, str | None]:
    """(reverse, keep) of pass ``q``'s full-vocab pick (``q`` None: ascending, no hint); neither changes a token."""
    if q is None:
        return False, None
    return q % 2 == 1 and p.entry.switches.alternate, p.entry.keep(config)


def _pallas_select(logits, c, *, interpret, table):
    n, b, v = logits.shape
    p = _plan(n, b, v, 1, c, logits.dtype, interpret, table)
    if p.select is None:
        return _xla_select(logits, c)
    # The draft rows of the whole logits, read in place (slot_stride): no logits[:, 1:] copy.
    return select.select_candidates(logits.reshape(n * b, v), c, slot_stride=b, interpret=interpret, **p.select)


def _pallas_start(logits, *, interpret, table):
    """`Ops.start`: the selection's argmax (``c=1``) where the entry's ``start_select`` says so, else XLA's."""
    n, b, _ = logits.shape
    if not table.entry(n * (b - 1)).switches.start_select:
        return ref.full_vocab_start(logits)
    return _pallas_select(logits, 1, interpret=interpret, table=table)[2]


def _kernel_gathers(w2, cand):  # the top-C ``prepare``: the pick kernel gathers the candidates' rows from w2 itself
    return w2


def _pallas_topc_pick(base_c, cand, lat, w2, q=None, slots=None, *, interpret, table):
    """`Ops.topc_pick`: the pick kernel; pass ``q`` of blocks of ``slots`` draft slots: the slots ``s..`` as
    ``row_ids`` (`dispatch.pass_pick_rows`, one program per row) and `dispatch.Table.topc_keep`'s L2 hints."""
    rows, c = base_c.shape
    r = w2.shape[1]
    cfg = _topc_config(table, rows, c, r, base_c.dtype)
    lat, lat_add = _latent_terms(lat)
    s, kw = 0, {}
    if q is not None:
        skip = table.entry(rows).switches.topc_skip_final_slots
        s = dispatch.pass_pick_rows(rows // slots, slots + 1, q, 1, skip=skip, everywhere=interpret)
        kw["keep"] = table.topc_keep(rows, c, r, jnp.dtype(w2.dtype).itemsize, cdiv(c, cfg.c_tile * cfg.c_steps))
        kw["row_ids"] = _slot_rows(rows // slots, slots + 1, s) if s else None
    return topc_pick.topc_pick(base_c, cand, lat, w2, config=cfg, interpret=interpret, lat_add=lat_add, **kw), s


def _pallas_topc_best(base_c, cand, lat, w2, skip=None, *, interpret, table, ties="base"):
    """`Ops.topc_best` (the splits' winners combined in XLA) or, ``ties="id"``, `Ops.candidates_best`."""
    rows, c = base_c.shape
    cfg = _topc_config(table, rows, c, w2.shape[1], base_c.dtype)
    lat, lat_add = _latent_terms(lat)
    out = topc_pick.topc_pick(base_c, cand, lat, w2, config=cfg, interpret=interpret, partials=True, ties=ties,
                              skip=skip, lat_add=lat_add)
    return ref.best_by_score(out[0], out[2], axis=0) if ties == "id" else ref.best_by_topc_rule(*out, axis=0)


def _pallas_topc_sample(base_c, cand, lat, w2, seeds, inv_t, proposal=None, q=None, slots=None, *, interpret,
                        table):
    """`Ops.topc_sample`: the pick kernel with the noise (`topc_pick.topc_pick`'s ``seeds``); the jnp spelling for
    the seed block (``lat`` None). Pass ``q`` (no proposal): the greedy pick's slots and hints (`_pallas_topc_pick`)."""
    if lat is None:
        return (*ref.topc_sample(base_c, cand, None, w2, seeds, inv_t, proposal), 0)
    lat, lat_add = _latent_terms(lat)
    rows, c = base_c.shape
    r = w2.shape[1]
    cfg = _topc_config(table, rows, c, r, base_c.dtype)
    s, kw = 0, {}
    if q is not None and proposal is None:
        skip = table.entry(rows).switches.topc_skip_final_slots
        s = dispatch.pass_pick_rows(rows // slots, slots + 1, q, 1, skip=skip, everywhere=interpret)
        kw = dict(row_ids=_slot_rows(rows // slots, slots + 1, s)) if s else {}
    if q is not None:
        kw["keep"] = table.topc_keep(rows, c, r, jnp.dtype(w2.dtype).itemsize, cdiv(c, cfg.c_tile * cfg.c_steps))
    out = topc_pick.topc_pick(base_c, cand, lat, w2, config=cfg, interpret=interpret, lat_add=lat_add, seeds=seeds,
                              inv_t=inv_t, proposal=proposal, **kw)
    return (*out, s) if proposal is not None else (out, None, s)


def _pallas_certify(base_c, cand, lat, w2, tau, max_norm, mex, valid, fallen, limit=None, *, interpret, table):
    """`certify`: the pick and certify kernels; jnp where ``limit`` needs more rows than one program holds."""
    rows, c = base_c.shape
    if limit is not None and rows > topc_pick.CERTIFY_SINGLE_ROWS:
        best, best_id = _pallas_topc_best(base_c, cand, lat, w2, fallen, interpret=interpret, table=table, ties="id")
        return ref.certify_rows(best, best_id, lat, tau, max_norm, mex, valid, fallen, limit, base_c.dtype)
    return topc_pick.certify(base_c, cand, lat, w2, tau, max_norm, mex, valid, fallen, slack=ref.SLACK, limit=limit,
                             interpret=interpret, config=_topc_config(table, rows, c, w2.shape[1], base_c.dtype))


def _pallas_full_vocab_pick(logits, lat, w2, q=None, active=None, fallback=None, *, interpret, table):
    """`Ops.full_vocab_pick`: the fused pick kernel, reading the draft rows of the whole logits in place; pass ``q``
    (without ``active``): the slots ``s..`` as ``row_ids`` (`dispatch.pass_pick_rows`), and its read order and hint
    (`_pass_order`). jnp where the plan has no kernel (no rows)."""
    n, b, v = logits.shape
    fv = (p := _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret, table)).full_vocab
    if fv is None:
        return with_fallback(ref.full_vocab_pick(ref.draft_rows(logits), lat, w2), active, fallback), 0
    s = 0
    if q is not None and active is None:
        s = dispatch.pass_pick_rows(n, b, q, fv.row_tile, skip=p.entry.switches.skip_final_slots, everywhere=interpret)
    reverse, keep = _pass_order(p, q, fv)
    return full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fv, interpret=interpret, slot_stride=b,
                                      active=active, fallback=fallback, reverse=reverse, keep=keep,
                                      row_ids=_slot_rows(n, b, s) if s else None), s


def _pallas_full_vocab_best(logits, lat, w2, *, interpret, table):
    """`Ops.full_vocab_best`: the fused pick's parts, their winners combined in XLA."""
    n, b, v = logits.shape
    fv = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret, table).full_vocab
    if fv is None:
        return ref.full_vocab_best(ref.draft_rows(logits), lat, w2)
    out = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fv, interpret=interpret, slot_stride=b,
                                     partials=True)
    return ref.best_by_score(*out, axis=0)


def _pallas_full_vocab_sample(logits, lat, w2, seeds, inv_t, proposal=None, q=None, *, interpret, table):
    """`Ops.full_vocab_sample`: the fused pick with the noise (`full_vocab.full_vocab_pick`'s ``seeds``), reading the
    draft rows of the whole logits in place; the jnp spelling for the seed block (``lat`` None). Pass ``q`` (no
    proposal): the greedy pick's slots and read order (`_pallas_full_vocab_pick`)."""
    n, b, v = logits.shape
    p = None if lat is None else _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret, table)
    if p is None or p.full_vocab is None:
        return (*_xla_full_vocab_sample(logits, lat, w2, seeds, inv_t, proposal, direct_readout=not interpret), 0)
    s, kw = 0, {}
    if q is not None and proposal is None:
        s = dispatch.pass_pick_rows(n, b, q, p.full_vocab.row_tile, skip=p.entry.switches.skip_final_slots,
                                    everywhere=interpret)
        reverse, keep = _pass_order(p, q, p.full_vocab)
        kw = dict(reverse=reverse, keep=keep, row_ids=_slot_rows(n, b, s) if s else None)
    out = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=p.full_vocab, interpret=interpret,
                                     slot_stride=b, seeds=seeds, inv_t=inv_t, proposal=proposal, **kw)
    return (*out, s) if proposal is not None else (out, None, s)


def _pallas_gated_pick(logits, lat, w2, active, fallback, flags, q=None, *, interpret, table):
    """`Ops.gated_pick`: the counted launch (counters in ``flags[2:]``) up to the table's ``gated_row_tiles`` row
    tiles, else the pick."""
    n, b, v = logits.shape
    p = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret, table)
    fv = p.full_vocab
    if (fv is None or flags.shape != (8,) or flags.dtype != jnp.int32
            or full_vocab.cdiv(lat.shape[0], fv.row_tile) > table.thresholds.gated_row_tiles):
        pick = _pallas_full_vocab_pick(logits, lat, w2, q, active, fallback, interpret=interpret, table=table)[0]
        return pick, flags
    reverse, keep = _pass_order(p, q, fv)
    return full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fv, interpret=interpret,
                                      slot_stride=b, active=active, fallback=fallback, reverse=reverse, keep=keep,
                                      counter=flags, counter_at=2)


def _pallas_scan_failing(logits, lat, w2, fail, fallen, fallback, limit, *, interpret, table, q=None):
    """`scan_failing`: where ``scan_one_launch`` says so `full_vocab.scan_failing` (one counted launch), else the
    packed launch of at most ``limit`` failing rows and the all-rows launch, whose programs return at once unless
    the pass is full. A row's token is the plan's pick's either way; draft slots before ``q`` are never scanned."""
    n, b, v = logits.shape
    rows = n * (b - 1)
    p = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret, table)
    fv = p.full_vocab
    if fv is None:
        raise ValueError("scan_failing: no full-vocab kernel serves these shapes (full_vocab_capacity is None there)")
    s = q if q is not None and 0 < q < b - 1 else 0
    if p.entry.switches.scan_one_launch:
        return full_vocab.scan_failing(logits.reshape(n * b, v), lat, w2, fail, fallen, fallback, limit=int(limit),
                                       config=table.capacity_config(fv, v), v_steps_full=fv.v_steps,
                                       interpret=interpret, slot_stride=b, skip_slots=s)
    fail = fail != 0
    n_fail = jnp.sum(fail, dtype=jnp.int32)
    full = ref.flag_value(fallen) | (n_fail > limit)
    few_rows = fail & ~full
    few = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=table.capacity_config(fv, v),
                                     interpret=interpret, slot_stride=b, active=few_rows, capacity=int(limit))
    if s:  # the slots that are not final, through row_ids; programs return at once unless the pass is full
        ids = _slot_rows(n, b, s)
        reverse, keep = _pass_order(p, q, fv)
        tok = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fv, interpret=interpret,
                                         slot_stride=b, row_ids=ids, active=jnp.broadcast_to(full, ids.shape),
                                         reverse=reverse, keep=keep)
        every = fallback.astype(jnp.int32).at[ids].set(tok, unique_indices=True)
    else:
        every_rows = jnp.broadcast_to(full, (rows,))
        reverse, keep = _pass_order(p, q, fv)
        every = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fv, interpret=interpret,
                                           slot_stride=b, active=every_rows, reverse=reverse, keep=keep)
    return jnp.where(full, every, jnp.where(fail, few, fallback)), ref.make_flags(full, n_fail)


def _pallas_full_vocab_capacity(n, b, v, r, dtype, limit, *, interpret, table):
    """``limit`` where the packed launch saves work, None where there is no kernel or one row tile holds every row."""
    fv = _plan(n, b, v, r, 0, dtype, interpret, table).full_vocab
    if not limit or fv is None or n * (b - 1) <= fv.row_tile:
        return None
    return limit


def _pallas_latent(params, xh, blk, prev_ids, terms=False, *, interpret, table):
    """The plan's latent kernel, or XLA's where the plan (or, with a token table, ``table_latent``) says so; XLA's is
    in two terms where asked and ``latent_terms`` says so, else its mixer behind a barrier where ``mixer_barrier``."""
    n, b = blk.shape
    v, r = params["w1"].shape
    p = _plan(n, b, v, r, 0, params["w1"].dtype, interpret, table)
    if p.latent is None or (TOKEN_TABLE in params and p.entry.switches.table_latent):
        terms = terms and p.entry.switches.latent_terms
        barrier = not terms and p.entry.switches.mixer_barrier
        return ref.latent_pass(params, xh, blk, prev_ids, terms=terms, barrier=barrier)
    return latent.latent_pass(params, xh, blk, prev_ids, config=p.latent, interpret=interpret)
