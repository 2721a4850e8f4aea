"""Source checkpoints: find the tensor files, list the tensors, pick out the XPress head.

A folder: a ``*.safetensors.index.json`` (its files must lie inside the folder), else ``*.safetensors``,
else ``pytorch_model.bin[.index.json]`` / ``*.bin`` / ``*.pt`` / ``*.pth``; or one file. PyTorch
pickles are opened only with ``torch.load(weights_only=True)`` (nothing in them is executed); the
xPress release's training checkpoint (``refiner_state_dict``, ``args``, ``global_step``) with
`argparse.Namespace` as the one extra allowed global. A pickle whose tensors sit one level down
(``{"model": state_dict}``, ``{"state_dict": ...}``) is read from there.

Two layouts of the head's names: vLLM's (`HYBRID_KEY_MAP`, under ``xpress_head.``) and the
``speculators`` library's (`SPECULATORS_KEY_MAP`, under ``refiner_head.``; a reduced draft vocabulary's
``d2t``/``t2d`` beside it, at the top level).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Callable, Mapping

import numpy as np

from xpress_jax.params import HYBRID_KEY_MAP, to_numpy

from .errors import ConversionError
from .safetensors_io import SAFETENSORS_DTYPES, SafetensorsFile

__all__ = ["HEAD_PREFIXES", "SPECULATORS", "SPECULATORS_KEY_MAP", "SPECULATORS_PREFIXES", "VLLM", "VOCAB_MAP_KEYS",
           "HeadSelection", "Source", "TensorRef", "open_source", "select_head", "select_in"]

#: Prefixes under which vLLM finds the head in a drafter checkpoint, tried in this order.
HEAD_PREFIXES = ("xpress_head.", "model.xpress_head.")
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# Files a training run leaves beside the weights: never weights, often arbitrary pickles.
_NOT_WEIGHTS = {"training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.pt"}
#: The xPress release's training checkpoint (its ``torch.save`` of the refiner).
RELEASE = "xpress-release"
#: The two layouts of the head's tensor names.
VLLM, SPECULATORS = "vllm", "speculators"
#: Prefixes under which vLLM's ``speculators`` library keeps the head of an XPress model.
SPECULATORS_PREFIXES = ("refiner_head.", "model.refiner_head.")
#: ``speculators``' `XPressRefinerHead` attribute -> the HYBRID_KEY_MAP name (same layouts; ``mix_l`` is raw).
SPECULATORS_KEY_MAP = {
    "token_embed.weight": "w1.weight",
    "down_h.weight": "down_h.weight",
    "down_g.weight": "down_g.weight",
    "in_proj.weight": "in_proj.weight",
    "mix_l": "mix.L",
    "mlp_gate.weight": "mlp.gate_proj.weight",
    "mlp_up.weight": "mlp.up_proj.weight",
    "mlp_down.weight": "mlp.down_proj.weight",
    "readout.weight": "w2.weight",
}
#: A reduced draft vocabulary's maps: ``d2t`` [V_draft] (verifier id = draft id + d2t[id]), ``t2d`` [V] bool.
VOCAB_MAP_KEYS = ("d2t", "t2d")
_LAYOUTS = {VLLM: ({n: n for n in HYBRID_KEY_MAP}, HEAD_PREFIXES), SPECULATORS: (SPECULATORS_KEY_MAP,
                                                                              SPECULATORS_PREFIXES)}


@dataclass
class TensorRef:
    """One tensor of the source, described without reading its data."""

    key: str
    dtype: str  # numpy dtype name, or the file's own code for dtypes numpy lacks
    shape: tuple[int, ...]
    nbytes: int
    file: Path
    load: Callable[[], np.ndarray] = field(repr=False)


@dataclass
class Source:
    """The tensors of a source (by full key), its config.json and, for the release's format, its args."""

    path: Path
    kind: str  # "safetensors" | "torch" | RELEASE
    files: list[Path] = field(default_factory=list)
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    config: dict | None = None
    config_path: Path | None = None
    notes: list[str] = field(default_factory=list)
    args: dict | None = None  # RELEASE: the training run's argparse options
    step: Any = None  # RELEASE: global_step
    # A pickle whose top level holds no tensors: the entries one level down that do (name -> tensor count). With
    # one entry its keys are used as they are; with several, as "entry.key".
    entries: dict[str, int] = field(default_factory=dict)

    @property
    def model_type(self) -> str | None:
        """config.json's ``speculators_model_type`` (a model saved by vLLM's speculators library), else None."""
        t = (self.config or {}).get("speculators_model_type")
        return None if t is None else str(t)


