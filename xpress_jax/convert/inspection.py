"""``xpress-convert inspect PATH``: what a source or converted checkpoint holds, read-only.

For a source checkpoint: its files, config.json and the `HeadConfig` vLLM would
build from it, the head tensors found (source key, shape, dtype, expected
shape), what is missing / duplicated / unknown, whether ``mix.L`` looks raw or
already folded, and the backbone grouped by name. For a converted Orbax
checkpoint: the stored config, dtype, conversion metadata and every param's
shape and dtype (from Orbax metadata: no arrays are restored).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from xpress_jax.checkpoint import is_checkpoint, read_checkpoint_info, stored_param_metadata
from xpress_jax.params import HYBRID_KEY_MAP, source_shapes

from .convert import config_line, mixer_looks_folded, resolve_config
from .errors import ConversionError
from .progress import human_bytes
from .sources import open_source, select_head

__all__ = ["inspect_path", "format_inspect"]


def _group(key: str) -> str:
    parts = key.split(".")
    for i, p in enumerate(parts[:4]):
        if p.isdigit():
            return ".".join(parts[:i]) + ".*"
    return ".".join(parts[:-1]) if len(parts) > 1 else key


def _inspect_orbax(path: Path) -> dict:
    try:
        config, info = read_checkpoint_info(path)
        arrays = stored_param_metadata(path)
    except (ValueError, OSError) as e:
        raise ConversionError(str(e)) from None
    nbytes = sum(int(np.prod(s)) * np.dtype(_np_dtype(d)).itemsize for s, d in arrays.values())
    return {
        "kind": "orbax",
        "path": str(path),
        "format": info.get("format"),
        "format_version": info.get("format_version"),
        "dtype": info.get("dtype"),
        "config": dataclasses.asdict(config),
        "config_line": config_line(config),
        "metadata": info.get("metadata", {}),
        "params": {k: {"shape": list(s), "dtype": d} for k, (s, d) in arrays.items()},
        "bytes": nbytes,
    }


def _np_dtype(name: str):
    import jax.numpy as jnp

    return jnp.dtype(name)


def _inspect_source(path: Path, config: Any, prefix: str | None) -> dict:
    source = open_source(path)
    sel = select_head(source.tensors, prefix=prefix)
    out: dict[str, Any] = {
        "kind": "source",
        "path": str(path),
        "format": source.kind,
        "files": [p.name for p in source.files],
        "notes": list(source.notes),
        "config_json": source.config,
        "config_path": str(source.config_path) if source.config_path else None,
        "tensor_count": len(source.tensors),
        "bytes": sum(r.nbytes for r in source.tensors.values()),
    }
    cfg = None
    try:
        cfg, where = resolve_config(config, source)
        out["head_config"] = dataclasses.asdict(cfg)
        out["head_config_line"] = config_line(cfg)
        out["head_config_from"] = where
    except ConversionError as e:
        out["head_config_error"] = str(e)
    want = source_shapes(cfg) if cfg is not None else {}
    head = []
    for name in HYBRID_KEY_MAP:
        ref = sel.head.get(name)
        if ref is None:
            continue
        row = {
            "name": name,
            "key": ref.key,
            "shape": list(ref.shape),
            "dtype": ref.dtype,
            "bytes": ref.nbytes,
            "file": ref.file.name,
        }
        if cfg is not None:
            row["expected_shape"] = list(want[name])
            row["shape_ok"] = tuple(ref.shape) == want[name]
        head.append(row)
    out["head"] = head
    out["head_prefixes"] = sel.prefixes
    out["problems"] = sel.problems()
    if cfg is not None:
        out["problems"] += [
            f"{r['key']}: shape {tuple(r['shape'])}, expected {tuple(r['expected_shape'])} from the config"
            for r in head
            if not r["shape_ok"]
        ]
    ref_L = sel.head.get("mix.L")
    if ref_L is not None and len(ref_L.shape) == 3 and ref_L.shape[1] == ref_L.shape[2]:
        try:
            L = ref_L.load()
            folded = mixer_looks_folded(L)
            out["mixer"] = (
                "looks ALREADY FOLDED (unit diagonal, zero upper triangle): convert with --mixer folded"
                if folded
                else "raw (the converter folds it once)"
            )
            if not np.all(np.isfinite(L.astype(np.float64))):
                out["problems"].append(f"{ref_L.key} holds NaN or inf")
        except ConversionError as e:
            out["mixer"] = f"unreadable: {e}"
    groups = Counter(_group(k) for k in sel.backbone)
    out["backbone"] = {
        "count": len(sel.backbone),
        "bytes": sel.backbone_bytes,
        "groups": dict(sorted(groups.items())),
    }
    out["dtypes"] = dict(Counter(r.dtype for r in source.tensors.values()))
    return out


def inspect_path(path: str | os.PathLike, *, config: Any = None, prefix: str | None = None) -> dict:
    """A JSON-serialisable description of a source checkpoint or a converted Orbax one."""
    path = Path(path).expanduser().absolute()
    if not path.exists():
        raise ConversionError(f"{path} does not exist")
    if is_checkpoint(path):
        return _inspect_orbax(path)
    return _inspect_source(path, config, prefix)


def format_inspect(info: dict) -> str:
    """The human-readable form of `inspect_path`'s result."""
    lines = []
    if info["kind"] == "orbax":
        lines += [
            f"{info['path']}: converted XPress head (Orbax, {info['format']} v{info['format_version']})",
            f"  config : {info['config_line']}",
            f"  dtype  : {info['dtype']}, {human_bytes(info['bytes'])} in {len(info['params'])} params",
            "  params :",
        ]
        for k, p in info["params"].items():
            lines.append(f"    {k:<16} {str(tuple(p['shape'])):<18} {p['dtype']}")
        meta = info.get("metadata") or {}
        if meta:
            lines.append("  from   :")
            for k in ("source", "source_kind", "source_dtypes", "mixer", "config_from", "converted_at"):
                if k in meta:
                    lines.append(f"    {k:<16} {meta[k]}")
        return "\n".join(lines)

    lines.append(
        f"{info['path']}: {info['format']} checkpoint, {len(info['files'])} file(s), "
        f"{info['tensor_count']} tensors, {human_bytes(info['bytes'])}"
    )
    lines.append(f"  files  : {', '.join(info['files'])}")
    lines.append(f"  dtypes : {', '.join(f'{d} x{n}' for d, n in info['dtypes'].items())}")
    if info.get("config_path"):
        lines.append(f"  config.json: {info['config_path']}")
    if "head_config_line" in info:
        lines.append(f"  head config: {info['head_config_line']} (from {info['head_config_from']})")
    else:
        lines.append(f"  head config: unavailable: {info['head_config_error']}")
    prefixes = ", ".join(repr(p) for p in info["head_prefixes"]) or "-"
    lines.append(f"  head   : {len(info['head'])} of {len(HYBRID_KEY_MAP)} tensors, prefix {prefixes}")
    for r in info["head"]:
        exp = ""
        if "shape_ok" in r:
            exp = "ok" if r["shape_ok"] else f"MISMATCH, expected {tuple(r['expected_shape'])}"
        lines.append(f"    {r['key']:<40} {str(tuple(r['shape'])):<18} {r['dtype']:<9} {exp}")
    if "mixer" in info:
        lines.append(f"  mixer  : {info['mixer']}")
    bb = info["backbone"]
    lines.append(f"  backbone (ignored): {bb['count']} tensors, {human_bytes(bb['bytes'])}")
    for g, n in bb["groups"].items():
        lines.append(f"    {g:<40} {n}")
    for note in info.get("notes", []):
        lines.append(f"  note   : {note}")
    if info["problems"]:
        lines.append("  PROBLEMS:")
        lines += [f"    - {p}" for p in info["problems"]]
    else:
        lines.append("  status : convertible")
    return "\n".join(lines)


def to_json(info: dict) -> str:
    return json.dumps(info, indent=2, sort_keys=False, default=str)
