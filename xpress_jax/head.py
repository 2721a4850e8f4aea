"""The XPress refiner head: the serving form's pure-jnp pieces, and the training form (`XPressHead`).

Serving form (`hidden_input`, `latent`: what `xpress_jax.refine` and the kernels run). Every matmul
takes operands in the params' dtype ``cd`` and accumulates in ``acc`` (float32; float64 for float64
params); elementwise work in the latent pass stays in ``acc``; the hidden cache, ``xh``, the latent
and the readout bias are rounded to ``cd`` (docs/semantics.md).

Training form (`XPressHead`, a Flax NNX module): the parameters as they are trained and checkpointed
(raw mixer, whole ``in_proj``, PyTorch layouts); `XPressHead.to_serving` turns them into serving params.
"""

from __future__ import annotations

from typing import Any, Mapping

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from .config import HeadConfig
from .params import HYBRID_KEY_MAP, Head, params_from_state_dict, source_shapes

__all__ = ["acc_dtype", "acc_dot", "round_to", "hidden_input", "latent", "token_table", "TOKEN_TABLE", "XPressHead",
           "MODULE_PARAM_NAMES"]

Params = Mapping[str, jax.Array]


def acc_dtype(dtype: Any) -> jnp.dtype:
    """Accumulation dtype for a compute dtype: float64 stays float64, else float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def precision_for(dtype: Any) -> jax.lax.Precision | None:
    """HIGHEST for float32/64 operands (no TF32 on GPUs); default for 16-bit operands (whose products are
    exact in float32 anyway, and HIGHEST could pick a slower float32 GEMM)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def round_to(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` rounded to ``dtype`` (to nearest even), a rounding XLA may not skip: XLA on GPUs drops an ``f32 ->
    bf16 -> f32`` pair (``xla_allow_excess_precision``), but keeps ``reduce_precision``."""
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


def acc_dot(a: jax.Array, b: jax.Array, acc: jnp.dtype) -> jax.Array:
    """``a @ b`` accumulated in ``acc`` (the dtype's precision: `precision_for`)."""
    return jnp.matmul(a, b, precision=precision_for(a.dtype), preferred_element_type=acc)


def hidden_cache(params: Params, h: jax.Array, *, pad_rows: int = 0) -> jax.Array:
    """``concat(h @ down_h, mean_slots(h) @ down_g)``: [N, B, H] -> [N, B, 2r] (pass-invariant). ``pad_rows``
    (XLA:GPU, the same values): N < pad_rows rows are zero-padded behind an optimization barrier before the
    dot, so that XLA cannot turn an N = 1 dot into a multiply + reduce."""
    cd = params["w1"].dtype
    acc = acc_dtype(cd)
    n = h.shape[0]
    hh = round_to(acc_dot(h, params["down_h"], acc), cd)  # [N, B, r]
    g = round_to(jnp.mean(h.astype(acc), axis=1), cd)  # [N, H]
    if n < pad_rows:
        g = jax.lax.optimization_barrier(jnp.pad(g, ((0, pad_rows - n), (0, 0))))
    hg = round_to(acc_dot(g, params["down_g"], acc), cd)[:n]  # [N, r]
    return jnp.concatenate([hh, jnp.broadcast_to(hg[:, None, :], hh.shape)], axis=-1)


def hidden_input(params: Params, h: jax.Array, *, pad_rows: int = 0) -> jax.Array:
    """``xh = hidden_cache(h) @ in_proj_hidden``: the pass-invariant half of ``in_proj``, [N, B, r]."""
    cd = params["w1"].dtype
    return round_to(acc_dot(hidden_cache(params, h, pad_rows=pad_rows), params["in_proj_hidden"], acc_dtype(cd)), cd)


#: The params key under which `xpress_jax.refine` hands a `token_table` to `latent` (users pass ``token_table=``).
TOKEN_TABLE = "token_table"


def token_table(params: Params | Head) -> jax.Array:
    """``w1 @ in_proj_token`` for every vocab id: [V, r] in the accumulation dtype, once per set of weights:
    `latent` reads ``table[prev]`` instead of a gather and a small GEMM every pass (the same sums; three
    kernels fewer per pass on a GPU: docs/performance.md). Pass it as ``refine(..., token_table=...)``
    (`RefineServer` keeps one); V * r * 4 bytes; it must come from the very weights passed to refine."""
    params = params.params if isinstance(params, Head) else params
    return acc_dot(params["w1"], params["in_proj_token"], acc_dtype(params["w1"].dtype))


def latent(params: Params, xh: jax.Array, prev: jax.Array, *, terms: bool = False, barrier: bool = False):
    """One pass's latents for the draft slots: [N, B, r], [N, B] int -> [N, B-1, r]: ``x = xh + w1[prev] @
    in_proj_token``, ``u[n,k,c] = sum_j mix[k,j,c] x[n,j,c]``, ``lat = u + down(silu(u @ gate) * (u @ up))``.
    ``prev`` must be valid indices (callers clamp); ``params[TOKEN_TABLE]`` (added by `xpress_jax.refine`)
    replaces ``w1[prev] @ in_proj_token`` by ``table[prev]``. ``terms=True`` returns ``(u, d)`` before their
    sum (the latent is ``round_to(u + d, dtype)``, which the top-C pick kernel forms as it loads them).
    ``barrier=True``: ``u`` behind an optimization barrier (the same values; XLA:GPU computes the gather and
    the mixer once instead of inside the residual's fusion)."""
    cd = params["w1"].dtype
    acc = acc_dtype(cd)
    table = params.get(TOKEN_TABLE)
    if table is not None:
        x = xh.astype(acc) + jnp.take(table, prev, axis=0, mode="clip")  # [N, B, r]
    else:
        e = jnp.take(params["w1"], prev, axis=0, mode="clip")  # [N, B, r]
        x = xh.astype(acc) + acc_dot(e, params["in_proj_token"], acc)
    u = jnp.einsum("kjc,njc->nkc", params["mix"].astype(acc), x, precision=precision_for(acc))[:, 1:]
    uc = round_to(u, cd)
    if barrier:
        u, uc = jax.lax.optimization_barrier((u, uc))
    gate, up = acc_dot(uc, params["mlp_gate"], acc), acc_dot(uc, params["mlp_up"], acc)
    act = round_to(jax.nn.silu(gate) * up, cd)
    d = acc_dot(act, params["mlp_down"], acc)
    return (u, d) if terms else round_to(u + d, cd)


#: `XPressHead` attribute -> its checkpoint name in `HYBRID_KEY_MAP` (one to one, PyTorch layouts).
MODULE_PARAM_NAMES = {("mix_L" if target == "__raw_mix_L__" else target.removesuffix(".weight")): source
                      for source, target in HYBRID_KEY_MAP.items()}


def _check_static_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} must be a static Python int, got a traced value; under jit mark it static: "
                        "nnx.jit(XPressHead.refine, static_argnames=('num_passes', 'topc'))")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class XPressHead(nnx.Module):
    """The XPress refiner head in training form: a Flax NNX module.

    Its params are the checkpoint's tensors one to one, in PyTorch layouts (`MODULE_PARAM_NAMES`:
    attribute -> `HYBRID_KEY_MAP` name; ``in_proj`` whole, ``mix_L`` raw); `state_dict` returns them under
    those names. `__call__` scores the draft slots (``base + bias``; teacher-forced: what training fits),
    `refine` runs K greedy Jacobi passes, and `to_serving` builds the serving `xpress_jax.Head` with the code
    that loads a converted checkpoint, so ``xpress_jax.refine(head.to_serving(), ...)`` gives `refine`'s
    tokens. The pass is docs/semantics.md's training form: the mixer as ``u = x + (raw_L * tril) x``.
    Matmul operands in the params' dtype, accumulation and activations in float32 (float64 for float64).

    ``std=None`` (default) is the training init: normal weights scaled by 1/sqrt(fan in) (``w1``: std 1);
    ``w2``, ``mlp_down`` and the raw mixer's causal part zero, so a fresh head leaves the drafter's tokens
    unchanged. A float: every param normal with that std (a random head that changes tokens).
    """

    def __init__(self, config: HeadConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32,
                 std: float | None = None):
        if not isinstance(config, HeadConfig):
            raise TypeError(f"config must be a HeadConfig, got {type(config).__name__}")
        if config.reduced:
            raise ValueError(f"XPressHead trains heads over the whole vocabulary; draft_vocab_size="
                             f"{config.draft_vocab_size} < vocab_size={config.vocab_size} (a reduced head, as "
                             "speculators trains them) is served from a converted checkpoint (xpress-convert)")
        param_dtype = jnp.dtype(param_dtype)
        if not jnp.issubdtype(param_dtype, jnp.floating):
            raise TypeError(f"param_dtype must be a floating dtype, got {param_dtype}")
        if std is not None and not (isinstance(std, (int, float)) and std > 0):
            raise ValueError(f"std must be None (training init) or a float > 0, got {std!r}")
        self.config = config
        shapes = source_shapes(config)
        zero = ("w2", "mlp_down", "mix_L")
        for attr, source in MODULE_PARAM_NAMES.items():
            shape = shapes[source]
            if std is None and attr == "mix_L":
                # Zero causal part; small noise in the masked upper triangle, so that `xpress-convert
                # --mixer auto` (which looks for a zero upper triangle) never takes it for a folded mixer.
                B = shape[-1]
                upper = jnp.triu(jnp.ones((B, B), jnp.float32), 1)
                value = jax.random.normal(rngs.params(), shape, jnp.float32) * 0.02 * upper
            elif std is None and attr in zero:
                value = jnp.zeros(shape, jnp.float32)
            else:
                scale = std if std is not None else (1.0 if attr == "w1" else shape[-1] ** -0.5)
                value = jax.random.normal(rngs.params(), shape, jnp.float32) * scale
            setattr(self, attr, nnx.Param(value.astype(param_dtype)))

    # ------------------------------------------------------------------ forward pass
    @property
    def dtype(self) -> jnp.dtype:
        """The params' dtype."""
        return jnp.dtype(self.w1[...].dtype)

    def _mm(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """``x @ w.T`` (``w`` in PyTorch's [out, in] layout): operands in the params' dtype, accumulated wide."""
        cd = w.dtype
        return jnp.matmul(x.astype(cd), w.T, precision=precision_for(cd), preferred_element_type=acc_dtype(cd))

    def hidden_cache(self, h: jax.Array) -> jax.Array:
        """``concat(down_h(h), down_g(mean_slots(h)))``: [N, B, H] -> [N, B, 2r] (pass-invariant)."""
        hh = self._mm(h, self.down_h[...])
        hg = self._mm(jnp.mean(h.astype(acc_dtype(self.dtype)), axis=1), self.down_g[...])  # [N, r]
        return jnp.concatenate([hh, jnp.broadcast_to(hg[:, None, :], hh.shape)], axis=-1)

    def latents(self, hcache: jax.Array, prev: jax.Array) -> jax.Array:
        """Latents of every slot: [N, B, 2r] hidden cache, [N, B] int prev tokens (``prev[:, 0]``: the token
        before the anchor, ``prev[:, b]``: the token in slot ``b-1``) -> [N, B, r]."""
        acc = acc_dtype(self.dtype)
        e = jnp.take(self.w1[...], prev, axis=0, mode="clip").astype(acc)  # [N, B, r]
        x = self._mm(jnp.concatenate([hcache, e], axis=-1), self.in_proj[...])  # [N, B, r]
        B = x.shape[1]
        causal = self.mix_L[...].astype(acc) * jnp.tril(jnp.ones((B, B), acc))  # [r, B, B]
        u = x + jnp.einsum("ckj,njc->nkc", causal, x, precision=precision_for(acc))
        act = jax.nn.silu(self._mm(u, self.mlp_gate[...])) * self._mm(u, self.mlp_up[...])
        return u + self._mm(act, self.mlp_down[...])

    def bias(self, lat: jax.Array) -> jax.Array:
        """The readout ``lat @ w2.T``: [..., r] -> [..., V] (accumulation dtype)."""
        return self._mm(lat, self.w2[...])

    @staticmethod
    def prev_tokens(blk: jax.Array, prev_ids: jax.Array) -> jax.Array:
        """[N, B] block (slot 0 = anchor), [N] token before the anchor -> [N, B] each slot's predecessor."""
        return jnp.concatenate([prev_ids[:, None], blk[:, :-1]], axis=1).astype(jnp.int32)

    def __call__(self, logits: jax.Array, h: jax.Array, prev: jax.Array) -> jax.Array:
        """Scores of the draft slots, ``base + bias``, in the accumulation dtype: [N, B, V], [N, B, H], [N, B]
        int -> [N, B-1, V]. ``prev`` as in `latents`; teacher forcing: ``prev_tokens(target_block, prev_ids)``."""
        lat = self.latents(self.hidden_cache(h), prev)[:, 1:]
        return logits[:, 1:].astype(acc_dtype(self.dtype)) + self.bias(lat)

    def refine(self, logits: jax.Array, h: jax.Array, anchors: jax.Array, prev_ids: jax.Array | None = None, *,
               num_passes: int, topc: int = 0) -> jax.Array:
        """K >= 0 greedy Jacobi passes from ``[anchor, argmax base]``: [N, B-1] int32 draft tokens. ``topc=0``:
        argmax over the vocabulary (lowest id on ties); ``topc=C``: over each slot's C largest base logits
        in ``lax.top_k``'s order. Both are static under jit."""
        num_passes = _check_static_int("num_passes", num_passes, 0)
        topc = _check_static_int("topc", topc, 0)
        N, B, V = logits.shape
        if topc > V:
            raise ValueError(f"topc must be in [0, vocab_size={V}], got {topc}")
        anchors = jnp.asarray(anchors).astype(jnp.int32)
        if prev_ids is None and self.config.predecessor == "previous":
            raise ValueError("prev_ids is required: this head is trained with the real token before the anchor in "
                             "slot 0 (config.predecessor='previous'); pass prev_ids=anchors for vLLM's behaviour")
        prev_ids = anchors if prev_ids is None else jnp.asarray(prev_ids).astype(jnp.int32)
        acc = acc_dtype(self.dtype)
        base = logits[:, 1:].astype(acc)  # [N, B-1, V]
        hcache = self.hidden_cache(h)
        if topc:
            base_c, cand = jax.lax.top_k(base, topc)  # [N, B-1, C]
            w2c = jnp.take(self.w2[...], cand, axis=0)  # [N, B-1, C, r]
        blk = jnp.concatenate([anchors[:, None], jnp.argmax(base, axis=-1).astype(jnp.int32)], axis=1)
        for _ in range(num_passes):
            lat = self.latents(hcache, self.prev_tokens(blk, prev_ids))[:, 1:]  # [N, B-1, r]
            if topc:
                s = base_c + jnp.einsum("nbr,nbcr->nbc", lat.astype(w2c.dtype), w2c,
                                        precision=precision_for(w2c.dtype), preferred_element_type=acc)
                pick = jnp.take_along_axis(cand, jnp.argmax(s, axis=-1)[..., None], axis=-1)[..., 0]
            else:
                pick = jnp.argmax(base + self.bias(lat), axis=-1)
            blk = blk.at[:, 1:].set(pick.astype(jnp.int32))
        return blk[:, 1:]

    # ------------------------------------------------------------------ export
    def state_dict(self) -> dict[str, jax.Array]:
        """The params under their checkpoint names (`HYBRID_KEY_MAP` keys, PyTorch layouts, raw ``mix.L``)."""
        return {source: getattr(self, attr)[...] for attr, source in MODULE_PARAM_NAMES.items()}

    def to_serving(self, config: HeadConfig | None = None, *, dtype: Any = None) -> Head:
        """The serving `xpress_jax.Head` (folded mixer, split ``in_proj``), built by `params_from_state_dict`
        from `state_dict`. ``config`` (default: the module's) may change ``topc``, ``num_passes`` and
        ``max_num_reqs``, not the sizes; ``dtype`` casts (default: the params' dtype)."""
        config = self.config if config is None else config
        if not isinstance(config, HeadConfig):
            raise TypeError(f"config must be a HeadConfig, got {type(config).__name__}")
        sizes = ("vocab_size", "hidden_size", "block_size", "rank", "mlp_hidden")
        bad = [f"{f}={getattr(config, f)} (the module has {getattr(self.config, f)})"
               for f in sizes if getattr(config, f) != getattr(self.config, f)]
        if bad:
            raise ValueError("to_serving: config sizes differ from the module's: " + ", ".join(bad))
        return Head(config, params_from_state_dict(self.state_dict(), config, dtype=dtype))
