"""xpress-jax: the XPress refiner head (speculative decoding) in JAX.

Quickstart::

    import jax, jax.numpy as jnp, xpress_jax as xj
    cfg = xj.HeadConfig(vocab_size=V, hidden_size=H, block_size=16)
    head = xj.init_head(cfg, jax.random.key(0), dtype=jnp.bfloat16)   # or xj.load_params(path)
    refine = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES, compiler_options=xj.compiler_options())
    draft = refine(head, logits, h, anchors)   # [N, B-1] int32; C and K from head.config
"""

from .checkpoint import load_params, save_params
from .compile_options import GPU_COMPILER_OPTIONS, compiler_options
from .config import HeadConfig
from .head import XPressHead, hidden_input, latent, round_to, token_table
from .params import (HYBRID_KEY_MAP, PARAM_NAMES, Head, check_params, config_from_params, fold_causal_mixer, init_head,
                     init_params, param_shapes, params_from_state_dict)
from .refine import BACKENDS, INVALID_TOKEN, refine
from .refine import STATIC as STATIC_ARGNAMES
from .sampling import Proposal
from .serving import RefineServer, default_buckets

__version__ = "0.1.0"

__all__ = ["Head", "HeadConfig", "init_head", "XPressHead", "HYBRID_KEY_MAP", "PARAM_NAMES", "STATIC_ARGNAMES",
           "BACKENDS", "GPU_COMPILER_OPTIONS", "compiler_options", "RefineServer", "default_buckets", "INVALID_TOKEN",
           "check_params", "config_from_params", "fold_causal_mixer", "hidden_input", "init_params", "latent",
           "round_to", "token_table", "param_shapes", "params_from_state_dict", "refine", "load_params",
           "save_params", "Proposal"]
