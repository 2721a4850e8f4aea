"""``--verify``: the converted checkpoint's `refine` tokens against a reference built from the source.

1. Round trip: the params restored from the written checkpoint are bitwise
   identical to the ones converted in memory.
2. Tokens: `xpress_jax.refine` (jnp path, float32) on the restored params, on
   random logits / hidden states, against
   - the PyTorch spelling of the reference (`xpress_jax.convert.torch_reference`, float64)
     built straight from the source tensors, when torch is installed, else
   - the jnp path on params built straight from the source tensors in float32
     (`params_from_state_dict`), which checks storage and layout but shares
     the math with the converted side.
   Both scoring modes are run: full vocabulary (topc=0) and, when the config
   has one, top-C.

The token check must be identical when the stored dtype holds the source
values exactly (``keep``, or widening to float32). After a narrowing cast
(e.g. float32 -> bfloat16) the reference still sees the source values, so the
agreement is reported but cannot be required.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from xpress_jax.checkpoint import load_params
from xpress_jax.params import params_from_state_dict
from xpress_jax import STATIC_ARGNAMES
from xpress_jax.refine import refine as _refine

# Jitted once: an eager `refine` re-traces its pass loop on every call.
refine = jax.jit(_refine, static_argnames=STATIC_ARGNAMES)

__all__ = ["VerifyResult", "lossless", "verify_checkpoint"]

_WIDTH = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


def lossless(source_dtypes: set[str], stored: str) -> bool:
    """Whether casting every source dtype to ``stored`` keeps every value exactly."""
    for d in source_dtypes:
        if d == stored:
            continue
        if d not in _WIDTH or stored not in _WIDTH or _WIDTH[stored] <= _WIDTH[d]:
            return False
    return True


@dataclasses.dataclass
class ModeResult:
    mode: str  # "full-vocab" | "top-C(512)"
    agree: int
    total: int
    changed: int  # draft tokens the refiner changed vs the base argmax (on the reference side)

    @property
    def identical(self) -> bool:
        return self.agree == self.total


@dataclasses.dataclass
class VerifyResult:
    reference: str
    roundtrip_ok: bool
    roundtrip_detail: str
    modes: list[ModeResult]
    required: bool  # exactness required (lossless dtype)
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.roundtrip_ok and (not self.required or all(m.identical for m in self.modes))

    def lines(self) -> list[str]:
        out = [f"round trip: {self.roundtrip_detail}"]
        for m in self.modes:
            pct = 100.0 * m.agree / max(m.total, 1)
            out.append(
                f"{m.mode}: {m.agree}/{m.total} draft tokens identical ({pct:.2f}%) vs {self.reference}"
                f"; the refiner changed {m.changed}/{m.total} of the drafter's tokens"
            )
        if self.note:
            out.append(self.note)
        return out


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def verify_checkpoint(
    path: Any,
    source_tensors: Mapping[str, np.ndarray],
    converted: Mapping[str, Any],
    source_dtypes: set[str],
    *,
    n: int = 4,
    seed: int = 0,
    reference: str = "auto",
) -> VerifyResult:
    """Check the checkpoint at ``path`` (see the module docstring); never raises on a mismatch.

    ``source_tensors``: the head's source tensors (HYBRID_KEY_MAP names, RAW
    mixer) exactly as they were converted; ``converted``: the params that were
    saved. ``reference``: ``"auto"``, ``"torch"`` or ``"jnp"``.
    """
    config, stored = load_params(path)
    diffs = [
        k
        for k in converted
        if stored[k].dtype != jnp.asarray(converted[k]).dtype
        or not np.array_equal(np.asarray(stored[k]).view(np.uint8), np.asarray(converted[k]).view(np.uint8))
    ]
    roundtrip = (
        f"{len(stored)} params restored bitwise identical"
        if not diffs
        else f"restored params differ from the converted ones: {diffs}"
    )
    stored_dtype = jnp.dtype(stored["w1"].dtype).name
    params32 = {k: v.astype(jnp.float32) for k, v in stored.items()}

    use_torch = reference == "torch" or (reference == "auto" and _torch_available())
    rng = np.random.default_rng(seed)
    V, H, B = config.vocab_size, config.hidden_size, config.block_size
    n = max(1, min(int(n), config.max_num_reqs))
    logits = rng.standard_normal((n, B, V), dtype=np.float32)
    h = rng.standard_normal((n, B, H), dtype=np.float32)
    anchors = rng.integers(0, V, size=(n,), dtype=np.int32)
    base_argmax = np.argmax(logits[:, 1:, :], axis=-1)

    if use_torch:
        from .torch_reference import reference_refine

        ref_name = "the PyTorch reference (float64) on the source tensors"
    else:
        direct = params_from_state_dict(source_tensors, config, dtype=jnp.float32)
        ref_name = "the jnp path on params built straight from the source tensors (torch not installed)"

    def jax_tokens(params, topc):
        args = (jnp.asarray(logits), jnp.asarray(h), jnp.asarray(anchors))
        return np.asarray(refine(params, *args, config=config, topc=topc, backend="xla"))

    modes = []
    for topc in sorted({0, config.topc}):
        got = jax_tokens(params32, topc)
        if use_torch:
            want = reference_refine(
                source_tensors, logits, h, anchors, num_passes=config.num_passes, topc=topc
            )
        else:
            want = jax_tokens(direct, topc)
        modes.append(
            ModeResult(
                mode="full-vocab" if topc == 0 else f"top-C({topc})",
                agree=int((got == want).sum()),
                total=int(want.size),
                changed=int((want != base_argmax).sum()),
            )
        )
    required = lossless(source_dtypes, stored_dtype)
    note = (
        ""
        if required
        else f"note: {'/'.join(sorted(source_dtypes))} -> {stored_dtype} rounds the weights, so agreement is "
        "reported, not required"
    )
    return VerifyResult(ref_name, not diffs, roundtrip, modes, required, note)

