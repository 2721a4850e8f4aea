"""`convert_checkpoint`: a PyTorch XPress checkpoint (as vLLM loads it) -> an Orbax head checkpoint.

Steps, each refusing bad input with a `ConversionError` that names the problem:

1. source and destination: the source must not be an already converted
   checkpoint; the destination must not lie inside the source folder, must not
   exist unless ``force``, and must not contain the source;
2. source: list the tensors (`xpress_jax.convert.sources.open_source`; safetensors headers
   are validated, pickles opened with ``weights_only=True``);
3. head: the tensors under ``xpress_head.`` / ``model.xpress_head.`` by
   HYBRID_KEY_MAP name; missing, duplicate and unknown names are errors; the
   backbone is counted and ignored;
4. config: ``HeadConfig.from_hf_config`` of config.json (or ``config=``) with
   ``overrides`` on top; every head tensor's shape is checked against it before
   any data is read;
5. read the head tensors (progress bar), refuse NaN/inf, check the mixer: a
   ``mix.L`` that is exactly lower-triangular with a unit diagonal looks
   already folded and is refused under ``mixer="auto"``;
6. ``params_from_state_dict`` folds the raw mixer exactly once and converts the
   layouts; ``dtype`` picks the stored dtype;
7. write into a temporary folder beside the destination, optionally verify
   there (`xpress_jax.convert.verify`), and rename into place only when all succeeded.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from xpress_jax.checkpoint import staged_directory, write_checkpoint
from xpress_jax.config import HeadConfig
from xpress_jax.params import HYBRID_KEY_MAP, params_from_state_dict, source_shapes

from .errors import ConversionError, VerificationError
from .progress import Progress, human_bytes
from .sources import HeadSelection, Source, open_source, read_config_json, select_head

__all__ = [
    "DTYPES",
    "MIXER_MODES",
    "ConvertReport",
    "convert_checkpoint",
    "mixer_looks_folded",
    "resolve_config",
]

DTYPES = ("keep", "bfloat16", "float32")
MIXER_MODES = ("auto", "raw", "folded")
_FLOAT_NAMES = {"float16", "bfloat16", "float32", "float64"}


def config_line(c: HeadConfig) -> str:
    return (
        f"V={c.vocab_size} H={c.hidden_size} B={c.block_size} r={c.rank} M={c.mlp_hidden} "
        f"topc={c.topc} K={c.num_passes} max_num_reqs={c.max_num_reqs}"
    )


@dataclasses.dataclass
class ConvertReport:
    src: Path
    dst: Path
    source_kind: str
    files: list[Path]
    config: HeadConfig
    config_from: str
    head_keys: dict[str, str]
    prefixes: list[str]
    backbone_count: int
    backbone_bytes: int
    source_dtypes: list[str]
    dtype: str
    mixer: str
    tensors_read: int
    bytes_read: int
    params_written: int
    bytes_written: int
    seconds_read: float
    seconds_write: float
    seconds_verify: float
    seconds_total: float
    warnings: list[str]
    verify: Any = None  # convert.verify.VerifyResult

    def lines(self) -> list[str]:
        prefixes = ", ".join(repr(p) for p in self.prefixes) or "(bare names)"
        out = [
            f"converted {self.src} -> {self.dst}",
            f"  source : {self.source_kind}, {len(self.files)} file(s); config from {self.config_from}",
            f"  config : {config_line(self.config)}",
            f"  head   : {self.tensors_read} tensors under {prefixes}, {human_bytes(self.bytes_read)} read, "
            f"{'/'.join(self.source_dtypes)}; mixer {self.mixer}",
            f"  ignored: {self.backbone_count} backbone tensor(s), {human_bytes(self.backbone_bytes)} (not read)",
            f"  wrote  : {self.params_written} params, {self.dtype}, {human_bytes(self.bytes_written)} on disk",
            f"  time   : read {self.seconds_read:.2f} s, write {self.seconds_write:.2f} s"
            + (f", verify {self.seconds_verify:.2f} s" if self.verify is not None else "")
            + f", total {self.seconds_total:.2f} s",
        ]
        if self.verify is not None:
            out += [f"  verify : {line}" for line in self.verify.lines()]
        return out


def _upper_is_zero(L: np.ndarray) -> bool:
    B = L.shape[-1]
    rows, cols = np.triu_indices(B, k=1)
    return bool(np.all(L[..., rows, cols] == 0))


def mixer_looks_folded(mix_L: np.ndarray) -> bool:
    """Whether ``mix_L`` [r, B, B] looks like the folded serving form ``raw * tril + I``.

    Folding zeroes the upper triangle exactly and adds 1 to the diagonal. A raw
    mixer keeps whatever its upper triangle was initialised to (the tril mask
    hides it from training) and has a trained diagonal near 0 (it is a
    residual branch: ``x + (raw * tril) x``). So: the upper triangle is exactly
    zero in every channel AND the diagonal sits near 1 (median > 0.5). A raw
    mixer with a zero upper triangle and a diagonal near 0 is taken as raw;
    a heuristic like this can be wrong, hence ``--mixer raw|folded``.
    """
    L = np.asarray(mix_L).astype(np.float64)
    if L.ndim != 3 or L.shape[1] != L.shape[2]:
        return False
    diag = np.diagonal(L, axis1=-2, axis2=-1)
    return _upper_is_zero(L) and bool(np.median(diag) > 0.5)


def resolve_config(
    config: HeadConfig | Mapping[str, Any] | str | os.PathLike | None,
    source: Source | None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[HeadConfig, str]:
    """The `HeadConfig` to convert with and a description of where it came from."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if isinstance(config, HeadConfig):
        return (dataclasses.replace(config, **overrides) if overrides else config), "the given HeadConfig"
    if isinstance(config, Mapping):
        hf, where = dict(config), "the given config dict"
    elif config is not None:
        hf, where = read_config_json(config), str(config)
    elif source is not None and source.config is not None:
        hf, where = source.config, str(source.config_path)
    else:
        hf, where = {}, "flags"
        if not ({"vocab_size", "hidden_size"} <= set(overrides)):
            raise ConversionError(
                "no config.json in the source: pass --config PATH (a config.json with the vLLM fields "
                "vocab_size, hidden_size, xpress_block_size, xpress_rank, ...) or at least "
                "--vocab-size and --hidden-size"
            )
    if overrides and where != "flags":
        where += " + flags"
    try:
        return HeadConfig.from_hf_config(hf, **overrides), where
    except (TypeError, ValueError) as e:
        raise ConversionError(f"invalid head config from {where}: {e}") from None


