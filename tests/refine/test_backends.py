"""refine(backend="pallas", interpret=True) == refine(backend="xla"), both modes, and the HLO really holds the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj

from xpress_jax.kernels.common import gpu_supported
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

from helpers import lower_triton, make_head, make_inputs

refine_jit = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)

CFG = xj.HeadConfig(vocab_size=1337, hidden_size=40, block_size=6, rank=32, mlp_hidden=48, topc=50, max_num_reqs=8)


_F32, _BF = jnp.float32, jnp.bfloat16
slow = pytest.mark.slow


# n x topc x dtype: each interpret-mode refine compiles every kernel (seconds); the default run keeps
# the four cases where every pair of values meets once, the other four are `slow`.
@pytest.mark.interpret_refine
@pytest.mark.parametrize("n,topc,dtype", [
    pytest.param(1, 0, _F32, id="1-0-float32"), pytest.param(3, 0, _BF, id="3-0-bfloat16", marks=slow),
    pytest.param(1, 50, _BF, id="1-50-bfloat16", marks=slow), pytest.param(3, 50, _F32, id="3-50-float32", marks=slow),
    pytest.param(1, 0, _BF, id="1-0-bfloat16", marks=slow), pytest.param(3, 0, _F32, id="3-0-float32", marks=slow),
    pytest.param(1, 50, _F32, id="1-50-float32", marks=slow), pytest.param(3, 50, _BF, id="3-50-bfloat16", marks=slow),
])
@pytest.mark.slow
def test_pallas_interpret_equals_xla(dtype, topc, n):
    params = make_head(CFG, dtype=dtype)
    x = make_inputs(CFG, n, seed=n + topc, dtype=dtype)
    want = np.asarray(refine_jit(params, *x, num_passes=4, topc=topc, backend="xla"))
    got = np.asarray(refine_jit(params, *x, num_passes=4, topc=topc, backend="pallas", interpret=True))
    drafter = np.asarray(jnp.argmax(x[0][:, 1:], -1))
    assert np.mean(want != drafter) > 0.2
    np.testing.assert_array_equal(got, want)


def test_auto_backend_choice():
    """"auto" runs the kernels on a supported GPU (CUDA, sm80+) and the jnp path anywhere else."""
    from xpress_jax.refine import select_ops

    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    supported = dev.platform == "gpu" and "nvidia" in dev.device_kind.lower() and cc is not None and float(cc) >= 8.0
    assert gpu_supported() == supported
    assert select_ops("auto", False) is (Ops.pallas(False) if supported else Ops.xla(jax.default_backend()))
    assert select_ops("xla", False) is Ops.xla(jax.default_backend())
    assert select_ops("auto", False).name == ("pallas" if supported else "xla")
    assert select_ops("auto", True).name == "pallas-interpret"
    assert select_ops("pallas", True).name == "pallas-interpret"
    assert select_ops("pallas", False).name == "pallas"


class _FakeDevice:
    def __init__(self, platform, device_kind, **attrs):
        self.platform, self.device_kind = platform, device_kind
        self.__dict__.update(attrs)


@pytest.mark.parametrize("dev,want", [
    (_FakeDevice("gpu", "NVIDIA H200", compute_capability="9.0"), True),
    (_FakeDevice("gpu", "NVIDIA A100-SXM4-80GB", compute_capability="8.0"), True),
    (_FakeDevice("gpu", "NVIDIA GeForce RTX 2080 Ti", compute_capability="7.5"), False),  # NVIDIA, but sm75
    (_FakeDevice("gpu", "NVIDIA H200"), False),  # no compute capability: not checked, not supported
    (_FakeDevice("gpu", "NVIDIA H200", compute_capability="n/a"), False),
    (_FakeDevice("gpu", "AMD Instinct MI300X", compute_capability="9.4"), False),  # not NVIDIA (ROCm)
    (_FakeDevice("cpu", "cpu"), False),
    (_FakeDevice("tpu", "TPU v5 lite"), False),
])
def test_gpu_supported_only_for_checked_nvidia_gpus(dev, want):
    assert gpu_supported([dev]) is want
    assert gpu_supported([]) is False


@pytest.mark.parametrize("topc", [0, pytest.param(512, marks=slow)])
def test_refine_lowers_to_triton_kernels(topc):
    """The whole pallas refine lowers for an H200; each kernel appears in the HLO (no silent fallback)."""
    cfg = xj.HeadConfig(vocab_size=4099, hidden_size=64, block_size=16, rank=256, mlp_hidden=512, topc=512)
    p = jax.eval_shape(lambda: xj.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16))
    n = 72  # 1080 draft rows: the dispatch serves its fused latent kernel there (XLA's latent up to 960 rows)
    logits = jax.ShapeDtypeStruct((n, 16, cfg.vocab_size), jnp.bfloat16)
    h = jax.ShapeDtypeStruct((n, 16, cfg.hidden_size), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((n,), jnp.int32)
    # refine(backend="pallas") refuses a CPU without interpret=True before tracing, so lower it with
    # the Pallas ops given directly: the same pipeline, validated shapes, traced for an H200.
    f = lambda p, l, h, a: refine_with(Ops.pallas(False), p, l, h, a, num_passes=3, topc=topc, unroll=True)
    text = lower_triton(f, p, logits, h, ids).as_text()
    assert "xpress_latent_pass" in text
    names = ("xpress_topc_pick", "select_bgather", "select_finish") if topc else ("xpress_full_vocab",)
    for name in names:
        assert name in text, f"{name} missing from the lowered HLO"


@pytest.mark.interpret_refine
@pytest.mark.parametrize("steps", [pytest.param("latent", marks=slow), "pick", pytest.param("select", marks=slow),
                                   pytest.param("latent+pick", marks=slow)])
@pytest.mark.slow
def test_mixed_implementations_match_xla(steps):
    """One kernel step at a time in the XLA refine, as bench_refine builds them (`dataclasses.replace` on
    `Ops`, run with `refine_with`: the documented way to build mixed implementations); a pair is `slow`."""
    from benchmarks.bench_refine import bench_ops

    params = make_head(CFG)
    x = make_inputs(CFG, 2, seed=5)
    xla, mixed = Ops.xla(), bench_ops(f"xla+{steps}", interpret=True)
    assert mixed != xla
    run = jax.jit(refine_with, static_argnums=0, static_argnames=("num_passes", "topc"))
    want = np.asarray(run(xla, params, *x, num_passes=3, topc=50))
    np.testing.assert_array_equal(np.asarray(run(mixed, params, *x, num_passes=3, topc=50)), want)
    assert (want != np.asarray(jnp.argmax(x[0][:, 1:], -1))).mean() > 0.2


@pytest.mark.parametrize("backend", [pytest.param("pallas:latent", marks=slow), pytest.param("xla:latent", marks=slow), "XLA", "cuda", None, Ops.xla()])
def test_backend_is_one_of_three_names(backend):
    """backend is only "auto" | "xla" | "pallas" (mixed implementations go through refine_with)."""
    # The backend is checked first: no head or inputs are read.
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'xla', 'pallas'\)"):
        xj.refine(None, None, None, None, num_passes=1, topc=0, backend=backend)


@pytest.mark.slow
def test_importing_installs_no_warning_filter():
    """Library code leaves the process's warning filters alone (the tests filter in pytest config)."""
    import subprocess
    import sys

    # (numpy and friends add their own filters on import: only a Pallas one would be ours)
    code = ("import warnings, xpress_jax, xpress_jax.ops, xpress_jax.dispatch, xpress_jax.kernels.common; "
            "ours = [f for f in warnings.filters if 'Pallas' in str(f[1])]; assert not ours, ours")
    subprocess.run([sys.executable, "-c", code], check=True)
