"""`RefineServer`: every bucket AOT-compiled at start-up, no tracing and no compiling while serving.

Start-up lowers ``refine`` once per bucket size N from `jax.ShapeDtypeStruct`s (no input is
allocated) and keeps the compiled executables. A call picks its bucket's executable and runs
it; an input whose shape, dtype or sharding differs from what that executable was compiled
for is refused with an error naming it, never silently recompiled. Weights are an argument
of the executables, so a reload swaps arrays and reuses them.
"""

from __future__ import annotations

import bisect
import dataclasses
import sys
import time
from os import PathLike
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import sharded
from .checkpoint import load_params, read_checkpoint_info
from .compile_options import check_compiler_options
from .compile_options import compiler_options as default_compiler_options
from .config import HeadConfig
from .exact import Auto, prepare_certified, resolve_full_vocab
from .head import token_table as token_table_of
from .params import VOCAB_MAP, Head, check_params, param_names, param_shapes
from .refine import INVALID_TOKEN, check_backend, refine
from .sampling import PROPOSALS, Proposal, check_sampling

__all__ = ["RefineServer", "default_buckets"]

_ARGS = ("logits", "h", "anchors", "prev_ids")

#: How many device scalars of distinct temperatures a server keeps (each made once, then reused).
_TEMPERATURE_CACHE = 64


def default_buckets(max_num_reqs: int) -> tuple[int, ...]:
    """Powers of two up to ``max_num_reqs`` (which is always the last bucket)."""
    out, b = [], 1
    while b < max_num_reqs:
        out.append(b)
        b *= 2
    out.append(max_num_reqs)
    return tuple(out)


def _describe(x: Any) -> str:
    if isinstance(x, jax.Array):
        return f"a jax.Array {tuple(x.shape)} {jnp.dtype(x.dtype).name} with sharding {x.sharding}"
    return f"a numpy array {tuple(x.shape)} {np.dtype(x.dtype).name}"


@dataclasses.dataclass
class _Bucket:
    """One bucket's executables (`jax.stages.Compiled`, compiled at start-up) and its input specs.

    Every executable takes ``(params, table, logits, h, anchors, prev_ids, num_valid)`` first, then:
      greedy: the certified mode's weight data where that is its mode -> tokens (with ``full_vocab="auto"``: the
        scan, nothing more).
      certified: ``full_vocab="auto"``'s certified mode in buckets of at least ``Auto.min_blocks`` blocks (else
        None): the weight data -> (tokens, `CertifiedStats`).
      sampled: ``sampling=True`` (else None): the temperature and the key -> tokens, or (tokens, `Proposal`).
    """

    size: int
    specs: dict[str, jax.ShapeDtypeStruct]
    greedy: Any = None
    certified: Any = None
    sampled: Any = None
    seconds: float = 0.0


class _FixedPolicy:
    """The full-vocabulary mode fixed at start-up (top-C, a mesh, ``"scan"``, ``"certified"``): every greedy
    call runs its bucket's greedy executable."""

    greedy_takes_data = True  # the greedy executables take the certified data (() unless the mode is certified)

    def __init__(self, mode: str):
        self._mode = mode

    def certifies(self, size: int) -> bool:
        """Whether a bucket of ``size`` blocks also has a certified executable."""
        return False

    def mode(self, size: int) -> str:
        """How the last greedy call of bucket ``size`` ran (before any call: how the first will)."""
        return self._mode

    def serve(self, bucket: _Bucket, inputs: tuple, data: tuple) -> jax.Array:
        """Choose which of ``bucket``'s executables serves this greedy call and run it: the tokens. ``inputs``:
        the arguments every executable takes; ``data``: the certified mode's weight data."""
        return bucket.greedy(*inputs, *data)


@dataclasses.dataclass
class _AutoState:
    """One bucket's state under `_AutoPolicy`."""

    mode: str = "certified"  # how the next call runs
    last: str = "certified"  # how the last call ran (before any call: how the first will)
    since: int = 0  # certified calls since the certified mode was last tried
    scan_left: int = 0  # scan calls left before the certified mode is tried again
    pending: jax.Array | None = None  # a kept call's fraction of fallen-back passes, read once the device has it
    switches: int = 0  # switches to the scan


