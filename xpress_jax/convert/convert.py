"""`convert_checkpoint`: a PyTorch XPress checkpoint (vLLM's layout, the xPress runtime's, or a model saved by
vLLM's ``speculators`` library) -> an Orbax head checkpoint.

Bad input is refused with a `ConversionError` naming the problem before anything is written. The
checkpoint is written into a temporary folder beside the destination, verified there on request,
and renamed into place only when everything succeeded.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from xpress_jax.checkpoint import is_checkpoint, staged_directory, write_checkpoint
from xpress_jax.config import HeadConfig
from xpress_jax.params import HYBRID_KEY_MAP, VOCAB_MAP, check_vocab_map, params_from_state_dict, source_shapes

from .errors import ConversionError, VerificationError
from .sources import (RELEASE, SPECULATORS, HeadSelection, Source, TensorRef, open_source, read_config_json,
                      select_in)
from .speculators_format import is_speculators_config, speculators_hf_config

__all__ = ["DTYPES", "MIXER_MODES", "RELEASE_VARIANT", "ConvertReport", "ResolvedConfig", "convert_checkpoint",
           "mixer_looks_folded", "resolve", "resolve_config", "sizing_config", "vocab_map_refs"]

DTYPES = ("keep", "bfloat16", "float32")
MIXER_MODES = ("auto", "raw", "folded")
_FLOATS = {"float16", "bfloat16", "float32", "float64"}
#: The head variant the xPress release serves: its training options and the value each must have
#: (an option absent from ``args`` takes this value, as the release's loader does).
RELEASE_VARIANT = dict(
    markov_only=False, no_hidden=False, no_perpos=False, no_global=False, no_mixer=False, no_mlp=False,
    input_relu=False, no_residual=True, no_sublayer_norm=True, no_mix_out=True, input_mode="concat",
    lowrank_lmhead_shared_rank=0, lowrank_base_rank=0,
)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def config_line(c: HeadConfig) -> str:
    return (f"V={c.vocab_size} H={c.hidden_size} B={c.block_size} r={c.rank} M={c.mlp_hidden} "
            f"topc={c.topc} K={c.num_passes} max_num_reqs={c.max_num_reqs}"
            + (f" V_draft={c.draft_vocab_size}" if c.reduced else "")
            + (f" predecessor={c.predecessor}" if c.predecessor != "anchor" else ""))


def source_line(source: Source) -> str:
    if source.kind == RELEASE:
        return f"xPress release training checkpoint (global_step {source.step})"
    line = source.kind
    if source.model_type is not None:
        version = (source.config or {}).get("speculators_version")
        line = (f"speculators {source.model_type} model" + (f" (speculators {version})" if version else "")
                + f", {source.kind}")
    if source.entries:
        line += ", tensors one level down under " + " and ".join(repr(e) for e in source.entries)
    return line


def _wrap(label: str, items: list[str], width: int = 116) -> list[str]:
    """``  label: a, b, c`` over as many lines as ``width`` needs."""
    lines, cur = [], f"  {label}: "
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if len(cur) + len(piece) > width and cur.strip() != f"{label}:":
            lines.append(cur.rstrip())
            cur = " " * (len(label) + 4)
        cur += piece + " "
    return lines + [cur.rstrip()]


@dataclasses.dataclass
class ConvertReport:
    src: Path
    dst: Path
    source: str
    files: list[Path]
    config: HeadConfig
    config_from: str
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
    seconds: dict[str, float]
    warnings: list[str]
    verify: Any = None  # verify.VerifyResult
    defaults: list[str] = dataclasses.field(default_factory=list)  # values no config field nor flag set
    fields: list[str] = dataclasses.field(default_factory=list)  # speculators: the config fields read
    vocab_map: str = ""  # a reduced head: where d2t (and t2d) came from

    def lines(self) -> list[str]:
        prefixes = ", ".join(repr(p) for p in self.prefixes) or "(bare names)"
        out = [
            f"converted {self.src} -> {self.dst}",
            f"  source : {self.source}, {len(self.files)} file(s); config from {self.config_from}",
            f"  config : {config_line(self.config)}",
            *(_wrap("fields ", self.fields) if self.fields else []),
            *(_wrap("default", self.defaults) if self.defaults else []),
            f"  head   : {self.tensors_read} tensors under {prefixes}, {human_bytes(self.bytes_read)} read, "
            f"{'/'.join(self.source_dtypes)}; mixer {self.mixer}",
            *([f"  vocab  : {self.vocab_map}"] if self.vocab_map else []),
            f"  ignored: {self.backbone_count} backbone tensor(s), {human_bytes(self.backbone_bytes)} (not read)",
            f"  wrote  : {self.params_written} params, {self.dtype}, {human_bytes(self.bytes_written)} on disk",
            "  time   : " + ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items()),
        ]
        return out + [f"  verify : {line}" for line in (self.verify.lines() if self.verify else [])]


def _upper_is_zero(L: np.ndarray) -> bool:
    rows, cols = np.triu_indices(L.shape[-1], k=1)
    return bool(np.all(L[..., rows, cols] == 0))


def mixer_looks_folded(mix_L: np.ndarray) -> bool:
    """Whether ``mix_L`` [r, B, B] looks like the folded serving form ``raw * tril + I``.

    Folding zeroes the upper triangle and adds 1 to the diagonal; a trained raw mixer is a residual
    branch with a diagonal near 0 and an upper triangle the tril mask never trained. So: the upper
    triangle is exactly zero in every channel and the diagonal's median is above 0.5. A heuristic
    can be wrong, hence ``--mixer raw|folded``.
    """
    L = np.asarray(mix_L).astype(np.float64)
    if L.ndim != 3 or L.shape[1] != L.shape[2]:
        return False
    return _upper_is_zero(L) and bool(np.median(np.diagonal(L, axis1=-2, axis2=-1)) > 0.5)


def _sizes_from_tensors(head: Mapping[str, TensorRef], layout: str | None = None) -> dict[str, Any]:
    """V, H, B, r, M and V_draft (config.json names) read from the shapes of w1, down_h, mix.L, mlp.gate_proj
    and w2; the speculators layout's heads read the real previous token (``xpress_predecessor``)."""
    try:
        (V, r), (_, H), M = head["w1.weight"].shape, head["down_h.weight"].shape, head["mlp.gate_proj.weight"].shape[0]
        B = head["mix.L"].shape[-1]
        Vd = head["w2.weight"].shape[0] if "w2.weight" in head else V
    except (KeyError, ValueError, IndexError):
        shapes = {n: tuple(ref.shape) for n, ref in head.items()}
        raise ConversionError(f"no config.json, and the head tensors' shapes do not give the sizes ({shapes}): pass "
                              "--config PATH (a config.json with vocab_size, hidden_size, xpress_rank, ...)") from None
    out = {"vocab_size": V, "hidden_size": H, "xpress_block_size": B, "xpress_rank": r, "xpress_mlp_hidden": M}
    if Vd != V:
        out["draft_vocab_size"] = Vd
    if layout == SPECULATORS:  # as a speculators config.json would give them
        out["xpress_predecessor"], out["xpress_topc"] = "previous", 0
    return out


