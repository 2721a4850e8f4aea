"""refine on a 2x2 mesh: blocks over "data", the vocabulary over "model"; the same tokens as one device.

Runs on a CPU by splitting it into 4 host devices (the flag must be set before JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/multi_device.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from xpress_jax.sharded import STATIC_ARGNAMES, input_shardings, param_shardings, refine_sharded

if len(jax.devices()) < 4:
    raise SystemExit(f"this example needs 4 devices, JAX sees {len(jax.devices())}: run it with "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=4")
cfg = xj.HeadConfig(vocab_size=1000, hidden_size=64, block_size=8, rank=32, mlp_hidden=64, topc=0, num_passes=3)
head = xj.init_head(cfg, 0, std=0.15)
k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
logits = jax.random.normal(k1, (8, cfg.block_size, cfg.vocab_size))
h = jax.random.normal(k2, (8, cfg.block_size, cfg.hidden_size))
anchors = jax.random.randint(k3, (8,), 0, cfg.vocab_size)

one = xj.refine(head, logits, h, anchors)  # one device, for comparison

mesh = jax.make_mesh((2, 2), ("data", "model"))
# Optional: put the weights and inputs where refine_sharded wants them (it reshards whatever it is given).
head = xj.Head(cfg, jax.device_put(head.params, param_shardings(mesh, vocab_size=cfg.vocab_size)))
sh = input_shardings(mesh, num_blocks=8, vocab_size=cfg.vocab_size)
logits, h, anchors = (jax.device_put(x, sh[k]) for x, k in ((logits, "logits"), (h, "h"), (anchors, "anchors")))

run = jax.jit(refine_sharded, static_argnames=STATIC_ARGNAMES)
draft = run(head, logits, h, anchors, mesh=mesh)
print(f"mesh {dict(mesh.shape)}: draft {draft.shape} split {draft.sharding.spec}, "
      f"equal to one device's: {bool(np.array_equal(np.asarray(draft), np.asarray(one)))}")
