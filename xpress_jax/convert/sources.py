"""Source checkpoints: find the tensor files, list tensors, pick out the XPress head.

A source is a folder or a single file:

- a folder with ``model.safetensors.index.json`` (sharded safetensors; every
  file it names must be a plain relative path inside the folder), else its
  ``*.safetensors`` files, else ``pytorch_model.bin.index.json`` / ``pytorch_model.bin``
  / ``*.bin`` / ``*.pt`` / ``*.pth`` (training leftovers such as
  ``training_args.bin`` and ``optimizer.pt`` are skipped); ``config.json`` beside
  them sizes the head;
- a single ``.safetensors`` / ``.bin`` / ``.pt`` / ``.pth`` file (a ``config.json``
  in the same folder is used when present).

Safetensors are read by `xpress_jax.convert.safetensors_io` (no torch). PyTorch pickles need
torch and are opened only with ``torch.load(..., weights_only=True)``, which
refuses any pickle that tries to build objects other than tensors and plain
containers: nothing in the file is executed.

The head is found under the prefixes vLLM sees (`HEAD_PREFIXES`); names after
the prefix are `xpress_jax.HYBRID_KEY_MAP`'s keys. Every other tensor is the
drafter backbone and is only counted.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Callable, Mapping

import numpy as np

from xpress_jax.params import HYBRID_KEY_MAP, _to_numpy

from .errors import ConversionError
from .safetensors_io import SafetensorsFile

__all__ = [
    "HEAD_PREFIXES",
    "HeadSelection",
    "Source",
    "TensorRef",
    "open_source",
    "select_head",
]

#: Prefixes under which vLLM finds the head in a drafter checkpoint, tried in this order.
HEAD_PREFIXES = ("xpress_head.", "model.xpress_head.")

SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# Files a training run leaves beside the weights; never weights, often arbitrary pickles.
_NOT_WEIGHTS = {"training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.pt"}


@dataclass
class TensorRef:
    """One tensor of the source, described without reading its data."""

    key: str
    dtype: str  # numpy dtype name ("bfloat16", "float32", ...) or the file's own code
    shape: tuple[int, ...]
    nbytes: int
    file: Path
    _load: Callable[[Callable[[int], None] | None], np.ndarray] = field(repr=False)

    def load(self, progress: Callable[[int], None] | None = None) -> np.ndarray:
        return self._load(progress)


@dataclass
class Source:
    """The tensors of a source checkpoint (by full key) and its config.json, if any."""

    path: Path
    kind: str  # "safetensors" | "torch"
    files: list[Path]
    tensors: dict[str, TensorRef]
    config: dict | None = None
    config_path: Path | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class HeadSelection:
    """The head's tensors (HYBRID_KEY_MAP names -> refs) and what was left aside."""

    head: dict[str, TensorRef]
    source_keys: dict[str, str]  # head name -> full source key
    prefixes: list[str]
    backbone: list[str]
    backbone_bytes: int
    missing: list[str]
    duplicates: dict[str, list[str]]
    unknown: list[str]  # keys under a head prefix whose name HYBRID_KEY_MAP does not know
    searched: tuple[str, ...]

    def problems(self) -> list[str]:
        """Human-readable reasons the head cannot be converted (empty when it can)."""
        out = []
        if not self.head and not self.duplicates:
            shown = ", ".join(repr(k) for k in self.backbone[:5])
            more = f" (of {len(self.backbone)})" if len(self.backbone) > 5 else ""
            out.append(
                "no XPress head tensors found: looked for keys starting with "
                + " or ".join(repr(p) for p in self.searched if p)
                + (" or bare head names" if "" in self.searched else "")
                + (f"; the source holds {shown}{more}" if self.backbone else "; the source holds no tensors")
            )
            return out
        for name, keys in sorted(self.duplicates.items()):
            out.append(
                f"duplicate head tensor {name!r} after prefix stripping: "
                + " and ".join(repr(k) for k in keys)
                + " (pass --prefix to choose one)"
            )
        if self.missing:
            pre = self.prefixes[0] if self.prefixes else self.searched[0]
            out.append(
                "missing head tensor(s): " + ", ".join(repr(pre + m) for m in self.missing)
                + (f" (searched prefixes {list(p for p in self.searched if p)})" if len(self.searched) > 1 else "")
            )
        if self.unknown:
            hint = ""
            if any(k.endswith("mix_L") for k in self.unknown):
                hint = (
                    " ('mix_L' is the serving module's attribute name: that checkpoint holds the FOLDED"
                    " mixer under module names; rename its keys to the HYBRID_KEY_MAP names and pass"
                    " --mixer folded)"
                )
            out.append(
                "unexpected tensor(s) under the head prefix (not in HYBRID_KEY_MAP): "
                + ", ".join(repr(k) for k in self.unknown)
                + hint
            )
        return out


