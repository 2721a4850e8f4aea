"""`Ops`: one implementation of the refine steps, as a frozen dataclass of step functions.

``Ops.xla(platform)`` is the jnp path: the reference's steps (`xpress_jax.reference`) with the top-C selection of
`xpress_jax.xla_ops` (the same candidates; ``Ops.xla(platform, reference=True)``: every step the reference's);
``Ops.pallas(interpret, table)`` the Pallas-Triton kernels, each step's config from `xpress_jax.dispatch.plan` over
``table`` at trace time.
`xpress_jax.refine.refine_with` runs any `Ops` (a static jit argument); mix them with `dataclasses.replace`::

    mixed = dataclasses.replace(Ops.pallas(), latent=Ops.xla(platform="gpu").latent)
    draft = refine_with(mixed, head, logits, h, anchors)

The steps (static shapes; ``rows`` = N * (B-1) draft rows):

- ``select(logits [N,B,V], c) -> (cand [rows,c] int32, base_c [rows,c], start [rows] int32)``: each draft
  slot's C largest base logits and its full-vocab argmax.
- ``topc_prepare(w2, cand) -> prepared`` (once per call; XLA: ``w2[cand]``, the kernel: ``w2``) and
  ``topc_pick(base_c, cand, lat [rows,r], prepared) -> [rows] int32``: replace both or neither.
- ``full_vocab_prepare(w2) -> prepared`` and ``full_vocab_pick(logits, lat, prepared, active=None,
  fallback=None, q=None) -> [rows] int32``: only the ``active`` rows' tokens are wanted (a device value; the
  kernel skips row tiles without one), inactive rows return ``fallback``; ``q`` (the 0-based pass, unrolled
  passes) may change the order ``w2`` is read in, never a token.
- ``full_vocab_pass_pick`` / ``topc_pass_pick``: None or a `PassPick` whose ``run(logits, lat, prepared, q)``
  / ``run(base_c, cand, lat, prepared, q, n)`` returns ``(tokens [N*(B-1-s)] int32, s)``: the plain pick's
  tokens of draft slots ``s..B-2``, ``s <= min(q, B-1)``. Used only while ``PassPick.pick`` is this `Ops`' pick.
- ``gated_pick``: None or a `PassPick` whose ``run(logits, lat, prepared, active, fallback, flags, q=None) ->
  (tokens, flags)`` writes nothing where no row is active (the certified mode; ``flags`` int32 [8]).
- ``full_vocab_sample(logits, lat, prepared, seeds [rows] int32, inv_t, proposal=None, q=None) -> (tokens, extras,
  s)`` and ``topc_sample(base_c, cand, lat, prepared, seeds, inv_t, proposal=None, q=None, n=None)``: the sampled
  picks (`xpress_jax.sampling`; ``lat`` None: the seed block, scored on the base logits); ``extras`` None, or with a
  ``proposal`` (token_score [rows] float32, lse [rows] float32, scores or None) (`reference.sample_extras`).
  ``q`` (unrolled passes, no proposal) as for the pass picks: the tokens of draft slots ``s..B-2`` only.
- ``latent(params, xh [N,B,r], blk [N,B] int32, prev_ids [N] int32, split=False) -> [N,B-1,r]``; with
  ``split=True`` possibly a `reference.LatentSum` that only ``topc_pick`` accepts; ``split_latent``: whether
  `xpress_jax.refine` asks for it (top-C passes).
- ``hidden(params, h [N,B,H]) -> xh [N,B,r]``: None means `xpress_jax.head.hidden_input`.
- ``thresholds``: the `dispatch.Thresholds` the pass loop and the certified mode read (the table's for Pallas).
- ``start(logits) -> [rows] int32``: the full-vocab argmax of the base logits.
- ``full_vocab_best(logits, lat, prepared) -> (score [rows] f32, id)``, ``topc_best(base_c, cand, lat, prepared) ->
  (score, base, id)``: the picks with the winner's values (`xpress_jax.sharded` combines them).
- The certified mode's steps (`xpress_jax.exact`, docs/certified.md; None where an implementation lacks them):
  ``candidates_best(base_c, cand, lat, prepared, skip=None) -> (score, id)``, ``certify(base_c, cand, lat, prepared,
  tau, max_norm, mex, valid, fallen, limit=None) -> (best_id, fail, act, flags)``, ``scan_failing(logits, lat,
  prepared, fail, fallen, fallback, limit, q=None) -> (tokens, flags)``, ``full_vocab_capacity(N, B, V, r, dtype,
  limit) -> int | None``.
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

__all__ = ["Ops", "PassPick", "PLATFORMS"]

#: Platforms `Ops.xla` accepts ("gpu" selects the GPU spelling of the readout; same values).
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class PassPick:
    """A pick told which pass it serves (module doc): ``run``, used only together with ``pick``."""

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
    full_vocab_sample: Callable[..., Any] | None = None
    topc_sample: Callable[..., Any] | None = None
    candidates_best: Callable[..., Any] | None = None
    full_vocab_capacity: Callable[..., Any] | None = None
    certify: Callable[..., Any] | None = None
    scan_failing: Callable[..., Any] | None = None
    hidden: Callable[..., Any] | None = None
    split_latent: bool = False
    full_vocab_pass_pick: PassPick | None = None
    topc_pass_pick: PassPick | None = None
    gated_pick: PassPick | None = None
    thresholds: dispatch.Thresholds = dispatch.Thresholds()

    def pass_pick(self, topc: bool = False) -> PassPick | None:
        """``topc_pass_pick`` (``topc``) or ``full_vocab_pass_pick`` where it belongs to this `Ops`' own pick."""
        pp, pick = (self.topc_pass_pick, self.topc_pick) if topc else (self.full_vocab_pass_pick, self.full_vocab_pick)
        return pp if pp is not None and pp.pick is pick else None

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
        One object per (mode, table)."""
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
    pick = functools.partial(_pallas_full_vocab, best=False, **kw)
    tpick = functools.partial(_pallas_topc, best=False, **kw)
    return Ops(
        name="pallas-interpret" if interpret else "pallas",
        select=functools.partial(_pallas_select, **kw),
        topc_prepare=_pallas_topc_prepare,
        topc_pick=tpick,
        full_vocab_prepare=same,
        full_vocab_pick=pick,
        latent=functools.partial(_pallas_latent, **kw),
        start=functools.partial(_pallas_start, **kw),
        full_vocab_best=functools.partial(_pallas_full_vocab, best=True, **kw),
        topc_best=functools.partial(_pallas_topc, best=True, **kw),
        full_vocab_sample=functools.partial(_pallas_full_vocab_sample, **kw),
        topc_sample=functools.partial(_pallas_topc_sample, **kw),
        candidates_best=functools.partial(_pallas_topc, best=True, ties="id", **kw),
        full_vocab_capacity=functools.partial(_pallas_full_vocab_capacity, **kw),
        certify=functools.partial(_pallas_certify, **kw),
        scan_failing=functools.partial(_pallas_scan_failing, **kw),
        # Interpret mode runs on a CPU: the plain spelling there (the GPU one is for XLA:GPU's fusions).
        hidden=None if interpret else functools.partial(ref.hidden_input_gpu,
                                                        materialize=table.thresholds.materialize_xh),
        split_latent=True,
        full_vocab_pass_pick=PassPick(pick, functools.partial(_pallas_pass_pick, **kw)),
        topc_pass_pick=PassPick(tpick, functools.partial(_pallas_topc_pass_pick, **kw)),
        gated_pick=PassPick(pick, functools.partial(_pallas_gated_pick, **kw)),
        thresholds=table.thresholds,
    )


def same(w2):  # the identity ``full_vocab_prepare``: the pick reads ``w2`` itself
    return w2


# ----------------------------------------------------------------------------- XLA steps
def _xla_select(logits, c):
    return ref.select_candidates(ref.draft_rows(logits), c)


def _xla_fast_select(logits, c, *, method):
    return xla_ops.select_candidates(ref.draft_rows(logits), c, method=method)


def _xla_latent(params, xh, blk, prev_ids, split=False):  # ``split``: a request the jnp step need not follow
    return ref.latent_pass(params, xh, blk, prev_ids)


def _xla_topc_pick(base_c, cand, lat, w2c):
    return xla_ops.topc_pick(base_c, cand, ref.latent_value(lat, base_c.dtype), w2c)


def _xla_full_vocab_pick(logits, lat, w2, active=None, fallback=None, *, direct_readout: bool, q=None):
    return with_fallback(ref.full_vocab_pick(ref.draft_rows(logits), lat, w2, direct_readout=direct_readout),
                         active, fallback)


def _xla_full_vocab_sample(logits, lat, w2, seeds, inv_t, proposal=None, *, direct_readout: bool):
    return ref.full_vocab_sample(ref.draft_rows(logits), lat, w2, seeds, inv_t, proposal, direct_readout=direct_readout)


def _xla_sampled(step):
    """A jnp sampled pick as an `Ops` step: every row (``q`` and ``n`` unused), so ``s`` = 0."""
    def run(*args, q=None, n=None, **kw):
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


def _pallas_topc_prepare(w2, cand):
    # The pick kernel gathers the candidates' rows from w2 itself; float64 (the jnp path): w2[cand].
    return ref.topc_gather(w2, cand) if jnp.dtype(w2.dtype) == jnp.float64 else w2


def _pallas_topc(base_c, cand, lat, prepared, skip=None, *, interpret, table, best, ties="base"):
    """`topc_pick`, `topc_best` (``best``: the splits' winners combined in XLA) or (``ties="id"``) `candidates_best`."""
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
    p = _plan(rows, 2, v, r, c, base_c.dtype, interpret, table)
    out = topc_pick.topc_pick(base_c, cand, lat, prepared, config=p.topc, interpret=interpret, partials=best,
                              ties=ties, skip=skip, lat_add=lat_add)
    if by_id:
        return ref.best_by_score(out[0], out[2], axis=0)
    return ref.best_by_topc_rule(*out, axis=0) if best else out


def _pallas_topc_sample(base_c, cand, lat, prepared, seeds, inv_t, proposal=None, *, interpret, table, q=None,
                        n=None):
    """`Ops.topc_sample`: the pick kernel with the noise (`topc_pick.topc_pick`'s ``seeds``); the jnp spelling for
    the seed block (``lat`` None) and float64. Pass ``q`` of ``n`` blocks (no proposal): the greedy pass pick's
    slots (`_pallas_topc_pass_pick`)."""
    if lat is None or prepared.ndim == 3:
        w2c = prepared if lat is None or prepared.ndim == 3 else ref.topc_gather(prepared, cand)
        return (*ref.topc_sample(base_c, cand, lat if lat is None else ref.latent_value(lat, base_c.dtype), w2c,
                                 seeds, inv_t, proposal), 0)
    lat, lat_add = lat if isinstance(lat, ref.LatentSum) else (lat, None)  # the residual's terms: the kernel adds them
    rows, c = base_c.shape
    v, r = prepared.shape
    p = _plan(rows, 2, v, r, c, base_c.dtype, interpret, table)
    s, kw = 0, {}
    if q is not None and proposal is None:
        b = rows // n + 1
        s = dispatch.pass_pick_rows(n, b, q, 1, skip=table.entry(rows).switches.topc_skip_final_slots,
                                    everywhere=interpret)
        if s == b - 1:  # every draft slot is final: nothing to pick
            return jnp.zeros((0,), jnp.int32), None, s
        kw = dict(row_ids=_slot_rows(n, b, s)) if s else {}
    if q is not None:  # the greedy pass pick's L2 hints (`dispatch.Table.topc_keep`)
        kw["keep"] = table.topc_keep(rows, c, r, jnp.dtype(prepared.dtype).itemsize,
                                     -(-c // (p.topc.c_tile * p.topc.c_steps)))
    out = topc_pick.topc_pick(base_c, cand, lat, prepared, config=p.topc, interpret=interpret, lat_add=lat_add,
                              seeds=seeds, inv_t=inv_t, proposal=proposal, **kw)
    return (*out, s) if proposal is not None else (out, None, s)


def _pallas_certify(base_c, cand, lat, prepared, tau, max_norm, mex, valid, fallen, limit=None, *, interpret, table):
    """`certify`: the pick and certify kernels; jnp where the plan has none (float64) or ``limit`` needs more rows
    than one program holds."""
    rows, c = base_c.shape
    if prepared.ndim == 3 or (limit is not None and rows > topc_pick.CERTIFY_SINGLE_ROWS):
        best, best_id = _pallas_topc(base_c, cand, lat, prepared, fallen, interpret=interpret, table=table,
                                     best=True, ties="id")
        return ref.certify_rows(best, best_id, lat, tau, max_norm, mex, valid, fallen, limit, base_c.dtype)
    v, r = prepared.shape
    p = _plan(rows, 2, v, r, c, base_c.dtype, interpret, table)
    return topc_pick.certify(base_c, cand, lat, prepared, tau, max_norm, mex, valid, fallen, slack=ref.SLACK,
                             limit=limit, interpret=interpret, config=p.topc)


def _pallas_full_vocab(logits, lat, w2, active=None, fallback=None, *, interpret, table, best, capacity=None, q=None):
    """`full_vocab_pick` or `full_vocab_best` (``best``: the parts' winners combined in XLA). ``capacity``
    (`_pallas_scan_failing`): the first ``capacity`` active rows packed in `dispatch.Table.capacity_config`."""
    n, b, v = logits.shape
    p = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret, table)
    if p.full_vocab is None:
        if best:
            return ref.full_vocab_best(ref.draft_rows(logits), lat, w2)
        return with_fallback(ref.full_vocab_pick(ref.draft_rows(logits), lat, w2), active, fallback)
    cfg = p.full_vocab if capacity is None else table.capacity_config(p.full_vocab, v)
    reverse, keep = _pass_order(p, q, cfg)
    out = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=cfg, interpret=interpret,
                                     slot_stride=b, partials=best, active=active, capacity=capacity,
                                     fallback=fallback, reverse=reverse, keep=keep)
    return ref.best_by_score(*out, axis=0) if best else out


def _pallas_full_vocab_sample(logits, lat, w2, seeds, inv_t, proposal=None, *, interpret, table, q=None):
    """`Ops.full_vocab_sample`: the fused pick with the noise (`full_vocab.full_vocab_pick`'s ``seeds``), reading the
    draft rows of the whole logits in place; the jnp spelling for the seed block (``lat`` None) and float64. Pass
    ``q`` (no proposal): the greedy pass pick's slots and read order (`_pallas_pass_pick`)."""
    n, b, v = logits.shape
    p = None if lat is None else _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret, table)
    if p is None or p.full_vocab is None:
        return (*_xla_full_vocab_sample(logits, lat, w2, seeds, inv_t, proposal, direct_readout=not interpret), 0)
    s, kw = 0, {}
    if q is not None and proposal is None:
        s = dispatch.pass_pick_rows(n, b, q, p.full_vocab.row_tile, skip=p.entry.switches.skip_final_slots,
                                    everywhere=interpret)
        if s == b - 1:  # every draft slot is final: nothing to pick
            return jnp.zeros((0,), jnp.int32), None, s
        reverse, keep = _pass_order(p, q, p.full_vocab)
        kw = dict(reverse=reverse, keep=keep, row_ids=_slot_rows(n, b, s) if s else None)
    out = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=p.full_vocab, interpret=interpret,
                                     slot_stride=b, seeds=seeds, inv_t=inv_t, proposal=proposal, **kw)
    return (*out, s) if proposal is not None else (out, None, s)