def _check_dst(src: Path, dst: Path, force: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if s.is_dir() and s in d.parents:  # before anything else: nothing may be written inside the source
        raise ConversionError(
            f"destination {dst} lies inside the source folder {src}; write the checkpoint somewhere else "
            "(e.g. next to the source folder), so the source stays as vLLM loads it"
        )
    if (dst.exists() or dst.is_symlink()) and not force:
        raise ConversionError(f"destination {dst} already exists; pass --force to replace it")
    if s == d or d in s.parents:
        raise ConversionError(f"destination {dst} is or contains the source {src}; refusing to overwrite it")


def _check_not_converted(src: Path) -> None:
    """A converted (Orbax) checkpoint as the source: say so, and what to do with it instead."""
    from xpress_jax.checkpoint import is_checkpoint

    folder = src if src.is_dir() else None
    # Also catch a path inside a converted checkpoint (e.g. DST/params).
    for p in ([folder] if folder else []) + list(src.parents)[:3]:
        if p is not None and is_checkpoint(p):
            raise ConversionError(
                f"{src} is {'' if p == src else 'inside '}an already converted xpress-jax checkpoint ({p}): there "
                f"is nothing to convert. Load it with xpress_jax.load_params({str(p)!r}), look at it with "
                f"`xpress-convert inspect {p}`, or run it with `xpress bench --checkpoint {p}`"
            )


def _pick_dtype(dtype: str, source_dtypes: set[str], warn: Callable[[str], None]) -> np.dtype:
    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype != "keep":
        return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    if len(source_dtypes) == 1:
        return jnp.dtype(next(iter(source_dtypes)))
    # Mixed source dtypes: the narrowest dtype that holds all of them exactly.
    widest = "float64" if "float64" in source_dtypes else "float32"
    warn(f"head tensors have mixed dtypes {sorted(source_dtypes)}; keeping them exactly as {widest}")
    return jnp.dtype(widest)


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def _check_head(sel: HeadSelection, config: HeadConfig) -> None:
    problems = sel.problems()
    if problems:
        raise ConversionError("; ".join(problems))
    want = source_shapes(config)
    bad = [
        f"{sel.source_keys[n]}: {tuple(ref.shape)}, expected {want[n]}"
        for n, ref in sel.head.items()
        if tuple(ref.shape) != want[n]
    ]
    if bad:
        raise ConversionError(
            f"head tensor shapes do not match the config ({config_line(config)}): " + "; ".join(bad)
        )
    nonfloat = [f"{sel.source_keys[n]}: {ref.dtype}" for n, ref in sel.head.items() if ref.dtype not in _FLOAT_NAMES]
    if nonfloat:
        raise ConversionError("head tensors must be float16/bfloat16/float32/float64: " + "; ".join(nonfloat))


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: str = "keep",
    force: bool = False,
    verify: bool = False,
    config: HeadConfig | Mapping[str, Any] | str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
    mixer: str = "auto",
    prefix: str | None = None,
    verify_n: int = 4,
    seed: int = 0,
    reference: str = "auto",
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> ConvertReport:
    """Convert the XPress head of the checkpoint at ``src`` into an Orbax checkpoint at ``dst``.

    Args:
      src: a folder (config.json + safetensors, sharded or not, or PyTorch
        pickles) or a single file.
      dst: the checkpoint folder to create (`xpress_jax.load_params` reads it).
      dtype: ``"keep"`` (the source's dtype), ``"bfloat16"`` or ``"float32"``.
      force: replace an existing ``dst`` (only once the new one is complete).
      verify: compare `refine` tokens of the written checkpoint with a reference
        built from the source tensors (`xpress_jax.convert.verify`); a mismatch where
        exactness is required raises `VerificationError` and writes nothing.
      config: a config.json path, a parsed dict or a `HeadConfig`; default: the
        source's config.json.
      overrides: `HeadConfig` fields that win over the config (None values ignored).
      mixer: ``"auto"`` (refuse a mix.L that looks already folded), ``"raw"``
        (fold it regardless) or ``"folded"`` (the source holds the serving form;
        do not fold again).
      prefix: look for the head only under this key prefix (``""``: bare names).
      progress: draw progress bars on stderr (only on a terminal).
      log: called with warning lines (default: ignored).

    Raises:
      ConversionError: bad input (the message says what and where).
      VerificationError: ``verify`` found a required token mismatch.
    """
    t0 = time.perf_counter()
    log = log or (lambda _msg: None)
    warnings: list[str] = []

    def warn(msg: str) -> None:
        warnings.append(msg)
        log(f"warning: {msg}")

    if mixer not in MIXER_MODES:
        raise ConversionError(f"mixer must be one of {MIXER_MODES}, got {mixer!r}")
    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if reference not in ("auto", "torch", "jnp"):
        raise ConversionError(f"reference must be 'auto', 'torch' or 'jnp', got {reference!r}")
    if verify and reference == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ConversionError("--reference torch needs torch installed (or use --reference jnp)") from None
    src_p, dst_p = Path(src).expanduser().absolute(), Path(dst).expanduser().absolute()
    if not src_p.exists():
        raise ConversionError(f"source {src_p} does not exist")
    _check_not_converted(src_p)
    _check_dst(src_p, dst_p, force)

    source = open_source(src_p)
    for note in source.notes:
        warn(note)
    sel = select_head(source.tensors, prefix=prefix)
    if sel.problems():  # before the config: a missing head is the clearer message
        raise ConversionError(f"{src_p}: " + "; ".join(sel.problems()))
    cfg, cfg_from = resolve_config(config, source, overrides)
    _check_head(sel, cfg)

    # Read the head tensors (only those; the backbone stays on disk).
    total = sum(ref.nbytes for ref in sel.head.values())
    tensors: dict[str, np.ndarray] = {}
    t_read = time.perf_counter()
    with Progress(total, "reading", enabled=progress) as bar:
        for name in HYBRID_KEY_MAP:
            tensors[name] = sel.head[name].load(bar.update)
    seconds_read = time.perf_counter() - t_read

    nonfinite = []
    for name, a in tensors.items():
        bad = int(a.size - np.count_nonzero(np.isfinite(a)))
        if bad:
            nonfinite.append(f"{sel.source_keys[name]} ({bad} of {a.size} values)")
    if nonfinite:
        raise ConversionError("non-finite values (NaN or inf) in head tensor(s): " + ", ".join(nonfinite))

    raw = tensors["mix.L"]
    looks_folded = mixer_looks_folded(raw)
    key_L = sel.source_keys["mix.L"]
    if mixer == "auto" and looks_folded:
        raise ConversionError(
            f"{key_L} looks ALREADY FOLDED: its upper triangle is exactly 0 in all {raw.shape[0]} channels and "
            f"its diagonal sits near 1 (median {np.median(np.diagonal(raw.astype(np.float64), axis1=-2, axis2=-1)):.3g}),"
            " while vLLM checkpoints store the RAW mixer and fold it on load (raw * tril + I). Folding it again "
            "would silently add 1 to the diagonal. Pass --mixer folded if it is the serving form (it is then "
            "stored as is), or --mixer raw if it really is a raw mixer"
        )
    if mixer == "raw" and looks_folded:
        warn(f"{key_L} looks already folded, but --mixer raw was given: folding it (adds 1 to its diagonal)")
    source_dtypes = {a.dtype.name for a in tensors.values()}
    if mixer == "folded":
        if not _upper_is_zero(raw):
            raise ConversionError(
                f"--mixer folded, but the upper triangle of {key_L} is not all zero, so it is not a folded "
                "mixer (raw * tril + I); drop --mixer folded (the default treats it as raw and folds it once)"
            )
        # raw' = Lf - I in float64 folds back to exactly Lf (float64 holds every Lf - 1 exactly).
        tensors["mix.L"] = raw.astype(np.float64) - np.eye(raw.shape[-1])
    mixer_desc = {
        "auto": "raw (folded once)",
        "raw": "raw (folded once, as asked)",
        "folded": "already folded (stored as is)",
    }[mixer]

    target = _pick_dtype(dtype, source_dtypes, warn)
    try:
        params = params_from_state_dict(tensors, cfg, dtype=target)
    except (TypeError, ValueError) as e:
        raise ConversionError(str(e)) from None

    metadata = {
        "source": str(src_p),
        "source_kind": source.kind,
        "source_files": [str(p.relative_to(src_p)) if src_p.is_dir() else p.name for p in source.files],
        "source_keys": sel.source_keys,
        "source_dtypes": sorted(source_dtypes),
        "backbone_tensors_ignored": len(sel.backbone),
        "mixer": mixer_desc,
        "config_from": cfg_from,
        "converted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

    t_write = time.perf_counter()
    verify_result = None
    try:
        with staged_directory(dst_p, overwrite=force) as staged:
            param_bytes = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in params.values())
            with Progress(param_bytes, "writing", enabled=progress) as bar:
                stop = threading.Event()

                def poll() -> None:  # Orbax writes all arrays in one call: watch the bytes land
                    while not stop.wait(0.2):
                        bar.set(_dir_bytes(staged.parent))

                watcher = threading.Thread(target=poll, daemon=True)
                if bar.enabled:
                    watcher.start()
                try:
                    write_checkpoint(staged, cfg, params, metadata=metadata)
                finally:
                    stop.set()
                    if watcher.is_alive():
                        watcher.join()
            bytes_written = _dir_bytes(staged)
            seconds_write = time.perf_counter() - t_write
            t_verify = time.perf_counter()
            if verify:
                from .verify import verify_checkpoint

                verify_result = verify_checkpoint(
                    staged, tensors, params, source_dtypes, n=verify_n, seed=seed, reference=reference
                )
                if not verify_result.ok:
                    raise VerificationError(
                        "verification failed; nothing was written:\n  " + "\n  ".join(verify_result.lines()),
                        verify_result,
                    )
            seconds_verify = time.perf_counter() - t_verify
    except FileExistsError as e:
        raise ConversionError(str(e)) from None

    return ConvertReport(
        src=src_p,
        dst=dst_p,
        source_kind=source.kind,
        files=list(source.files),
        config=cfg,
        config_from=cfg_from,
        head_keys=dict(sel.source_keys),
        prefixes=sel.prefixes,
        backbone_count=len(sel.backbone),
        backbone_bytes=sel.backbone_bytes,
        source_dtypes=sorted(source_dtypes),
        dtype=jnp.dtype(target).name,
        mixer=mixer_desc,
        tensors_read=len(tensors),
        bytes_read=total,
        params_written=len(params),
        bytes_written=bytes_written,
        seconds_read=seconds_read,
        seconds_write=seconds_write,
        seconds_verify=seconds_verify,
        seconds_total=time.perf_counter() - t0,
        warnings=warnings,
        verify=verify_result,
    )
