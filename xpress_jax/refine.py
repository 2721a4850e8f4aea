"""`refine`: K greedy or sampled Jacobi passes of the XPress head, jit-able with static shapes.

One call goes: `refine` settles its arguments (the `xpress_jax.ops.Ops` of the backend and the params' dtype,
every check, the defaults), then `prepare` builds the call's mode (`xpress_jax.modes`: `Greedy` for top-C and the full-vocabulary
scan, `Sampled`, or the certified mode of `xpress_jax.exact`); then `run_passes`, the one pass loop, starts the
mode, runs its passes and finishes it. A pass calls the `Ops` steps (the jnp reference, the fast XLA spelling or
the Pallas-Triton kernels), each of which calls its kernel's wrapper. The platform is read once per call, at the
API edge (`_platform`).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .config import HeadConfig
from .exact import Certified, CertifiedMode, CertifiedPrepared, resolve_full_vocab
from .head import TOKEN_TABLE, acc_dtype, hidden_input
from .modes import INVALID_TOKEN, Call, Greedy, Loop, Mode, Sampled
from .ops import Ops
from .params import VOCAB_MAP, Head, check_params
from .sampling import Sampler, check_sampling, inverse_temperature, row_seeds

__all__ = ["refine", "refine_with", "select_ops", "check_backend", "resolve_call", "prepare", "run_passes",
           "exit_checks", "INVALID_TOKEN", "BACKENDS", "STATIC"]

BACKENDS = ("auto", "xla", "pallas")

#: The keyword arguments of `refine` that must be static under ``jax.jit`` (``xj.STATIC_ARGNAMES``).
STATIC = ("num_passes", "topc", "max_num_reqs", "config", "backend", "interpret", "unroll", "full_vocab",
          "return_stats", "early_exit", "proposal")


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _validate(params, logits, h, anchors, prev_ids, num_passes, topc, max_num_reqs, config=None):
    check_params(params, config)
    V, r = params["w1"].shape
    Vd = params["w2"].shape[0]  # the draft vocabulary (V unless the head is reduced)
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
        raise ValueError(f"logits has block size {logits.shape[1]} (shape {tuple(logits.shape)}), "
                         f"but the head's block_size is {B}")
    if logits.shape[2] != Vd:
        what = f"draft_vocab_size is {Vd} (a reduced head: logits over its draft vocabulary)" if Vd != V else \
            f"vocab_size is {V}"
        raise ValueError(f"logits has vocab {logits.shape[2]}, but the head's {what}")
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
    if isinstance(num_passes, bool) or not isinstance(num_passes, (int, np.integer)) or num_passes < 0:
        raise ValueError(f"num_passes must be an int >= 0 (0: the seed block), got {num_passes!r}")
    if isinstance(topc, bool) or not isinstance(topc, (int, np.integer)):
        raise TypeError(f"topc must be an int (0 = full vocabulary), got {topc!r}")
    if not 0 <= topc <= Vd:
        raise ValueError(f"topc must be in [0, {'draft_vocab_size' if Vd != V else 'vocab_size'}={Vd}], got {topc}")
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
                raise ValueError(f"{name} has token ids outside [0, {V}) at rows {bad[:8].tolist()}"
                                 f"{' ...' if bad.size > 8 else ''}: values {a[bad[:8]].tolist()}")


def _no_defaults_error(missing: list[str]) -> TypeError:
    return TypeError(f"refine: plain params carry no HeadConfig, so {' and '.join(missing)} "
                     f"{'has' if len(missing) == 1 else 'have'} no default (refine does not guess C and K). "
                     "Fix it one of three ways: pass a Head (xj.load_params and xj.init_head return one; "
                     "xj.Head(config, params) wraps a dict); or pass config=HeadConfig(...), whose num_passes and topc "
                     "are then the defaults; or pass num_passes=K and topc=C explicitly (topc=0: full vocabulary)")


def refine(params: Head | Mapping[str, jax.Array], logits: jax.Array, h: jax.Array, anchors: jax.Array,
           prev_ids: jax.Array | None = None, *, num_passes: int | None = None, topc: int | None = None,
           max_num_reqs: int | None = None, config: HeadConfig | None = None, backend: str = "auto",
           interpret: bool = False, unroll: bool | None = None, full_vocab: Any = "scan", return_stats: bool = False,
           certified_prepared: Any = None, early_exit: bool | tuple = False,
           token_table: jax.Array | None = None, temperature: Any = None, key: jax.Array | None = None,
           proposal: str | None = None) -> jax.Array:
    """Refine N draft blocks with K Jacobi passes, greedy or sampled; returns the draft [N, B-1] int32.

    Args:
      params: a `xpress_jax.Head` (what `load_params` and `init_head` return), or the plain params dict.
      logits: [N, B, V] drafter logits (slot 0's row is unused), params' dtype.
      h: [N, B, H] drafter hidden states, params' dtype.
      anchors: [N] int, the verified token of each block (slot 0).
      prev_ids: [N] int, the token before each anchor, which slot 0's latent reads. A head whose
        ``config.predecessor`` is "anchor" (vLLM's checkpoints) defaults it to ``anchors``, as vLLM does; a
        "previous" head (speculators' and `xpress_jax.train`'s) requires it (pass ``prev_ids=anchors`` to get
        vLLM's behaviour anyway).
      num_passes, topc, max_num_reqs: K >= 0 (0: the seed block, as vLLM returns it); 0 = exact full-vocabulary
        scoring or C in [1, V] = score only
        each draft slot's C largest base logits; the largest accepted N. Default: the config's.
      config: the `HeadConfig` for plain params. With a `Head` it may be left out (if given, it must equal
        the Head's). No silent defaults: with a plain dict and no config, num_passes and topc are required.
      backend: ``"xla"`` (pure jnp), ``"pallas"`` (Pallas-Triton kernels: a CUDA GPU, or ``interpret=True``)
        or ``"auto"`` (Pallas on a supported GPU, else jnp). Mixed implementations: `refine_with`.
      interpret: run Pallas kernels in interpret mode (CPU tests).
      unroll: unroll the K passes instead of a loop (same tokens). Default: unrolled on GPUs, a loop
        elsewhere. Unrolled, each pass knows its number, and the Pallas steps may skip the draft slots
        already final and alternate the order in which they read ``w2`` (the same tokens).
      full_vocab: how ``topc=0`` is computed (the same tokens either way; unused when ``topc > 0``):
        ``"scan"`` (every pass scores the whole vocabulary) or ``"certified"`` (each pass scores the C=512
        largest base logits and proves with a bound that no other token wins; rows it cannot certify are
        scanned; `xpress_jax.exact`, docs/certified.md). A `xpress_jax.exact.Certified` sets its options.
      return_stats: with ``topc=0`` and ``full_vocab="certified"``, return ``(tokens, stats)``, the
        `xpress_jax.exact.CertifiedStats` (the fraction of rows certified and of passes that scanned).
      certified_prepared: with ``full_vocab="certified"``, `xpress_jax.exact.prepare_certified` of these
        very weights' ``w2``, computed once (None: every call, one read of ``w2``).
      early_exit: True stops the scan and top-C passes once a pass leaves the block unchanged (the same
        tokens: a pass is a function of the block alone, so every later pass would return it too). Off a
        GPU a ``lax.while_loop`` checks after every pass; unrolled, only after the passes `exit_checks`
        names (each check a ``lax.cond``, on a GPU a host round trip); a tuple of pass numbers (1..K-1)
        names them instead. False (the default): all K passes.
      token_table: `xpress_jax.token_table` of these very weights ([V, r], V*r*4 bytes): each pass gathers
        its rows instead of running a gather and a GEMM (the same sums).
      temperature, key: sample instead (`xpress_jax.sampling`): each draft slot takes ``argmax(s * (1/T) + g)`` with
        frozen Gumbel noise ``g``, a function of ``key`` (a `jax.random.key`), the draft row and the vocab id,
        the same for the seed block and every pass. ``temperature`` may be traced (changing it never recompiles);
        0 gives the greedy tokens. In top-C mode the seed block is sampled among the candidates too. Not with
        ``full_vocab="certified"``.
      proposal: with a temperature, also return the draft distribution: ``(tokens, xpress_jax.Proposal)``;
        ``"logprob"`` (each drafted token's score and the log-normalizer) or ``"scores"`` (also the last pass's
        scores: [N, B-1, V], or the C candidates' with their ids).

    Rules (docs/semantics.md): a slot's score is ``float(dtype(base + bias))``; the largest score wins.
    Ties: full-vocab mode, the lowest vocab id; top-C mode, the larger base logit, then the lowest id. The
    candidates are each slot's C largest base logits, lowest ids first among values tied at the C-th place;
    the block starts from the full-vocab argmax of the base logits. NaN counts as -inf; +inf wins.

    Reduced draft vocabulary (``config.draft_vocab_size`` < V, params with ``d2t``): ``logits`` are [N, B, V_draft],
    each pass picks draft ids (ties: the lowest draft id; the noise is a function of the draft id) and maps them to
    verifier ids (``id + d2t[id]``) for the next pass and the result; anchors, prev_ids and the returned tokens are
    verifier ids, a `Proposal`'s ids and scores are in draft-id space (`xpress_jax.sampling.accept` maps them).

    Invalid ids: with concrete ``anchors``/``prev_ids``, ids outside [0, V) raise ``ValueError``. Under
    ``jit`` such a row is never read out of range; all its draft slots are `INVALID_TOKEN` (-1), so padded
    rows can be marked with anchor -1. Likewise a traced ``temperature`` that is negative, NaN or infinite
    makes every draft slot of the call -1 (a concrete one raises).

    Under jit: ``static_argnames=xpress_jax.STATIC_ARGNAMES``; a `Head` argument needs nothing more (its
    config is static pytree aux data).
    """
    check_backend(backend, interpret)
    settled = _settle(select_ops(backend, interpret), params, logits, h, anchors, prev_ids, num_passes=num_passes,
                      topc=topc, max_num_reqs=max_num_reqs, config=config, unroll=unroll, full_vocab=full_vocab,
                      return_stats=return_stats, certified_prepared=certified_prepared, early_exit=early_exit,
                      token_table=token_table, temperature=temperature, key=key, proposal=proposal)
    return run_passes(prepare(**settled))


def _platform() -> str:
    """The platform the call compiles for: JAX's default backend, read once per call, here."""
    return jax.default_backend()


def check_backend(backend: Any, interpret: bool) -> None:
    """Refuse (ValueError) a backend name other than `BACKENDS`, and "pallas" off a GPU without interpret."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "pallas":
        from .kernels.common import TRITON_IMPORT_ERROR, triton_available

        if not triton_available():
            raise ValueError(f"backend='pallas' runs Pallas-Triton kernels, and this JAX ({jax.__version__}) has no "
                             f"jax.experimental.pallas.triton ({TRITON_IMPORT_ERROR}); use backend='xla' or 'auto' "
                             "(the same tokens)")
    if backend == "pallas" and not interpret and _platform() != "gpu":
        raise ValueError(
            f"backend={backend!r} compiles Pallas-Triton kernels, which need a CUDA GPU, but JAX's default "
            f"backend here is {_platform()!r}. Pass interpret=True to run the kernels in interpret "
            "mode (slow: for tests), or backend='xla' (or 'auto', which picks the jnp path off a GPU)"
        )


def select_ops(backend: str, interpret: bool) -> Ops:
    """The `Ops` of a ``backend`` (`check_backend` refuses the bad ones): ``"xla"`` -> `Ops.xla`; ``"pallas"`` ->
    `Ops.pallas`; ``"auto"`` -> Pallas on a supported NVIDIA GPU (or with ``interpret=True``), else XLA."""
    from .kernels.common import gpu_supported, triton_available  # only where a call asks for a backend

    if backend == "pallas" or (backend == "auto" and ((interpret and triton_available()) or gpu_supported())):
        return Ops.pallas(interpret)
    return Ops.xla(_platform())


def refine_with(ops: Ops, params, logits, h, anchors, prev_ids=None, **kwargs) -> jax.Array:
    """`refine` with an explicit `xpress_jax.ops.Ops` instead of ``backend`` and ``interpret`` (benchmarks
    build mixed implementations with `dataclasses.replace`). Same keywords, checks and result; ``ops`` is
    static under jit."""
    if not isinstance(ops, Ops):
        raise TypeError(f"ops must be an xpress_jax.ops.Ops, got {type(ops).__name__}")
    return run_passes(prepare(**_settle(ops, params, logits, h, anchors, prev_ids, **kwargs)))


def _settle(ops: Ops, params, logits, h, anchors, prev_ids=None, *, num_passes=None, topc=None, max_num_reqs=None,
            config=None, unroll=None, full_vocab="scan", return_stats=False, certified_prepared=None,
            early_exit=False, token_table=None, temperature=None, key=None, proposal=None) -> dict:
    """`refine`'s arguments settled, as `prepare`'s keyword arguments: the config's defaults, every check, the steps
    for the params' dtype (`Ops.for_dtype`), the token table in the params, the `Sampler`."""
    certified = resolve_full_vocab(full_vocab)
    check_sampling(temperature, key, proposal)
    if temperature is not None and certified is not None:
        raise ValueError(f"full_vocab={full_vocab!r}: the certified mode's bound is for greedy picks; sample with "
                         "full_vocab='scan' (or topc > 0)")
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
    if (return_stats or certified_prepared is not None) and (topc or certified is None):
        what = "return_stats=True" if return_stats else "certified_prepared"
        raise ValueError(f"{what} is for the certified mode: it needs topc=0 and full_vocab='certified' "
                         f"(got topc={topc}, full_vocab={full_vocab!r})")
    if certified_prepared is not None:
        _check_certified_prepared(certified_prepared, params)
    if token_table is not None:
        _check_token_table(token_table, params)
        params = {**params, TOKEN_TABLE: token_table}  # read by `head.latent`
    sampler = None
    if temperature is not None:
        sampler = Sampler(row_seeds(key, logits.shape[0] * (logits.shape[1] - 1)), inverse_temperature(temperature),
                          proposal)
    return dict(ops=ops.for_dtype(params["w1"].dtype), params=params, logits=logits, h=h, anchors=anchors,
                prev_ids=prev_ids, num_passes=num_passes, topc=topc, unroll=unroll,
                certified=None if topc else certified, return_stats=return_stats,
                certified_prepared=certified_prepared, early_exit=early_exit, sampler=sampler)


def _check_token_table(table, params) -> None:
    """``token_table`` must be an array [V, r] in the params' accumulation dtype (`xpress_jax.token_table`)."""
    want_shape, want_dtype = tuple(params["w1"].shape), acc_dtype(params["w1"].dtype)
    if not hasattr(table, "shape") or not hasattr(table, "dtype"):
        raise TypeError(f"token_table must be an array (xpress_jax.token_table(params)), got {type(table).__name__}")
    if tuple(table.shape) != want_shape or jnp.dtype(table.dtype) != want_dtype:
        raise ValueError(f"token_table must be xpress_jax.token_table(params): shape {want_shape} (params['w1']'s) "
                         f"and dtype {want_dtype.name}; got shape {tuple(table.shape)}, "
                         f"dtype {jnp.dtype(table.dtype).name}")


def _check_certified_prepared(prepared, params) -> None:
    """``certified_prepared`` must be a `CertifiedPrepared` (a scalar ``max_norm`` in the params'
    accumulation dtype)."""
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
    """`refine`'s argument handling (`xpress_jax.sharded` shares it): the config's defaults, every check,
    the defaults of ``prev_ids`` and ``unroll``. Returns (params dict, prev_ids, num_passes, topc, unroll)."""
    for name, v in (("num_passes", num_passes), ("topc", topc), ("max_num_reqs", max_num_reqs)):
        if isinstance(v, jax.core.Tracer):
            raise TypeError(f"{name} must be a static int, got a traced value: jit refine with "
                            f"static_argnames=xj.STATIC_ARGNAMES ({', '.join(STATIC)})")
    if config is not None and not isinstance(config, HeadConfig):
        raise TypeError(f"config must be a HeadConfig, got {type(config).__name__}")
    if isinstance(params, Head):
        if config is not None and config != params.config:
            raise ValueError(f"config={config} disagrees with the Head's own config {params.config}; leave config= out "
                             "(the Head carries it), or override single values with num_passes=/topc=/max_num_reqs=")
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
        if config is not None and config.predecessor == "previous":
            raise ValueError("prev_ids is required: this head was trained with the real token before the anchor in "
                             "slot 0 (config.predecessor='previous'; speculators' and xpress_jax.train's heads). "
                             "Pass prev_ids=<the token before each anchor>, or prev_ids=anchors for vLLM's behaviour")
        prev_ids = anchors
    if unroll is None:
        unroll = _platform() == "gpu"
    return params, prev_ids, int(num_passes), int(topc), bool(unroll)


def prepare(ops: Ops, params, logits, h, anchors, prev_ids, num_passes: int, topc: int, unroll: bool = False, *,
            vocab_size: int | None = None, certified: Certified | None = None, return_stats: bool = False,
            certified_prepared=None, early_exit: bool | tuple = False, return_passes: bool = False,
            sampler: Sampler | None = None) -> Mode:
    """The call's mode for `run_passes`, its once-per-call work done: the ids range-checked (invalid rows marked),
    the hidden input, the mode's own (candidates, prepared ``w2``, seed block). Arguments as `refine` settles them
    (``ops`` for the params' dtype). ``vocab_size``: the global V when ``logits``, ``w1`` and ``w2`` hold one
    vocabulary shard (`xpress_jax.sharded`; ``ops`` then combines across shards). ``certified`` (with ``topc=0``):
    the certified mode; ``return_stats`` then also returns its `CertifiedStats`. ``return_passes`` (benchmarks):
    also return the number of passes run, an int32 scalar. ``sampler``: sample (`Sampler`); with its ``proposal``
    the result is ``(tokens, Proposal)``."""
    N, B, _ = logits.shape
    V = params["w1"].shape[0] if vocab_size is None else vocab_size  # the verifier's vocabulary
    # Range check in the ids' own dtype, before any narrowing cast (an int64 2**32 + id must not
    # wrap into a valid int32 id).
    valid = (anchors >= 0) & (anchors < V) & (prev_ids >= 0) & (prev_ids < V)
    anchors = jnp.where(valid, anchors, 0).astype(jnp.int32)
    prev_ids = jnp.where(valid, prev_ids, 0).astype(jnp.int32)
    if sampler is not None:  # an invalid traced temperature (NaN 1/T) marks every row
        t_ok = ~jnp.isnan(sampler.inv_t)
        valid = valid & t_ok
        sampler = sampler._replace(inv_t=jnp.where(t_ok, sampler.inv_t, 0.0))
    xh = (ops.hidden or hidden_input)(params, h)  # [N, B, r], once per call
    call = Call(ops, params, logits, xh, anchors, prev_ids, valid, params.get(VOCAB_MAP))
    if certified is not None and not topc:
        return CertifiedMode(call, num_passes, certified, certified_prepared, Loop(num_passes, unroll, unroll),
                             return_stats=return_stats, with_passes=return_passes)
    checks = None
    if early_exit:
        checks = exit_checks(N, num_passes, ops.thresholds.exit_every_pass_from) if early_exit is True else early_exit
    if sampler is None:
        # Unrolled steps that ignore the pass number keep fori_loop(unroll=True): on a CPU its compiled HLO differs
        # from a Python loop's for XLA's full-vocab steps (one convert per pass).
        return Greedy(call, topc, Loop(num_passes, unroll, unroll and ops.numbered, checks), with_passes=return_passes)
    passes = num_passes
    if sampler.proposal is not None:  # K - 1 passes in the loop, the last one (with its extras) in `finish`
        passes = max(num_passes - 1, 0)
        if num_passes and checks:
            checks = tuple(q for q in checks if q < num_passes - 1) or None
    return Sampled(call, topc, sampler, Loop(passes, unroll, unroll, checks), num_passes, with_passes=return_passes)


def exit_checks(num_blocks: int, num_passes: int, every_pass_from: int = 16) -> tuple[int, ...]:
    """The passes after which an unrolled refine checks for its fixed point (``early_exit=True``):
    below N = ``every_pass_from`` (the table's `dispatch.Thresholds.exit_every_pass_from`, 16) every other
    pass (2, 4, ...), from there every pass from pass 2 (a pass costs more there than a check). Pass 1 is
    not checked: it changes some token of most calls.
    """
    step = 2 if num_blocks < every_pass_from else 1
    return tuple(range(2, num_passes, step))


def run_passes(mode: Mode):
    """The pass loop of every mode (`xpress_jax.modes`): ``carry = mode.start()``, then ``mode.loop.passes`` times
    ``carry = mode.pass_(carry, q)``, then ``mode.finish(carry, passes)`` (``passes``: the passes run, an int32
    scalar). ``q`` is the 0-based pass number (a Python int) where the loop numbers the passes, else None.

    ``loop.checks`` None: all passes, ``loop.numbered`` in Python, else one ``lax.fori_loop(unroll=loop.unroll)``.
    A tuple (early exit): stop after the first checked pass that leaves ``blk`` unchanged: unrolled, the passes
    checked after the pass numbers (1..K-1) in ``checks``, each check a ``lax.cond`` holding the passes after it;
    else one ``lax.while_loop`` checking after every pass. Numbered, the passes from B-1 on are not run: every
    draft slot is final, the pass would return its block.
    """
    num_passes, unroll, numbered, checks = mode.loop
    carry = mode.start()
    if checks is None:
        if numbered:
            for q in range(min(num_passes, mode.slots)):
                carry = mode.pass_(carry, q)
        else:
            carry = jax.lax.fori_loop(0, num_passes, lambda _, c: mode.pass_(c, None), carry, unroll=unroll)
        return mode.finish(carry, jnp.int32(num_passes))
    if not unroll:
        def step(c):
            i, cur, _ = c
            new = mode.pass_(cur, None)
            return i + 1, new, jnp.all(new[0] == cur[0])

        i, carry, _ = jax.lax.while_loop(lambda c: (c[0] < num_passes) & ~c[2], step,
                                         (jnp.int32(0), carry, jnp.bool_(False)))
        return mode.finish(carry, i)
    checks = frozenset(checks)

    def tail(c, done):  # the passes after ``done``, checked where ``checks`` says
        _, cur = c
        for q in range(done + 1, num_passes + 1):
            if not numbered:
                new = mode.pass_(cur, None)
            else:
                new = mode.pass_(cur, q - 1) if q - 1 < mode.slots else cur
            if q in checks and q < num_passes:
                return jax.lax.cond(jnp.all(new[0] == cur[0]), lambda x: x, lambda x, q=q: tail(x, q),
                                    (jnp.int32(q), new))
            cur = new
        return jnp.int32(num_passes), cur

    passes, carry = tail((jnp.int32(0), carry), 0)
    return mode.finish(carry, passes)