def _pallas_gated_pick(logits, lat, w2, active, fallback, flags, *, interpret, table, q=None):
    """`Ops.gated_pick`'s ``run``: the counted launch (counters in ``flags[2:]``) up to the table's
    ``gated_row_tiles`` row tiles, else the pick."""
    n, b, v = logits.shape
    p = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret, table)
    fv = p.full_vocab
    if (fv is None or flags.shape != (8,) or flags.dtype != jnp.int32
            or full_vocab.cdiv(lat.shape[0], fv.row_tile) > table.thresholds.gated_row_tiles):
        pick = _pallas_full_vocab(logits, lat, w2, active, fallback, interpret=interpret, table=table, best=False, q=q)
        return pick, flags
    reverse, keep = _pass_order(p, q, fv)
    return full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fv, interpret=interpret,
                                      slot_stride=b, active=active, fallback=fallback, reverse=reverse, keep=keep,
                                      counter=flags, counter_at=2)


def _pallas_pass_pick(logits, lat, w2, q, *, interpret, table):
    """`Ops.full_vocab_pass_pick`'s ``run``: the draft slots ``s..`` (`dispatch.pass_pick_rows`) as ``row_ids``."""
    n, b, v = logits.shape
    p = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret, table)
    if p.full_vocab is None:
        return _pallas_full_vocab(logits, lat, w2, interpret=interpret, table=table, best=False), 0
    s = dispatch.pass_pick_rows(n, b, q, p.full_vocab.row_tile, skip=p.entry.switches.skip_final_slots,
                                everywhere=interpret)
    if s == b - 1:  # every draft slot is final: nothing to pick
        return jnp.zeros((0,), jnp.int32), s
    reverse, keep = _pass_order(p, q, p.full_vocab)
    tok = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=p.full_vocab, interpret=interpret,
                                     slot_stride=b, reverse=reverse, row_ids=_slot_rows(n, b, s) if s else None,
                                     keep=keep)
    return tok, s