@dataclass
class HeadSelection:
    """The head's tensors (HYBRID_KEY_MAP names -> refs), what was left aside, and why it cannot be converted."""

    head: dict[str, TensorRef]
    source_keys: dict[str, str]  # head name -> full source key
    prefixes: list[str]
    backbone: list[str]
    backbone_bytes: int
    problems: list[str]  # empty when the head can be converted
    layout: str = VLLM  # VLLM or SPECULATORS: the names the head was found under
    vocab_map: dict[str, TensorRef] = field(default_factory=dict)  # "d2t"/"t2d" found beside the head
    vocab_map_keys: dict[str, str] = field(default_factory=dict)  # "d2t"/"t2d" -> full source key

    def source_name(self, name: str) -> str:
        """The source key of head tensor ``name`` (a HYBRID_KEY_MAP name), found or as it would be named."""
        if name in self.source_keys:
            return self.source_keys[name]
        names, prefixes = _LAYOUTS[self.layout]
        inverse = {v: k for k, v in names.items()}
        return (self.prefixes or [prefixes[0]])[0] + inverse.get(name, name)


def read_config_json(path: str | os.PathLike) -> dict:
    """A parsed config.json (an object), or `ConversionError` saying why not."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConversionError(f"cannot read config {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"config {path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConversionError(f"config {path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _member(root: Path, name: Any, index: Path) -> Path:
    """``root / name`` for a file an index names, refusing names that leave ``root``.

    The check is on the name (absolute paths, drive letters, ``..`` and backslashes are refused);
    symlinks inside ``root`` are followed (a Hugging Face snapshot is a folder of symlinks).
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ConversionError(f"{index}: weight_map names an invalid file {name!r}")
    posix, win = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or win.is_absolute() or win.drive or "\\" in name or ".." in posix.parts:
        raise ConversionError(f"{index}: weight_map names file {name!r}, which points outside the source folder "
                              f"{root}; refusing")
    if not (root / posix).is_file():
        raise ConversionError(f"{index}: weight_map names file {name!r}, which does not exist in {root}")
    return root / posix


def _add(source: Source, key: str, dtype: str, shape: tuple, nbytes: int, path: Path, load: Callable) -> None:
    prev = source.tensors.get(key)
    if prev is not None:
        raise ConversionError(f"duplicate tensor {key!r}: in {prev.file.name} and in {path.name}")
    source.tensors[key] = TensorRef(key, dtype, tuple(shape), nbytes, path, load)


def _add_safetensors(source: Source, path: Path) -> None:
    st = SafetensorsFile(path)
    for key, info in st.tensors.items():
        dtype = SAFETENSORS_DTYPES[info.code].name if info.code in SAFETENSORS_DTYPES else info.code
        _add(source, key, dtype, info.shape, info.nbytes, path, lambda key=key: st.get(key))
    source.files.append(path)


def _torch_load(path: Path) -> Any:
    try:
        import torch
    except ImportError:
        raise ConversionError(f"{path} is a PyTorch pickle; reading it needs torch (pip install torch), "
                              "or convert it to safetensors first") from None
    allow = getattr(torch.serialization, "safe_globals", None)
    try:
        with warnings.catch_warnings(), (allow([argparse.Namespace]) if allow else contextlib.nullcontext()):
            warnings.filterwarnings("ignore", message=".*pickle protocol.*")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines()]
        detail = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), "unsupported pickle content")
        raise ConversionError(
            f"refusing {path}: torch.load(weights_only=True) rejected it ({detail.rstrip('.')}). It holds more than "
            "tensors and may try to run code; nothing in it was executed. Re-save the weights as "
            "safetensors (or a plain state dict) from a trusted environment."
        ) from None
    except Exception as e:  # corrupt zip, truncated pickle, ...
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConversionError(f"cannot read {path} as a PyTorch checkpoint (corrupt or truncated?): {first}") from None


