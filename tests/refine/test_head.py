"""No silent defaults: a head's sizes, C and K travel with its params (`Head`), or refine refuses to guess."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj

from helpers import SMALL, make_head, make_inputs

refine_jit = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)

# A converted checkpoint's C and K differ from HeadConfig's defaults (512, 6): leaving out config= used to
# silently run C=512, K=6.
CFG = xj.HeadConfig(**dict(SMALL, topc=13, num_passes=4))


@pytest.fixture(scope="module")
def head():
    return xj.Head(CFG, make_head(CFG))


def test_topc_larger_than_vocab_is_clamped_as_vllm_does():
    assert xj.HeadConfig(vocab_size=97, hidden_size=24).topc == 97
    assert xj.HeadConfig(vocab_size=97, hidden_size=24, topc=1000).topc == 97
    assert xj.HeadConfig(vocab_size=97, hidden_size=24, topc=0).topc == 0
    assert xj.HeadConfig.from_hf_config({"vocab_size": 97, "hidden_size": 24, "xpress_topc": 512}).topc == 97
    assert xj.HeadConfig(vocab_size=151936, hidden_size=4096).topc == 512


@pytest.mark.slow
def test_head_runs_with_its_own_c_and_k(head):
    x = make_inputs(CFG, 3)
    want = np.asarray(xj.refine(head.params, *x, config=CFG))
    np.testing.assert_array_equal(np.asarray(xj.refine(head, *x)), want)
    np.testing.assert_array_equal(np.asarray(xj.refine(head, *x, config=CFG)), want)
    np.testing.assert_array_equal(np.asarray(xj.refine(head.params, *x, num_passes=4, topc=13)), want)
    # HeadConfig's defaults (C=512, K=6) would give other tokens on this head: the config matters.
    other = np.asarray(xj.refine(head.params, *x, num_passes=6, topc=512))
    assert np.any(other != want)
    # Explicit keywords still win over the Head's config.
    np.testing.assert_array_equal(np.asarray(xj.refine(head, *x, topc=0, num_passes=2)),
                                  np.asarray(xj.refine(head.params, *x, topc=0, num_passes=2)))


def test_plain_dict_without_config_refuses_to_guess(head):
    x = make_inputs(CFG, 2)
    with pytest.raises(TypeError, match="num_passes and topc") as e:
        xj.refine(head.params, *x)
    msg = str(e.value)
    assert "Head" in msg and "config=" in msg and "num_passes=K and topc=C" in msg
    with pytest.raises(TypeError, match=r"\btopc has no default"):
        xj.refine(head.params, *x, num_passes=3)
    with pytest.raises(TypeError, match=r"num_passes has no default"):
        refine_jit(head.params, *x, topc=0)
    # Without a config, max_num_reqs is "no limit" (traced only: the shapes check out).
    big = make_inputs(CFG, CFG.max_num_reqs + 1)
    jax.eval_shape(lambda *a: xj.refine(head.params, *a, num_passes=1, topc=0), *big)
    with pytest.raises(ValueError, match="max_num_reqs"):
        xj.refine(head, *big)


def test_conflicting_config_is_refused(head):
    x = make_inputs(CFG, 2)
    with pytest.raises(ValueError, match="disagrees with the Head's own config"):
        xj.refine(head, *x, config=dataclasses.replace(CFG, topc=5))
    with pytest.raises(TypeError, match="HeadConfig"):
        xj.refine(head.params, *x, config={"topc": 3})


def test_explicit_topc_above_vocab_still_raises(head):
    with pytest.raises(ValueError, match="topc"):
        xj.refine(head, *make_inputs(CFG, 1), topc=CFG.vocab_size + 1)


def test_head_is_a_pytree_with_static_config(head):
    leaves, treedef = jax.tree.flatten(head)
    assert len(leaves) == len(xj.PARAM_NAMES)
    doubled = jax.tree.map(lambda w: w * 2, head)
    assert isinstance(doubled, xj.Head) and doubled.config == CFG
    np.testing.assert_array_equal(np.asarray(doubled.params["w1"]), 2 * np.asarray(head.params["w1"]))
    abstract = jax.eval_shape(lambda: xj.init_head(CFG, jax.random.key(0), dtype=jnp.bfloat16))
    assert isinstance(abstract, xj.Head) and abstract.params["w2"].shape == (CFG.vocab_size, CFG.rank)
    # Backward compatible with load_params' old (config, params) tuple.
    config, params = head
    assert config is head.config and params is head.params and head[0] is CFG
    assert head.dtype == jnp.float32 and head.astype(jnp.bfloat16).dtype == jnp.bfloat16
    assert "Head(" in repr(head) and "float32" in repr(head)
    with pytest.raises(ValueError, match="mlp_up"):
        xj.Head(CFG, dict(head.params, mlp_up=head.params["mlp_up"][:, :-1]))
    with pytest.raises(TypeError, match="HeadConfig"):
        xj.Head(dataclasses.asdict(CFG), head.params)
    with pytest.raises(KeyError, match=r"head.params\['w1'\]"):
        head["w1"]


@pytest.mark.slow  # the default suite: the module's and the server's no-retrace tests
def test_jit_with_a_head_argument_does_not_retrace_for_the_same_config(head):
    x1, x2 = make_inputs(CFG, 3, seed=1), make_inputs(CFG, 3, seed=2)
    traces = []

    def counted(*a, **k):
        traces.append(1)
        return xj.refine(*a, **k)

    f = jax.jit(counted, static_argnames=xj.STATIC_ARGNAMES)
    out1 = f(head, *x1)
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(xj.refine(head, *x1)))
    head2 = xj.Head(CFG, jax.tree.map(lambda w: w * 1.5, head.params))  # new weights, same config
    with jax.no_tracing():
        out2 = f(head2, *x2)
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(xj.refine(head2, *x2)))
    assert len(traces) == 1
    # The public recipe works too, and a different config is a different compile.
    np.testing.assert_array_equal(np.asarray(refine_jit(head, *x1)), np.asarray(out1))
    f(xj.Head(dataclasses.replace(CFG, num_passes=2), head.params), *x1)
    assert len(traces) == 2


def test_init_head_matches_init_params():
    head = xj.init_head(CFG, jax.random.key(3), dtype=jnp.bfloat16, std=0.1)
    params = xj.init_params(CFG, jax.random.key(3), dtype=jnp.bfloat16, std=0.1)
    assert head.config == CFG
    for k in xj.PARAM_NAMES:
        np.testing.assert_array_equal(np.asarray(head.params[k]), np.asarray(params[k]))


def test_refine_server_takes_a_head_with_its_own_c_and_k(head):
    server = xj.RefineServer(head, buckets=(4,), progress=False)
    assert (server.topc, server.num_passes) == (CFG.topc, CFG.num_passes)
    x = make_inputs(CFG, 3)
    np.testing.assert_array_equal(server.tokens(*[np.asarray(a) for a in x]), np.asarray(xj.refine(head, *x)))
    with pytest.raises(TypeError, match="RefineServer"):
        xj.RefineServer(head.params)


def test_pallas_on_cpu_without_interpret_names_the_fix(head):
    if jax.default_backend() != "cpu":
        pytest.skip("CPU only: a CPU property (on a GPU backend='pallas' compiles the kernels)")
    x = make_inputs(CFG, 1)
    for f in (xj.refine, refine_jit):
        with pytest.raises(ValueError, match=r"interpret=True") as e:
            f(head, *x, backend="pallas")
        assert "backend='xla'" in str(e.value)


def test_params_from_state_dict_suggests_the_prefix(small_cfg):
    from xpress_jax.params import source_shapes

    rng = np.random.default_rng(0)
    sd = {k: rng.normal(size=s).astype(np.float32) for k, s in source_shapes(small_cfg).items()}
    prefixed = {f"xpress_head.{k}": v for k, v in sd.items()} | {"layers.0.w": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"prefix 'xpress_head\.'.*pass prefix='xpress_head\.'"):
        xj.params_from_state_dict(prefixed, small_cfg)
    with pytest.raises(ValueError, match=r"pass prefix='model\.xpress_head\.'"):
        xj.params_from_state_dict({f"model.{k}": v for k, v in prefixed.items()}, small_cfg, prefix="xpress_head.")
    got = xj.params_from_state_dict(prefixed, small_cfg, prefix="xpress_head.")
    want = xj.params_from_state_dict(sd, small_cfg)
    for k in xj.PARAM_NAMES:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


def test_load_params_places_the_arrays_where_asked(tmp_path, head):
    path = xj.save_params(tmp_path / "ck", head)
    cpu = jax.devices("cpu")[0]
    for sharding in (None, cpu, jax.sharding.make_single_device_sharding(cpu)):
        loaded = xj.load_params(path, sharding=sharding)
        assert isinstance(loaded, xj.Head) and loaded.config == CFG
        where = jax.devices()[0] if sharding is None else cpu  # None: JAX's default device
        for k, v in loaded.params.items():
            assert v.devices() == {where}, k
            assert v.sharding == jax.sharding.make_single_device_sharding(where), k
            np.testing.assert_array_equal(np.asarray(v), np.asarray(head.params[k]))
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    loaded = xj.load_params(path, dtype=jnp.bfloat16, sharding={"w1": replicated, "w2": cpu})
    assert loaded.params["w1"].sharding == replicated and loaded.params["w1"].dtype == jnp.bfloat16
    assert loaded.params["w2"].devices() == {cpu}
    with pytest.raises(ValueError, match="unknown param name"):
        xj.load_params(path, sharding={"w3": cpu})
    with pytest.raises(TypeError, match="sharding must be"):
        xj.load_params(path, sharding="cpu")
