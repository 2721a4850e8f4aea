"""`HeadConfig`: the static shape of an XPress refiner head (the fields and defaults vLLM reads from a
drafter's ``config.json``: `HeadConfig.from_hf_config`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

__all__ = ["HeadConfig", "PREDECESSORS"]

#: `HeadConfig.predecessor`'s values: the token slot 0's latent reads (see the field).
PREDECESSORS = ("anchor", "previous")


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    """An int (or an integral float from JSON, e.g. 16.0; never a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """Static configuration of an XPress refiner head (hashable: usable as a jit static arg). It gives
    `refine` its ``num_passes``, ``topc`` and ``max_num_reqs`` (through a `xpress_jax.Head` or ``config=``).
    A ``topc`` larger than V is clamped to V, as vLLM does (C = V gives topc=0's tokens, more slowly)."""

    vocab_size: int  # V: the verifier's vocabulary, rows of w1 (token ids in and out are verifier ids)
    hidden_size: int  # H: the drafter's hidden size
    block_size: int = 16  # B: slot 0 = anchor, slots 1..B-1 = draft
    rank: int = 256  # r: latent width
    mlp_hidden: int = 512  # M: SwiGLU hidden width
    topc: int = 512  # C: candidates per draft slot; 0 = exact full-vocabulary scoring
    num_passes: int = 6  # K: Jacobi passes per call
    max_num_reqs: int = 256  # the largest N (blocks per call) the head accepts
    # V_draft: rows of w2 and the logits' last dim (None: V). Below V, the head scores a reduced draft vocabulary
    # and its params carry "d2t" (verifier id = draft id + d2t[draft id]), as vLLM's speculators library writes.
    draft_vocab_size: int | None = None
    # The token slot 0 was trained with (its latent reads w1[prev_ids]): "anchor" (vLLM's heads: refine's
    # prev_ids defaults to the anchors) or "previous" (the real token before the anchor: speculators' heads and
    # xpress_jax.train's; refine then requires prev_ids).
    predecessor: str = "anchor"

    def __post_init__(self) -> None:
        if self.draft_vocab_size is None:
            object.__setattr__(self, "draft_vocab_size", self.vocab_size)
        for field, minimum in (("vocab_size", 1), ("hidden_size", 1), ("block_size", 2), ("rank", 1),
                               ("mlp_hidden", 1), ("topc", 0), ("num_passes", 0), ("max_num_reqs", 1),
                               ("draft_vocab_size", 1)):
            object.__setattr__(self, field, _check_int(field, getattr(self, field), minimum=minimum))
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be <= vocab_size={self.vocab_size} "
                             "(the draft vocabulary is a subset of the verifier's; a config copied with a new "
                             "vocab_size keeps the old draft_vocab_size: pass draft_vocab_size=None with it)")
        if self.predecessor not in PREDECESSORS:
            raise ValueError(f"predecessor must be one of {PREDECESSORS}, got {self.predecessor!r}")
        object.__setattr__(self, "topc", min(self.topc, self.draft_vocab_size))  # vLLM's rule

    @property
    def reduced(self) -> bool:
        """True when the head scores a reduced draft vocabulary (V_draft < V; its params carry ``d2t``)."""
        return self.draft_vocab_size != self.vocab_size

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], **overrides: Any) -> "HeadConfig":
        """Build a config from a drafter's ``config.json`` dict, reading what vLLM reads: ``vocab_size``,
        ``hidden_size``, ``xpress_block_size`` (else ``num_speculative_steps + 1``, default 16),
        ``xpress_rank``, ``xpress_mlp_hidden``, ``xpress_topc``, ``xpress_num_passes``, and ``max_num_seqs``
        (vLLM's scheduler limit) for ``max_num_reqs``; ``draft_vocab_size`` and ``xpress_predecessor`` where
        present (defaults: V, "anchor"). Keyword ``overrides`` win over the dict."""
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping (a parsed config.json), got {type(config).__name__}")
        for key in ("vocab_size", "hidden_size"):
            if key not in config and key not in overrides:
                raise ValueError(f"config.json has no {key!r}; it is required to size the head")
        if "xpress_block_size" in config:
            block_size = config["xpress_block_size"]
        else:
            steps = config.get("num_speculative_steps", 15)
            block_size = _check_int("num_speculative_steps", steps, minimum=1) + 1
        kwargs = dict(vocab_size=config.get("vocab_size"), hidden_size=config.get("hidden_size"), block_size=block_size,
                      rank=config.get("xpress_rank", 256), mlp_hidden=config.get("xpress_mlp_hidden", 512),
                      topc=config.get("xpress_topc", 512), num_passes=config.get("xpress_num_passes", 6),
                      max_num_reqs=config.get("max_num_seqs", 256), draft_vocab_size=config.get("draft_vocab_size"),
                      predecessor=config.get("xpress_predecessor", "anchor"))
        unknown = set(overrides) - set(kwargs)
        if unknown:
            raise TypeError(f"unknown HeadConfig override(s): {sorted(unknown)}")
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_config(self) -> dict[str, Any]:
        """The inverse of `from_hf_config` (``config.json`` field names; the draft vocabulary and the predecessor
        only where they differ from the defaults, so vLLM-style configs stay as they were)."""
        out = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "xpress_block_size": self.block_size,
               "xpress_rank": self.rank, "xpress_mlp_hidden": self.mlp_hidden, "xpress_topc": self.topc,
               "xpress_num_passes": self.num_passes, "max_num_seqs": self.max_num_reqs}
        if self.reduced:
            out["draft_vocab_size"] = self.draft_vocab_size
        if self.predecessor != "anchor":
            out["xpress_predecessor"] = self.predecessor
        return out
