"""The XPress refiner head in serving form: pure-jnp pieces and the Flax module.

Precision (matches the reference's fused path): every matmul takes operands in
the params' dtype ``cd`` and accumulates in ``acc`` (float32, or float64 for
float64 params); elementwise work inside the latent pass stays in ``acc``; the
hidden cache, ``xh``, the latent and the readout bias are rounded to ``cd``.
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import HeadConfig
from .params import PARAM_NAMES, fold_causal_mixer, param_shapes

__all__ = ["acc_dtype", "round_to", "hidden_input", "latent", "XPressHead"]

Params = Mapping[str, jax.Array]


def acc_dtype(dtype: Any) -> jnp.dtype:
    """Accumulation dtype for a compute dtype: float64 stays float64, else float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def precision_for(dtype: Any) -> jax.lax.Precision | None:
    """HIGHEST for float32/64 operands (no TF32 on GPUs); default for 16-bit operands.

    HIGHEST on bf16 operands can make XLA pick a slower float32 GEMM; bf16 products
    are exact in float32 anyway.
    """
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def round_to(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` rounded to ``dtype`` (round to nearest even), a rounding XLA may not skip.

    A plain ``x.astype(bf16)`` whose result is converted back to float32 later (inside a
    fusion, or by XLA's own bf16 normalisation) is an ``f32 -> bf16 -> f32`` pair that XLA
    on GPUs removes by default (``xla_allow_excess_precision``): the value is then never
    rounded, and near-tied tokens can differ from the reference. ``reduce_precision`` to
    the target format first is kept by XLA and makes the rounding real on every backend.
    """
    dtype = jnp.dtype(dtype)
    if jnp.dtype(x.dtype) == dtype:
        return x
    fi, src = jnp.finfo(dtype), jnp.finfo(x.dtype)
    y = jax.lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    if fi.nexp < src.nexp:
        # reduce_precision flushes the target's subnormals to zero (float16: |x| < 2^-14); those
        # lie on a fixed grid of 2^(minexp - nmant), where rounding half to even is exact.
        q = jnp.asarray(2.0 ** (int(fi.minexp) - int(fi.nmant)), x.dtype)
        y = jnp.where(jnp.abs(x) < jnp.asarray(fi.tiny, x.dtype), jnp.round(x / q) * q, y)
    return y.astype(dtype)


def _dot(a: jax.Array, b: jax.Array, acc: jnp.dtype) -> jax.Array:
    return jnp.matmul(a, b, precision=precision_for(a.dtype), preferred_element_type=acc)


def hidden_cache(params: Params, h: jax.Array) -> jax.Array:
    """``concat(h @ down_h, mean_slots(h) @ down_g)``: [N, B, H] -> [N, B, 2r] (pass-invariant)."""
    cd = params["w1"].dtype
    acc = acc_dtype(cd)
    hh = round_to(_dot(h, params["down_h"], acc), cd)  # [N, B, r]
    g = round_to(jnp.mean(h.astype(acc), axis=1), cd)  # [N, H]
    hg = round_to(_dot(g, params["down_g"], acc), cd)  # [N, r]
    return jnp.concatenate([hh, jnp.broadcast_to(hg[:, None, :], hh.shape)], axis=-1)


def hidden_input(params: Params, h: jax.Array) -> jax.Array:
    """``xh = hidden_cache(h) @ in_proj_hidden``: the pass-invariant half of ``in_proj``, [N, B, r]."""
    cd = params["w1"].dtype
    return round_to(_dot(hidden_cache(params, h), params["in_proj_hidden"], acc_dtype(cd)), cd)


def latent(params: Params, xh: jax.Array, prev: jax.Array) -> jax.Array:
    """One pass's latents for the draft slots: [N, B, r], [N, B] int -> [N, B-1, r].

    ``x = xh + w1[prev] @ in_proj_token``; ``u[n,k,c] = sum_j mix[k,j,c] x[n,j,c]``
    (causal: mix is lower-triangular in (k, j)); ``lat = u + down(silu(u @ gate) * (u @ up))``.
    ``prev`` must already be a valid index (callers clamp).
    """
    cd = params["w1"].dtype
    acc = acc_dtype(cd)
    e = jnp.take(params["w1"], prev, axis=0, mode="clip")  # [N, B, r]
    x = xh.astype(acc) + _dot(e, params["in_proj_token"], acc)
    u = jnp.einsum("kjc,njc->nkc", params["mix"].astype(acc), x, precision=precision_for(acc))[:, 1:]
    uc = round_to(u, cd)
    gate = _dot(uc, params["mlp_gate"], acc)
    up = _dot(uc, params["mlp_up"], acc)
    act = round_to(jax.nn.silu(gate) * up, cd)
    return round_to(u + _dot(act, params["mlp_down"], acc), cd)


class XPressHead(nn.Module):
    """Flax (linen) form of the head; its ``params`` collection is the documented pytree.

    ``XPressHead(cfg).init(key, logits, h, anchors)["params"]`` has the same names,
    shapes and layouts as `init_params`; ``apply`` runs `refine` with the
    config's ``num_passes`` and ``topc``.
    """

    config: HeadConfig
    dtype: Any = jnp.float32
    std: float = 0.02

    def setup(self) -> None:
        shapes = param_shapes(self.config)
        normal = nn.initializers.normal(self.std)

        def mix_init(key, shape, dtype):
            B, _, r = shape
            raw = jax.random.normal(key, (r, B, B), jnp.float32) * self.std
            return jnp.transpose(fold_causal_mixer(raw.astype(dtype)), (1, 2, 0))

        self.p = {
            name: self.param(name, mix_init if name == "mix" else normal, shapes[name], self.dtype)
            for name in PARAM_NAMES
        }

    def hidden_input(self, h: jax.Array) -> jax.Array:
        return hidden_input(self.p, h)

    def latent(self, xh: jax.Array, prev: jax.Array) -> jax.Array:
        return latent(self.p, xh, prev)

    def __call__(self, logits, h, anchors, prev_ids=None, **kwargs):
        from .refine import refine

        kwargs.setdefault("config", self.config)
        return refine(dict(self.p), logits, h, anchors, prev_ids, **kwargs)
