"""`RefineServer(sampling=True)`: temperature and key are runtime arguments of executables compiled at start-up.

A sampled call gives `refine`'s tokens for the same key on the unpadded inputs (padding rows come after the real
ones, so the real rows keep their noise), T and the key change without a trace or a compile, and the proposal comes
back like the tokens (bucket rows from ``server(...)``, the valid rows from ``tokens``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj

from helpers import make_head, make_inputs, run_on_host_devices, serving

# Another V than test_serving.py's: no executable of one file is a cache hit of the other's (it counts compiles).
CFG = xj.HeadConfig(vocab_size=310, hidden_size=32, block_size=5, rank=24, mlp_hidden=32, topc=7, num_passes=3,
                    max_num_reqs=8)
BUCKETS = (2, 5)
B1 = CFG.block_size - 1


@pytest.fixture(scope="module")
def head():
    return xj.Head(CFG, make_head(CFG))


# The top-C server's cases are slow (a second server compile); the full-vocab one runs every test fast.
@pytest.fixture(scope="module", params=[pytest.param(7, marks=pytest.mark.slow), 0], ids=["topc", "full-vocab"])
def server(request, head):
    xj.compiler_options(jax.devices()[0].platform)  # its one-op check compiles here, not inside a test
    return xj.RefineServer(head, buckets=BUCKETS, topc=request.param, sampling=True, proposal="scores",
                           progress=False)


def test_sampled_tokens_are_refines_for_the_same_key_padding_changes_nothing(server, head):
    x = [np.asarray(a) for a in make_inputs(CFG, 3, seed=3)]  # N = 3: padded to the bucket of 5
    greedy = np.asarray(xj.refine(head, *x, topc=server.topc))
    seen = []
    for seed, t in ((0, 4.0), (1, 4.0), (1, 1.5), (2, 0.0)):
        key = jax.random.key(seed)
        want = np.asarray(xj.refine(head, *x, topc=server.topc, temperature=t, key=key))
        # T as a Python float, a numpy scalar, a float32 device scalar; and a raw key: the same executables
        for temp, k in ((t, key), (np.float32(t), key), (jnp.float32(t), key),
                        (t, jax.random.key_data(key))):
            with serving() as compiles:
                out = server(*x, temperature=temp, key=k)
                for nv in (1, 2, 3):
                    host = server.tokens(*x, num_valid=nv, temperature=temp, key=k)
                    np.testing.assert_array_equal(host, want[:nv], err_msg=f"T={t}, seed={seed}, num_valid={nv}")
            assert compiles() == 0
            assert out.shape == (5, B1) and out.dtype == jnp.int32
            out = np.asarray(out)
            np.testing.assert_array_equal(out[:3], want)
            assert (out[3:] == xj.INVALID_TOKEN).all()
        if t == 0:
            np.testing.assert_array_equal(want, greedy)  # T = 0: the greedy tokens
        seen.append(want)
    assert (seen[0] != seen[1]).mean() > 0.2 and (seen[1] != greedy).mean() > 0.2  # the key and T are in play
    with serving() as compiles:
        np.testing.assert_array_equal(server.tokens(*x), greedy)  # greedy calls: the greedy executables
    assert compiles() == 0


@pytest.mark.slow
def test_proposal_comes_back_like_the_tokens(server, head):
    x = [np.asarray(a) for a in make_inputs(CFG, 2, seed=4)]
    key, t = jax.random.key(7), 0.8
    want, wp = xj.refine(head, *x, topc=server.topc, temperature=t, key=key, proposal="scores")
    with serving() as compiles:
        out, prop = server(*x, temperature=t, key=key, proposal="scores")
        host, hp = server.tokens(*x, num_valid=1, temperature=t, key=key, proposal="scores")
        lp_tokens, lp = server(*x, temperature=t, key=key, proposal="logprob")
        only = server(*x, temperature=t, key=key)
    assert compiles() == 0
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(only), np.asarray(want))
    np.testing.assert_array_equal(host, np.asarray(want)[:1])
    c = server.topc or CFG.vocab_size
    assert prop.scores.shape == (2, B1, c) and prop.token_score.shape == prop.lse.shape == (2, B1)
    assert (prop.ids is None) == (server.topc == 0) and (wp.ids is None) == (server.topc == 0)
    assert lp.scores is None and lp.ids is None
    np.testing.assert_array_equal(np.asarray(lp_tokens), np.asarray(want))
    assert all(isinstance(a, np.ndarray) and a.shape[0] == 1 for a in hp if a is not None)
    for name in ("token_score", "lse", "scores", "ids"):
        w = getattr(wp, name)
        if w is None:
            continue
        # The same sums up to float rounding (XLA may order a bucket's larger products differently).
        for got, rows in ((getattr(prop, name), 2), (getattr(hp, name), 1), (getattr(lp, name, None), 2)):
            if got is not None:
                np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(w, np.float32)[:rows],
                                           rtol=1e-5, atol=1e-4, err_msg=name)
    # The proposal describes the drafted tokens: log q(x) <= 0, and token_score is the drafted token's score.
    assert (np.asarray(prop.log_prob(t)) <= 1e-5).all()
    out = np.asarray(out)
    col = (np.asarray(prop.ids) == out[..., None]).argmax(-1) if server.topc else out
    drafted = np.take_along_axis(np.asarray(prop.scores, np.float32), col[..., None], -1)[..., 0]
    np.testing.assert_array_equal(np.asarray(prop.token_score), drafted)


def test_bad_sampling_arguments_are_refused_naming_them(server, head):
    x = [np.asarray(a) for a in make_inputs(CFG, 2, seed=5)]
    key = jax.random.key(0)
    cases = [
        (dict(temperature=1.0), ValueError, "temperature needs key"),
        (dict(key=key), ValueError, "key is for sampling"),
        (dict(temperature=-1.0, key=key), ValueError, "temperature must be finite and >= 0"),
        (dict(temperature=float("nan"), key=key), ValueError, "temperature must be finite"),
        (dict(temperature=jnp.ones((2,)), key=key), ValueError, "temperature must be"),
        (dict(temperature=jnp.bfloat16(1), key=key), ValueError, "float32 jax.Array scalar"),
        (dict(temperature=1.0, key=jax.random.key(0, impl="rbg")), ValueError, "rbg key"),
        (dict(temperature=1.0, key=jax.random.split(key, 2)), ValueError, "key must be one key"),
        (dict(temperature=1.0, key=key, proposal="all"), ValueError, "proposal must be None or one of"),
    ]
    for kw, err, msg in cases:
        with pytest.raises(err, match=msg):
            server(*x, **kw)


def test_options_are_checked_at_start_up_and_calls_name_them(head):
    greedy = xj.RefineServer(head, buckets=(2,), progress=False)
    x = [np.asarray(a) for a in make_inputs(CFG, 2, seed=6)]
    assert not greedy.sampled_executables and "temperature" not in greedy.input_specs(2)
    with pytest.raises(ValueError, match=r"sampling=True"):
        greedy(*x, temperature=1.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"proposal='scores'.*pass sampling=True"):
        xj.RefineServer(head, buckets=(2,), proposal="scores", progress=False)
    with pytest.raises(ValueError, match=r"proposal must be None or one of"):
        xj.RefineServer(head, buckets=(2,), sampling=True, proposal="logits", progress=False)
    with pytest.raises(TypeError, match=r"sampling must be True or False"):
        xj.RefineServer(head, buckets=(2,), sampling="yes", progress=False)
    # Built with proposal="logprob": a call may ask for it or for nothing, never for more.
    lp = xj.RefineServer(head, buckets=(2,), sampling=True, proposal="logprob", topc=0, progress=False)
    specs = lp.input_specs(2)
    assert specs["temperature"].dtype == jnp.float32 and specs["key"].dtype == jax.random.key(0).dtype
    with pytest.raises(ValueError, match=r"executables compute proposal='logprob'"):
        lp(*x, temperature=1.0, key=jax.random.key(0), proposal="scores")
    tokens, prop = lp(*x, temperature=1.0, key=jax.random.key(0), proposal="logprob")
    assert prop.scores is None and prop.lse.shape == (2, B1)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(
        xj.refine(head, *x, topc=0, temperature=1.0, key=jax.random.key(0))))


@pytest.mark.slow
def test_certified_greedy_and_early_exit_servers_sample_with_the_scan(head):
    """full_vocab="certified" (greedy calls) and early_exit: sampled calls give refine's sampled tokens."""
    x = [np.asarray(a) for a in make_inputs(CFG, 2, seed=8)]
    key = jax.random.key(3)
    want = np.asarray(xj.refine(head, *x, topc=0, temperature=0.9, key=key))
    for kw in (dict(full_vocab="certified"), dict(early_exit=True)):
        server = xj.RefineServer(head, buckets=(2,), topc=0, sampling=True, progress=False, **kw)
        with serving() as compiles:
            out = server.tokens(*x, temperature=0.9, key=key)
            greedy = server.tokens(*x)
        assert compiles() == 0
        np.testing.assert_array_equal(out, want, err_msg=str(kw))
        np.testing.assert_array_equal(greedy, np.asarray(xj.refine(head, *x, topc=0)), err_msg=str(kw))


