"""The head's parameters: names, shapes, layouts, initialisation and loading.

Params are a plain dict pytree in serving form (mixer folded, matrices laid out for ``x @ W``), all of
one floating dtype. With V vocab, H hidden, B block, r rank, M mlp hidden (PyTorch source names as in
`HYBRID_KEY_MAP`):

=================  =========  =====================================================================
``w1``             [V, r]     token embedding (``w1.weight``)
``down_h``         [H, r]     per-slot hidden projection (``down_h.weight``.T)
``down_g``         [H, r]     block-mean hidden projection (``down_g.weight``.T)
``in_proj_hidden`` [2r, r]    ``in_proj.weight[:, :2r].T``: on the hidden cache, once per call
``in_proj_token``  [r, r]     ``in_proj.weight[:, 2r:].T``: on ``w1[prev]``, every pass
``mix``            [B, B, r]  folded causal mixer ``mix[k, j, c] = Lf[c, k, j]``, ``Lf = raw * tril + I``
``mlp_gate``/``up`` [r, M]    ``mlp.{gate,up}_proj.weight``.T
``mlp_down``       [M, r]     ``mlp.down_proj.weight``.T
``w2``             [V, r]     readout (``w2.weight``): bias = lat @ w2.T
=================  =========  =====================================================================
"""

from __future__ import annotations

import collections
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import HeadConfig

__all__ = ["Head", "init_head", "HYBRID_KEY_MAP", "PARAM_NAMES", "param_shapes", "init_params", "fold_causal_mixer",
           "params_from_state_dict", "check_params", "config_from_params"]

#: Source (checkpoint) name -> the reference module's attribute; "__raw_mix_L__": the raw mixer, folded on load.
HYBRID_KEY_MAP = {
    "w1.weight": "w1.weight",
    "down_h.weight": "down_h.weight",
    "down_g.weight": "down_g.weight",
    "in_proj.weight": "in_proj.weight",
    "mix.L": "__raw_mix_L__",
    "mlp.gate_proj.weight": "mlp_gate.weight",
    "mlp.up_proj.weight": "mlp_up.weight",
    "mlp.down_proj.weight": "mlp_down.weight",
    "w2.weight": "w2.weight",
}

PARAM_NAMES = ("w1", "down_h", "down_g", "in_proj_hidden", "in_proj_token", "mix", "mlp_gate", "mlp_up", "mlp_down",
               "w2")


def _shapes(V: int, H: int, B: int, r: int, M: int) -> dict[str, tuple[int, ...]]:
    return {"w1": (V, r), "down_h": (H, r), "down_g": (H, r), "in_proj_hidden": (2 * r, r), "in_proj_token": (r, r),
            "mix": (B, B, r), "mlp_gate": (r, M), "mlp_up": (r, M), "mlp_down": (M, r), "w2": (V, r)}


def param_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every param for ``config`` (see the module docstring)."""
    c = config
    return _shapes(c.vocab_size, c.hidden_size, c.block_size, c.rank, c.mlp_hidden)


def source_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every source tensor (HYBRID_KEY_MAP names, PyTorch layouts)."""
    V, H, B, r, M = config.vocab_size, config.hidden_size, config.block_size, config.rank, config.mlp_hidden
    return {"w1.weight": (V, r), "down_h.weight": (r, H), "down_g.weight": (r, H), "in_proj.weight": (r, 3 * r),
            "mix.L": (r, B, B), "mlp.gate_proj.weight": (M, r), "mlp.up_proj.weight": (M, r),
            "mlp.down_proj.weight": (r, M), "w2.weight": (V, r)}


def fold_causal_mixer(raw_L: Any) -> jax.Array:
    """Serving form of the causal mixer: ``raw_L * tril + I`` ([r, B, B] -> [r, B, B]).

    Training computes ``x + (raw_L * tril) @ x`` per rank channel; the folded matrix gives the same
    result as one product ``Lf @ x``. Formed in ``raw_L``'s dtype, as the reference does.
    """
    raw = jnp.asarray(raw_L)
    if raw.ndim != 3 or raw.shape[1] != raw.shape[2]:
        raise ValueError(f"raw_L must have shape [r, B, B], got {raw.shape}")
    B = raw.shape[-1]
    return raw * jnp.tril(jnp.ones((B, B), raw.dtype)) + jnp.eye(B, dtype=raw.dtype)


def _fold_np(raw: np.ndarray) -> np.ndarray:
    """NumPy twin of `fold_causal_mixer` (exact: the sum is formed in float64, rounded once)."""
    B = raw.shape[-1]
    return (raw.astype(np.float64) * np.tril(np.ones((B, B))) + np.eye(B)).astype(raw.dtype)


