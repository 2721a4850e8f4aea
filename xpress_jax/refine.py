"""`refine`: K greedy Jacobi passes of the XPress head, jit-able with static shapes.

The data path (`_refine`) is written once against `xpress_jax.ops.Ops`, the steps of one
implementation: the jnp reference (`xpress_jax.reference`, the CPU/TPU path and the kernels'
oracle) or the Pallas-Triton kernels (`xpress_jax.kernels`, configs from `xpress_jax.dispatch`).
The platform is read here, once per call, at the API edge (`_platform`); nothing below reads it.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .config import HeadConfig
from .exact import Pruned, certified_passes, pruned_passes, resolve_full_vocab
from .head import TOKEN_TABLE, hidden_input
from .ops import Ops
from .params import Head, check_params

__all__ = ["refine", "refine_with", "INVALID_TOKEN", "BACKENDS"]

#: Token written to every draft slot of a row whose anchor or prev id lies outside [0, V)
#: (only reachable under ``jit``; concrete calls raise instead).
INVALID_TOKEN = -1

BACKENDS = ("auto", "xla", "pallas")

#: The keyword arguments of `refine` that must be static under ``jax.jit``.
STATIC = ("num_passes", "topc", "max_num_reqs", "config", "backend", "interpret", "unroll", "full_vocab",
          "return_stats", "early_exit")


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _validate(params, logits, h, anchors, prev_ids, num_passes, topc, max_num_reqs, config=None):
    check_params(params, config)
    V, r = params["w1"].shape
    H = params["down_h"].shape[0]
    B = params["mix"].shape[0]
    dtype = jnp.dtype(params["w1"].dtype)
    for name, x, nd in (("logits", logits, 3), ("h", h, 3), ("anchors", anchors, 1)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if len(x.shape) != nd:
            raise ValueError(f"{name} must have {nd} dims, got shape {tuple(x.shape)}")
    N = logits.shape[0]
    if logits.shape[1] != B:
        raise ValueError(
            f"logits has block size {logits.shape[1]} (shape {tuple(logits.shape)}), "
            f"but the head's block_size is {B}"
        )
    if logits.shape[2] != V:
        raise ValueError(f"logits has vocab {logits.shape[2]}, but the head's vocab_size is {V}")
    if tuple(h.shape) != (N, B, H):
        raise ValueError(f"h must have shape {(N, B, H)} (N, block_size, hidden_size), got {tuple(h.shape)}")
    if tuple(anchors.shape) != (N,):
        raise ValueError(f"anchors must have shape ({N},), got {tuple(anchors.shape)}")
    if jnp.dtype(logits.dtype) != dtype:
        raise TypeError(f"logits dtype {jnp.dtype(logits.dtype)} must equal the params' dtype {dtype}")
    if jnp.dtype(h.dtype) != dtype:
        raise TypeError(f"h dtype {jnp.dtype(h.dtype)} must equal the params' dtype {dtype}")
    if not jnp.issubdtype(anchors.dtype, jnp.integer):
        raise TypeError(f"anchors must be integer token ids, got dtype {jnp.dtype(anchors.dtype)}")
    if prev_ids is not None:
        if not hasattr(prev_ids, "shape") or tuple(prev_ids.shape) != (N,):
            raise ValueError(f"prev_ids must have shape ({N},), got {getattr(prev_ids, 'shape', prev_ids)}")
        if not jnp.issubdtype(prev_ids.dtype, jnp.integer):
            raise TypeError(f"prev_ids must be integer token ids, got dtype {jnp.dtype(prev_ids.dtype)}")
    if isinstance(num_passes, bool) or not isinstance(num_passes, (int, np.integer)) or num_passes < 1:
        raise ValueError(f"num_passes must be a positive int, got {num_passes!r}")
    if isinstance(topc, bool) or not isinstance(topc, (int, np.integer)):
        raise TypeError(f"topc must be an int (0 = full vocabulary), got {topc!r}")
    if not 0 <= topc <= V:
        raise ValueError(f"topc must be in [0, vocab_size={V}], got {topc}")
    if max_num_reqs is not None:  # None: no config and no limit given
        if isinstance(max_num_reqs, bool) or not isinstance(max_num_reqs, (int, np.integer)) or max_num_reqs < 1:
            raise ValueError(f"max_num_reqs must be a positive int, got {max_num_reqs!r}")
        if N > max_num_reqs:
            raise ValueError(f"logits has N={N} blocks, more than max_num_reqs={max_num_reqs}")
    for name, ids in (("anchors", anchors), ("prev_ids", prev_ids)):
        if ids is not None and _is_concrete(ids):
            a = np.asarray(ids)
            bad = np.nonzero((a < 0) | (a >= V))[0]
            if bad.size:
                raise ValueError(
                    f"{name} has token ids outside [0, {V}) at rows {bad[:8].tolist()}"
                    f"{' ...' if bad.size > 8 else ''}: values {a[bad[:8]].tolist()}"
                )


def _no_defaults_error(missing: list[str]) -> TypeError:
    return TypeError(
        f"refine: plain params carry no HeadConfig, so {' and '.join(missing)} "
        f"{'has' if len(missing) == 1 else 'have'} no default (refine does not guess C and K). "
        "Fix it one of three ways: pass a Head (xj.load_params and xj.init_head return one; "
        "xj.Head(config, params) wraps a dict); or pass config=HeadConfig(...), whose num_passes and topc "
        "are then the defaults; or pass num_passes=K and topc=C explicitly (topc=0: full vocabulary)"
    )


def refine(
    params: Head | Mapping[str, jax.Array],
    logits: jax.Array,
    h: jax.Array,
    anchors: jax.Array,
    prev_ids: jax.Array | None = None,
    *,
    num_passes: int | None = None,
    topc: int | None = None,
    max_num_reqs: int | None = None,
    config: HeadConfig | None = None,
    backend: str = "auto",
    interpret: bool = False,
    unroll: bool | None = None,
    full_vocab: Any = "scan",
    return_stats: bool = False,
    certified_prepared: Any = None,
    early_exit: bool | tuple = False,
    token_table: jax.Array | None = None,
) -> jax.Array:
    """Refine N draft blocks with K greedy Jacobi passes; returns the draft [N, B-1] int32.

    Args:
      params: a `xpress_jax.Head` (params with their `HeadConfig`: what `load_params` and
        `init_head` return), or the plain params dict (see `xpress_jax.params`), all of one dtype.
      logits: [N, B, V] drafter logits (slot 0's row is unused), params' dtype.
      h: [N, B, H] drafter hidden states, params' dtype.
      anchors: [N] int, the verified token of each block (slot 0).
      prev_ids: [N] int, the token before each anchor; defaults to ``anchors``
        (what vLLM's speculator passes).
      num_passes: K >= 1. Default: the config's ``num_passes``.
      topc: 0 = exact full-vocabulary scoring; C in [1, V] = score only each draft
        slot's C largest base logits. Default: the config's ``topc``. An explicit C > V raises.
      max_num_reqs: largest accepted N. Default: the config's ``max_num_reqs``; without a
        config, no limit.
      config: the `HeadConfig` for plain params (its sizes must match them). With a `Head`
        it may be left out; if given it must equal the Head's config.
      backend: ``"xla"`` (pure jnp), ``"pallas"`` (Pallas-Triton kernels: a CUDA GPU, or
        ``interpret=True``) or ``"auto"`` (Pallas on a supported GPU, else jnp). (Mixed
        implementations, for measurement: `xpress_jax.ops.refine_with`.)
      interpret: run Pallas kernels in interpret mode (CPU tests).
      unroll: unroll the K passes instead of a loop (same tokens). Default: unrolled on GPUs (an
        XLA while loop costs several µs per iteration there), a loop elsewhere. Unrolled, each full-vocab
        pass knows its number, so the Pallas steps alternate the order in which they read ``w2`` and may
        skip the draft slots already final (`xpress_jax.ops`, ``full_vocab_pass_pick`` and
        ``topc_pass_pick``; the same tokens).
      early_exit: True stops the passes once a pass leaves the block unchanged (the same tokens;
        see "Early exit" below); a tuple of pass numbers (1..K-1) says where an unrolled refine
        checks (True: `exit_checks`). False (the default, until a trained head is measured): all K.
      full_vocab: how ``topc=0`` is computed (the same tokens either way; unused when ``topc > 0``):
        ``"scan"`` (every pass scores the whole vocabulary) or ``"certified"`` (each pass scores the
        C=512 largest base logits and proves with a bound that no other token can win; rows the bound
        cannot certify are scanned; `xpress_jax.exact`, README "Certified exact mode"). A
        `xpress_jax.exact.Certified` sets its candidate count and fallback threshold. ``"pruned"``
        (an int8 copy of ``w2`` bounds every vocab tile's scores against each row's best candidate;
        only the tiles it cannot exclude are scored exactly, by the scan's own code: the scan's
        tokens bit for bit; `xpress_jax.exact` "The pruned mode"); a `xpress_jax.exact.Pruned` sets
        its guess, C and fallback threshold.
      return_stats: with ``full_vocab="certified"`` or ``"pruned"`` (and ``topc=0``) return ``(tokens,
        stats)``: `xpress_jax.exact.CertifiedStats` (the fraction of rows certified and of passes
        that scanned) or `xpress_jax.exact.PrunedStats`.
      certified_prepared: with ``full_vocab="certified"``, `xpress_jax.exact.prepare_certified`
        (``params["w2"]``); with ``"pruned"``, `xpress_jax.exact.prepare_pruned` (``params["w2"]``);
        computed once for these weights (a traced argument, not static); None:
        refine computes it every call (one read of ``w2``, ~20 µs at serving shapes on an H200).
        It must come from the very weights passed: from other weights the bound may be wrong and
        so may the tokens. `RefineServer` keeps it and recomputes it on every reload.
      token_table: `xpress_jax.token_table` (params): ``w1 @ in_proj_token`` for every vocab id, [V, r] in
        the accumulation dtype, computed once for these weights (a traced argument, not static). Each
        pass then gathers its rows instead of running a gather and a GEMM: the same sums (their order
        the GEMM's choice, as for any dot), three XLA kernels fewer per pass on an H200. Costs V*r*4
        bytes of memory. It must come from the very weights passed. With a table the Pallas backend runs
        XLA's latent up to `dispatch.TABLE_XLA_LATENT_MAX_ROWS` draft rows (N=128 at B=16: measured faster
        than the Pallas latent kernel there), the kernel above (it does not read the table). `RefineServer`
        keeps one (its ``token_table`` option).

    No silent defaults: the config (from the `Head` or ``config=``) is the only source of
    ``num_passes`` and ``topc``. With a plain dict and no config both must be given, else
    ``TypeError`` (refine never falls back to `HeadConfig`'s field defaults, which would
    quietly give different tokens than the checkpoint's own C and K).

    Tie and value rules: a slot's score is ``float(dtype(base + bias))`` (the sum
    rounded to the logits' dtype before comparing); the largest score wins. Ties:
    full-vocab mode, the lowest vocab id; top-C mode (vLLM's sorted candidates, first
    position wins), the larger base logit, then the lowest vocab id. The candidate set
    is each slot's C largest base logits, lowest vocab ids first among values tied
    at the C-th place; the block starts from the full-vocab argmax of the base
    logits. NaN (in base logits or sums) counts as -inf; +inf wins; a row with no
    score above -inf follows the same tie rules (vocab id 0 in full-vocab mode).

    Early exit (``early_exit=True``; off by default): a pass is a function of the block alone (the
    hidden input, the logits and the weights are fixed for the call), so once a pass returns the
    block it was given, every later pass returns it too, and skipping them gives the K-pass tokens.
    Off a GPU one ``lax.while_loop`` checks after every pass; unrolled (GPUs) the check runs only
    after the passes `exit_checks` names, each a ``lax.cond`` holding the passes after it. On an
    H200 a check is a host round trip: a call whose fixed point never comes costs 39-92 µs more
    than ``early_exit=False`` (benchmarks/results/2026-12-02-s10/exit.jsonl). Unrolled, XLA may
    compile pass 1 apart from the others, which can change a float32 sum's order, as unrolling
    itself can.

    Invalid ids: with concrete ``anchors``/``prev_ids``, ids outside [0, V) raise
    ``ValueError``. Under ``jit`` (traced ids) such a row is never read out of
    range; all its draft slots are `INVALID_TOKEN` (-1), so padded rows can be
    marked with anchor -1.

    Use under jit with ``static_argnames=xpress_jax.STATIC_ARGNAMES`` (``num_passes``,
    ``topc``, ``max_num_reqs``, ``config``, ``backend``, ``interpret``, ``unroll``, ``full_vocab``,
    ``return_stats``, ``early_exit``); a
    `Head` argument needs nothing more (its config is static pytree aux data).
    """
    check_backend(backend, interpret)
    return _run(_select_ops(backend, interpret), params, logits, h, anchors, prev_ids, num_passes=num_passes,
                topc=topc, max_num_reqs=max_num_reqs, config=config, unroll=unroll, full_vocab=full_vocab,
                return_stats=return_stats, certified_prepared=certified_prepared, early_exit=early_exit,
                token_table=token_table)


def _platform() -> str:
    """The platform the call compiles for: JAX's default backend, read once per call, here."""
    return jax.default_backend()


def check_backend(backend: Any, interpret: bool) -> None:
    """Refuse (ValueError) a backend name other than `BACKENDS`, and "pallas" off a GPU without interpret."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "pallas" and not interpret and _platform() != "gpu":
        # Before any kernel is traced: Pallas-Triton only compiles for CUDA GPUs.
        raise ValueError(
            f"backend={backend!r} compiles Pallas-Triton kernels, which need a CUDA GPU, but JAX's default "
            f"backend here is {_platform()!r}. Pass interpret=True to run the kernels in interpret "
            "mode (slow: for tests), or backend='xla' (or 'auto', which picks the jnp path off a GPU)"
        )


def _select_ops(backend: str, interpret: bool) -> Ops:
    """``"xla"`` -> `Ops.xla`; ``"pallas"`` -> `Ops.pallas`; ``"auto"`` -> Pallas on a supported
    NVIDIA GPU (or with ``interpret=True``), else XLA."""
    if backend == "xla":
        return Ops.xla(_platform())
    if backend == "pallas":
        return Ops.pallas(interpret)
    try:
        from .kernels.common import gpu_supported
    except ImportError:  # a JAX without Pallas-Triton: the jnp path
        return Ops.xla(_platform())
    if interpret or gpu_supported():
        return Ops.pallas(interpret)
    return Ops.xla(_platform())


def refine_with(ops: Ops, params, logits, h, anchors, prev_ids=None, *, num_passes: int | None = None,
                topc: int | None = None, max_num_reqs: int | None = None, config: HeadConfig | None = None,
                unroll: bool | None = None, full_vocab: Any = "scan", return_stats: bool = False,
                certified_prepared: Any = None, early_exit: bool | tuple = False,
                token_table: jax.Array | None = None) -> jax.Array:
    """`refine` with an explicit `xpress_jax.ops.Ops` instead of ``backend`` (documented internal:
    benchmarks and experiments build mixed implementations with `dataclasses.replace`).

    Same arguments, validation, defaults and result as `refine`. Static under ``jit``: ``ops``
    (hashable), ``num_passes``, ``topc``, ``max_num_reqs``, ``config``, ``unroll``, ``full_vocab``,
    ``return_stats``, ``early_exit``.
    """
    if not isinstance(ops, Ops):
        raise TypeError(f"ops must be an xpress_jax.ops.Ops, got {type(ops).__name__}")
    return _run(ops, params, logits, h, anchors, prev_ids, num_passes=num_passes, topc=topc,
                max_num_reqs=max_num_reqs, config=config, unroll=unroll, full_vocab=full_vocab,
                return_stats=return_stats, certified_prepared=certified_prepared, early_exit=early_exit,
                token_table=token_table)


def _run(ops: Ops, params, logits, h, anchors, prev_ids=None, *, num_passes=None, topc=None, max_num_reqs=None,
         config=None, unroll=None, full_vocab="scan", return_stats=False, certified_prepared=None, early_exit=False,
         token_table=None):
    """Resolve the config's defaults, validate, and run `_refine` with ``ops`` (`refine`'s body)."""
    certified = resolve_full_vocab(full_vocab)
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats must be a bool, got {return_stats!r}")
    if not isinstance(early_exit, (bool, tuple)) or (isinstance(early_exit, tuple) and not all(
            isinstance(q, int) and not isinstance(q, bool) for q in early_exit)):
        raise TypeError(f"early_exit must be a bool or a tuple of pass numbers, got {early_exit!r}")
    params, prev_ids, num_passes, topc, unroll = resolve_call(
        params, logits, h, anchors, prev_ids, num_passes=num_passes, topc=topc, max_num_reqs=max_num_reqs,
        config=config, unroll=unroll)
    if isinstance(early_exit, tuple) and any(not 1 <= q < num_passes for q in early_exit):
        raise ValueError(f"early_exit's pass numbers must lie in [1, num_passes-1={num_passes - 1}] (a check "
                         f"after the last pass skips nothing), got {early_exit}")
    if return_stats and (topc or certified is None):
        raise ValueError(f"return_stats=True reports the certified or pruned mode: it needs topc=0 and "
                         f"full_vocab='certified' or 'pruned' (got topc={topc}, full_vocab={full_vocab!r})")
    if certified_prepared is not None:
        _check_certified_prepared(certified_prepared, params, topc, certified, full_vocab)
    if token_table is not None:
        _check_token_table(token_table, params)
        params = {**params, TOKEN_TABLE: token_table}  # read by `head.latent`
    return _refine(ops, params, logits, h, anchors, prev_ids, num_passes, topc, unroll,
                   certified=None if topc else certified, return_stats=return_stats,
                   certified_prepared=certified_prepared, early_exit=early_exit)


def _check_token_table(table, params) -> None:
    """``token_table`` must be an array [V, r] in the params' accumulation dtype (`xpress_jax.token_table`)."""
    from .head import acc_dtype

    want_shape, want_dtype = tuple(params["w1"].shape), acc_dtype(params["w1"].dtype)
    if not hasattr(table, "shape") or not hasattr(table, "dtype"):
        raise TypeError(f"token_table must be an array (xpress_jax.token_table(params)), got {type(table).__name__}")
    if tuple(table.shape) != want_shape or jnp.dtype(table.dtype) != want_dtype:
        raise ValueError(f"token_table must be xpress_jax.token_table(params): shape {want_shape} (params['w1']'s) "
                         f"and dtype {want_dtype.name}; got shape {tuple(table.shape)}, dtype {jnp.dtype(table.dtype).name}")


def _check_certified_prepared(prepared, params, topc, certified, full_vocab) -> None:
    """``certified_prepared`` must be a `CertifiedPrepared` (scalar ``max_norm`` in the accumulation
    dtype of the params) and the call must run the certified mode; else a clear error."""
    from .exact import CertifiedPrepared, Pruned, PrunedPrepared
    from .head import acc_dtype

    if topc or certified is None:
        raise ValueError(f"certified_prepared is for the certified and pruned modes: it needs topc=0 and "
                         f"full_vocab='certified' or 'pruned' (got topc={topc}, full_vocab={full_vocab!r})")
    if isinstance(certified, Pruned):
        w2 = params["w2"]
        if not isinstance(prepared, PrunedPrepared):
            raise TypeError(f"certified_prepared for full_vocab='pruned' must be xpress_jax.exact.prepare_pruned("
                            f"params['w2']), got {type(prepared).__name__}")
        if getattr(prepared.q, "shape", None) != w2.shape or jnp.dtype(prepared.q.dtype) != jnp.int8:
            raise ValueError(f"certified_prepared.q must be int8 {w2.shape} (prepare_pruned of this head's w2), "
                             f"got {getattr(prepared.q, 'dtype', None)} {getattr(prepared.q, 'shape', None)}")
        return
    if not isinstance(prepared, CertifiedPrepared):
        raise TypeError(f"certified_prepared must be xpress_jax.exact.prepare_certified(params['w2']), "
                        f"got {type(prepared).__name__}")
    m = prepared.max_norm
    want = acc_dtype(params["w2"].dtype)
    if getattr(m, "shape", None) != () or jnp.dtype(m.dtype) != want:
        raise ValueError(f"certified_prepared.max_norm must be a {want.name} scalar (prepare_certified of this "
                         f"head's w2), got {getattr(m, 'shape', None)} {getattr(m, 'dtype', None)}")


def resolve_call(params, logits, h, anchors, prev_ids=None, *, num_passes=None, topc=None, max_num_reqs=None,
                 config=None, unroll=None):
    """`refine`'s argument handling (package-internal; `xpress_jax.sharded` shares it): the config's
    defaults, every check, the defaults of ``prev_ids`` and ``unroll``.

    Returns (params dict, prev_ids, num_passes, topc, unroll) as `_refine` takes them.
    """
    if config is not None and not isinstance(config, HeadConfig):
        raise TypeError(f"config must be a HeadConfig, got {type(config).__name__}")
    if isinstance(params, Head):
        if config is not None and config != params.config:
            raise ValueError(
                f"config={config} disagrees with the Head's own config {params.config}; leave config= out "
                "(the Head carries it), or override single values with num_passes=/topc=/max_num_reqs="
            )
        config, params = params.config, params.params
    if config is None:
        missing = [name for name, v in (("num_passes", num_passes), ("topc", topc)) if v is None]
        if missing:
            raise _no_defaults_error(missing)
    else:
        num_passes = config.num_passes if num_passes is None else num_passes
        topc = config.topc if topc is None else topc
        max_num_reqs = config.max_num_reqs if max_num_reqs is None else max_num_reqs
    _validate(params, logits, h, anchors, prev_ids, num_passes, topc, max_num_reqs, config)
    if prev_ids is None:
        prev_ids = anchors
    if unroll is None:
        unroll = _platform() == "gpu"
    return params, prev_ids, int(num_passes), int(topc), bool(unroll)


def _refine(ops: Ops, params, logits, h, anchors, prev_ids, num_passes, topc, unroll=False, vocab_size=None,
            certified=None, return_stats=False, certified_prepared=None, early_exit=False, return_passes=False):
    """The data path. ``vocab_size``: the global V when ``logits``, ``w1`` and ``w2`` hold one
    vocabulary shard (`xpress_jax.sharded`; then ``ops`` combines across shards). ``certified``: a
    `xpress_jax.exact.Certified` runs the full-vocab passes certified (`exact.certified_passes`);
    ``return_stats`` then also returns its `exact.CertifiedStats`. ``early_exit``: stop at the passes'
    fixed point (`refine`'s "Early exit"; the scan and top-C passes). ``return_passes`` (benchmarks):
    also return the number of passes run, an int32 scalar."""
    N, B, V = logits.shape
    V = V if vocab_size is None else vocab_size
    r = params["w1"].shape[1]
    rows = N * (B - 1)
    # Range check in the ids' own dtype, before any narrowing cast (an int64 2**32 + id must not
    # wrap into a valid int32 id).
    valid = (anchors >= 0) & (anchors < V) & (prev_ids >= 0) & (prev_ids < V)
    anchors = jnp.where(valid, anchors, 0).astype(jnp.int32)
    prev_ids = jnp.where(valid, prev_ids, 0).astype(jnp.int32)

    xh = (ops.hidden or hidden_input)(params, h)  # [N, B, r], once per call

    if isinstance(certified, Pruned) and not topc:
        blk, stats = pruned_passes(ops, params, logits, xh, anchors, prev_ids, valid, num_passes, unroll, certified,
                                   certified_prepared)
        out = jnp.where(valid[:, None], blk[:, 1:], INVALID_TOKEN)
        return (out, stats) if return_stats else out

    if certified is not None and not topc:
        blk, stats = certified_passes(ops, params, logits, xh, anchors, prev_ids, valid, num_passes, unroll, certified,
                                      certified_prepared)
        out = jnp.where(valid[:, None], blk[:, 1:], INVALID_TOKEN)
        return (out, stats) if return_stats else out

    if topc:
        cand, base_c, start = ops.select(logits, topc)
        prepared = ops.topc_prepare(params["w2"], cand)  # once per call

        pass_pick = ops.pass_pick(topc=True)

        def pick(lat, q=0):  # Ops.topc_pass_pick, as the full-vocab one below
            if pass_pick is not None:
                return pass_pick.run(base_c, cand, lat, prepared, q, N)
            return ops.topc_pick(base_c, cand, lat, prepared), 0

    else:
        start = ops.start(logits)
        prepared = ops.full_vocab_prepare(params["w2"])  # once per call

        pass_pick = ops.pass_pick()

        def pick(lat, q=0):
            # Unrolled (q static), Ops.full_vocab_pass_pick may skip the draft slots before s (final since
            # pass s) and read w2 in another order: the same tokens.
            if pass_pick is not None:
                return pass_pick.run(logits, lat, prepared, q)
            return ops.full_vocab_pick(logits, lat, prepared), 0

    blk = jnp.concatenate([anchors[:, None], start.reshape(N, B - 1)], axis=1)

    def one_pass(blk, q=0):  # q: the 0-based pass number where it is static (unrolled), else 0 (every row)
        # split_latent: in top-C passes the latent may come as its residual's two terms, which the pick
        # adds (ops module doc; the full-vocab pick measured slower with them)
        lat = (ops.latent(params, xh, blk, prev_ids, split=True) if ops.split_latent and topc
               else ops.latent(params, xh, blk, prev_ids)).reshape(rows, r)
        tok, s = pick(lat, q)  # the tokens of draft slots s.. (the slots before s are final)
        return blk.at[:, 1 + s:].set(tok.reshape(N, B - 1 - s)) if s < B - 1 else blk

    if early_exit:
        checks = exit_checks(N, num_passes) if early_exit is True else early_exit
        blk, passes = passes_to_fixed_point(one_pass, blk, num_passes, unroll, checks, numbered=True)
    elif unroll and ops.pass_pick(topc=bool(topc)) is not None:
        # The pass number static, for the pass pick. Steps without one keep fori_loop(unroll=True): on a CPU its
        # compiled HLO differs from this loop's for XLA's full-vocab steps (one convert per pass), so they stay
        # in the form they were measured in.
        for q in range(num_passes):
            blk = one_pass(blk, q)
        passes = jnp.int32(num_passes)
    else:
        blk = jax.lax.fori_loop(0, num_passes, lambda _, b: one_pass(b), blk, unroll=unroll)
        passes = jnp.int32(num_passes)
    out = jnp.where(valid[:, None], blk[:, 1:], INVALID_TOKEN)
    return (out, passes) if return_passes else out


def exit_checks(num_blocks: int, num_passes: int) -> tuple[int, ...]:
    """The passes after which an unrolled refine checks for its fixed point (``early_exit=True``):
    below N=16 every other pass (2, 4, ...), from N=16 every pass from pass 2 (a pass costs more
    there than a check). Pass 1 is not checked: it changes some token of most calls.
    """
    step = 2 if num_blocks < 16 else 1
    return tuple(range(2, num_passes, step))


def passes_to_fixed_point(one_pass, blk: jax.Array, num_passes: int, unroll: bool, checks=None, numbered: bool = False):
    """Up to ``num_passes`` applications of ``one_pass`` to ``blk``, stopping at the first checked
    pass that returns its input unchanged (every later pass would return it too). Returns (blk,
    passes run, an int32 scalar).

    ``unroll=False``: one ``lax.while_loop`` that checks after every pass. ``unroll=True``: the passes
    unrolled, checked only after the passes in ``checks`` (pass numbers in 1..K-1; default: every
    pass), each check a ``lax.cond`` holding all the passes after it (on a GPU a host round trip);
    there, with ``numbered=True``, ``one_pass`` gets the 0-based pass number too, ``one_pass(blk, q)`` (a
    Python int).
    """
    if not unroll:
        def step(carry):
            i, b, _ = carry
            new = one_pass(b)
            return i + 1, new, jnp.all(new == b)

        carry = jax.lax.while_loop(lambda c: (c[0] < num_passes) & ~c[2], step,
                                   (jnp.int32(0), blk, jnp.bool_(False)))
        return carry[1], carry[0]
    checks = frozenset(range(1, num_passes) if checks is None else checks)

    def tail(carry, done_passes):  # the passes after ``done_passes``, checked where ``checks`` says
        _, b = carry
        for q in range(done_passes + 1, num_passes + 1):
            new = one_pass(b, q - 1) if numbered else one_pass(b)
            if q in checks and q < num_passes:
                return jax.lax.cond(jnp.all(new == b), lambda c: c, lambda c, q=q: tail(c, q), (jnp.int32(q), new))
            b = new
        return jnp.int32(num_passes), b

    passes, blk = tail((jnp.int32(0), blk), 0)
    return blk, passes
