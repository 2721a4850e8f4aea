"""Serving helper: static-shape buckets, padded rows, every bucket compiled at start-up."""

from __future__ import annotations

import bisect
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from .config import HeadConfig
from .params import Head, check_params
from .refine import refine

__all__ = ["BucketedRefiner", "default_buckets"]


def default_buckets(max_num_reqs: int) -> tuple[int, ...]:
    """Powers of two up to ``max_num_reqs`` (which is always the last bucket)."""
    out, b = [], 1
    while b < max_num_reqs:
        out.append(b)
        b *= 2
    out.append(max_num_reqs)
    return tuple(out)


class BucketedRefiner:
    """``refine`` for any N <= max_num_reqs with a fixed set of compiled shapes.

    A call with N blocks runs the smallest bucket >= N: rows N..bucket-1 are
    padding (anchor -1: the refine sentinel rule, so they never read out of
    range) and are dropped from the result. Params are a jit argument: swapping
    weights of the same shapes (`update_params`) never recompiles.
    """

    def __init__(self, params: Head | Mapping[str, jax.Array], config: HeadConfig | None = None, *,
                 buckets: Sequence[int] | None = None, backend: str = "auto", **refine_kwargs: Any):
        if isinstance(params, Head):
            if config is not None and config != params.config:
                raise ValueError(f"config={config} disagrees with the Head's own config {params.config}")
            config, params = params.config, params.params
        if not isinstance(config, HeadConfig):
            raise TypeError(
                "BucketedRefiner(head) takes a Head, or BucketedRefiner(params, config) a params dict and its "
                f"HeadConfig; got config={type(config).__name__}"
            )
        check_params(params, config)
        self.config = config
        self.params = dict(params)
        self.buckets = tuple(sorted(set(buckets or default_buckets(config.max_num_reqs))))
        if not self.buckets or self.buckets[0] < 1 or self.buckets[-1] > config.max_num_reqs:
            raise ValueError(f"buckets must lie in [1, max_num_reqs={config.max_num_reqs}], got {self.buckets}")
        kw = dict(config=config, backend=backend, **refine_kwargs)

        def run(p, logits, h, anchors, prev_ids, num_valid):
            pad = jnp.arange(anchors.shape[0]) >= num_valid
            return refine(p, logits, h, jnp.where(pad, -1, anchors), jnp.where(pad, -1, prev_ids), **kw)

        self._fn = jax.jit(run)

    def update_params(self, params: Head | Mapping[str, jax.Array]) -> None:
        """Swap in new weights of the same config (never recompiles)."""
        if isinstance(params, Head):
            if params.config != self.config:
                raise ValueError(f"the new Head's config {params.config} differs from {self.config}")
            params = params.params
        check_params(params, self.config)
        self.params = dict(params)

    def bucket_for(self, n: int) -> int:
        i = bisect.bisect_left(self.buckets, n)
        if n < 1 or i == len(self.buckets):
            raise ValueError(f"N={n} blocks: must be in [1, {self.buckets[-1]}]")
        return self.buckets[i]

    def warmup(self) -> None:
        """Compile every bucket now (start-up), so serving calls never trace."""
        cfg, dtype = self.config, self.params["w1"].dtype
        for b in self.buckets:
            logits = jnp.zeros((b, cfg.block_size, cfg.vocab_size), dtype)
            h = jnp.zeros((b, cfg.block_size, cfg.hidden_size), dtype)
            ids = jnp.zeros((b,), jnp.int32)
            self._fn(self.params, logits, h, ids, ids, jnp.int32(b)).block_until_ready()

    def __call__(self, logits, h, anchors, prev_ids=None, num_valid=None) -> jax.Array:
        """Refine the first ``num_valid`` blocks; returns [num_valid, B-1] int32.

        Zero-trace path: hand arrays whose N is a bucket size (e.g. a persistent
        buffer) and say how many rows are real with ``num_valid``; the rest are
        masked inside the compiled function. Arrays of any other N are padded
        here first: a copy of logits and h into the bucket's shape (B*V + B*H values
        per block, ~4.7 MB per block at serving shapes), traced once per distinct N.
        """
        n = logits.shape[0]
        num_valid = n if num_valid is None else int(num_valid)
        if not 1 <= num_valid <= n:
            raise ValueError(f"num_valid must be in [1, {n}], got {num_valid}")
        b = self.bucket_for(n)
        anchors = jnp.asarray(anchors, jnp.int32)
        prev_ids = anchors if prev_ids is None else jnp.asarray(prev_ids, jnp.int32)
        if b != n:
            pad = b - n
            logits = jnp.pad(logits, ((0, pad), (0, 0), (0, 0)))
            h = jnp.pad(h, ((0, pad), (0, 0), (0, 0)))
            anchors = jnp.pad(anchors, (0, pad), constant_values=-1)
            prev_ids = jnp.pad(prev_ids, (0, pad), constant_values=-1)
        out = self._fn(self.params, logits, h, anchors, prev_ids, jnp.int32(num_valid))
        return out if num_valid == b else out[:num_valid]