def _config_beside(folder: Path, source: Source) -> None:
    cfg = folder / "config.json"
    if cfg.is_file():
        source.config = read_config_json(cfg)
        source.config_path = cfg


def read_config_json(path: str | os.PathLike) -> dict:
    """A parsed config.json (an object), or `ConversionError` saying why not."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConversionError(f"cannot read config {path}: {e}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConversionError(f"config {path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConversionError(f"config {path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _member(root: Path, name: Any, index: Path) -> Path:
    """``root / name`` for a file named by an index, refusing names that leave ``root``.

    The check is on the name (absolute paths, drive letters, ``..`` parts and
    backslashes are refused). Symlinks inside ``root`` are followed: a Hugging
    Face cache snapshot is a folder of symlinks into ``../../blobs``.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ConversionError(f"{index}: weight_map names an invalid file {name!r}")
    posix, win = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or win.is_absolute() or win.drive or "\\" in name or ".." in posix.parts:
        raise ConversionError(
            f"{index}: weight_map names file {name!r}, which points outside the source folder {root}; refusing"
        )
    path = root / posix
    if not path.is_file():
        raise ConversionError(f"{index}: weight_map names file {name!r}, which does not exist in {root}")
    return path


def _read_index(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"cannot read the shard index {index}: {e}") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise ConversionError(f"{index}: no 'weight_map' object (key -> shard file name)")
    return wm


def _add(source: Source, ref: TensorRef) -> None:
    prev = source.tensors.get(ref.key)
    if prev is not None:
        raise ConversionError(f"duplicate tensor {ref.key!r}: in {prev.file.name} and in {ref.file.name}")
    source.tensors[ref.key] = ref


def _add_safetensors(source: Source, path: Path) -> SafetensorsFile:
    st = SafetensorsFile(path)
    for key, info in st.tensors.items():
        _add(
            source,
            TensorRef(
                key,
                info.dtype_name,
                info.shape,
                info.nbytes,
                path,
                lambda progress, st=st, key=key: st.get(key, progress),
            ),
        )
    source.files.append(path)
    return st


def _torch_load(path: Path) -> Mapping[str, Any]:
    try:
        import torch
    except ImportError:
        raise ConversionError(
            f"{path} is a PyTorch pickle; reading it needs torch (pip install torch), "
            "or convert it to safetensors first"
        ) from None
    mmap = zipfile.is_zipfile(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*pickle protocol.*")
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines()]
        detail = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), "unsupported pickle content")
        detail = detail.rstrip(".")
        raise ConversionError(
            f"refusing {path}: torch.load(weights_only=True) rejected it ({detail}). It holds more than "
            "tensors and may try to run code; nothing in it was executed. Re-save the weights as "
            "safetensors (or a plain state dict) from a trusted environment."
        ) from None
    except Exception as e:  # corrupt zip, truncated pickle, ...
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConversionError(f"cannot read {path} as a PyTorch checkpoint (corrupt or truncated?): {first}") from None
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise ConversionError(f"{path}: expected a state dict (name -> tensor), got {type(obj).__name__}")
    return obj


def _add_torch(source: Source, path: Path) -> None:
    sd = _torch_load(path)  # refuses first when torch is missing
    import torch

    source.kind = "torch"
    skipped = []
    for key, t in sd.items():
        if not isinstance(t, torch.Tensor):
            skipped.append(str(key))
            continue
        _add(
            source,
            TensorRef(
                str(key),
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape),
                t.numel() * t.element_size(),
                path,
                lambda progress, t=t: _torch_to_numpy(t, progress),
            ),
        )
    if skipped:
        source.notes.append(f"{path.name}: ignored {len(skipped)} non-tensor entries ({', '.join(skipped[:5])})")
    source.files.append(path)


def _torch_to_numpy(t: Any, progress: Callable[[int], None] | None) -> np.ndarray:
    a = np.array(_to_numpy(t), copy=True)
    if progress is not None:
        progress(a.nbytes)
    return a


def _add_file(source: Source, path: Path) -> None:
    if path.suffix == ".safetensors":
        _add_safetensors(source, path)
    elif path.suffix in TORCH_SUFFIXES:
        _add_torch(source, path)
    else:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic[:2] == b"PK" or magic[:1] == b"\x80":
            _add_torch(source, path)
        else:
            _add_safetensors(source, path)