def _check_release_args(source: Source, head: Mapping[str, TensorRef]) -> None:
    """Refuse a release training checkpoint without ``args``, of a variant the release does not serve,
    or whose ``markov_rank`` / ``mlp_ratio`` disagree with its tensors."""
    a = source.args
    if a is None:
        raise ConversionError(f"{source.path}: the training checkpoint has no 'args', so its head variant and "
                              "sizes cannot be checked; refusing it")
    bad = [f"{k}={a[k]!r} (must be {v!r})" for k, v in RELEASE_VARIANT.items() if a.get(k, v) != v]
    if bad:
        raise ConversionError(f"{source.path}: trained with a head variant the xPress release does not serve: "
                              + ", ".join(bad))
    r, ratio = a.get("markov_rank", 256), a.get("mlp_ratio", 2)
    w1, gate = head.get("w1.weight"), head.get("mlp.gate_proj.weight")
    if w1 is not None and gate is not None and (r, r * ratio) != (w1.shape[-1], gate.shape[0]):
        raise ConversionError(
            f"{source.path}: args markov_rank={r}, mlp_ratio={ratio} (rank {r}, mlp hidden {r * ratio}) disagree "
            f"with the tensors: w1.weight {tuple(w1.shape)} (rank {w1.shape[-1]}), "
            f"mlp.gate_proj.weight {tuple(gate.shape)} (mlp hidden {gate.shape[0]})"
        )