def _add_torch(source: Source, path: Path) -> None:
    obj = _torch_load(path)  # refuses first when torch is missing
    import torch

    source.kind = "torch"
    if isinstance(obj, Mapping) and isinstance(obj.get("refiner_state_dict"), Mapping):
        source.kind, args = RELEASE, obj.get("args")
        if isinstance(args, (argparse.Namespace, Mapping)):
            source.args = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
        source.step = obj.get("global_step", obj.get("step"))
        rest = [str(k) for k in obj if k not in ("refiner_state_dict", "args", "global_step", "step")]
        if rest:
            source.notes.append(f"{path.name}: ignored entries {', '.join(rest[:5])}")
        obj = obj["refiner_state_dict"]
    if not isinstance(obj, Mapping):
        raise ConversionError(f"{path}: expected a state dict (name -> tensor), got {type(obj).__name__}")
    if source.kind != RELEASE and not any(isinstance(t, torch.Tensor) for t in obj.values()):
        obj = _one_level_down(source, path, obj, torch.Tensor)
    skipped = [str(k) for k, t in obj.items() if not isinstance(t, torch.Tensor)]
    for key, t in obj.items():
        if isinstance(t, torch.Tensor):
            _add(source, str(key), str(t.dtype).removeprefix("torch."), t.shape, t.numel() * t.element_size(), path,
                 lambda t=t: np.array(to_numpy(t), copy=True))
    if skipped:
        source.notes.append(f"{path.name}: ignored {len(skipped)} non-tensor entries ({', '.join(skipped[:5])})")
    source.files.append(path)


def _one_level_down(source: Source, path: Path, obj: Mapping, tensor_type: type) -> Mapping:
    """The tensors of a pickle whose top level holds none (``{"model": state_dict, "epoch": 3}``): one entry
    holding tensors is read as the state dict; several are read side by side as ``"entry.key"`` (`select_head`
    then picks the one holding the head, or asks for ``--prefix``). Anything else is left as it is."""
    found = {str(k): v for k, v in obj.items() if isinstance(v, Mapping)
             and any(isinstance(t, tensor_type) for t in v.values())}
    if not found:
        return obj
    source.entries = {k: sum(isinstance(t, tensor_type) for t in v.values()) for k, v in found.items()}
    rest = [str(k) for k in obj if str(k) not in found]
    where = ", ".join(f"{k!r} ({n} tensors)" for k, n in source.entries.items())
    if len(found) == 1:
        (name, inner), = found.items()
        source.notes.append(f"{path.name}: no tensors at its top level; read the state dict one level down, under "
                            f"the entry {name!r}" + (f" (ignored: {', '.join(rest[:5])})" if rest else ""))
        return inner
    source.notes.append(f"{path.name}: no tensors at its top level; read the entries one level down side by side, "
                        f"as 'entry.key': {where}" + (f" (ignored: {', '.join(rest[:5])})" if rest else ""))
    return {f"{name}.{k}": t for name, inner in found.items() for k, t in inner.items()}


def _add_file(source: Source, path: Path) -> None:
    if path.suffix in TORCH_SUFFIXES:
        return _add_torch(source, path)
    if path.suffix != ".safetensors":
        with open(path, "rb") as f:
            magic = f.read(2)
        if magic == b"PK" or magic[:1] == b"\x80":
            return _add_torch(source, path)
    _add_safetensors(source, path)


