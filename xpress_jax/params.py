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
``w2``             [Vd, r]    readout (``w2.weight``): bias = lat @ w2.T; Vd = the draft vocabulary (V unless reduced)
``d2t``            [Vd] int32 reduced heads only: verifier id = draft id + d2t[draft id] (speculators' map)
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

__all__ = ["Head", "init_head", "HYBRID_KEY_MAP", "PARAM_NAMES", "VOCAB_MAP", "param_names", "param_shapes",
           "init_params", "fold_causal_mixer", "params_from_state_dict", "check_params", "check_vocab_map",
           "to_verifier_ids", "config_from_params", "to_numpy"]

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

#: The int32 param of a reduced head ([V_draft]): verifier id = draft id + d2t[draft id].
VOCAB_MAP = "d2t"


def param_names(config: HeadConfig) -> tuple[str, ...]:
    """The params a head of ``config`` holds: `PARAM_NAMES`, and `VOCAB_MAP` when its draft vocabulary is reduced."""
    return PARAM_NAMES + ((VOCAB_MAP,) if config.reduced else ())


def _shapes(V: int, H: int, B: int, r: int, M: int, Vd: int | None = None) -> dict[str, tuple[int, ...]]:
    Vd = V if Vd is None else Vd
    return {"w1": (V, r), "down_h": (H, r), "down_g": (H, r), "in_proj_hidden": (2 * r, r), "in_proj_token": (r, r),
            "mix": (B, B, r), "mlp_gate": (r, M), "mlp_up": (r, M), "mlp_down": (M, r), "w2": (Vd, r),
            **({VOCAB_MAP: (Vd,)} if Vd != V else {})}


def param_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every param for ``config`` (see the module docstring; ``d2t`` only for a reduced head)."""
    c = config
    return _shapes(c.vocab_size, c.hidden_size, c.block_size, c.rank, c.mlp_hidden, c.draft_vocab_size)


def source_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every source tensor (HYBRID_KEY_MAP names, PyTorch layouts; a reduced head's ``d2t`` too)."""
    V, H, B, r, M = config.vocab_size, config.hidden_size, config.block_size, config.rank, config.mlp_hidden
    Vd = config.draft_vocab_size
    return {"w1.weight": (V, r), "down_h.weight": (r, H), "down_g.weight": (r, H), "in_proj.weight": (r, 3 * r),
            "mix.L": (r, B, B), "mlp.gate_proj.weight": (M, r), "mlp.up_proj.weight": (M, r),
            "mlp.down_proj.weight": (r, M), "w2.weight": (Vd, r), **({VOCAB_MAP: (Vd,)} if config.reduced else {})}


def to_verifier_ids(tok: jax.Array, d2t: jax.Array | None) -> jax.Array:
    """Draft ids -> verifier ids, ``tok + d2t[tok]`` (``d2t`` None: a head without a reduced vocabulary, the ids
    as they are)."""
    if d2t is None:
        return tok
    return tok + jnp.take(d2t, tok, axis=0, mode="clip").astype(tok.dtype)


def check_vocab_map(d2t: Any, vocab_size: int, t2d: Any = None) -> np.ndarray:
    """Validate a reduced head's draft-to-verifier map (concrete values): every mapped id ``i + d2t[i]`` in
    [0, vocab_size), no two draft ids on one verifier id, and, with speculators' ``t2d`` [V] bool, ``t2d.sum() ==
    V_draft`` and ``t2d`` true exactly at the mapped ids. Returns ``d2t`` as int32; raises ValueError naming the
    problem."""
    a = to_numpy(d2t)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"d2t must be a 1-d integer array [V_draft], got shape {a.shape} dtype {a.dtype}")
    mapped = np.arange(a.size, dtype=np.int64) + a.astype(np.int64)
    bad = np.nonzero((mapped < 0) | (mapped >= vocab_size))[0]
    if bad.size:
        raise ValueError(f"d2t maps draft ids {bad[:8].tolist()} to verifier ids {mapped[bad[:8]].tolist()}, outside "
                         f"[0, {vocab_size})")
    uniq, counts = np.unique(mapped, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1][:8].tolist()
        raise ValueError(f"d2t maps two draft ids to one verifier id (verifier ids {dup}); a draft vocabulary is a "
                         "subset of the verifier's, each id once")
    if t2d is not None:
        t = to_numpy(t2d).astype(bool)
        if t.shape != (vocab_size,):
            raise ValueError(f"t2d must have shape ({vocab_size},) (the verifier's vocabulary), got {t.shape}")
        if int(t.sum()) != a.size:
            raise ValueError(f"t2d marks {int(t.sum())} verifier ids, but d2t has {a.size} draft ids")
        if not t[mapped].all():
            raise ValueError("t2d and d2t disagree: t2d is false at verifier ids that d2t maps to")
    return a.astype(np.int32)


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
        """The same head with every floating param cast to ``dtype`` (``d2t`` stays int32)."""
        return Head(self.config, {k: v if k == VOCAB_MAP else v.astype(dtype) for k, v in self.params.items()})

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
    """`init_params` wrapped with its config: a `Head` that `refine` runs without ``config=``. ``key``: a
    `jax.random.key` or an int seed."""
    return Head(config, init_params(config, key, dtype, std=std, mix_std=mix_std))