@dataclasses.dataclass
class ResolvedConfig:
    """The `HeadConfig` to convert with, where it came from, the serving values no config field or flag set
    (``defaults``: one phrase each, the flags to set them last) and, for a speculators model, the fields read."""

    config: HeadConfig
    where: str
    defaults: list[str] = dataclasses.field(default_factory=list)
    fields: list[str] = dataclasses.field(default_factory=list)


def sizing_config(config: HeadConfig | Mapping[str, Any] | str | os.PathLike | None,
                   source: Source | None) -> tuple[HeadConfig | dict | None, str]:
    """The config to size the head with: ``config`` (a HeadConfig, a dict, a config.json path), else the source's
    config.json, else None; and where it came from."""
    if isinstance(config, HeadConfig):
        return config, "the given HeadConfig"
    if isinstance(config, Mapping):
        return dict(config), "the given config dict"
    if config is not None:
        return read_config_json(config), str(config)
    if source is not None and source.config is not None:
        return source.config, str(source.config_path)
    return None, "the tensor shapes"


#: The serving values a config may leave out (HeadConfig field, config.json name, flag, what it is).
_SERVING = (("topc", "xpress_topc", "--topc N", "candidates per slot, 0 = full vocabulary"),
            ("num_passes", "xpress_num_passes", "--num-passes N", "Jacobi passes K"),
            ("max_num_reqs", "max_num_seqs", "--max-num-reqs N", "the largest N per call"))


def _defaults(hf: Mapping[str, Any], overrides: Mapping[str, Any], cfg: HeadConfig, speculators: bool,
              where: str) -> list[str]:
    """One phrase per serving value that neither the config nor a flag set (its value, why, the flag that sets it),
    the last one saying that they are defaults."""
    out = []
    for field, key, flag, what in _SERVING:
        if field in overrides or (key in hf and not (speculators and field == "topc")):
            continue
        value = getattr(cfg, field)
        if field == "topc" and speculators:
            what = "speculators scores the full draft vocabulary"
        elif field == "topc" and value != 512:
            what = f"512 clamped to {'V_draft' if cfg.reduced else 'V'}={cfg.draft_vocab_size}"
        out.append(f"{field}={value} ({what}; {flag} sets it)")
    if out:
        out[-1] += (": DEFAULTS (no config.json)" if where.startswith("the tensor shapes")
                    else ": DEFAULTS (no config field or flag sets them)")
    return out