@jax.tree_util.register_pytree_node_class
class Head:
    """A head's params together with the `HeadConfig` that sizes them (sizes, C, K, max N).

    A registered pytree: the params dict is its only child and the frozen config is static aux data,
    so under ``jax.jit`` new weights with the same config never retrace. ``refine(head, logits, h,
    anchors)`` takes ``num_passes``, ``topc`` and ``max_num_reqs`` from ``head.config`` (explicit
    keywords win). It unpacks as ``config, params = head``. Build one with ``Head(config, params)``
    (checked), `init_head` or `xpress_jax.load_params`; treat it as immutable.
    """

    __slots__ = ("config", "params")

    def __init__(self, config: HeadConfig, params: Mapping[str, Any]):
        if not isinstance(config, HeadConfig):
            raise TypeError(f"Head(config, params): config must be a HeadConfig, got {type(config).__name__}")
        check_params(params, config)
        self.config = config
        self.params = dict(params)

    def tree_flatten(self):
        return (self.params,), self.config

    @classmethod
    def tree_unflatten(cls, config, children):
        # No checks here: JAX unflattens with tracers, ShapeDtypeStructs, shardings, None, ...
        head = object.__new__(cls)
        head.config = config
        head.params = children[0]
        return head

    @property
    def dtype(self) -> jnp.dtype:
        """The params' (common) dtype."""
        return jnp.dtype(self.params["w1"].dtype)

    def astype(self, dtype: Any) -> "Head":
        """The same head with every param cast to ``dtype``."""
        return Head(self.config, {k: v.astype(dtype) for k, v in self.params.items()})

    def __iter__(self):
        return iter((self.config, self.params))

    def __getitem__(self, i: int):
        if isinstance(i, str):
            raise KeyError(f"{i!r}: a Head is (config, params); index its params: head.params[{i!r}]")
        return (self.config, self.params)[i]

    def __repr__(self) -> str:
        dtype = getattr(self.params.get("w1"), "dtype", "?")  # "?": unflattened with non-array leaves
        return f"Head({self.config!r}, params=<{len(self.params)} arrays, {dtype}>)"


def init_head(config: HeadConfig, key: jax.Array, dtype: Any = jnp.float32, *, std: float = 0.02,
              mix_std: float | None = None) -> Head:
    """`init_params` wrapped with its config: a `Head` that `refine` runs without ``config=``."""
    return Head(config, init_params(config, key, dtype, std=std, mix_std=mix_std))


def init_params(config: HeadConfig, key: jax.Array, dtype: Any = jnp.float32, *, std: float = 0.02,
                mix_std: float | None = None) -> dict[str, jax.Array]:
    """Random params in serving form: normal(0, std) weights, a folded random mixer (``mix_std``,
    default ``std``, scales the raw one). A larger ``std`` changes more of the drafter's tokens."""
    if not isinstance(config, HeadConfig):
        raise TypeError(f"config must be a HeadConfig, got {type(config).__name__}")
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    shapes = param_shapes(config)
    keys = dict(zip(PARAM_NAMES, jax.random.split(key, len(PARAM_NAMES))))
    params = {n: (jax.random.normal(keys[n], shapes[n], jnp.float32) * std).astype(dtype) for n in PARAM_NAMES}
    raw = jax.random.normal(keys["mix"], (config.rank, config.block_size, config.block_size), jnp.float32)
    raw = raw * (std if mix_std is None else mix_std)
    params["mix"] = jnp.transpose(fold_causal_mixer(raw.astype(dtype)), (1, 2, 0))
    return params


def _to_numpy(t: Any) -> np.ndarray:
    """NumPy view of a numpy/JAX/torch tensor; torch bf16 goes through an int16 view."""
    if hasattr(t, "detach") and hasattr(t, "numpy"):  # torch.Tensor, without importing torch
        t = t.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            import torch  # only reached when the caller already holds torch tensors

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(t)


