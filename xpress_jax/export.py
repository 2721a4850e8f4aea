"""Export a trained `XPressHead` both ways.

- `export_serving`: ``xpress_jax.save_params`` of ``model.to_serving()``: what `xpress_jax.load_params`
  restores and `refine` runs.
- `export_vllm`: the head as vLLM's XPress drafter loads it: ``model.safetensors`` (every tensor under
  ``xpress_head.`` by its `HYBRID_KEY_MAP` name, PyTorch layouts, the RAW ``mix.L``) and ``config.json``.

Both writes are atomic (a temporary folder beside the destination, renamed at the end).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .checkpoint import save_params, staged_directory
from .config import HeadConfig
from .head import XPressHead

__all__ = ["VLLM_PREFIX", "export_serving", "export_vllm"]

#: Where vLLM's XPress drafter keeps the head's tensors.
VLLM_PREFIX = "xpress_head."


def _check_model(model: Any) -> None:
    if not isinstance(model, XPressHead):
        raise TypeError(f"model must be an XPressHead, got {type(model).__name__}")


def export_serving(path: str | os.PathLike, model: XPressHead, *, config: HeadConfig | None = None,
                   dtype: Any = None, overwrite: bool = False, metadata: Mapping[str, Any] | None = None) -> Path:
    """Save ``model.to_serving(config, dtype=dtype)`` as an Orbax checkpoint (`xpress_jax.save_params`)."""
    _check_model(model)
    return save_params(path, model.to_serving(config, dtype=dtype),
                       metadata={"source": "xpress_jax.export.export_serving", **dict(metadata or {})},
                       overwrite=overwrite)


def export_vllm(folder: str | os.PathLike, model: XPressHead, *, config: HeadConfig | None = None,
                dtype: Any = None, overwrite: bool = False, extra_config: Mapping[str, Any] | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` into ``folder``; returns its path. ``config`` (default: the
    module's) supplies C, K and ``max_num_seqs`` (its sizes must be the module's); ``dtype`` casts the
    tensors; ``extra_config`` adds fields to config.json (not replacing the head's own)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)

    from .convert import save_file

    _check_model(model)
    config = model.to_serving(config).config if config is not None else model.config  # checks the sizes
    hf = config.to_hf_config()
    clash = sorted(set(extra_config or {}) & set(hf))
    if clash:
        raise ValueError(f"extra_config may not replace the head's own config.json fields: {clash}")
    hf = {**hf, **dict(extra_config or {})}
    tensors = {VLLM_PREFIX + name: np.asarray(v) if dtype is None else np.asarray(v).astype(np.dtype(dtype))
               for name, v in model.state_dict().items()}
    folder = Path(folder).expanduser().absolute()
    with staged_directory(folder, overwrite=overwrite) as staged:
        staged.mkdir()
        (staged / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        save_file(tensors, staged / "model.safetensors", metadata={"format": "pt"})
    return folder
