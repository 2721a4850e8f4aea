"""Refine on a `jax.sharding.Mesh`: requests split over a data axis, the vocabulary over a model axis.

`refine_sharded` runs the same data path as `xpress_jax.refine` inside `jax.shard_map`; every kernel runs
per shard, on that shard's arrays, never on gathered inputs.

- **Data axis**: the N blocks are split across it; the weights are replicated. N that the axis does not
  divide is padded with sentinel rows (anchor -1: they read nothing and are dropped).
- **Model axis**: ``w1``, ``w2`` and the logits are split over the vocabulary (V that the axis does not
  divide is padded with ids that never win: logits -inf, zero weight rows). Per pass, ``w1[prev]`` is each
  device's rows summed over the axis (one term is non-zero: exact); the latent runs replicated; every
  device picks its local winner (score, base logit in top-C mode, global id) and an ``all_gather`` of
  those and the same rule pick the global winner. Top-C candidates: each device selects its local top
  min(C, V/M); the union holds the global top C, and a sort by (value, id) on the float bits, as
  ``lax.top_k`` orders them, keeps exactly the C one device would select. A candidate is scored on the
  device holding its ``w2`` row; the others see it with base logit -inf.

Every rule is a total order, so the best of the per-shard bests is the best overall: the tokens equal the
single-device `refine`'s on the same backend, in both modes (not the certified mode).

Sampling (``temperature``, ``key``): every draft row's noise seed is computed once, from its GLOBAL row index, before
the blocks are split, and the noise of a vocab id is drawn with its GLOBAL id, so every shard adds the noise one
device would. Full vocabulary: each device's sampled pick over its ids (the largest key, the lowest id), then the
same cross-shard rule; the proposal's token score comes from the winning shard, its log-normalizer is the
logsumexp of the shards' (equal to one device's up to float rounding), its scores stay split over the vocabulary.
Top-C: each device scores the candidates it holds and a ``psum`` (one non-zero term per candidate: exact) gives
every device all C scores, so the pick and the proposal are one device's, computed on every device.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import reference as ref
from .head import acc_dtype
from .kernels.common import gumbel, sample_key, src_row
from .ops import Ops, same
from .params import PARAM_NAMES, VOCAB_MAP, Head
from .refine import check_backend, prepare, resolve_call, run_passes, select_ops
from .sampling import Proposal, Sampler, check_sampling, inverse_temperature, row_seeds

__all__ = ["refine_sharded", "STATIC_ARGNAMES", "param_shardings", "input_shardings", "vocab_sharded_ops",
           "axis_size"]

#: The keyword arguments of `refine_sharded` that must be static under ``jax.jit``.
STATIC_ARGNAMES = ("mesh", "data_axis", "model_axis", "num_passes", "topc", "max_num_reqs", "config", "backend",
                   "interpret", "unroll", "proposal")

_VOCAB_PARAMS = ("w1", "w2")


def axis_size(mesh: Mesh, axis: str | None) -> int:
    """The size of ``axis`` in ``mesh`` (1 for None); a name the mesh lacks raises ValueError."""
    if axis is None:
        return 1
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh (axes: {tuple(mesh.shape)}); "
                         "pass None to not use it")
    return int(mesh.shape[axis])


def param_shardings(mesh: Mesh, model_axis: str | None = "model", vocab_size: int | None = None,
                    draft_vocab_size: int | None = None) -> dict[str, NamedSharding]:
    """Where `refine_sharded` expects each param: ``w1`` and ``w2`` split over their rows on ``model_axis``
    (when the axis divides ``vocab_size``, and ``draft_vocab_size`` for ``w2``; else replicated, and padded
    inside), the rest replicated. A reduced head (``draft_vocab_size`` given) also has ``d2t``, replicated.
    Pass it to `xpress_jax.load_params(path, sharding=...)` or `jax.device_put`."""
    m = axis_size(mesh, model_axis)
    rows = {"w1": vocab_size, "w2": vocab_size if draft_vocab_size is None else draft_vocab_size}
    names = PARAM_NAMES + ((VOCAB_MAP,) if draft_vocab_size is not None else ())
    return {name: NamedSharding(mesh, P(model_axis, None) if name in _VOCAB_PARAMS and model_axis is not None and (
        rows[name] is None or rows[name] % m == 0) else P()) for name in names}


def input_shardings(mesh: Mesh, data_axis: str | None = "data", model_axis: str | None = "model", *,
                    num_blocks: int | None = None, vocab_size: int | None = None) -> dict[str, NamedSharding]:
    """Where `refine_sharded` expects its inputs and puts its output, by argument name: ``"logits"`` [N, B, V]
    (N over ``data_axis``, V over ``model_axis``; a reduced head's V is its draft vocabulary), ``"h"`` [N, B, H],
    ``"anchors"`` and ``"prev_ids"`` [N] (also as ``"ids"``), ``"out"`` [N, B-1]. An axis that does not divide
    its dimension (given ``num_blocks`` / ``vocab_size``) is left out of the spec (refine_sharded pads inside)."""
    d, m = axis_size(mesh, data_axis), axis_size(mesh, model_axis)
    da = data_axis if data_axis is not None and (num_blocks is None or num_blocks % d == 0) else None
    ma = model_axis if model_axis is not None and (vocab_size is None or vocab_size % m == 0) else None
    ids = NamedSharding(mesh, P(da))
    return {"logits": NamedSharding(mesh, P(da, None, ma)), "h": NamedSharding(mesh, P(da, None, None)),
            "anchors": ids, "prev_ids": ids, "ids": ids, "out": NamedSharding(mesh, P(da, None))}


def refine_sharded(params: Head | Mapping[str, jax.Array], logits: jax.Array, h: jax.Array, anchors: jax.Array,
                   prev_ids: jax.Array | None = None, *, mesh: Mesh, data_axis: str | None = "data",
                   model_axis: str | None = "model", num_passes: int | None = None, topc: int | None = None,
                   max_num_reqs: int | None = None, config=None, backend: str = "auto", interpret: bool = False,
                   unroll: bool | None = None, temperature=None, key: jax.Array | None = None,
                   proposal: str | None = None) -> jax.Array:
    """`xpress_jax.refine` on ``mesh``: same arguments, checks and tokens. ``data_axis`` / ``model_axis``: the
    mesh axes for the blocks and the vocabulary (None: not used). Jit it with
    ``static_argnames=xpress_jax.sharded.STATIC_ARGNAMES``. The mesh may have Auto or Explicit axes
    (``jax.make_mesh``'s default); inputs and params are resharded to where they must be.
    The result is [N, B-1] int32, split over ``data_axis``.

    ``temperature``, ``key``, ``proposal``: sample, as `refine` does (the same tokens as one device for the same
    key); with a ``proposal`` the result is ``(tokens, xpress_jax.Proposal)``, split over ``data_axis`` (full-vocab
    ``scores`` [N, B-1, V] also over ``model_axis``)."""
    check_backend(backend, interpret)
    check_sampling(temperature, key, proposal)
    ops = select_ops(backend, interpret)
    params, prev_ids, k, c, unroll = resolve_call(params, logits, h, anchors, prev_ids, num_passes=num_passes,
                                                  topc=topc, max_num_reqs=max_num_reqs, config=config, unroll=unroll)
    ops = ops.for_dtype(params["w1"].dtype)
    d, m = axis_size(mesh, data_axis), axis_size(mesh, model_axis)
    if data_axis is not None and data_axis == model_axis:
        raise ValueError(f"data_axis and model_axis must differ, both are {data_axis!r}")
    n, b, v = logits.shape  # v: the draft vocabulary (w2's rows)
    vv = params["w1"].shape[0]  # the verifier's vocabulary (w1's rows; v unless the head is reduced)
    anchors, prev_ids = jnp.asarray(anchors), jnp.asarray(prev_ids)  # range-checked by prepare (vocab_size=vv)
    n_pad = -(-n // d) * d - n
    if n_pad:  # sentinel rows: anchor -1 (no reads, dropped below)
        logits = jnp.pad(logits, ((0, n_pad), (0, 0), (0, 0)))
        h = jnp.pad(h, ((0, n_pad), (0, 0), (0, 0)))
        anchors = jnp.pad(anchors, (0, n_pad), constant_values=-1)
        prev_ids = jnp.pad(prev_ids, (0, n_pad), constant_values=-1)
    v_pad = -(-v // m) * m - v
    if v_pad:  # ids >= V: logits -inf and zero rows, so they never win (ties go to lower ids)
        logits = jnp.pad(logits, ((0, 0), (0, 0), (0, v_pad)), constant_values=-jnp.inf)
    pads = {"w2": v_pad, "w1": -(-vv // m) * m - vv}  # a reduced head's w1 and w2 differ in rows
    params = {name: jnp.pad(x, ((0, pads[name]), (0, 0))) if pads.get(name) else x for name, x in params.items()}
    if model_axis is not None and m > 1:  # one shard holds the whole vocabulary: the plain steps
        ops = vocab_sharded_ops(ops, model_axis)
    da, ma = data_axis, model_axis
    param_specs = {name: P(ma, None) if name in _VOCAB_PARAMS else P() for name in params}
    in_specs = (param_specs, P(da, None, ma), P(da, None, None), P(da), P(da))
    args = _placed(mesh, in_specs, (dict(params), logits, h, anchors, prev_ids))
    if temperature is None:
        def body(p, lg, hh, a, q):
            return run_passes(prepare(ops, p, lg, hh, a, q, k, c, unroll, vocab_size=vv))

        run = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(da, None), check_vma=False)
        out = run(*args)
        return _trim(mesh, out, n if n_pad else None)

    # The seeds of the GLOBAL draft rows (padding rows come last: the real rows keep their indices), split with
    # the blocks.
    seeds = row_seeds(key, (n + n_pad) * (b - 1)).reshape(n + n_pad, b - 1)

    def sampled_body(p, lg, hh, a, q, sd, inv_t):
        return run_passes(prepare(ops, p, lg, hh, a, q, k, c, unroll, vocab_size=vv,
                                  sampler=Sampler(sd.reshape(-1), inv_t, proposal)))

    out_specs = P(da, None)
    if proposal is not None:  # top-C: every device holds all C candidates' scores and ids
        scores = None if proposal != "scores" else P(da, None, None) if c else P(da, None, ma)
        ids = P(da, None, None) if c and proposal == "scores" else None
        out_specs = (out_specs, Proposal(P(da, None), P(da, None), scores, ids))
    in_specs = (*in_specs, P(da, None), P())
    run = jax.shard_map(sampled_body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    out = run(*args, *_placed(mesh, in_specs[5:], (seeds, inverse_temperature(temperature))))
    if proposal is None:
        return _trim(mesh, out, n if n_pad else None)
    tokens, prop = out
    if n_pad:
        tokens, prop = _trim(mesh, tokens, n), Proposal(*(None if x is None else _trim(mesh, x, n) for x in prop))
    if v_pad and not c and prop.scores is not None:  # the padded ids' scores (-inf)
        prop = prop._replace(scores=_trim(mesh, prop.scores, vocab=v))
    return tokens, prop


def _explicit(mesh: Mesh) -> bool:
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _trim(mesh: Mesh, x: jax.Array, rows: int | None = None, vocab: int | None = None) -> jax.Array:
    """``x`` without its padding: the first ``rows`` rows, the first ``vocab`` entries of its last dim (None: all).
    On an Explicit mesh a sliced dim that its axis no longer divides is gathered first (the type must say it)."""
    if rows is None and vocab is None:
        return x
    if _explicit(mesh):
        spec = list(jax.typeof(x).sharding.spec) + [None] * (x.ndim - len(jax.typeof(x).sharding.spec))
        if rows is not None:
            spec[0] = None
        if vocab is not None:
            spec[-1] = None
        x = jax.sharding.reshard(x, NamedSharding(mesh, P(*spec)))
    return x[:rows] if vocab is None else x[..., :vocab]


def _placed(mesh: Mesh, specs, args):
    """``args`` where shard_map's ``specs`` want them. On a mesh with Explicit axes (``jax.make_mesh``'s default) an
    array's type carries its sharding and must match the spec: reshard it (a no-op where it already matches). On
    an Auto mesh shard_map moves the data itself."""
    if not _explicit(mesh):
        return args
    return jax.tree.map(lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec)), args, specs,
                        is_leaf=lambda x: isinstance(x, P))


# ----------------------------------------------------------------------------- vocab-sharded steps


@functools.lru_cache(maxsize=None)
def vocab_sharded_ops(inner: Ops, axis: str) -> Ops:
    """``inner``'s steps for one vocabulary shard inside `jax.shard_map` over ``axis``: local
    work on the shard's ids, then the exact cross-shard combination (module doc)."""
    if inner.full_vocab_prepare is not same:
        raise ValueError(f"vocabulary sharding combines plain full-vocab picks; {inner.name!r} prepares its own "
                         "readout data (full_vocab_prepare), which is not split by vocabulary")
    return Ops(
        name=f"{inner.name}/vocab[{axis}]",
        select=functools.partial(_select, inner=inner, axis=axis),
        topc_prepare=functools.partial(_topc_prepare, inner=inner, axis=axis),
        topc_pick=functools.partial(_topc_pick, inner=inner, axis=axis),
        full_vocab_prepare=same,  # the shard's w2 (each device picks from its own rows)
        full_vocab_pick=functools.partial(_full_vocab_pick, inner=inner, axis=axis),
        latent=functools.partial(_latent, inner=inner, axis=axis),
        start=functools.partial(_start, axis=axis),
        full_vocab_best=functools.partial(_full_vocab_best, inner=inner, axis=axis),
        topc_best=functools.partial(_topc_best, inner=inner, axis=axis),
        full_vocab_sample=functools.partial(_full_vocab_sample, inner=inner, axis=axis),
        topc_sample=functools.partial(_topc_sample, inner=inner, axis=axis),
    )


def _offset(axis: str, vs: int) -> jax.Array:
    """The first global vocab id of this device's shard."""
    return jax.lax.axis_index(axis).astype(jnp.int32) * vs


def _gather(x: jax.Array, axis: str) -> jax.Array:
    """[...] per device -> [M, ...]: every device's value, in shard order."""
    return jax.lax.all_gather(x, axis, axis=0, tiled=False)


def _order_key(x: jax.Array) -> jax.Array:
    """int32 keys in ``lax.top_k``'s order of the values (on the bits: -0.0 below +0.0; no NaN here)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))


def _draft_value(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """logits of draft row q at local column ids[q], NaN as -inf (a [rows] gather, no copy of the rows)."""
    n, b, vs = logits.shape
    row = src_row(jnp.arange(n * (b - 1)), b)  # the row of logits [N*B, V] that draft row q reads
    return ref.clean(logits.reshape(n * b, vs)[row, ids])


def _global_best(score, ids, axis):
    return ref.best_by_score(_gather(score.astype(jnp.float32), axis), _gather(ids, axis), axis=0)


def _start(logits, *, axis):
    vs = logits.shape[2]
    loc = ref.full_vocab_start(logits)
    return _global_best(_draft_value(logits, loc), loc + _offset(axis, vs), axis)[1]


def _select(logits, c, *, inner, axis):
    n, b, vs = logits.shape
    rows = n * (b - 1)
    cl = min(c, vs)
    cand, base_c, am = inner.select(logits, cl)
    off = _offset(axis, vs)
    start = _global_best(_draft_value(logits, am), am + off, axis)[1]
    vals = jnp.moveaxis(_gather(base_c, axis), 0, 1).reshape(rows, -1)  # [rows, M*cl]
    ids = jnp.moveaxis(_gather(cand + off, axis), 0, 1).reshape(rows, -1)
    # The C best by (larger value, lower id): ascending sort on (~key, id).
    _, ids, vals = jax.lax.sort((~_order_key(vals), ids, vals), dimension=1, num_keys=2)
    return ids[:, :c], vals[:, :c], start


def _owned(cand, vs, axis):
    loc = cand - _offset(axis, vs)
    own = (loc >= 0) & (loc < vs)
    return jnp.where(own, loc, 0), own


def _topc_prepare(w2, cand, *, inner, axis):
    loc, own = _owned(cand, w2.shape[0], axis)
    return inner.topc_prepare(w2, loc), loc, own, w2.shape[0]


def _topc_best(base_c, cand, lat, prepared, *, inner, axis):
    inner_prep, loc, own, vs = prepared
    base = jnp.where(own, base_c, jnp.array(-jnp.inf, base_c.dtype))
    s, bb, i = inner.topc_best(base, loc, lat, inner_prep)
    # A local winner with base -inf may be a candidate this device does not hold: it must not
    # lend its (local) id to the tie break; such rows are settled below from the candidate ids.
    i = jnp.where(bb == -jnp.inf, jnp.iinfo(jnp.int32).max, i + _offset(axis, vs))
    s, bb, i = ref.best_by_topc_rule(_gather(s, axis), _gather(bb, axis), _gather(i, axis), axis=0)
    # Best base -inf: every candidate scores -inf with base -inf: the lowest candidate id wins.
    return s, bb, jnp.where(bb == -jnp.inf, jnp.min(cand, axis=-1), i)


def _topc_pick(base_c, cand, lat, prepared, q=None, slots=None, *, inner, axis):
    return _topc_best(base_c, cand, lat, prepared, inner=inner, axis=axis)[2], 0


def _full_vocab_best(logits, lat, w2, *, inner, axis):
    s, i = inner.full_vocab_best(logits, lat, w2)
    return _global_best(s, i + _offset(axis, w2.shape[0]), axis)


def _full_vocab_pick(logits, lat, w2, q=None, *, inner, axis):
    return _full_vocab_best(logits, lat, w2, inner=inner, axis=axis)[1], 0


def _latent(params, xh, blk, prev_ids, *, inner, axis):
    """``w1[prev]`` from the shards (psum of each device's rows), then ``inner``'s latent on those
    rows: ``w1`` becomes the [N*B, r] gathered rows and the ids index them."""
    w1 = params["w1"]
    vs, r = w1.shape
    n, b = blk.shape
    prev = jnp.concatenate([prev_ids[:, None], blk[:, :-1]], axis=1)  # [N, B]: each slot's predecessor
    loc, own = _owned(prev, vs, axis)
    rows = jnp.where(own[..., None], jnp.take(w1, loc, axis=0), jnp.zeros((), w1.dtype))
    rows = jax.lax.psum(rows, axis).reshape(n * b, r)
    base = jnp.arange(n, dtype=jnp.int32)[:, None] * b
    # slot j's predecessor is row n*B + j: prev_ids' -> slot 0, blk'[:, j-1] -> slot j
    blk2 = jnp.minimum(base + jnp.arange(1, b + 1, dtype=jnp.int32)[None, :], n * b - 1)
    return inner.latent(dict(params, w1=rows), xh, blk2, base[:, 0])



def _full_vocab_sample(logits, lat, w2, seeds, inv_t, proposal=None, *, inner, axis, q=None):
    """The sampled full-vocab pick of one vocabulary shard (noise of the global ids; the jnp spelling), combined
    across ``axis`` by the full-vocab rule on the keys (the largest key, the lowest id); with a ``proposal`` the
    extras (module doc). Every draft row (``s`` = 0)."""
    vs = w2.shape[0]
    off = _offset(axis, vs)
    key, idx, s = ref.full_vocab_sample_best(ref.draft_rows(logits), lat, w2, seeds, inv_t, id_offset=off)
    ids = _gather(idx, axis)  # the keys compare in their own dtype (float64 keys are not rounded to float32)
    tok = ref.best_by_score(_gather(key, axis), ids, axis=0)[1]
    if proposal is None:
        return tok, None, 0
    token_score, lse, scores = ref.sample_extras(s, idx - off, inv_t, proposal)
    # The winner's shard holds its score (the global ids are distinct across shards).
    token_score = jnp.max(jnp.where(ids == tok, _gather(token_score, axis), -jnp.inf), axis=0)
    lse = jnp.where(inv_t > 0, jax.nn.logsumexp(_gather(lse, axis), axis=0), jnp.inf).astype(jnp.float32)
    return tok, (token_score, lse, scores), 0


def _topc_sample(base_c, cand, lat, prepared, seeds, inv_t, proposal=None, *, inner, axis, q=None,
                 slots=None):
    """The sampled top-C pick: every candidate's score (``lat`` None: its base logit; else scored on the device
    holding its ``w2`` row and summed over ``axis``, one non-zero term each), then `reference.topc_sample_best`'s
    rule on those scores, the same on every device."""
    if lat is None:
        s = ref.clean(base_c)
    else:
        inner_prep, loc, own, _ = prepared
        _, (_, _, s_own), _ = inner.topc_sample(base_c, loc, lat, inner_prep, seeds, inv_t, "scores")
        s = jax.lax.psum(jnp.where(own, s_own, jnp.zeros((), s_own.dtype)), axis)
    acc = acc_dtype(base_c.dtype)
    key = sample_key(s.astype(acc), inv_t.astype(acc), gumbel(seeds[:, None], cand).astype(acc))
    _, _, tok = ref.best_by_topc_rule(key, ref.clean(base_c).astype(acc), cand)
    pos = jnp.argmax(cand == tok[:, None], axis=-1)  # the winner's column (candidate ids are distinct)
    return tok, ref.sample_extras(s, pos, inv_t, proposal), 0