def init_params(config: HeadConfig, key: jax.Array, dtype: Any = jnp.float32, *, std: float = 0.02,
                mix_std: float | None = None) -> dict[str, jax.Array]:
    """Random params in serving form: normal(0, std) weights, a folded random mixer (``mix_std``,
    default ``std``, scales the raw one). A larger ``std`` changes more of the drafter's tokens. ``key``: a
    `jax.random.key` (or a raw ``jax.random.PRNGKey``), or an int seed as ``nnx.Rngs(0)`` takes. A reduced head
    (``config.draft_vocab_size < vocab_size``) gets a random ``d2t``: V_draft distinct verifier ids, ascending."""
    if not isinstance(config, HeadConfig):
        raise TypeError(f"config must be a HeadConfig, got {type(config).__name__}")
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        key = jax.random.key(int(key))
    elif not (hasattr(key, "dtype") and (jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                                          or (key.dtype == jnp.uint32 and key.ndim == 1))):
        raise TypeError(f"key must be a jax.random.key(seed) or an int seed, got {type(key).__name__} "
                        f"{getattr(key, 'dtype', '')} {getattr(key, 'shape', '')}".rstrip())
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    shapes = param_shapes(config)
    keys = dict(zip(PARAM_NAMES, jax.random.split(key, len(PARAM_NAMES))))
    params = {n: (jax.random.normal(keys[n], shapes[n], jnp.float32) * std).astype(dtype) for n in PARAM_NAMES}
    raw = jax.random.normal(keys["mix"], (config.rank, config.block_size, config.block_size), jnp.float32)
    raw = raw * (std if mix_std is None else mix_std)
    params["mix"] = jnp.transpose(fold_causal_mixer(raw.astype(dtype)), (1, 2, 0))
    if config.reduced:
        ids = jnp.sort(jax.random.choice(jax.random.fold_in(key, 1), config.vocab_size, (config.draft_vocab_size,),
                                         replace=False))
        params[VOCAB_MAP] = (ids - jnp.arange(config.draft_vocab_size)).astype(jnp.int32)
    return params


def to_numpy(t: Any) -> np.ndarray:
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
    t2d = tensors.get("t2d") if config.reduced else None
    tensors = {k: v for k, v in tensors.items() if not (k == "t2d" and config.reduced)}
    expected = source_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    arrays = {k: to_numpy(tensors[k]) for k in expected if k in tensors}
    vocab_map = arrays.pop(VOCAB_MAP, None)
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
    out = {k: jnp.asarray(np.ascontiguousarray(v).astype(dtype)) for k, v in out.items()}
    if config.reduced:
        out[VOCAB_MAP] = jnp.asarray(check_vocab_map(vocab_map, config.vocab_size, t2d))
    return out


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
    kwargs.setdefault("draft_vocab_size", params["w2"].shape[0])
    return HeadConfig(vocab_size=V, hidden_size=H, block_size=B, rank=r, mlp_hidden=M, **kwargs)


def check_params(params: Mapping[str, Any], config: HeadConfig | None = None) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first bad param (name, shape or dtype). Shapes are
    checked against ``config`` when given, else against each other; no values are read."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of arrays, got {type(params).__name__}")
    names = param_names(config) if config is not None else PARAM_NAMES + ((VOCAB_MAP,) if VOCAB_MAP in params else ())
    missing = [k for k in names if k not in params]
    extra = sorted(set(params) - set(names))
    if missing or extra:
        hint = (f" (a reduced head, draft_vocab_size={config.draft_vocab_size} < vocab_size={config.vocab_size}, "
                f"needs {VOCAB_MAP!r})" if config is not None and config.reduced and VOCAB_MAP in missing else "")
        raise ValueError(f"params: missing {missing}, unexpected {extra}{hint}")
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
        Vd = params["w2"].shape[0] if VOCAB_MAP in params and len(params["w2"].shape) == 2 else V
        expected = _shapes(V, H, B, r, M, Vd)
        if VOCAB_MAP not in expected and VOCAB_MAP in params:
            expected[VOCAB_MAP] = (Vd,)
    else:
        expected = param_shapes(config)
    for k in names:
        if tuple(params[k].shape) != expected[k]:
            raise ValueError(f"params[{k!r}] has shape {tuple(params[k].shape)}, expected {expected[k]}")
    if VOCAB_MAP in params and not jnp.issubdtype(params[VOCAB_MAP].dtype, jnp.integer):
        raise TypeError(f"params[{VOCAB_MAP!r}] must be integer ids, got {jnp.dtype(params[VOCAB_MAP].dtype)}")
    dtype = jnp.dtype(params["w1"].dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"params must be floating, params['w1'] is {dtype}")
    for k in PARAM_NAMES:
        if jnp.dtype(params[k].dtype) != dtype:
            raise TypeError(f"params[{k!r}] has dtype {jnp.dtype(params[k].dtype)}, but params['w1'] is {dtype}; "
                            "all params must share one dtype")