def _add_indexed(source: Source, root: Path, index: Path) -> None:
    try:
        wm = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"cannot read the shard index {index}: {e}") from None
    wm = wm.get("weight_map") if isinstance(wm, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise ConversionError(f"{index}: no 'weight_map' object (key -> shard file name)")
    files: dict[Path, list[str]] = {}
    for key, name in wm.items():
        files.setdefault(_member(root, name, index), []).append(key)
    for path in sorted(files):
        _add_file(source, path)
        absent = [k for k in files[path] if k not in source.tensors]
        if absent:
            raise ConversionError(f"{index}: says {absent[:3]} {'are' if len(absent) > 1 else 'is'} in {path.name}, "
                                  "which does not hold them (index and shards disagree)")
    unlisted = set(source.tensors) - set(wm)
    if unlisted:
        source.notes.append(f"{index.name}: {len(unlisted)} tensor(s) in the shards are not in its weight_map")


def open_source(path: str | os.PathLike) -> Source:
    """List a source checkpoint's tensors (headers only for safetensors) and read its config.json."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConversionError(f"source {path} does not exist")
    source = Source(path, "safetensors")
    folder = path if path.is_dir() else path.parent
    if (folder / "config.json").is_file():
        source.config_path = folder / "config.json"
        source.config = read_config_json(source.config_path)
    if path.is_file():
        _add_file(source, path)
        return source
    st_indexes = sorted(path.glob("*.safetensors.index.json"))
    if st_indexes:
        index = path / SAFETENSORS_INDEX if (path / SAFETENSORS_INDEX).is_file() else st_indexes[0]
        if len(st_indexes) > 1:
            source.notes.append(f"several shard indexes; using {index.name}")
        _add_indexed(source, path, index)
    elif st_files := sorted(p for p in path.glob("*.safetensors") if p.is_file()):
        for f in st_files:
            _add_safetensors(source, f)
    elif (path / TORCH_INDEX).is_file():
        _add_indexed(source, path, path / TORCH_INDEX)
    elif (path / "pytorch_model.bin").is_file():
        _add_torch(source, path / "pytorch_model.bin")
    else:
        cands = sorted(p for p in path.iterdir()
                       if p.is_file() and p.suffix in TORCH_SUFFIXES and p.name not in _NOT_WEIGHTS)
        if not cands:
            raise ConversionError(f"no weights in {path}: expected {SAFETENSORS_INDEX}, *.safetensors, "
                                  "pytorch_model.bin or *.pt files")
        for f in cands:
            _add_torch(source, f)
    other = sorted(p.name for p in path.glob("*") if p.suffix in TORCH_SUFFIXES)
    if source.kind == "safetensors" and other:
        source.notes.append(f"ignored PyTorch files beside the safetensors: {', '.join(other[:4])}")
    return source


def _guess_layout(tensors: Mapping[str, TensorRef], prefix: str | None) -> str:
    """SPECULATORS when keys under its prefixes (or ``prefix``) carry its names, else VLLM."""
    names, prefixes = _LAYOUTS[SPECULATORS]
    prefixes = prefixes if prefix is None else (prefix,)
    hits = {n: sum(1 for k in tensors for p in prefixes if k.startswith(p) and k[len(p):] in lay_names)
            for n, (lay_names, _) in ((VLLM, _LAYOUTS[VLLM]), (SPECULATORS, _LAYOUTS[SPECULATORS]))}
    return SPECULATORS if hits[SPECULATORS] > hits[VLLM] else VLLM


def _parent(prefix: str) -> str:
    """``"model.refiner_head."`` -> ``"model."``; ``"refiner_head."`` and ``""`` -> ``""``."""
    head, dot, _ = prefix.rstrip(".").rpartition(".")
    return head + dot


def select_head(tensors: Mapping[str, TensorRef], prefix: str | None = None,
                layout: str | None = None) -> HeadSelection:
    """Split ``tensors`` into the head (by HYBRID_KEY_MAP name) and the rest.

    ``layout``: VLLM (HYBRID_KEY_MAP names under `HEAD_PREFIXES`) or SPECULATORS (`SPECULATORS_KEY_MAP` names
    under `SPECULATORS_PREFIXES`); None: the one whose names the keys carry. ``prefix=None`` looks under the
    layout's prefixes, and for bare names when no key carries one; an explicit ``prefix`` (``""``: bare names)
    is the only one used. The same head name reached from two keys is a duplicate, never a choice. A reduced
    draft vocabulary's ``d2t``/``t2d`` are looked for under the head's prefix, then one level up, then at the
    top level (`HeadSelection.vocab_map`; ones outside the prefix also stay listed as backbone).
    """
    if layout is None:
        layout = _guess_layout(tensors, prefix)
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
    names, layout_prefixes = _LAYOUTS[layout]
    if prefix is not None:
        searched: tuple[str, ...] = (prefix,)
    elif any(k.startswith(p) for k in tensors for p in layout_prefixes):
        searched = layout_prefixes
    else:
        searched = layout_prefixes + ("",)
    found: dict[str, list[str]] = {}
    unknown: list[str] = []
    backbone: list[str] = []
    in_prefix_maps: dict[str, list[str]] = {}
    for key in tensors:
        p = next((p for p in searched if (key.startswith(p) if p else key in names)), None)
        if p is None:
            backbone.append(key)
        elif key[len(p):] in names:
            found.setdefault(names[key[len(p):]], []).append(key)
        elif key[len(p):] in VOCAB_MAP_KEYS:
            in_prefix_maps.setdefault(key[len(p):], []).append(key)
        else:
            unknown.append(key)
    keys = {n: ks[0] for n, ks in found.items() if len(ks) == 1}
    prefixes = sorted({k[: len(k) - len(_source_name(layout, n))] for n, k in keys.items()}, key=len)
    problems = [f"duplicate head tensor {n!r} after prefix stripping: " + " and ".join(map(repr, ks))
                + " (pass --prefix to choose one)" for n, ks in sorted(found.items()) if len(ks) > 1]
    if not found:
        shown = ", ".join(map(repr, backbone[:5])) + (f" (of {len(backbone)})" if len(backbone) > 5 else "")
        looked = " or ".join(repr(p) for p in searched if p) + (" or bare head names" if "" in searched else "")
        problems.append(f"no XPress head tensors found: looked for keys starting with {looked}"
                        + (f"; the source holds {shown}" if backbone else "; the source holds no tensors"))
    elif missing := [n for n in HYBRID_KEY_MAP if n not in found]:
        pre = (prefixes or searched)[0]
        problems.append("missing head tensor(s): " + ", ".join(repr(pre + _source_name(layout, m)) for m in missing)
                        + (f" (searched prefixes {[p for p in searched if p]})" if len(searched) > 1 else ""))
    if unknown:
        hint = (" ('mix_L' is the serving module's attribute name: that checkpoint holds the FOLDED mixer under"
                " module names; rename its keys to the HYBRID_KEY_MAP names and pass --mixer folded)")
        problems.append(f"unexpected tensor(s) under the head prefix (not in the {layout} layout's names): "
                        + ", ".join(map(repr, unknown))
                        + (hint if layout == VLLM and any(k.endswith("mix_L") for k in unknown) else ""))
    vocab_keys: dict[str, str] = {}
    if found:
        pre = prefixes[0] if prefixes else searched[0]
        for name in VOCAB_MAP_KEYS:
            ks = in_prefix_maps.get(name, [])
            if len(ks) > 1:
                problems.append(f"duplicate {name!r} after prefix stripping: " + " and ".join(map(repr, ks)))
            key = next((k for k in (*ks, _parent(pre) + name, name) if k in tensors), None)
            if key is not None:
                vocab_keys[name] = key
    return HeadSelection({n: tensors[k] for n, k in keys.items()}, keys, prefixes, backbone,
                         sum(tensors[k].nbytes for k in backbone), problems, layout,
                         {n: tensors[k] for n, k in vocab_keys.items()}, vocab_keys)


def _source_name(layout: str, name: str) -> str:
    """The layout's name of HYBRID_KEY_MAP name ``name``."""
    return next((k for k, v in _LAYOUTS[layout][0].items() if v == name), name)


def select_in(source: Source, prefix: str | None = None, layout: str | None = None) -> HeadSelection:
    """`select_head` on a source's tensors. Entries read side by side from one level down (`Source.entries`):
    the one that holds a head is used; when several do, a problem names them and the ``--prefix`` of each."""
    if len(source.entries) > 1 and prefix is None:
        holding, layouts = {}, []
        for entry in source.entries:
            sub = {k[len(entry) + 1:]: r for k, r in source.tensors.items() if k.startswith(entry + ".")}
            sel = select_head(sub, layout=layout)
            if sel.head:
                holding[entry] = f"{entry}.{sel.prefixes[0] if sel.prefixes else ''}"
                layouts.append(sel.layout)
        if len(holding) == 1:
            return select_head(source.tensors, prefix=next(iter(holding.values())), layout=layout)
        if len(holding) > 1:
            problem = ("the tensors lie one level down, and several entries hold an XPress head: "
                       + ", ".join(f"{e!r} (--prefix {p!r})" for e, p in holding.items())
                       + "; pass --prefix to choose one, e.g. --prefix " + repr(next(iter(holding.values()))))
            everything = list(source.tensors)
            return HeadSelection({}, {}, [], everything, sum(r.nbytes for r in source.tensors.values()), [problem],
                                 layouts[0])
    return select_head(source.tensors, prefix=prefix, layout=layout)
