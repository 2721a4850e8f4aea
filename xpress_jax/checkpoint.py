"""Orbax checkpoints of the head: one composite checkpoint of two items, ``params/`` (StandardSave of the
serving params) and ``xpress/`` (JsonSave: format, version, the `HeadConfig`, dtype, metadata); see
docs/semantics.md. `load_params` restores the arrays against the abstract target of the stored config and
dtype, so arrays that disagree with their config are refused. `save_params` is atomic.

A reduced head's ``d2t`` is stored as int32 beside the floating params (all of the stored dtype). The config's
``draft_vocab_size`` and ``predecessor`` are stored only where they differ from their defaults, and such a
checkpoint is format version 2; every other is version 1, as before, and a version-1 checkpoint (no such
fields) loads as a head over the whole vocabulary with ``predecessor="anchor"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp

from .config import HeadConfig
from .params import PARAM_NAMES, VOCAB_MAP, Head, check_params, param_names, param_shapes

__all__ = ["FORMAT", "FORMAT_VERSION", "save_params", "load_params", "read_checkpoint_info", "staged_directory",
           "write_checkpoint", "is_checkpoint", "stored_param_metadata"]

FORMAT = "xpress-jax/refiner-head"
FORMAT_VERSION = 2  # the newest this version reads and writes; 1 for heads without the version-2 fields
#: HeadConfig fields added in format version 2, stored only where they differ from these defaults.
_V2_DEFAULTS = {"draft_vocab_size": None, "predecessor": "anchor"}
_PARAMS = "params"
_INFO = "xpress"


def _ocp():
    import orbax.checkpoint as ocp  # lazily: `import xpress_jax` stays light

    return ocp


def _checkpointer():
    """An Orbax checkpointer of the two items (a context manager: closed on exit)."""
    ocp = _ocp()
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(**{_PARAMS: ocp.StandardCheckpointHandler(),
                                                              _INFO: ocp.JsonCheckpointHandler()}))


@contextlib.contextmanager
def staged_directory(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a not-yet-existing path (in a hidden temporary folder beside ``path``) to write a directory into;
    rename it to ``path`` on success. On an exception ``path`` is untouched; ``overwrite`` replaces it."""
    path = Path(path).expanduser().absolute()
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise FileExistsError(f"{path} already exists (pass overwrite=True / --force to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    staged = root / "new"
    try:
        yield staged
        if not staged.exists():
            raise RuntimeError(f"nothing was written to the staging path {staged}")
        if path.exists() or path.is_symlink():
            if not overwrite:
                raise FileExistsError(f"{path} appeared while writing; not replacing it")
            old = root / "old"
            os.replace(path, old)
            try:
                os.replace(staged, path)
            except BaseException:
                os.replace(old, path)
                raise
        else:
            os.replace(staged, path)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _stored_config(config: HeadConfig) -> tuple[dict, int]:
    """The config dict to store and the format version it needs (2 only with a version-2 field set)."""
    stored = dataclasses.asdict(config)
    if not config.reduced:
        stored.pop("draft_vocab_size")
    if config.predecessor == _V2_DEFAULTS["predecessor"]:
        stored.pop("predecessor")
    return stored, (2 if set(stored) & set(_V2_DEFAULTS) else 1)


def _param_dtype(name: str, stored: Any) -> jnp.dtype:
    """The dtype param ``name`` is stored in: int32 for ``d2t``, else the checkpoint's float dtype."""
    return jnp.dtype(jnp.int32) if name == VOCAB_MAP else jnp.dtype(stored)


def _info(config: HeadConfig, dtype: Any, metadata: Mapping[str, Any] | None) -> dict:
    from . import __version__

    stored, version = _stored_config(config)
    return {"format": FORMAT, "format_version": version, "config": stored, "hf_config": config.to_hf_config(),
            "dtype": jnp.dtype(dtype).name, "param_names": list(param_names(config)),
            "xpress_jax_version": __version__, "metadata": dict(metadata or {})}


def write_checkpoint(path: str | os.PathLike, config: HeadConfig, params: Mapping[str, Any], *,
                     metadata: Mapping[str, Any] | None = None) -> Path:
    """Write the checkpoint at ``path``, which must not exist (not atomic: see `save_params`)."""
    if not isinstance(config, HeadConfig):
        raise TypeError(f"config must be a HeadConfig, got {type(config).__name__}")
    check_params(params, config)
    path = Path(path).expanduser().absolute()
    if path.exists():
        raise FileExistsError(f"{path} already exists")
    arrays = {k: jnp.asarray(params[k]) for k in param_names(config)}
    if VOCAB_MAP in arrays:
        arrays[VOCAB_MAP] = arrays[VOCAB_MAP].astype(jnp.int32)
    ocp = _ocp()
    info = _info(config, arrays["w1"].dtype, metadata)
    with _checkpointer() as ckptr:
        ckptr.save(path, args=ocp.args.Composite(**{_PARAMS: ocp.args.StandardSave(arrays),
                                                    _INFO: ocp.args.JsonSave(info)}))
    return path


def save_params(path: str | os.PathLike, config: HeadConfig | Head, params: Mapping[str, Any] | None = None, *,
                metadata: Mapping[str, Any] | None = None, overwrite: bool = False) -> Path:
    """Save ``params`` (serving form, checked against ``config``) and ``config`` as an Orbax checkpoint, or
    ``save_params(path, head)``. ``metadata`` (JSON-able) is stored beside the config. Atomic; returns the
    absolute path."""
    if isinstance(config, Head):
        if params is not None:
            raise TypeError("save_params(path, head) takes no params: the Head holds them")
        config, params = config.config, config.params
    if params is None:
        raise TypeError("save_params(path, config, params): params missing (or pass a Head: save_params(path, head))")
    with staged_directory(path, overwrite=overwrite) as staged:
        write_checkpoint(staged, config, params, metadata=metadata)
    return Path(path).expanduser().absolute()


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like a checkpoint written by `save_params` (no arrays are read)."""
    path = Path(path).expanduser()
    return path.is_dir() and (path / _INFO).is_dir() and (path / _PARAMS).is_dir()


def read_checkpoint_info(path: str | os.PathLike) -> tuple[HeadConfig, dict]:
    """The stored `HeadConfig` and the whole info record (format, dtype, metadata); reads no arrays."""
    path = Path(path).expanduser().absolute()
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not is_checkpoint(path):
        raise ValueError(f"{path} is not an xpress-jax head checkpoint (expected the Orbax items {_PARAMS!r} and "
                         f"{_INFO!r}); convert a PyTorch checkpoint with `xpress-convert SRC DST`")
    ocp = _ocp()
    try:
        with _checkpointer() as ckptr:
            info = ckptr.restore(path, args=ocp.args.Composite(**{_INFO: ocp.args.JsonRestore()}))[_INFO]
    except Exception as e:
        raise ValueError(f"{path}: cannot read the checkpoint's {_INFO!r} item: {e}") from e
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        fmt = info.get("format") if isinstance(info, dict) else info
        raise ValueError(f"{path}: unknown checkpoint format {fmt!r}")
    if info.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format version {info['format_version']} is newer than this "
                         f"xpress-jax reads ({FORMAT_VERSION}); upgrade xpress-jax")
    try:
        config = HeadConfig(**info["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: the stored config is invalid: {e}") from e
    return config, info


def _shardings(sharding: Any, names: tuple[str, ...]) -> dict[str, jax.sharding.Sharding]:
    """``sharding=`` of `load_params` as one `jax.sharding.Sharding` per param name in ``names``. A dict may name
    any param a head can hold (``d2t`` too: ignored for a head without one)."""
    def one(s: Any, what: str) -> jax.sharding.Sharding:
        if s is None:
            return jax.sharding.make_single_device_sharding(jax.devices()[0])
        if isinstance(s, jax.sharding.Sharding):
            return s
        if isinstance(s, jax.Device):
            return jax.sharding.make_single_device_sharding(s)
        raise TypeError(f"{what} must be None (the default device), a jax.Device, a jax.sharding.Sharding, or a "
                        f"dict {{param name: Device | Sharding}}, got {type(s).__name__}")

    if isinstance(sharding, Mapping):
        known = PARAM_NAMES + (VOCAB_MAP,)
        unknown = sorted(set(sharding) - set(known), key=str)
        if unknown:
            raise ValueError(f"sharding: unknown param name(s) {unknown}; the params are {list(known)}")
        out = {k: one(sharding.get(k), f"sharding[{k!r}]") for k in known}
        return {k: out[k] for k in names}
    s = one(sharding, "sharding")
    return {k: s for k in names}


def load_params(path: str | os.PathLike, dtype: Any = None, sharding: Any = None) -> Head:
    """Restore the `Head` (config + params) from a checkpoint written by `save_params` / ``xpress-convert``.

    The params are restored straight onto the devices ``sharding`` names: ``None`` (the default device),
    a ``jax.Device``, a ``jax.sharding.Sharding`` for every param (e.g. a ``NamedSharding``;
    ``PartitionSpec()`` replicates), or a dict ``{param name: Device | Sharding}`` (names left out: the
    default device; ``d2t`` may be named, and is ignored for a head without one). ``dtype`` casts the
    floating params afterwards (a reduced head's ``d2t`` stays int32).
    """
    _shardings(sharding, ())  # argument errors before any file is read
    config, info = read_checkpoint_info(path)
    shardings = _shardings(sharding, param_names(config))
    path = Path(path).expanduser().absolute()
    stored = jnp.dtype(info["dtype"])
    abstract = {name: jax.ShapeDtypeStruct(shape, _param_dtype(name, stored), sharding=shardings[name])
                for name, shape in param_shapes(config).items()}
    # Compare the abstract target with Orbax's metadata first: a clear message, and no failed restore.
    try:
        on_disk = stored_param_metadata(path)
    except Exception as e:
        raise ValueError(f"{path}: cannot read the params' metadata: {e}") from e
    bad = [f"{k}: stored {' '.join(map(str, on_disk.get(k, ('nothing', ''))))}, expected {a.shape} {a.dtype.name}"
           for k, a in abstract.items() if on_disk.get(k) != (tuple(a.shape), a.dtype.name)]
    if bad:
        raise ValueError(f"{path}: cannot restore the params against the stored config {config}: " + "; ".join(bad))
    ocp = _ocp()
    try:
        with _checkpointer() as ckptr:
            restored = ckptr.restore(path, args=ocp.args.Composite(**{_PARAMS: ocp.args.StandardRestore(abstract)}))
    except Exception as e:
        raise ValueError(f"{path}: cannot restore the params: {e}") from e
    head = Head(config, {k: restored[_PARAMS][k] for k in param_names(config)})
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {jnp.dtype(dtype)}")
    return head if dtype is None else head.astype(dtype)


def stored_param_metadata(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype name)}`` of the stored arrays, from Orbax metadata (no arrays read)."""
    path = Path(path).expanduser().absolute()
    with _checkpointer() as ckptr:
        meta = ckptr.metadata(path).item_metadata[_PARAMS]
    if meta is None:
        raise ValueError(f"{path}: the checkpoint has no readable {_PARAMS!r} metadata")
    return {k: (tuple(v.shape), jnp.dtype(v.dtype).name) for k, v in meta.tree.items()}
