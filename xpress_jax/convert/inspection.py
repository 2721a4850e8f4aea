"""``xpress-convert inspect PATH``: what a source or a converted checkpoint holds (read-only).

A source: its format (the release's training checkpoint: also its step and variant flags; a speculators
model: the config fields read), the `HeadConfig` the converter would use and the values it would take as
defaults, each head tensor against its expected shape, a reduced head's vocabulary map, the problems that
would refuse it, the mixer's form. A converted checkpoint: its config, dtype, origin and params.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from xpress_jax.checkpoint import is_checkpoint, read_checkpoint_info, stored_param_metadata
from xpress_jax.params import HYBRID_KEY_MAP, check_vocab_map, source_shapes

from .convert import (RELEASE_VARIANT, config_line, human_bytes, mixer_looks_folded, resolve, sizing_config,
                      source_line, vocab_map_refs)
from .errors import ConversionError
from .sources import RELEASE, SPECULATORS, open_source, select_in
from .speculators_format import is_speculators_config, speculators_hf_config

__all__ = ["format_inspect", "inspect_path", "to_json"]


def _group(key: str) -> str:
    parts = key.split(".")
    i = next((i for i, p in enumerate(parts[:4]) if p.isdigit()), None)
    return ".".join(parts[:i]) + ".*" if i is not None else ".".join(parts[:-1]) or key


def _inspect_orbax(path: Path) -> dict:
    try:
        config, info = read_checkpoint_info(path)
        arrays = stored_param_metadata(path)
    except (ValueError, OSError) as e:
        raise ConversionError(str(e)) from None
    return {
        "kind": "orbax", "path": str(path), "format": info.get("format"),
        "format_version": info.get("format_version"), "dtype": info.get("dtype"),
        "config": dataclasses.asdict(config), "config_line": config_line(config), "metadata": info.get("metadata", {}),
        "params": {k: {"shape": list(s), "dtype": d} for k, (s, d) in arrays.items()},
        "bytes": sum(int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in arrays.values()),
    }


def _inspect_source(path: Path, config: Any, prefix: str | None) -> dict:
    source = open_source(path)
    problems: list[str] = []
    layout = None
    try:
        given, where = sizing_config(config, source)
        if is_speculators_config(given):
            layout = SPECULATORS
            speculators_hf_config(given, where)
    except ConversionError as e:
        problems.append(str(e))
    sel = select_in(source, prefix=prefix, layout=layout)
    out: dict[str, Any] = {
        "kind": "source", "path": str(path), "format": source_line(source), "step": source.step,
        "files": [p.name for p in source.files], "notes": source.notes, "config_json": source.config,
        "config_path": str(source.config_path) if source.config_path else None,
        "tensor_count": len(source.tensors), "bytes": sum(r.nbytes for r in source.tensors.values()),
        "dtypes": dict(Counter(r.dtype for r in source.tensors.values())),
        "head_prefixes": sel.prefixes, "layout": sel.layout, "problems": problems + list(sel.problems),
        "entries": source.entries,
    }
    if source.kind == RELEASE and source.args is not None:
        a = source.args
        out["variant"] = {k: a[k] for k in [*RELEASE_VARIANT, "markov_rank", "mlp_ratio"] if k in a}
        out["variant_absent"] = [k for k in RELEASE_VARIANT if k not in a]
    cfg = None
    try:
        if not sel.head and config is None and source.config is None:  # nothing to size: the problems say why
            raise ConversionError("no head tensors and no config.json to size the head with")
        res = resolve(config, source, head=sel.head, layout=sel.layout)
        cfg, out["head_config_from"] = res.config, res.where
        out["head_config"], out["head_config_line"] = dataclasses.asdict(cfg), config_line(cfg)
        out["config_fields"], out["config_defaults"] = res.fields, res.defaults
    except ConversionError as e:
        out["head_config_error"] = str(e)
        if str(e) not in out["problems"] and sel.head:
            out["problems"].append(str(e))
    want = {k: v for k, v in source_shapes(cfg).items() if k in HYBRID_KEY_MAP} if cfg is not None else {}
    out["head"] = [
        {"name": n, "key": r.key, "shape": list(r.shape), "dtype": r.dtype, "bytes": r.nbytes, "file": r.file.name,
         **({"expected_shape": list(want[n]), "shape_ok": tuple(r.shape) == want[n]} if want else {})}
        for n, r in ((n, sel.head[n]) for n in HYBRID_KEY_MAP if n in sel.head)
    ]
    out["problems"] += [f"{r['key']}: shape {tuple(r['shape'])}, expected {tuple(r['expected_shape'])} from the config"
                        for r in out["head"] if not r.get("shape_ok", True)]
    out["vocab_map"] = [{"name": n, "key": r.key, "shape": list(r.shape), "dtype": r.dtype}
                        for n, r in sel.vocab_map.items()]
    if cfg is not None and cfg.reduced and sel.head:
        try:
            refs = vocab_map_refs(sel, cfg, lambda m: None)
            n = len(check_vocab_map(refs["d2t"].load(), cfg.vocab_size, refs["t2d"].load() if "t2d" in refs else None))
            out["vocab_map_status"] = f"valid: {n} draft ids, each on its own verifier id"
        except (ConversionError, ValueError) as e:
            out["vocab_map_status"] = f"INVALID: {e}"
            out["problems"].append(f"vocabulary map: {e}")
    ref_L = sel.head.get("mix.L")
    if ref_L is not None and len(ref_L.shape) == 3 and ref_L.shape[1] == ref_L.shape[2]:
        try:
            L = ref_L.load()
            out["mixer"] = ("looks ALREADY FOLDED (unit diagonal, zero upper triangle): convert with --mixer folded"
                            if mixer_looks_folded(L) else "raw (the converter folds it once)")
            if not np.all(np.isfinite(L.astype(np.float64))):
                out["problems"].append(f"{ref_L.key} holds NaN or inf")
        except ConversionError as e:
            out["mixer"] = f"unreadable: {e}"
    used = set(sel.vocab_map_keys.values()) if cfg is not None and cfg.reduced else set()
    backbone = [k for k in sel.backbone if k not in used]
    groups = Counter(_group(k) for k in backbone)
    out["backbone"] = {"count": len(backbone), "bytes": sum(source.tensors[k].nbytes for k in backbone),
                       "groups": dict(sorted(groups.items()))}
    return out


def inspect_path(path: str | os.PathLike, *, config: Any = None, prefix: str | None = None) -> dict:
    """A JSON-serialisable description of a source checkpoint or a converted Orbax one."""
    path = Path(path).expanduser().absolute()
    if not path.exists():
        raise ConversionError(f"{path} does not exist")
    return _inspect_orbax(path) if is_checkpoint(path) else _inspect_source(path, config, prefix)


def format_inspect(info: dict) -> str:
    """The human-readable form of `inspect_path`'s result."""
    if info["kind"] == "orbax":
        lines = [
            f"{info['path']}: converted XPress head (Orbax, {info['format']} v{info['format_version']})",
            f"  config : {info['config_line']}",
            f"  dtype  : {info['dtype']}, {human_bytes(info['bytes'])} in {len(info['params'])} params",
            "  params :",
        ]
        lines += [f"    {k:<16} {str(tuple(p['shape'])):<18} {p['dtype']}" for k, p in info["params"].items()]
        meta = info.get("metadata") or {}
        keys = [k for k in ("source", "source_kind", "source_dtypes", "mixer", "config_from", "converted_at")
                if k in meta]
        return "\n".join(lines + (["  from   :"] if keys else []) + [f"    {k:<16} {meta[k]}" for k in keys])
    lines = [
        f"{info['path']}: {info['format']}, {len(info['files'])} file(s), {info['tensor_count']} tensors, "
        f"{human_bytes(info['bytes'])}",
        f"  files  : {', '.join(info['files'])}",
        f"  dtypes : {', '.join(f'{d} x{n}' for d, n in info['dtypes'].items())}",
    ]
    if "variant" in info:
        lines.append("  variant: " + ", ".join(f"{k}={v!r}" for k, v in info["variant"].items()))
        lines.append(f"  absent : {', '.join(info['variant_absent']) or '-'} (taken as the release's default)")
    if info.get("config_path"):
        lines.append(f"  config.json: {info['config_path']}")
    if "head_config_line" in info:
        lines.append(f"  head config: {info['head_config_line']} (from {info['head_config_from']})")
        lines += [f"    field  : {f}" for f in info.get("config_fields", [])]
        lines += [f"    default: {f}" for f in info.get("config_defaults", [])]
    else:
        lines.append(f"  head config: unavailable: {info['head_config_error']}")
    prefixes = ", ".join(repr(p) for p in info["head_prefixes"]) or "-"
    lines.append(f"  head   : {len(info['head'])} of {len(HYBRID_KEY_MAP)} tensors, prefix {prefixes} "
                 f"({info['layout']} names)")
    for r in info["head"]:
        exp = "ok" if r.get("shape_ok") else f"MISMATCH, expected {tuple(r.get('expected_shape', ()))}"
        exp = exp if "shape_ok" in r else ""
        lines.append(f"    {r['key']:<40} {str(tuple(r['shape'])):<18} {r['dtype']:<9} {exp}")
    for r in info.get("vocab_map", []):
        lines.append(f"    {r['key']:<40} {str(tuple(r['shape'])):<18} {r['dtype']:<9} vocabulary map")
    if "vocab_map_status" in info:
        lines.append(f"  vocab  : {info['vocab_map_status']}")
    if "mixer" in info:
        lines.append(f"  mixer  : {info['mixer']}")
    bb = info["backbone"]
    lines.append(f"  backbone (ignored): {bb['count']} tensors, {human_bytes(bb['bytes'])}")
    lines += [f"    {g:<40} {n}" for g, n in bb["groups"].items()]
    lines += [f"  note   : {note}" for note in info["notes"]]
    if info["problems"]:
        return "\n".join(lines + ["  PROBLEMS:"] + [f"    - {p}" for p in info["problems"]])
    return "\n".join(lines + ["  status : convertible"])


def to_json(info: dict) -> str:
    return json.dumps(info, indent=2, default=str)