class _AutoPolicy:
    """``full_vocab="auto"``, configured by an `xpress_jax.exact.Auto`: buckets of fewer than ``min_blocks``
    blocks scan; larger ones run certified, and every ``check_every``-th certified call keeps its stats, read
    by a later call once the device has them (never waiting). A fraction of fallen-back passes above
    ``max_fallback`` sends the bucket to the scan for the next ``retry_after`` calls, then it tries again."""

    greedy_takes_data = False  # the greedy executables are the scan

    def __init__(self, config: Auto, buckets: Sequence[int]):
        self.config = config
        self.state = {b: _AutoState() for b in buckets if b >= config.min_blocks}

    def certifies(self, size: int) -> bool:
        """Whether a bucket of ``size`` blocks also has a certified executable."""
        return size in self.state

    def mode(self, size: int) -> str:
        """How the last greedy call of bucket ``size`` ran (before any call: how the first will)."""
        st = self.state.get(size)
        return "scan" if st is None else st.last

    def serve(self, bucket: _Bucket, inputs: tuple, data: tuple) -> jax.Array:
        """Choose which of ``bucket``'s executables serves this greedy call and run it: the tokens. ``inputs``:
        the arguments every executable takes; ``data``: the certified mode's weight data."""
        st = self.state.get(bucket.size)
        if st is None:
            return bucket.greedy(*inputs)
        a, pending = self.config, st.pending
        if pending is not None and pending.is_ready():  # never waits for the device
            st.pending = None
            if float(pending) > a.max_fallback:  # the bound does not prune here: scan for a while
                st.mode, st.scan_left, st.switches = "scan", a.retry_after, st.switches + 1
        st.last = st.mode
        if st.mode == "scan":
            st.scan_left -= 1
            if st.scan_left <= 0:
                st.mode, st.since = "certified", 0
            return bucket.greedy(*inputs)
        out, stats = bucket.certified(*inputs, *data)
        if st.since % a.check_every == 0:
            st.pending = stats.passes_full_scan
        st.since += 1
        return out