def _add_indexed(source: Source, root: Path, index: Path) -> None:
    wm = _read_index(index)
    files: dict[Path, list[str]] = {}
    for key, name in wm.items():
        files.setdefault(_member(root, name, index), []).append(key)
    for path in sorted(files):
        _add_file(source, path)
        absent = [k for k in files[path] if k not in source.tensors]
        if absent:
            raise ConversionError(
                f"{index}: says {absent[:3]} {'are' if len(absent) > 1 else 'is'} in {path.name}, which does not hold "
                f"{'them' if len(absent) > 1 else 'it'} (index and shards disagree)"
            )
    unlisted = sorted(set(source.tensors) - set(wm))
    if unlisted:
        source.notes.append(f"{index.name}: {len(unlisted)} tensor(s) in the shards are not in its weight_map")


def open_source(path: str | os.PathLike) -> Source:
    """List a source checkpoint's tensors (headers only for safetensors) and read its config.json."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConversionError(f"source {path} does not exist")
    if path.is_file():
        source = Source(path, "safetensors", [], {})
        _config_beside(path.parent, source)
        _add_file(source, path)
        return source
    if not path.is_dir():
        raise ConversionError(f"source {path} is neither a file nor a folder")

    source = Source(path, "safetensors", [], {})
    _config_beside(path, source)
    st_indexes = sorted(path.glob("*.safetensors.index.json"))
    st_files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if (path / SAFETENSORS_INDEX).is_file() or st_indexes:
        index = path / SAFETENSORS_INDEX if (path / SAFETENSORS_INDEX).is_file() else st_indexes[0]
        if len(st_indexes) > 1:
            source.notes.append(f"several shard indexes; using {index.name}")
        _add_indexed(source, path, index)
    elif st_files:
        for f in st_files:
            _add_safetensors(source, f)
    else:
        if (path / TORCH_INDEX).is_file():
            _add_indexed(source, path, path / TORCH_INDEX)
        elif (path / "pytorch_model.bin").is_file():
            _add_torch(source, path / "pytorch_model.bin")
        else:
            cands = sorted(
                p for p in path.iterdir() if p.is_file() and p.suffix in TORCH_SUFFIXES and p.name not in _NOT_WEIGHTS
            )
            if not cands:
                raise ConversionError(
                    f"no weights in {path}: expected {SAFETENSORS_INDEX}, *.safetensors, "
                    "pytorch_model.bin or *.pt files"
                )
            for f in cands:
                _add_torch(source, f)
    other = sorted(p.name for p in path.glob("*") if p.suffix in TORCH_SUFFIXES)
    if source.kind == "safetensors" and other:
        source.notes.append(f"ignored PyTorch files beside the safetensors: {', '.join(other[:4])}")
    return source


def select_head(
    tensors: Mapping[str, TensorRef],
    prefix: str | None = None,
) -> HeadSelection:
    """Split ``tensors`` into the head (by HYBRID_KEY_MAP name) and the backbone.

    With ``prefix=None`` the head is looked for under `HEAD_PREFIXES`; when no key
    carries one, bare HYBRID_KEY_MAP names (a head-only state dict) are accepted.
    With an explicit ``prefix`` (``""`` for bare names) only that one is used.
    The same head name reached from two keys is a duplicate, never a choice.
    """
    if prefix is None:
        searched = HEAD_PREFIXES
        if not any(k.startswith(p) for k in tensors for p in HEAD_PREFIXES):
            searched = HEAD_PREFIXES + ("",)
    else:
        searched = (prefix,)
    found: dict[str, list[str]] = {}
    unknown: list[str] = []
    backbone: list[str] = []
    for key in tensors:
        for p in searched:
            if p == "":
                if key in HYBRID_KEY_MAP:
                    found.setdefault(key, []).append(key)
                    break
            elif key.startswith(p):
                name = key[len(p) :]
                if name in HYBRID_KEY_MAP:
                    found.setdefault(name, []).append(key)
                else:
                    unknown.append(key)
                break
        else:
            backbone.append(key)
    duplicates = {n: ks for n, ks in found.items() if len(ks) > 1}
    head = {n: tensors[ks[0]] for n, ks in found.items() if len(ks) == 1}
    source_keys = {n: ks[0] for n, ks in found.items() if len(ks) == 1}
    used = sorted({k[: len(k) - len(n)] for n, k in source_keys.items()}, key=len)
    missing = [n for n in HYBRID_KEY_MAP if n not in found]
    return HeadSelection(
        head=head,
        source_keys=source_keys,
        prefixes=used,
        backbone=backbone,
        backbone_bytes=sum(tensors[k].nbytes for k in backbone),
        missing=missing,
        duplicates=duplicates,
        unknown=unknown,
        searched=searched,
    )
