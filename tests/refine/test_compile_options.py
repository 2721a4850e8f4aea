"""`xpress_jax.compiler_options`: the XLA options refine's executables compile with.

On a GPU (XPRESS on the device machine) the token tests compare the options against XLA's defaults
for real: there the options change the CUDA graph's schedule. On a CPU they check that the options
are accepted by every path that takes them and reach XLA (a bad value is refused by XLA, naming it).
"""

from __future__ import annotations

import contextlib
import io
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax import compile_options as co

from helpers import make_head, make_inputs

OPTION = "xla_gpu_command_buffer_scheduling_mode"
CFG = xj.HeadConfig(vocab_size=301, hidden_size=32, block_size=5, rank=24, mlp_hidden=32, topc=7, num_passes=3,
                    max_num_reqs=4)


def test_platforms():
    assert co.compiler_options("cpu") == {}
    assert co.compiler_options("tpu") == {}
    # Every supported JAX's XLA knows the option, so nothing is dropped.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for p in ("gpu", "cuda", "rocm", "GPU"):
            assert co.compiler_options(p) == {OPTION: "CONCURRENT"} == dict(xj.GPU_COMPILER_OPTIONS)
    assert xj.compiler_options() == co.compiler_options(jax.default_backend())
    with pytest.raises(TypeError, match="platform must be a str"):
        co.compiler_options(jax.devices()[0])


def test_unknown_option_is_dropped_with_a_warning():
    with pytest.warns(RuntimeWarning, match="xla_gpu_no_such_option_xpress"):
        assert co._known("xla_gpu_no_such_option_xpress", "1") is False
    assert co._known(OPTION, "CONCURRENT") is True
    # A known option with a bad value is not "unknown": the real compile reports it.
    assert co._known(OPTION, "NOT_A_MODE") is True


def test_check_compiler_options():
    assert co.check_compiler_options(None, "w") == {}
    assert co.check_compiler_options({OPTION: "LHS"}, "w") == {OPTION: "LHS"}
    for bad in ("CONCURRENT", [OPTION], {1: "x"}):
        with pytest.raises(TypeError, match="w: compiler_options must be a mapping"):
            co.check_compiler_options(bad, "w")


@pytest.mark.parametrize("topc", [pytest.param(7, marks=pytest.mark.slow), 0])
@pytest.mark.slow
def test_same_tokens_with_and_without(topc):
    """The options change only the schedule: the same tokens as XLA's defaults (on the platform run on)."""
    head = xj.Head(CFG, make_head(CFG, dtype=jnp.bfloat16))
    logits, h, anchors, prev = make_inputs(CFG, 3, dtype=jnp.bfloat16, seed=5)
    backend = "pallas" if jax.default_backend() == "gpu" else "xla"
    kw = dict(static_argnames=xj.STATIC_ARGNAMES)
    plain = jax.jit(xj.refine, **kw)(head, logits, h, anchors, prev, topc=topc, backend=backend)
    opts = jax.jit(xj.refine, **kw, compiler_options=dict(xj.GPU_COMPILER_OPTIONS))(
        head, logits, h, anchors, prev, topc=topc, backend=backend)
    np.testing.assert_array_equal(np.asarray(opts), np.asarray(plain))


def _server(**kw):
    head = xj.Head(CFG, make_head(CFG))
    with contextlib.redirect_stderr(io.StringIO()):
        return xj.RefineServer(head, buckets=(2,), **kw)


@pytest.mark.slow
def test_server_passes_its_options_to_xla():
    # A value XLA refuses, naming the option: proves the server's options reach every compile.
    with pytest.raises(Exception, match=OPTION):
        _server(compiler_options={OPTION: "NOT_A_MODE"})
    with pytest.raises(Exception, match=OPTION):  # the token table's executable, compiled first
        _server(compiler_options={OPTION: "NOT_A_MODE"}, token_table=True)
    with pytest.raises(TypeError, match="RefineServer: compiler_options must be a mapping"):
        _server(compiler_options="CONCURRENT")


@pytest.mark.slow
def test_server_default_and_explicit_options():
    default = _server()
    assert default.compiler_options == xj.compiler_options(jax.devices()[0].platform)
    explicit = _server(compiler_options={OPTION: "CONCURRENT"})
    off = _server(compiler_options={})
    assert explicit.compiler_options == {OPTION: "CONCURRENT"} and off.compiler_options == {}
    logits, h, anchors, prev = make_inputs(CFG, 2, seed=9)
    want = default.tokens(np.asarray(logits), np.asarray(h), np.asarray(anchors), np.asarray(prev))
    for s in (explicit, off):
        np.testing.assert_array_equal(s.tokens(np.asarray(logits), np.asarray(h), np.asarray(anchors),
                                               np.asarray(prev)), want)