class RefineServer:
    """`refine` for N blocks per call, N <= the largest bucket, from executables compiled at start-up.

    ``RefineServer(head, buckets=...)`` (or ``RefineServer.from_checkpoint(path, ...)``) compiles one
    executable per bucket size N (default: powers of two up to the config's ``max_num_reqs``) before it
    returns, printing one line per bucket to stderr (``progress=False``: quiet; ``compile_seconds`` keeps
    the times). Serving then never traces and never compiles:

    - ``server(logits, h, anchors, prev_ids=None, num_valid=None)`` runs the bucket's executable and returns
      the device array [bucket, B-1] int32. Rows ``>= num_valid`` (a runtime argument) are padding: their
      anchors are set to -1 inside and they come back as `INVALID_TOKEN` (-1).
    - ``server.tokens(...)``: the same call, the first ``num_valid`` rows as a numpy array.
    - Sampling (built with ``sampling=True``): ``server(..., temperature=T, key=jax.random.key(s), proposal=None)``
      runs the bucket's sampled executable: `refine`'s sampled tokens for that key (T and the key are runtime
      arguments: changing them never compiles; T = 0 gives the greedy tokens). The noise is a function of the
      draft row, and padding rows come after the real ones, so the real rows' tokens are `refine`'s on the
      unpadded inputs. ``proposal`` (at most the constructor's): also return the `xpress_jax.Proposal`, device
      arrays of bucket rows (``tokens()``: numpy, the first ``num_valid`` rows). A temperature given as a
      jax.Array (a float scalar) is not range-checked (that would wait for the device).

    Inputs: jax arrays must match the bucket exactly (shape, dtype: the params' for logits and h, int32 for
    the ids, and a sharding equivalent to ``input_specs(bucket)``'s), else an error naming the argument.
    Numpy arrays of any N <= the largest bucket are padded on the host to the next bucket and placed; their
    ids are range-checked (rows below ``num_valid``). Nothing is converted to another float dtype.

    Weights: ``reload(head_or_params)`` / ``reload_from(path)`` check every array's shape, dtype and sharding
    before swapping (on an error the old weights keep serving); the executables are reused.

    Options:
      topc, num_passes: default the config's. ``full_vocab`` (``topc=0``): ``"auto"`` (the default: per
        bucket, the certified mode from ``min_blocks`` blocks while its bound prunes, else the scan; a
        `xpress_jax.exact.Auto` sets the policy; `exact_mode(bucket)` says how the last call ran), ``"scan"``,
        ``"certified"`` or a `xpress_jax.exact.Certified`; the same tokens (docs/certified.md). The bound's
        weight-only data is computed at start-up and on every reload. With a mesh: the scan.
      early_exit: `refine`'s option (one device only).
      output: ``"device"`` (the default) or ``"host"``: the executables put the tokens in pinned host memory,
        so ``tokens()`` needs no copy and the CUDA graph is not re-recorded every call (docs/performance.md).
      token_table: keep `xpress_jax.token_table` of the weights ([V, r] float32) and pass it to every call
        (`refine`'s option). None: on for one device, off with a mesh; False saves the memory.
      mesh, data_axis, model_axis: run `xpress_jax.sharded.refine_sharded` (blocks over ``data_axis``,
        ``w1``/``w2`` over the vocabulary on ``model_axis``); ``input_specs(bucket)`` and
        ``param_shardings`` say where inputs and weights must lie.
      compiler_options: XLA compile options for every executable. None: on one device
        `xpress_jax.compiler_options` for its platform, with a mesh of several devices XLA's defaults;
        ``{}``: XLA's defaults.
      sampling: also compile each bucket's sampled executable (``temperature`` and ``key`` are its arguments).
        Sampled calls score the full vocabulary with the scan whatever ``full_vocab`` says (the certified bound
        is for greedy picks); ``topc > 0`` samples among the candidates.
      proposal: with ``sampling``, what the sampled executables also compute (`refine`'s ``proposal``): None,
        ``"logprob"`` or ``"scores"`` (also every draft slot's scores: [bucket, B-1, V] for the full vocabulary).
        A call asks for it, or for less, with ``proposal=``; the executables compute it either way.
    """

    def __init__(self, head: Head, *, buckets: Sequence[int] | None = None, backend: str = "auto",
                 mesh: jax.sharding.Mesh | None = None, data_axis: str | None = "data",
                 model_axis: str | None = "model", num_passes: int | None = None, topc: int | None = None,
                 interpret: bool = False, progress: bool = True, full_vocab: Any = "auto", output: str = "device",
                 early_exit: bool | tuple = False, token_table: bool | None = None,
                 compiler_options: Mapping[str, Any] | None = None, sampling: bool = False,
                 proposal: str | None = None):
        if not isinstance(head, Head):
            raise TypeError(f"RefineServer(head): head must be a xpress_jax.Head (xj.load_params, xj.init_head, or "
                            f"xj.Head(config, params) around a params dict), got {type(head).__name__}; "
                            "or build it with RefineServer.from_checkpoint(path)")
        check_backend(backend, interpret)
        if not isinstance(sampling, bool):
            raise TypeError(f"RefineServer: sampling must be True or False, got {sampling!r}")
        if proposal is not None and proposal not in PROPOSALS:
            raise ValueError(f"RefineServer: proposal must be None or one of {PROPOSALS}, got {proposal!r}")
        if proposal is not None and not sampling:
            raise ValueError(f"RefineServer: proposal={proposal!r} is what the sampled executables return; "
                             "pass sampling=True as well")
        self.sampling, self.proposal = sampling, proposal
        # The keys the sampled executables take: JAX's default PRNG implementation's (``jax.random.key``'s).
        default_key = jax.random.key(0)
        self._key_impl, self._key_dtype = str(jax.random.key_impl(default_key)), default_key.dtype
        self._raw_key_shape = tuple(jax.random.key_data(default_key).shape)  # jax.random.PRNGKey(seed)'s
        auto = full_vocab if isinstance(full_vocab, Auto) else Auto() if full_vocab == "auto" else None
        self._auto_given = auto is not None  # "auto" in top-C mode or on a mesh: the scan
        if auto is None:
            resolve_full_vocab(full_vocab)  # ValueError naming full_vocab
        if mesh is not None and full_vocab not in ("scan", "auto"):
            raise ValueError(f"full_vocab={full_vocab!r} runs on one device; with a mesh use full_vocab='scan'")
        self.full_vocab = full_vocab
        self.output = self._check_output(output, mesh)
        if mesh is not None and early_exit is not False:
            raise ValueError(f"RefineServer: early_exit={early_exit!r} runs on one device; with a mesh leave it False")
        self.early_exit = early_exit
        if token_table not in (None, True, False):
            raise TypeError(f"RefineServer: token_table must be None, True or False, got {token_table!r}")
        if mesh is not None and token_table:
            raise ValueError("RefineServer: token_table=True runs on one device; with a mesh leave it None or False")
        self.token_table = mesh is None if token_table is None else bool(token_table)
        self.compiler_options: dict[str, Any] = (
            check_compiler_options(compiler_options, "RefineServer") if compiler_options is not None
            else default_compiler_options(jax.devices()[0].platform) if mesh is None or mesh.size == 1 else {})
        config = head.config
        self.config: HeadConfig = config
        self.num_passes = config.num_passes if num_passes is None else num_passes
        self.topc = config.topc if topc is None else topc
        self.backend, self.interpret = backend, bool(interpret)
        self.mesh, self.data_axis, self.model_axis = mesh, data_axis, model_axis
        self.dtype = jnp.dtype(head.dtype)
        self.buckets: tuple[int, ...] = tuple(sorted(set(default_buckets(config.max_num_reqs) if buckets is None
                                                          else (int(b) for b in buckets))))
        if not self.buckets or self.buckets[0] < 1 or self.buckets[-1] > config.max_num_reqs:
            raise ValueError(f"buckets must lie in [1, max_num_reqs={config.max_num_reqs}], got {self.buckets}")

        if mesh is not None:
            if data_axis is not None and data_axis == model_axis:
                raise ValueError(f"data_axis and model_axis must differ, both are {data_axis!r}")
            for axis in (data_axis, model_axis):
                sharded.axis_size(mesh, axis)
        self.param_shardings: dict[str, jax.sharding.Sharding] = self._param_shardings(mesh, model_axis, config)
        self._param_specs = {
            k: jax.ShapeDtypeStruct(s, jnp.int32 if k == VOCAB_MAP else self.dtype, sharding=self.param_shardings[k])
            for k, s in param_shapes(config).items()
        }
        self._params = self._checked_params(head.params, place_jax=True)  # placed (a transfer) where needed
        # Which of a bucket's executables serves a greedy call. Top-C mode or a mesh: nothing to decide.
        self._policy: _FixedPolicy | _AutoPolicy
        if auto is not None and mesh is None and not self.topc:
            self._policy = _AutoPolicy(auto, self.buckets)
            self._certified = bool(self._policy.state)  # some bucket runs certified
        else:
            self._certified = mesh is None and not self.topc and resolve_full_vocab(full_vocab) is not None
            self._policy = _FixedPolicy("certified" if self._certified else "scan")
        # Kept with the weights, computed here and at every reload: the token table and the bound's data.
        opts = self.compiler_options
        self._table_exe = self._table_spec = self._table = None
        if self.token_table:
            table_inputs = {k: self._param_specs[k] for k in ("w1", "in_proj_token")}
            self._table_exe = jax.jit(token_table_of).lower(table_inputs).compile(compiler_options=opts)
            self._table = self._table_exe({k: self._params[k] for k in table_inputs})
            self._table_spec = jax.ShapeDtypeStruct(self._table.shape, self._table.dtype, sharding=self._table.sharding)
        self._prepare_exe = None
        self._extra: tuple = ()
        if self._certified:
            self._prepare_exe = jax.jit(prepare_certified).lower(self._param_specs["w2"]).compile(compiler_options=opts)
            self._extra = (self._prepare_exe(self._params["w2"]),)
        self._buckets: dict[int, _Bucket] = {}
        self._temperature_cache: dict[float, jax.Array] = {}
        self._num_valid_cache: dict[tuple[int, int], jax.Array] = {}
        self._compile_all(progress)

    @property
    def executables(self) -> dict[int, Any]:
        """bucket -> its greedy `jax.stages.Compiled` (with ``full_vocab="auto"``: the scan)."""
        return {b: c.greedy for b, c in self._buckets.items()}

    @property
    def certified_executables(self) -> dict[int, Any]:
        """``full_vocab="auto"``: bucket -> its certified executable (returning the stats too), for the buckets of
        at least ``min_blocks`` blocks."""
        return {b: c.certified for b, c in self._buckets.items() if c.certified is not None}

    @property
    def sampled_executables(self) -> dict[int, Any]:
        """``sampling=True``: bucket -> its sampled executable."""
        return {b: c.sampled for b, c in self._buckets.items() if c.sampled is not None}

    @property
    def compile_seconds(self) -> dict[int, float]:
        """bucket -> the seconds its executables took to compile."""
        return {b: c.seconds for b, c in self._buckets.items()}

    @classmethod
    def from_checkpoint(cls, path: str | PathLike, *, dtype: Any = None, mesh: jax.sharding.Mesh | None = None,
                        model_axis: str | None = "model", **kwargs: Any) -> "RefineServer":
        """Restore the head of a converted checkpoint (`xpress_jax.load_params`) straight onto the
        devices the server uses, then compile every bucket. ``dtype`` casts the params, as in
        ``load_params``; the other keywords are the constructor's."""
        config, _ = read_checkpoint_info(path)
        head = load_params(path, dtype=dtype, sharding=cls._param_shardings(mesh, model_axis, config))
        return cls(head, mesh=mesh, model_axis=model_axis, **kwargs)

    @staticmethod
    def _param_shardings(mesh, model_axis, config: HeadConfig) -> dict[str, jax.sharding.Sharding]:
        if mesh is None:
            one = jax.sharding.make_single_device_sharding(jax.devices()[0])
            return {k: one for k in param_names(config)}
        return dict(sharded.param_shardings(mesh, model_axis, vocab_size=config.vocab_size,
                                            draft_vocab_size=config.draft_vocab_size if config.reduced else None))

    @staticmethod
    def _check_output(output: Any, mesh) -> str:
        """``output`` is ``"device"`` or ``"host"``; ``"host"`` needs every device to have pinned host memory."""
        if output not in ("device", "host"):
            raise ValueError(f"RefineServer: output must be 'device' or 'host', got {output!r}")
        if output == "host":
            devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
            for d in devices:
                kinds = [m.kind for m in d.addressable_memories()]
                if "pinned_host" not in kinds:
                    raise ValueError(f"RefineServer: output='host' puts the tokens in pinned host memory, which "
                                     f"{d} does not have (its memories: {kinds}); use output='device'")
        return output

    def input_shardings(self, bucket: int) -> dict[str, jax.sharding.Sharding]:
        """Where ``bucket``'s executable takes its inputs and puts its result, by argument name: ``"logits"``,
        ``"h"``, ``"anchors"``, ``"prev_ids"`` (also as ``"ids"``), ``"num_valid"`` (also the temperature and the
        key) and ``"out"`` (with ``output="host"``: pinned host memory)."""
        if bucket not in self.buckets:
            raise ValueError(f"{bucket} is not a bucket; the buckets are {self.buckets}")
        if self.mesh is None:
            one = jax.sharding.make_single_device_sharding(jax.devices()[0])
            out = {"logits": one, "h": one, "anchors": one, "prev_ids": one, "ids": one, "num_valid": one,
                   "out": one}
        else:
            out = dict(sharded.input_shardings(self.mesh, self.data_axis, self.model_axis, num_blocks=bucket,
                                               vocab_size=self.config.draft_vocab_size))
            out["num_valid"] = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        if self.output == "host":
            out["out"] = out["out"].with_memory_kind("pinned_host")
        return out

    def _serve_fn(self, full_vocab=None, return_stats=False, sampled=False):
        config, kw = self.config, dict(num_passes=self.num_passes, topc=self.topc, backend=self.backend,
                                        interpret=self.interpret)
        if self.mesh is None:
            kw["full_vocab"] = "scan" if sampled else full_vocab or ("scan" if self._auto_given else self.full_vocab)
            kw["early_exit"] = self.early_exit
            if return_stats:
                kw["return_stats"] = True
        mesh = self.mesh

        def serve(params, table, logits, h, anchors, prev_ids, num_valid, *extra):
            # Padding rows get anchor -1: refine's sentinel rule reads nothing for them, returns -1. They come
            # after the real rows, so a sampled call draws the real rows' noise from their own row indices.
            pad = jnp.arange(anchors.shape[0]) >= num_valid
            anchors = jnp.where(pad, INVALID_TOKEN, anchors)
            prev_ids = jnp.where(pad, INVALID_TOKEN, prev_ids)
            head = Head(config, params)
            call = dict(kw)
            if sampled:  # extra: the temperature and the key
                call.update(temperature=extra[0], key=extra[1], proposal=self.proposal)
            if mesh is None:
                prepared = None if sampled or not extra else extra[0]
                return refine(head, logits, h, anchors, prev_ids, certified_prepared=prepared, token_table=table,
                              **call)
            return sharded.refine_sharded(head, logits, h, anchors, prev_ids, mesh=mesh, data_axis=self.data_axis,
                                          model_axis=self.model_axis, **call)

        return serve

    def _proposal_shardings(self, bucket: int) -> Proposal:
        """Where the sampled executables put the proposal: on the device(s), never in host memory; with a mesh
        split like the tokens (full-vocab scores also like the logits' vocabulary)."""
        sh = self.input_shardings(bucket)
        if self.mesh is None:
            rows = whole = sh["logits"]
        else:
            da = sh["logits"].spec[0]
            rows = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(da, None))
            whole = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(da, None, None))
        scores = ids = None
        if self.proposal == "scores":
            scores, ids = (whole, whole) if self.topc else (sh["logits"], None)
        return Proposal(rows, rows, scores, ids)

    def input_specs(self, bucket: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The abstract inputs of ``bucket``'s executable (shape, dtype, sharding), by argument name
        (``"logits"``, ``"h"``, ``"anchors"``, ``"prev_ids"``, ``"num_valid"``): what a persistent
        input buffer must look like."""
        c, sh = self.config, self.input_shardings(bucket)
        ids = jax.ShapeDtypeStruct((bucket,), jnp.int32, sharding=sh["ids"])
        specs = {
            "logits": jax.ShapeDtypeStruct((bucket, c.block_size, c.draft_vocab_size), self.dtype,
                                           sharding=sh["logits"]),
            "h": jax.ShapeDtypeStruct((bucket, c.block_size, c.hidden_size), self.dtype, sharding=sh["h"]),
            "anchors": ids,
            "prev_ids": ids,
            "num_valid": jax.ShapeDtypeStruct((), jnp.int32, sharding=sh["num_valid"]),
        }
        if self.sampling:  # the sampled executables' runtime arguments: a float32 scalar and a `jax.random.key`
            specs["temperature"] = jax.ShapeDtypeStruct((), jnp.float32, sharding=sh["num_valid"])
            specs["key"] = jax.ShapeDtypeStruct((), self._key_dtype, sharding=sh["num_valid"])
        return specs

    def _compile_all(self, progress: bool) -> None:
        serve = self._serve_fn()
        say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
        devices = 1 if self.mesh is None else self.mesh.size
        say(f"RefineServer: compiling {len(self.buckets)} bucket(s) {self.buckets} (V={self.config.vocab_size}, "
            f"B={self.config.block_size}, {self.dtype.name}, topc={self.topc}, K={self.num_passes}, "
            f"backend={self.backend}, {devices} device(s){', sampling' if self.sampling else ''})")
        policy = self._policy
        if isinstance(policy, _AutoPolicy):
            serve_cert = self._serve_fn(full_vocab=policy.config.certified, return_stats=True)
        if self.sampling:
            serve_sampled = self._serve_fn(sampled=True)
        opts, t_all = self.compiler_options, time.perf_counter()
        for i, b in enumerate(self.buckets):
            t0 = time.perf_counter()
            c = self._buckets[b] = _Bucket(b, self.input_specs(b))
            spec, out = c.specs, self.input_shardings(b)["out"]
            args = (self._param_specs, self._table_spec, *(spec[k] for k in _ARGS), spec["num_valid"])
            data = self._extra if policy.greedy_takes_data else ()
            c.greedy = jax.jit(serve, out_shardings=out).lower(*args, *data).compile(compiler_options=opts)
            what = ""
            if policy.certifies(b):
                # The stats stay where refine puts them (the policy reads one scalar of them, seldom).
                stats_at = jax.sharding.make_single_device_sharding(jax.devices()[0])
                c.certified = jax.jit(serve_cert, out_shardings=(out, stats_at)).lower(
                    *args, *self._extra).compile(compiler_options=opts)
                what = " (scan and certified)"
            if self.sampling:
                outs = out if self.proposal is None else (out, self._proposal_shardings(b))
                c.sampled = jax.jit(serve_sampled, out_shardings=outs).lower(
                    *args, spec["temperature"], spec["key"]).compile(compiler_options=opts)
                what = " (scan, certified and sampled)" if what else " (greedy and sampled)"
            c.seconds = time.perf_counter() - t0
            say(f"RefineServer: [{i + 1}/{len(self.buckets)}] N={b}: compiled{what} in {c.seconds:.2f} s")
        say(f"RefineServer: ready, {time.perf_counter() - t_all:.2f} s")

    def bucket_for(self, n: int) -> int:
        """The smallest bucket >= n."""
        i = bisect.bisect_left(self.buckets, n)
        if n < 1 or i == len(self.buckets):
            raise ValueError(f"N={n} blocks: must be in [1, {self.buckets[-1]}] (the largest bucket)")
        return self.buckets[i]

    def __call__(self, logits, h, anchors, prev_ids=None, num_valid: int | None = None, *, temperature=None,
                 key: jax.Array | None = None, proposal: str | None = None):
        """Refine the first ``num_valid`` blocks (default: all N): [bucket, B-1] int32 (class docstring); with a
        ``temperature`` sampled, and with a ``proposal`` ``(tokens, xpress_jax.Proposal)``."""
        sample = self._sampling_args(temperature, key, proposal)
        args, bucket, num_valid = self._prepare(logits, h, anchors, prev_ids, num_valid)
        if sample is None:
            return self._run(bucket, args, self._num_valid(bucket, num_valid))
        return self._run_sampled(bucket, args, self._num_valid(bucket, num_valid), *sample)

    def _sampling_args(self, temperature, key, proposal):
        """None for a greedy call, else (the temperature, the key, the proposal wanted), checked and placed where
        the executables take them (no value read back from a device, nothing converted on a device)."""
        if temperature is None:
            check_sampling(None, key, proposal)  # a key or proposal without a temperature
            return None
        if not self.sampling:
            raise ValueError("RefineServer: temperature is for the sampled executables, which this server did not "
                             "compile; build it with RefineServer(..., sampling=True)")
        if isinstance(temperature, jax.core.Tracer):
            raise TypeError("RefineServer: temperature must be a concrete scalar (a float or a jax.Array), not a "
                            "traced value: the server runs compiled executables and is not traced")
        on_device = isinstance(temperature, jax.Array)
        if on_device and (temperature.shape != () or temperature.dtype != jnp.float32):
            raise ValueError(f"RefineServer: temperature must be a Python or numpy scalar, or a float32 jax.Array "
                             f"scalar; got a jax.Array {tuple(temperature.shape)} {jnp.dtype(temperature.dtype).name}")
        check_sampling(1.0 if on_device else temperature, key, proposal)
        if proposal is not None and (self.proposal is None or (proposal, self.proposal) == ("scores", "logprob")):
            raise ValueError(f"RefineServer: proposal={proposal!r}, but the sampled executables compute "
                             f"proposal={self.proposal!r}; build the server with RefineServer(..., sampling=True, "
                             f"proposal={proposal!r})")
        spec = self._buckets[self.buckets[0]].specs
        if on_device:
            t = temperature
            if not t.sharding.is_equivalent_to(spec["temperature"].sharding, 0):
                t = jax.device_put(t, spec["temperature"].sharding)
        else:
            value = float(np.asarray(temperature))
            t = self._temperature_cache.get(value)
            if t is None:  # a device scalar made once per value (else copied to the device on every call)
                if len(self._temperature_cache) >= _TEMPERATURE_CACHE:
                    self._temperature_cache.clear()
                t = self._temperature_cache[value] = jax.device_put(np.float32(value), spec["temperature"].sharding)
        want = spec["key"]
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):  # a raw key (jax.random.PRNGKey(seed))
            if tuple(key.shape) != self._raw_key_shape:
                raise ValueError(f"RefineServer: key must be one {self._key_impl} key (jax.random.key(seed)), got "
                                 f"a raw key of shape {tuple(key.shape)}")
            key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32), impl=self._key_impl)
        if key.dtype != want.dtype:
            raise ValueError(f"RefineServer: key is a {jax.random.key_impl(key)} key; the sampled executables take "
                             f"{self._key_impl} keys (jax.random.key(seed))")
        if not key.sharding.is_equivalent_to(want.sharding, 0):
            key = jax.device_put(key, want.sharding)
        return t, key, proposal

    def _run_sampled(self, bucket: int, args: tuple, num_valid: jax.Array, temperature, key, proposal):
        out = self._buckets[bucket].sampled(self._params, self._table, *args, num_valid, temperature, key)
        if self.proposal is None:
            return out
        tokens, prop = out
        if proposal is None:
            return tokens
        if proposal == "logprob":
            prop = prop._replace(scores=None, ids=None)
        return tokens, prop

    def _run(self, bucket: int, args: tuple, num_valid: jax.Array) -> jax.Array:
        return self._policy.serve(self._buckets[bucket], (self._params, self._table, *args, num_valid), self._extra)

    def exact_mode(self, bucket: int) -> str:
        """How ``bucket``'s ``topc=0`` calls run: ``"scan"`` or ``"certified"``. With ``full_vocab="auto"``:
        how its last call ran (before any call: how the first will). It changes no token."""
        if bucket not in self.buckets:
            raise ValueError(f"{bucket} is not a bucket; the buckets are {self.buckets}")
        return self._policy.mode(bucket)

    def _num_valid(self, bucket: int, num_valid: int) -> jax.Array:
        """``num_valid`` as a device scalar where ``bucket``'s executable takes it, made once per value (a
        numpy scalar argument would be copied to the device on every call)."""
        key = (bucket, num_valid)
        if key not in self._num_valid_cache:
            sharding = self._buckets[bucket].specs["num_valid"].sharding
            self._num_valid_cache[key] = jax.device_put(np.int32(num_valid), sharding)
        return self._num_valid_cache[key]

    def tokens(self, logits, h, anchors, prev_ids=None, num_valid: int | None = None, *, temperature=None,
               key: jax.Array | None = None, proposal: str | None = None):
        """``server(...)``'s valid rows on the host: numpy [num_valid, B-1] int32 (with ``output="device"``
        a device-to-host copy; with ``output="host"`` the tokens are there already). With a ``proposal``:
        ``(tokens, Proposal)``, its arrays numpy too, the same rows."""
        out = self(logits, h, anchors, prev_ids, num_valid, temperature=temperature, key=key, proposal=proposal)
        num_valid = logits.shape[0] if num_valid is None else int(num_valid)
        if proposal is None:
            return np.asarray(out)[:num_valid]
        tokens, prop = out
        return np.asarray(tokens)[:num_valid], Proposal(*(None if x is None else np.asarray(x)[:num_valid]
                                                          for x in prop))

    def _prepare(self, logits, h, anchors, prev_ids, num_valid):
        if prev_ids is None:
            if self.config.predecessor == "previous":
                raise ValueError("RefineServer: prev_ids is required: this head was trained with the real token "
                                 "before the anchor in slot 0 (config.predecessor='previous'). Pass prev_ids=<the "
                                 "token before each anchor>, or prev_ids=anchors for vLLM's behaviour")
            prev_ids = anchors
        xs = {"logits": logits, "h": h, "anchors": anchors, "prev_ids": prev_ids}
        for name, x in xs.items():
            if not isinstance(x, (jax.Array, np.ndarray)):
                raise TypeError(f"RefineServer: {name} must be a numpy array or a jax.Array, got {type(x).__name__}")
        c = self.config
        n = logits.shape[0] if logits.ndim == 3 else None
        want = {"logits": (n, c.block_size, c.draft_vocab_size), "h": (n, c.block_size, c.hidden_size),
                "anchors": (n,), "prev_ids": (n,)}
        for name, x in xs.items():
            if n is None or tuple(x.shape) != want[name]:
                raise ValueError(f"RefineServer: {name} is {_describe(x)}; expected shape "
                                 f"{tuple('N' if d is None else d for d in want[name])}, N the same for every input "
                                 f"(logits [N, B, V], h [N, B, H], anchors and prev_ids [N]; B={c.block_size}, "
                                 f"V={c.draft_vocab_size}, H={c.hidden_size})")
        if isinstance(num_valid, bool) or not (num_valid is None or isinstance(num_valid, (int, np.integer))):
            raise TypeError(f"RefineServer: num_valid must be an int, got {num_valid!r}")
        num_valid = n if num_valid is None else int(num_valid)
        if not 1 <= num_valid <= n:
            raise ValueError(f"RefineServer: num_valid must be in [1, N={n}], got {num_valid}")
        bucket = self.bucket_for(n)
        if bucket != n:
            devs = [k for k, x in xs.items() if isinstance(x, jax.Array)]
            if devs:
                raise ValueError(
                    f"RefineServer: {devs[0]} is a jax.Array with N={n} blocks, which is not a bucket "
                    f"{self.buckets}; device arrays are never padded here (that would compile per N). Serve them "
                    f"from a bucket-sized buffer: N={bucket} rows with num_valid={num_valid} (server.input_specs"
                    f"({bucket}) describes it), or pass numpy arrays (padded on the host)"
                )
        out = []
        for name in _ARGS:
            x = xs[name]
            if isinstance(x, np.ndarray):
                x = self._host(name, x, n, bucket, num_valid)
                x = jax.device_put(x, self._buckets[bucket].specs[name].sharding)
            else:
                self._check_device(name, x, bucket)
            out.append(x)
        return out, bucket, num_valid

    def _host(self, name: str, x: np.ndarray, n: int, bucket: int, num_valid: int) -> np.ndarray:
        if name in ("anchors", "prev_ids"):
            if not np.issubdtype(x.dtype, np.integer):
                raise TypeError(f"RefineServer: {name} must hold integer token ids, got {_describe(x)}")
            valid = x[:num_valid]
            bad = np.nonzero((valid < 0) | (valid >= self.config.vocab_size))[0]
            if bad.size:  # checked in the ids' own dtype, before the int32 cast (no wraparound)
                raise ValueError(
                    f"RefineServer: {name} has token ids outside [0, {self.config.vocab_size}) at rows "
                    f"{bad[:8].tolist()}{' ...' if bad.size > 8 else ''}: values {valid[bad[:8]].tolist()}"
                )
            x = np.where(np.arange(n) < num_valid, x, INVALID_TOKEN).astype(np.int32)
            fill = INVALID_TOKEN
        else:
            if np.dtype(x.dtype) != self.dtype:
                raise TypeError(
                    f"RefineServer: {name} is {_describe(x)}; the executables take {self.dtype.name} (the params' "
                    "dtype). Inputs are never converted: cast them before the call"
                )
            fill = 0
        if bucket != n:
            x = np.concatenate([x, np.full((bucket - n,) + x.shape[1:], fill, x.dtype)])
        return x

    def _check_device(self, name: str, x: jax.Array, bucket: int) -> None:
        spec = self._buckets[bucket].specs[name]
        if jnp.dtype(x.dtype) != spec.dtype:
            raise TypeError(
                f"RefineServer: {name} is {_describe(x)}; bucket N={bucket} was compiled for {spec.dtype.name}. "
                "Inputs are never converted or recompiled: pass the compiled dtype"
            )
        if not x.sharding.is_equivalent_to(spec.sharding, x.ndim):
            raise ValueError(
                f"RefineServer: {name} is {_describe(x)}; bucket N={bucket} was compiled for sharding "
                f"{spec.sharding}. Place it with jax.device_put(x, server.input_specs({bucket})[{name!r}].sharding) "
                "or pass a numpy array"
            )

    @property
    def head(self) -> Head:
        """The weights serving now, as a `Head`."""
        return Head(self.config, self._params)

    def _checked_params(self, params: Mapping[str, Any], *, place_jax: bool) -> dict[str, jax.Array]:
        """Validated params on ``param_shardings``; raises before anything changes."""
        check_params(params, self.config)  # names and shapes against the compiled config
        out = {}
        for k in param_names(self.config):
            x, spec = params[k], self._param_specs[k]
            if jnp.dtype(x.dtype) != spec.dtype:
                raise TypeError(
                    f"RefineServer: params[{k!r}] has dtype {jnp.dtype(x.dtype).name}; the executables were "
                    f"compiled for {spec.dtype.name}"
                )
            if isinstance(x, jax.Array) and not place_jax:
                if not x.sharding.is_equivalent_to(spec.sharding, x.ndim):
                    raise ValueError(
                        f"RefineServer: params[{k!r}] has sharding {x.sharding}; the executables were compiled for "
                        f"{spec.sharding}. Load weights onto server.param_shardings (reload_from(path) does; or "
                        "xj.load_params(path, sharding=server.param_shardings)), or pass numpy arrays"
                    )
                out[k] = x
            elif isinstance(x, (jax.Array, np.ndarray)):
                out[k] = jax.device_put(x, spec.sharding)
            else:
                raise TypeError(
                    f"RefineServer: params[{k!r}] must be a numpy array or a jax.Array, got {type(x).__name__}"
                )
        return out

    def reload(self, head_or_params: Head | Mapping[str, Any]) -> None:
        """Serve new weights with the same executables (no compile).

        Takes a `Head` with this server's config, or a params dict. Every array's shape, dtype and
        sharding is checked first; on an error nothing changes and the old weights keep serving.
        """
        params = head_or_params
        if isinstance(params, Head):
            if params.config != self.config:
                raise ValueError(
                    f"RefineServer.reload: the new Head's config {params.config} differs from the compiled "
                    f"{self.config}; build a new server for another config"
                )
            params = params.params
        checked = self._checked_params(params, place_jax=False)
        extra = (self._prepare_exe(checked["w2"]),) if self._certified else ()
        table = self._table_exe({k: checked[k] for k in ("w1", "in_proj_token")}) if self.token_table else None
        # together: the bound's data and the token table always match the weights
        self._params, self._extra, self._table = checked, extra, table

    def reload_from(self, path: str | PathLike, *, dtype: Any = None) -> None:
        """`reload` from a converted checkpoint, restored straight onto ``param_shardings``.
        The stored config is compared first (no arrays read when it differs)."""
        stored, _ = read_checkpoint_info(path)
        if stored != self.config:
            raise ValueError(
                f"RefineServer.reload_from: {path} holds a head with config {stored}, the server was compiled "
                f"for {self.config}; build a new server for another config"
            )
        self.reload(load_params(path, dtype=dtype, sharding=self.param_shardings))

    def __repr__(self) -> str:
        where = "1 device" if self.mesh is None else f"mesh {dict(self.mesh.shape)}"
        return (f"RefineServer(buckets={self.buckets}, V={self.config.vocab_size}, B={self.config.block_size}, "
                f"{self.dtype.name}, topc={self.topc}, K={self.num_passes}, backend={self.backend!r}, {where}, "
                f"output={self.output!r}, token_table={self.token_table})")