def resolve(config: HeadConfig | Mapping[str, Any] | str | os.PathLike | None, source: Source | None,
            overrides: Mapping[str, Any] | None = None, head: Mapping[str, TensorRef] | None = None,
            layout: str | None = None) -> ResolvedConfig:
    """`resolve_config` with the defaults it took and, for a speculators model, the fields it read."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if source is not None and source.kind == RELEASE:
        _check_release_args(source, head or {})
    given, where = sizing_config(config, source)
    if isinstance(given, HeadConfig):
        try:
            return ResolvedConfig(dataclasses.replace(given, **overrides), where + (" + flags" if overrides else ""))
        except (TypeError, ValueError) as e:
            raise ConversionError(f"invalid head config from {where} + flags: {e}") from None
    fields: list[str] = []
    speculators = is_speculators_config(given)
    if speculators:
        hf, fields = speculators_hf_config(given, where)
    elif given is not None:
        hf = given
    else:
        hf = _sizes_from_tensors(head or {}, layout)
        if layout == SPECULATORS:
            speculators = True
            fields = ["predecessor='previous' (the speculators layout's: slot 0 reads the real previous token)"]
    if "xpress_candidate_topc" in hf:  # the name some of the release's config.json files use
        hf, c = dict(hf), hf["xpress_candidate_topc"]
        if hf.setdefault("xpress_topc", c) != c:
            raise ConversionError(f"{where}: xpress_topc={hf['xpress_topc']!r} and xpress_candidate_topc={c!r} "
                                  "disagree; keep one of them")
    where += " + flags" if overrides else ""
    try:
        cfg = HeadConfig.from_hf_config(hf, **overrides)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"invalid head config from {where}: {e}") from None
    return ResolvedConfig(cfg, where, _defaults(hf, overrides, cfg, speculators, where), fields)


def resolve_config(config: HeadConfig | Mapping[str, Any] | str | os.PathLike | None, source: Source | None,
                   overrides: Mapping[str, Any] | None = None,
                   head: Mapping[str, TensorRef] | None = None, layout: str | None = None) -> tuple[HeadConfig, str]:
    """The `HeadConfig` to convert with and where it came from.

    ``config`` (a HeadConfig, a parsed config.json or its path), else the source's config.json, else
    the sizes of the ``head`` tensors; ``overrides`` (HeadConfig fields) win. A release training
    checkpoint's ``args`` are checked against the tensors first. A speculators XPress config
    (``speculators_model_type: "xpress"``) is read through `speculators_format.speculators_hf_config`.
    """
    r = resolve(config, source, overrides, head, layout)
    return r.config, r.where


def _check_paths(src: Path, dst: Path, force: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    for p in ([src] if src.is_dir() else []) + list(src.parents)[:3]:  # a converted checkpoint, or inside one
        if is_checkpoint(p):
            raise ConversionError(
                f"{src} is {'' if p == src else 'inside '}an already converted xpress-jax checkpoint ({p}): there "
                f"is nothing to convert. Load it with xpress_jax.load_params({str(p)!r}), look at it with "
                f"`xpress-convert inspect {p}`, or run it with `xpress bench --checkpoint {p}`"
            )
    if s.is_dir() and s in d.parents:
        raise ConversionError(f"destination {dst} lies inside the source folder {src}; write the checkpoint "
                              "somewhere else (e.g. next to the source folder), so the source stays as vLLM loads it")
    if (dst.exists() or dst.is_symlink()) and not force:
        raise ConversionError(f"destination {dst} already exists; pass --force to replace it")
    if s == d or d in s.parents:
        raise ConversionError(f"destination {dst} is or contains the source {src}; refusing to overwrite it")


def _pick_dtype(dtype: str, source_dtypes: set[str], warn: Callable[[str], None]) -> np.dtype:
    if dtype != "keep":
        return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    if len(source_dtypes) == 1:
        return jnp.dtype(next(iter(source_dtypes)))
    widest = "float64" if "float64" in source_dtypes else "float32"  # holds every mixed-in dtype exactly
    warn(f"head tensors have mixed dtypes {sorted(source_dtypes)}; keeping them exactly as {widest}")
    return jnp.dtype(widest)


def _check_head(sel: HeadSelection, config: HeadConfig) -> None:
    want = {k: v for k, v in source_shapes(config).items() if k != VOCAB_MAP}
    bad = [f"{sel.source_keys[n]}: {tuple(r.shape)}, expected {want[n]}" for n, r in sel.head.items()
           if tuple(r.shape) != want[n]]
    if bad:
        raise ConversionError(f"head tensor shapes do not match the config ({config_line(config)}): " + "; ".join(bad))
    nonfloat = [f"{sel.source_keys[n]}: {r.dtype}" for n, r in sel.head.items() if r.dtype not in _FLOATS]
    if nonfloat:
        raise ConversionError("head tensors must be float16/bfloat16/float32/float64: " + "; ".join(nonfloat))


_INTS = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}


def vocab_map_refs(sel: HeadSelection, config: HeadConfig, warn: Callable[[str], None]) -> dict[str, TensorRef]:
    """A reduced head's ``d2t`` (required) and ``t2d`` (optional) refs, their shapes and dtypes checked; ``{}`` for
    a head over the whole vocabulary (maps found under the head's prefix are then ignored, with a warning)."""
    V, Vd = config.vocab_size, config.draft_vocab_size
    if not config.reduced:
        inside = [k for k in sel.vocab_map_keys.values() if k not in sel.backbone]
        if inside:
            warn(f"ignored {', '.join(inside)}: the head scores the whole vocabulary (draft_vocab_size = vocab_size "
                 f"= {V}), so it needs no vocabulary map")
        return {}
    if "d2t" not in sel.vocab_map:
        pre = sel.prefixes[0] if sel.prefixes else ""
        looked = sorted({pre + "d2t", "d2t"})
        raise ConversionError(f"the head scores a reduced draft vocabulary (draft_vocab_size={Vd} < vocab_size={V}), "
                              f"so it needs the draft-to-verifier map d2t [{Vd}] (verifier id = draft id + "
                              f"d2t[draft id]); the source has none (looked for {looked})")
    d2t, t2d = sel.vocab_map["d2t"], sel.vocab_map.get("t2d")
    bad = []
    if tuple(d2t.shape) != (Vd,) or d2t.dtype not in _INTS:
        bad.append(f"{d2t.key}: {d2t.dtype}{tuple(d2t.shape)}, expected integer ids of shape ({Vd},) "
                   "(draft_vocab_size)")
    if t2d is not None and (tuple(t2d.shape) != (V,) or t2d.dtype not in _INTS | {"bool"}):
        bad.append(f"{t2d.key}: {t2d.dtype}{tuple(t2d.shape)}, expected a bool mask of shape ({V},) (vocab_size)")
    if bad:
        raise ConversionError("bad vocabulary map: " + "; ".join(bad))
    return dict(sel.vocab_map)


def _dir_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def convert_checkpoint(
    src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "keep", force: bool = False,
    verify: bool = False, config: HeadConfig | Mapping[str, Any] | str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None, mixer: str = "auto", prefix: str | None = None, verify_n: int = 4,
    seed: int = 0, reference: str = "auto", progress: bool = False, log: Callable[[str], None] | None = None,
) -> ConvertReport:
    """Convert the XPress head of the checkpoint at ``src`` (a folder or one file) into an Orbax one at ``dst``.

    ``dtype``: ``"keep"`` (the source's), ``"bfloat16"`` or ``"float32"``. ``force`` replaces an
    existing ``dst`` once the new one is complete. ``config``: see `resolve_config`; ``overrides``
    (HeadConfig fields) win over it. ``mixer``: ``"auto"`` refuses a mix.L that looks folded, ``"raw"``
    folds it regardless, ``"folded"`` stores the serving form as is. ``prefix``: look for the head only
    under it (``""``: bare names). ``verify`` compares `refine` tokens with a reference on the source
    tensors (``verify_n`` rows, ``seed``, ``reference`` ``"auto"|"torch"|"jnp"``; `verify.verify_checkpoint`).
    ``progress`` draws a bar on a terminal; ``log`` gets warning lines.

    Raises `ConversionError` on bad input, `VerificationError` when verify finds a required mismatch
    (nothing is written in either case).
    """
    t0 = time.perf_counter()
    warnings: list[str] = []

    def warn(msg: str) -> None:
        warnings.append(msg)
        if log is not None:
            log(f"warning: {msg}")

    for name, value, allowed in (("mixer", mixer, MIXER_MODES), ("dtype", dtype, DTYPES),
                                 ("reference", reference, ("auto", "torch", "jnp"))):
        if value not in allowed:
            raise ConversionError(f"{name} must be one of {allowed}, got {value!r}")
    if verify and reference == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ConversionError("--reference torch needs torch installed (or use --reference jnp)") from None
    src_p, dst_p = Path(src).expanduser().absolute(), Path(dst).expanduser().absolute()
    if not src_p.exists():
        raise ConversionError(f"source {src_p} does not exist")
    _check_paths(src_p, dst_p, force)

    source = open_source(src_p)
    for note in source.notes:
        warn(note)
    given, where = sizing_config(config, source)
    layout = None
    if is_speculators_config(given):  # its model type and layout are checked before the tensors
        speculators_hf_config(given, where)
        layout = SPECULATORS
    sel = select_in(source, prefix=prefix, layout=layout)
    if sel.problems:  # before the config: a missing head is the clearer message
        raise ConversionError(f"{src_p}: " + "; ".join(sel.problems))
    resolved = resolve(config, source, overrides, sel.head, sel.layout)
    cfg, cfg_from = resolved.config, resolved.where
    _check_head(sel, cfg)
    map_refs = vocab_map_refs(sel, cfg, warn)

    total, tensors = sum(ref.nbytes for ref in sel.head.values()), {}
    for name in HYBRID_KEY_MAP:  # with a progress bar on a terminal
        tensors[name] = sel.head[name].load()
        if progress and sys.stderr.isatty():
            frac = sum(a.nbytes for a in tensors.values()) / max(total, 1)
            sys.stderr.write(f"\rreading [{'#' * int(30 * frac):.<30}] {frac:6.1%} of {human_bytes(total)}"
                             + ("\n" if len(tensors) == len(HYBRID_KEY_MAP) else ""))
    seconds = {"read": time.perf_counter() - t0}
    nonfinite = [f"{sel.source_keys[n]} ({a.size - np.count_nonzero(np.isfinite(a))} of {a.size} values)"
                 for n, a in tensors.items() if not np.all(np.isfinite(a))]
    if nonfinite:
        raise ConversionError("non-finite values (NaN or inf) in head tensor(s): " + ", ".join(nonfinite))

    vocab_map, vocab_desc = {}, ""
    if map_refs:
        vocab_map = {n: ref.load() for n, ref in map_refs.items()}
        try:
            check_vocab_map(vocab_map["d2t"], cfg.vocab_size, vocab_map.get("t2d"))
        except ValueError as e:
            keys = " and ".join(ref.key for ref in map_refs.values())
            raise ConversionError(f"bad vocabulary map ({keys}): {e}") from None
        vocab_desc = (f"{cfg.draft_vocab_size} draft ids -> verifier ids by {map_refs['d2t'].key} "
                      f"({map_refs['d2t'].dtype}, stored as int32 d2t)"
                      + (f", checked against {map_refs['t2d'].key}" if "t2d" in map_refs else ", no t2d to check"))
    raw, key_L = tensors["mix.L"], sel.source_keys["mix.L"]
    looks_folded = mixer_looks_folded(raw)
    if mixer == "auto" and looks_folded:
        diag = np.median(np.diagonal(raw.astype(np.float64), axis1=-2, axis2=-1))
        raise ConversionError(
            f"{key_L} looks ALREADY FOLDED: its upper triangle is exactly 0 in all {raw.shape[0]} channels and "
            f"its diagonal sits near 1 (median {diag:.3g}), while vLLM checkpoints store the RAW mixer and fold it "
            "on load (raw * tril + I). Folding it again would silently add 1 to the diagonal. Pass --mixer folded "
            "if it is the serving form (it is then stored as is), or --mixer raw if it really is a raw mixer"
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
        # In float64, Lf - I folds back to exactly Lf (float64 holds every Lf - 1 exactly).
        tensors["mix.L"] = raw.astype(np.float64) - np.eye(raw.shape[-1])
    mixer_desc = {"auto": "raw (folded once)", "raw": "raw (folded once, as asked)",
                  "folded": "already folded (stored as is)"}[mixer]
    target = _pick_dtype(dtype, source_dtypes, warn)
    tensors.update(vocab_map)
    try:
        params = params_from_state_dict(tensors, cfg, dtype=target)
    except (TypeError, ValueError) as e:
        raise ConversionError(str(e)) from None
    source_keys = {**sel.source_keys, **{n: ref.key for n, ref in map_refs.items()}}
    backbone = [k for k in sel.backbone if k not in source_keys.values()]
    metadata = dict(
        source=str(src_p), source_kind=source_line(source), source_keys=source_keys,
        source_files=[str(p.relative_to(src_p)) if src_p.is_dir() else p.name for p in source.files],
        source_dtypes=sorted(source_dtypes), backbone_tensors_ignored=len(backbone), mixer=mixer_desc,
        config_from=cfg_from, converted_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )

    t_write, verify_result = time.perf_counter(), None
    try:
        with staged_directory(dst_p, overwrite=force) as staged:
            write_checkpoint(staged, cfg, params, metadata=metadata)
            bytes_written = _dir_bytes(staged)
            seconds["write"] = time.perf_counter() - t_write
            if verify:
                from .verify import verify_checkpoint

                verify_result = verify_checkpoint(staged, tensors, params, source_dtypes, n=verify_n, seed=seed,
                                                  reference=reference)
                if not verify_result.ok:
                    raise VerificationError("verification failed; nothing was written:\n  "
                                            + "\n  ".join(verify_result.lines()), verify_result)
                seconds["verify"] = time.perf_counter() - t_write - seconds["write"]
    except FileExistsError as e:
        raise ConversionError(str(e)) from None
    seconds["total"] = time.perf_counter() - t0
    return ConvertReport(
        src=src_p, dst=dst_p, source=source_line(source), files=list(source.files), config=cfg, config_from=cfg_from,
        prefixes=sel.prefixes, backbone_count=len(backbone),
        backbone_bytes=sel.backbone_bytes - sum(ref.nbytes for ref in map_refs.values() if ref.key in sel.backbone),
        source_dtypes=sorted(source_dtypes), dtype=jnp.dtype(target).name, mixer=mixer_desc,
        tensors_read=len(sel.head), bytes_read=total, params_written=len(params), bytes_written=bytes_written,
        seconds=seconds, warnings=warnings, verify=verify_result, defaults=resolved.defaults, fields=resolved.fields,
        vocab_map=vocab_desc,
    )
