"""A JAX without Pallas-Triton (deprecated since JAX 0.11): xpress_jax imports and refines on its XLA path.

The child process makes ``jax.experimental.pallas.triton`` fail to import before xpress_jax loads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import sys, warnings
    sys.modules["jax.experimental.pallas.triton"] = None  # `import` of it now raises ImportError
    import jax, jax.numpy as jnp, numpy as np
    import xpress_jax as xj
    from xpress_jax.kernels import common
    assert not common.triton_available()
    cfg = xj.HeadConfig(vocab_size=97, hidden_size=8, block_size=5, rank=6, mlp_hidden=10, topc=7, num_passes=2)
    head = xj.init_head(cfg, 0, std=0.5)
    logits, h = jax.random.normal(jax.random.key(1), (3, 5, 97)), jax.random.normal(jax.random.key(2), (3, 5, 8))
    anchors = jnp.arange(3)
    want = np.asarray(xj.refine(head, logits, h, anchors, backend="xla"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = np.asarray(xj.refine(head, logits, h, anchors, interpret=True))  # auto: no kernels to interpret
        assert common.gpu_supported([type("GPU", (), dict(platform="gpu", device_kind="NVIDIA H100",
                                                           compute_capability="9.0"))()]) is False
        assert common.gpu_supported([type("GPU", (), dict(platform="gpu", device_kind="NVIDIA H100",
                                                           compute_capability="9.0"))()]) is False
    assert (got == want).all()
    assert len([x for x in w if "no Pallas-Triton backend" in str(x.message)]) == 1, [str(x.message) for x in w]
    try:
        xj.refine(head, logits, h, anchors, backend="pallas", interpret=True)
        raise SystemExit("backend='pallas' did not raise")
    except ValueError as e:
        assert "jax.experimental.pallas.triton" in str(e) and "backend='xla'" in str(e), e
    print("ok")
""")


@pytest.mark.slow
def test_imports_and_refines_without_pallas_triton():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