_MESH_SCRIPT = """
import jax, numpy as np
import xpress_jax as xj
from jax.sharding import Mesh
from helpers import make_head, make_inputs
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **kw: compiles.append(name) if "backend_compile" in name else None)
cfg = xj.HeadConfig(**CFG)
head = xj.Head(cfg, make_head(cfg))
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
for topc in (0, 7):
    server = xj.RefineServer(head, buckets=(4,), mesh=mesh, topc=topc, sampling=True, proposal="scores",
                             progress=False)
    x = [np.asarray(a) for a in make_inputs(cfg, 3, seed=2)]
    key = jax.random.key(4)
    want, wp = xj.refine(head, *x, topc=topc, temperature=0.7, key=key, proposal="scores")
    start = len(compiles)
    with jax.no_tracing():
        out, prop = server(*x, temperature=0.7, key=key, proposal="scores")
        host = server.tokens(*x, num_valid=2, temperature=0.7, key=key)
    assert len(compiles) == start, compiles[start:]
    out = np.asarray(out)
    np.testing.assert_array_equal(out[:3], np.asarray(want))
    assert (out[3:] == -1).all()
    np.testing.assert_array_equal(host, np.asarray(want)[:2])
    want_sharding = server.input_specs(4)["logits"].sharding if topc == 0 else None
    if want_sharding is not None:  # full-vocab scores stay split like the logits
        assert prop.scores.sharding.is_equivalent_to(want_sharding, 3), prop.scores.sharding
    for name in ("token_score", "lse", "scores"):
        np.testing.assert_allclose(np.asarray(getattr(prop, name), np.float32)[:3],
                                   np.asarray(getattr(wp, name), np.float32), rtol=1e-5, atol=1e-4)
print("OK")
"""


@pytest.mark.slow
def test_on_a_2x2_mesh_sampled_tokens_are_refines():
    code = _MESH_SCRIPT.replace("**CFG", f"**{dataclasses.asdict(CFG)!r}")
    out = run_on_host_devices(["-c", code], timeout=600)
    assert out.strip().endswith("OK"), out
