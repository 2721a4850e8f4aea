"""``--verify``: the written checkpoint against the source.

The restored params must be bitwise the converted ones. `refine`'s tokens (jnp path, float32, full
vocabulary and top-C) on them are compared with the PyTorch reference (`torch_reference`, float64)
on the source tensors, or without torch with the jnp path on params built straight from the source.
They must be identical when the stored dtype holds the source values exactly; after a narrowing
cast (float32 -> bfloat16) the agreement is reported, not required. A head trained on the real previous
token (``predecessor="previous"``) gets random ``prev_ids``; a reduced head's logits are [N, B, V_draft].
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from xpress_jax import STATIC_ARGNAMES
from xpress_jax.checkpoint import load_params
from xpress_jax.params import VOCAB_MAP, params_from_state_dict
from xpress_jax.refine import refine as _refine

__all__ = ["VerifyResult", "lossless", "verify_checkpoint"]

refine = jax.jit(_refine, static_argnames=STATIC_ARGNAMES)
_WIDTH = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


def lossless(source_dtypes: set[str], stored: str) -> bool:
    """Whether casting every source dtype to ``stored`` keeps every value exactly."""
    return all(d == stored or (d in _WIDTH and _WIDTH.get(stored, 0) > _WIDTH[d]) for d in source_dtypes)


@dataclasses.dataclass
class ModeResult:
    mode: str  # "full-vocab" | "top-C(512)"
    agree: int
    total: int
    changed: int  # draft tokens the refiner changed from the drafter's argmax (reference side)


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
        return self.roundtrip_ok and (not self.required or all(m.agree == m.total for m in self.modes))

    def lines(self) -> list[str]:
        out = [f"round trip: {self.roundtrip_detail}"] + [
            f"{m.mode}: {m.agree}/{m.total} draft tokens identical ({100.0 * m.agree / max(m.total, 1):.2f}%) vs "
            f"{self.reference}; the refiner changed {m.changed}/{m.total} of the drafter's tokens"
            for m in self.modes
        ]
        return out + ([self.note] if self.note else [])


def verify_checkpoint(path: Any, source_tensors: Mapping[str, np.ndarray], converted: Mapping[str, Any],
                      source_dtypes: set[str], *, n: int = 4, seed: int = 0, reference: str = "auto") -> VerifyResult:
    """Check the checkpoint at ``path`` (see the module docstring); never raises on a mismatch.

    ``source_tensors``: the head's source tensors as converted (HYBRID_KEY_MAP names, raw mixer);
    ``converted``: the params that were saved; ``reference``: ``"auto"``, ``"torch"`` or ``"jnp"``.
    """
    config, stored = load_params(path)
    diffs = [k for k in converted if stored[k].dtype != jnp.asarray(converted[k]).dtype
             or not np.array_equal(np.asarray(stored[k]).view(np.uint8), np.asarray(converted[k]).view(np.uint8))]
    roundtrip = (f"{len(stored)} params restored bitwise identical" if not diffs
                 else f"restored params differ from the converted ones: {diffs}")
    stored_dtype = jnp.dtype(stored["w1"].dtype).name
    params32 = {k: v if k == VOCAB_MAP else v.astype(jnp.float32) for k, v in stored.items()}
    use_torch = reference == "torch" or (reference == "auto" and importlib.util.find_spec("torch") is not None)
    rng = np.random.default_rng(seed)
    V, H, B = config.vocab_size, config.hidden_size, config.block_size
    n = max(1, min(int(n), config.max_num_reqs))
    logits = rng.standard_normal((n, B, config.draft_vocab_size), dtype=np.float32)
    h = rng.standard_normal((n, B, H), dtype=np.float32)
    anchors = rng.integers(0, V, size=(n,), dtype=np.int32)
    prev = rng.integers(0, V, size=(n,), dtype=np.int32) if config.predecessor == "previous" else None
    if use_torch:
        from .torch_reference import reference_refine

        ref_name = "the PyTorch reference (float64) on the source tensors"
    else:
        direct = params_from_state_dict(source_tensors, config, dtype=jnp.float32)
        ref_name = "the jnp path on params built straight from the source tensors (torch not installed)"

    def jax_tokens(params, topc):
        args = (jnp.asarray(logits), jnp.asarray(h), jnp.asarray(anchors), None if prev is None else jnp.asarray(prev))
        return np.asarray(refine(params, *args, config=config, topc=topc, backend="xla"))

    modes = []
    for topc in sorted({0, config.topc}):
        got = jax_tokens(params32, topc)
        if use_torch:
            want = reference_refine(source_tensors, logits, h, anchors, prev, num_passes=config.num_passes, topc=topc)
        else:
            want = jax_tokens(direct, topc)
        drafter = np.argmax(logits[:, 1:, :], axis=-1)
        if VOCAB_MAP in stored:
            drafter = drafter + np.asarray(stored[VOCAB_MAP])[drafter]
        changed = int((want != drafter).sum())
        modes.append(ModeResult("full-vocab" if topc == 0 else f"top-C({topc})", int((got == want).sum()),
                                int(want.size), changed))
    required = lossless(source_dtypes, stored_dtype)
    note = "" if required else (f"note: {'/'.join(sorted(source_dtypes))} -> {stored_dtype} rounds the weights, so "
                                "agreement is reported, not required")
    return VerifyResult(ref_name, not diffs, roundtrip, modes, required, note)