def params_from_state_dict(tensors: Mapping[str, Any], config: HeadConfig, *, dtype: Any = None,
                           prefix: str = "") -> dict[str, jax.Array]:
    """Serving params from the head's source tensors (`HYBRID_KEY_MAP` names, PyTorch layouts; numpy,
    JAX or torch arrays; ``mix.L`` raw, folded once here).

    ``dtype`` (default: the source's common dtype) is the params' dtype. Missing, unexpected and
    mis-shaped keys are all reported by name in one ``ValueError``. ``prefix`` (e.g. ``"xpress_head."``,
    where a vLLM drafter checkpoint keeps the head): only keys that start with it are read, without
    it; other keys (the backbone) are ignored. Without it, keys that look prefixed get a hint naming
    the prefix to pass. Returns the plain dict (``Head(config, params)`` pairs it with its config).
    """
    if not isinstance(config, HeadConfig):
        raise TypeError(f"config must be a HeadConfig, got {type(config).__name__}")
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name -> array, got {type(tensors).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    given = list(tensors)
    if prefix:
        tensors = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    expected = source_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    arrays = {k: _to_numpy(tensors[k]) for k in expected if k in tensors}
    bad_shape = [f"{k}: expected {expected[k]}, got {tuple(a.shape)}" for k, a in arrays.items()
                 if tuple(a.shape) != expected[k]]
    bad_dtype = [f"{k}: {a.dtype}" for k, a in arrays.items()
                 if not (np.issubdtype(a.dtype, np.floating) or a.dtype == ml_dtypes.bfloat16)]
    problems = [f"{what}: {items}" for what, items in (("missing keys", missing), ("unexpected keys", extra)) if items]
    problems += [f"{what}: {'; '.join(items)}" for what, items in
                 (("shape mismatch", bad_shape), ("non-floating tensors", bad_dtype)) if items]
    if problems:
        raise ValueError("params_from_state_dict: " + " | ".join(problems) + _prefix_hint(missing, given, prefix))
    if dtype is None:
        dtypes = {a.dtype for a in arrays.values()}
        if len(dtypes) != 1:
            raise ValueError(f"source tensors have mixed dtypes {sorted(map(str, dtypes))}; pass dtype= explicitly")
        dtype = dtypes.pop()
    dtype = jnp.dtype(dtype)
    r, a = config.rank, arrays
    out = {"w1": a["w1.weight"], "down_h": a["down_h.weight"].T, "down_g": a["down_g.weight"].T,
           "in_proj_hidden": a["in_proj.weight"][:, : 2 * r].T, "in_proj_token": a["in_proj.weight"][:, 2 * r :].T,
           "mix": _fold_np(a["mix.L"]).transpose(1, 2, 0), "mlp_gate": a["mlp.gate_proj.weight"].T,
           "mlp_up": a["mlp.up_proj.weight"].T, "mlp_down": a["mlp.down_proj.weight"].T, "w2": a["w2.weight"]}
    return {k: jnp.asarray(np.ascontiguousarray(v).astype(dtype)) for k, v in out.items()}


def _prefix_hint(missing: list[str], keys: list[str], prefix: str) -> str:
    """When the given keys are the missing names behind a common prefix: say which prefix to pass."""
    found = collections.Counter(k[: len(k) - len(name)] for k in keys for name in missing
                                if k.endswith("." + name) and k != prefix + name)
    if not found:
        return ""
    best = max(found, key=lambda p: (found[p], -len(p)))
    return (f". The head's keys carry the prefix {best!r}: pass prefix={best!r} "
            "(keys without it, e.g. the drafter's backbone, are then ignored)")


def config_from_params(params: Mapping[str, Any], **kwargs: Any) -> HeadConfig:
    """The `HeadConfig` implied by the params' shapes (``kwargs`` set topc etc.)."""
    check_params(params)
    V, r = params["w1"].shape
    H = params["down_h"].shape[0]
    B = params["mix"].shape[0]
    M = params["mlp_gate"].shape[1]
    return HeadConfig(vocab_size=V, hidden_size=H, block_size=B, rank=r, mlp_hidden=M, **kwargs)


def check_params(params: Mapping[str, Any], config: HeadConfig | None = None) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first bad param (name, shape or dtype). Shapes are
    checked against ``config`` when given, else against each other; no values are read."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of arrays, got {type(params).__name__}")
    missing = [k for k in PARAM_NAMES if k not in params]
    extra = sorted(set(params) - set(PARAM_NAMES))
    if missing or extra:
        raise ValueError(f"params: missing {missing}, unexpected {extra}")
    for k in PARAM_NAMES:
        if not hasattr(params[k], "shape") or not hasattr(params[k], "dtype"):
            raise TypeError(f"params[{k!r}] must be an array, got {type(params[k]).__name__}")
    if config is None:
        if len(params["w1"].shape) != 2:
            raise ValueError(f"params['w1'] must be [V, r], got shape {params['w1'].shape}")
        V, r = params["w1"].shape
        H = params["down_h"].shape[0] if len(params["down_h"].shape) == 2 else -1
        B = params["mix"].shape[0] if len(params["mix"].shape) == 3 else -1
        M = params["mlp_gate"].shape[1] if len(params["mlp_gate"].shape) == 2 else -1
        expected = _shapes(V, H, B, r, M)
    else:
        expected = param_shapes(config)
    for k in PARAM_NAMES:
        if tuple(params[k].shape) != expected[k]:
            raise ValueError(f"params[{k!r}] has shape {tuple(params[k].shape)}, expected {expected[k]}")
    dtype = jnp.dtype(params["w1"].dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"params must be floating, params['w1'] is {dtype}")
    for k in PARAM_NAMES:
        if jnp.dtype(params[k].dtype) != dtype:
            raise TypeError(f"params[{k!r}] has dtype {jnp.dtype(params[k].dtype)}, but params['w1'] is {dtype}; "
                            "all params must share one dtype")