def _slot_rows(n: int, b: int, s: int) -> np.ndarray:
    """The draft rows of slots s..B-2 of every block ([N*(B-1-s)] int32; static)."""
    return (np.arange(n)[:, None] * (b - 1) + np.arange(s, b - 1)[None, :]).reshape(-1).astype(np.int32)


def _pallas_topc_pass_pick(base_c, cand, lat, prepared, q, n, *, interpret, table):
    """`Ops.topc_pass_pick`'s ``run``: draft slots ``s..`` as ``row_ids``, with `dispatch.Table.topc_keep`'s hints."""
    rows, c = base_c.shape
    b = rows // n + 1
    s = dispatch.pass_pick_rows(n, b, q, 1, skip=table.entry(rows).switches.topc_skip_final_slots,
                                everywhere=interpret)
    if s == b - 1:  # every draft slot is final: nothing to pick
        return jnp.zeros((0,), jnp.int32), s
    if prepared.ndim == 3:  # float64: the jnp path picks every row
        return _pallas_topc(base_c, cand, lat, prepared, interpret=interpret, table=table, best=False), 0
    v, r = prepared.shape
    p = _plan(rows, 2, v, r, c, base_c.dtype, interpret, table)
    keep = table.topc_keep(rows, c, r, jnp.dtype(prepared.dtype).itemsize, -(-c // (p.topc.c_tile * p.topc.c_steps)))
    if s == 0 and keep is None:  # every row
        return _pallas_topc(base_c, cand, lat, prepared, interpret=interpret, table=table, best=False), 0
    lat_add = None
    if isinstance(lat, ref.LatentSum):  # the residual's terms: the kernel adds them
        lat, lat_add = lat
    tok = topc_pick.topc_pick(base_c, cand, lat, prepared, config=p.topc, interpret=interpret, lat_add=lat_add,
                              row_ids=_slot_rows(n, b, s) if s else None, keep=keep)
    return tok, s


def _pass_order(p: dispatch.Plan, q, config) -> tuple[bool, str | None]:
    """(reverse, keep) of pass ``q``'s full-vocab pick (``q`` None: ascending, no hint); neither changes a token."""
    if q is None:
        return False, None
    return q % 2 == 1 and p.entry.switches.alternate, p.entry.keep(config)


def _pallas_scan_failing(logits, lat, w2, fail, fallen, fallback, limit, *, interpret, table, q=None):
    """`scan_failing`: where ``scan_one_launch`` says so `full_vocab.scan_failing` (one counted launch), else the
    packed launch of at most ``limit`` failing rows and the all-rows launch, whose programs return at once unless
    the pass is full. A row's token is the plan's pick's either way; draft slots before ``q`` are never scanned."""
    n, b, v = logits.shape
    rows = n * (b - 1)
    p = _plan(n, b, v, lat.shape[1], 0, logits.dtype, interpret, table)
    fv = p.full_vocab
    if fv is None:
        raise ValueError("scan_failing: no full-vocab kernel serves this dtype (full_vocab_capacity is None there)")
    s = q if q is not None and 0 < q < b - 1 else 0
    if p.entry.switches.scan_one_launch:
        return full_vocab.scan_failing(logits.reshape(n * b, v), lat, w2, fail, fallen, fallback, limit=int(limit),
                                       config=table.capacity_config(fv, v), v_steps_full=fv.v_steps,
                                       interpret=interpret, slot_stride=b, skip_slots=s)
    fail = fail != 0
    n_fail = jnp.sum(fail, dtype=jnp.int32)
    full = ref.flag_value(fallen) | (n_fail > limit)
    pick = functools.partial(_pallas_full_vocab, logits, lat, w2, interpret=interpret, table=table, best=False)
    few = pick(active=fail & ~full, capacity=int(limit))
    if s:  # the slots that are not final, through row_ids; programs return at once unless the pass is full
        ids = _slot_rows(n, b, s)
        reverse, keep = _pass_order(p, q, fv)
        tok = full_vocab.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fv, interpret=interpret,
                                         slot_stride=b, row_ids=ids, active=jnp.broadcast_to(full, ids.shape),
                                         reverse=reverse, keep=keep)
        every = fallback.astype(jnp.int32).at[ids].set(tok, unique_indices=True)
    else:
        every = pick(active=jnp.broadcast_to(full, (rows,)), q=q)
    return jnp.where(full, every, jnp.where(fail, few, fallback)), ref.make_flags(full, n_fail)


def _pallas_full_vocab_capacity(n, b, v, r, dtype, limit, *, interpret, table):
    """``limit`` where the packed launch saves work, None for the jnp step or where one row tile holds every row."""
    fv = _plan(n, b, v, r, 0, dtype, interpret, table).full_vocab
    if not limit or fv is None or n * (b - 1) <= fv.row_tile:
        return None
    return limit


def _pallas_latent(params, xh, blk, prev_ids, split=False, *, interpret, table):
    """The plan's latent kernel, or XLA's where the plan (or, with a token table, ``table_latent``) says so; XLA's is
    split where ``split_latent`` says so (not in float64), else its mixer behind a barrier where ``mixer_barrier``."""
    n, b = blk.shape
    v, r = params["w1"].shape
    dtype = params["w1"].dtype
    p = _plan(n, b, v, r, 0, dtype, interpret, table)
    if p.latent is None or (TOKEN_TABLE in params and p.entry.switches.table_latent):
        split = split and p.entry.switches.split_latent and jnp.dtype(dtype) != jnp.float64
        barrier = not split and p.entry.switches.mixer_barrier
        return ref.latent_pass(params, xh, blk, prev_ids, split=split, barrier=barrier)
    return latent.latent_pass(params, xh, blk, prev_ids, config=p.latent, interpret=interpret)
