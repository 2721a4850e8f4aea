"""`RefineServer`: compiled at start-up, then serving never traces and never compiles.

Every serving call below runs under ``jax.no_tracing()`` (raises on any trace) and a counter of
XLA backend compiles (``jax.monitoring``'s ``.../backend_compile_duration`` events).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj

from helpers import COMPILES, make_head, make_inputs, run_on_host_devices, serving

# Tiny, B not a power of two, top-C on (the candidate path), K < B-1.
CFG = xj.HeadConfig(vocab_size=300, hidden_size=32, block_size=5, rank=24, mlp_hidden=32, topc=7, num_passes=3,
                    max_num_reqs=8)
BUCKETS = (2, 5)
B1 = CFG.block_size - 1


@pytest.fixture(scope="module")
def head():
    return xj.Head(CFG, make_head(CFG))


@pytest.fixture(scope="module")
def started(head):
    """(server, its start-up stderr, compiles during start-up)."""
    # On a GPU the server's default options are checked once per process by a one-op compile
    # (`xpress_jax.compile_options`): done here first, so that only the server's own compiles count.
    xj.compiler_options(jax.devices()[0].platform)
    err, start = io.StringIO(), len(COMPILES)
    with contextlib.redirect_stderr(err):
        server = xj.RefineServer(head, buckets=BUCKETS)
    return server, err.getvalue(), len(COMPILES) - start


@pytest.fixture
def server(started, head):
    server = started[0]
    server.reload(head)  # tests that reload leave the module's server as they found it
    return server


def expected(head, x, k):
    """refine on the first k rows, then -1 padding up to the bucket."""
    ref = np.asarray(xj.refine(head, *[a[:k] for a in x]))
    return np.concatenate([ref, np.full((len(x[0]) - k, B1), xj.INVALID_TOKEN, np.int32)])


def test_startup_compiles_each_bucket_once_and_reports_it(started):
    server, err, compiles = started
    assert server.token_table  # the default on one device: one more executable, the table's
    assert compiles == len(BUCKETS) + 1
    assert sorted(server.executables) == sorted(server.compile_seconds) == list(BUCKETS)
    assert all(t > 0 for t in server.compile_seconds.values())
    lines = [ln for ln in err.splitlines() if "compiled in" in ln]
    assert [f"N={b}:" in ln for b, ln in zip(BUCKETS, lines)] == [True] * len(BUCKETS)
    assert f"{server.compile_seconds[5]:.2f} s" in lines[1]
    assert xj.default_buckets(8) == (1, 2, 4, 8) and xj.default_buckets(6) == (1, 2, 4, 6)


def test_quiet_start_up_and_default_buckets(head, capfd):
    small = dataclasses.replace(CFG, max_num_reqs=1)
    server = xj.RefineServer(xj.Head(small, head.params), progress=False)
    assert server.buckets == (1,) and capfd.readouterr().err == ""


@pytest.mark.slow
def test_every_input_kind_and_every_num_valid_runs_without_trace_or_compile(server, head):
    x = make_inputs(CFG, 5, seed=3)
    dev = jax.devices()[0]
    kinds = {
        "uncommitted jnp": x,
        "device_put": [jax.device_put(a) for a in x],
        "committed": [jax.device_put(a, dev) for a in x],
        "input_shardings": [jax.device_put(a, server.input_specs(5)[k].sharding)
                            for a, k in zip(x, ("logits", "h", "anchors", "prev_ids"))],
        "numpy": [np.asarray(a) for a in x],
    }
    assert kinds["committed"][0].committed and not kinds["uncommitted jnp"][0].committed
    full = np.asarray(xj.refine(head, *x))  # rows are independent: row i of any prefix is full[i]
    np.testing.assert_array_equal(expected(head, x, 3)[:3], full[:3])
    for kind, xs in kinds.items():
        for k in range(1, 6):
            with serving() as compiles:
                out = server(*xs, num_valid=k)
                host = server.tokens(*xs, num_valid=k)
            assert compiles() == 0, kind
            assert out.shape == (5, B1) and out.dtype == jnp.int32
            out = np.asarray(out)
            np.testing.assert_array_equal(out[:k], full[:k], err_msg=f"{kind}, num_valid={k}")
            assert (out[k:] == xj.INVALID_TOKEN).all(), (kind, k)
            np.testing.assert_array_equal(host, full[:k])


def test_numpy_inputs_of_any_n_are_padded_on_the_host(server, head):
    x = [np.asarray(a) for a in make_inputs(CFG, 5, seed=4)]
    x[2] = x[2].astype(np.int64)  # numpy int64 ids: range-checked and cast on the host
    full = np.asarray(xj.refine(head, *[jnp.asarray(a) for a in x]))
    for n in range(1, 6):
        with serving() as compiles:
            out = server(*[a[:n] for a in x])
            host = server.tokens(*[a[:n] for a in x])
        assert compiles() == 0
        assert out.shape == (server.bucket_for(n), B1) and host.shape == (n, B1)
        np.testing.assert_array_equal(host, full[:n])
        assert (np.asarray(out)[n:] == xj.INVALID_TOKEN).all()
    with pytest.raises(ValueError, match=r"N=6 blocks: must be in \[1, 5\]"):
        server(*[np.concatenate([a, a[:1]]) for a in x])


def test_padded_rows_read_nothing_and_bad_ids_give_sentinel_rows(server, head):
    x = make_inputs(CFG, 5, seed=5)
    want = np.asarray(xj.refine(head, *x))
    logits = np.array(x[0])
    logits[3:] = np.nan  # garbage beyond num_valid: never affects the valid rows
    anchors, prev = np.array(x[2]), np.array(x[3])
    anchors[3:], prev[3:] = [2**31 - 1, -7], [-(2**31), 10**6]
    bad = [jnp.asarray(logits), x[1], jnp.asarray(anchors), jnp.asarray(prev)]
    with serving() as compiles:
        out = np.asarray(server(*bad, num_valid=3))
        numpy_out = server.tokens(logits, np.asarray(x[1]), anchors, prev, num_valid=3)
    assert compiles() == 0
    np.testing.assert_array_equal(out[:3], want[:3])
    assert (out[3:] == xj.INVALID_TOKEN).all()
    np.testing.assert_array_equal(numpy_out, want[:3])
    # An out-of-range id in a valid row of a device array: that row is -1 (ids on the device are not read
    # back on the host), the others are unaffected.
    anchors = np.array(x[2])
    anchors[1] = CFG.vocab_size
    with serving() as compiles:
        out = np.asarray(server(x[0], x[1], jnp.asarray(anchors), x[3]))
    assert compiles() == 0
    assert (out[1] == xj.INVALID_TOKEN).all()
    np.testing.assert_array_equal(np.delete(out, 1, 0), np.delete(want, 1, 0))


def test_wrong_inputs_are_refused_with_a_clear_message_never_compiled(server):
    x = make_inputs(CFG, 5, seed=6)
    xn = [np.asarray(a) for a in x]
    bf16 = x[0].astype(jnp.bfloat16)
    wrong_v = jnp.zeros((5, CFG.block_size, CFG.vocab_size + 1), jnp.float32)
    n3 = [a[:3] for a in x]
    int64_big = xn[2].astype(np.int64)
    int64_big[1] = 2**32 + 5  # would wrap to a valid int32 id
    cases = [
        ((bf16, *x[1:]), {}, TypeError, r"logits is a jax.Array \(5, 5, 300\) bfloat16.*compiled for float32"),
        ((xn[0].astype(np.float64), *xn[1:]), {}, TypeError, r"logits is a numpy array .*float64.*never converted"),
        ((wrong_v, *x[1:]), {}, ValueError, r"logits is a jax.Array \(5, 5, 301\).*expected shape \(5, 5, 300\)"),
        ((x[0], x[1][:4], *x[2:]), {}, ValueError, r"h is a jax.Array \(4, 5, 32\)"),
        ((x[0], x[1], x[2].astype(jnp.float32)), {}, TypeError, r"anchors .* float32.*compiled for int32"),
        ((*xn[:2], xn[2].astype(np.float32)), {}, TypeError, r"anchors must hold integer token ids"),
        ((*xn[:2], int64_big), {}, ValueError, r"anchors has token ids outside \[0, 300\) at rows \[1\]"),
        (n3, {}, ValueError, r"logits is a jax.Array with N=3 blocks, which is not a bucket.*num_valid=3"),
        ((*xn[:3], x[3][:3]), {}, ValueError, r"expected shape \(5,\)"),
        ((*[a[:3] for a in xn[:3]], x[3][:3]), {}, ValueError, r"prev_ids is a jax.Array with N=3"),
        ((x[0].tolist(), *x[1:]), {}, TypeError, r"logits must be a numpy array or a jax.Array"),
        (x, {"num_valid": 0}, ValueError, r"num_valid must be in \[1, N=5\]"),
        (x, {"num_valid": 6}, ValueError, r"num_valid must be in \[1, N=5\]"),
        (x, {"num_valid": 2.0}, TypeError, r"num_valid must be an int"),
    ]
    for args, kw, err, msg in cases:
        with serving() as compiles:
            with pytest.raises(err, match=msg):
                server(*args, **kw)
        assert compiles() == 0, msg


def test_reload_reuses_the_executables_and_bad_weights_keep_the_old_ones(server, head):
    x = make_inputs(CFG, 5, seed=7)
    head2 = jax.tree.map(lambda w: w * 1.5, head)
    want1, want2 = np.asarray(xj.refine(head, *x)), np.asarray(xj.refine(head2, *x))
    assert (want1 != want2).mean() > 0.2  # the reload is visible in the tokens
    with serving() as compiles:
        server.reload(head2)
        out = np.asarray(server(*x))
    assert compiles() == 0
    np.testing.assert_array_equal(out, want2)
    host_params = {k: np.asarray(v) for k, v in head.params.items()}
    with serving() as compiles:
        server.reload(host_params)  # numpy weights: placed, same executables
        np.testing.assert_array_equal(np.asarray(server(*x)), want1)
    assert compiles() == 0
    server.reload(head2)
    bad = [
        (dict(head.params, w1=jnp.zeros((CFG.vocab_size + 1, CFG.rank))), ValueError, r"params\['w1'\] has shape"),
        (dict(head.params, mix=head.params["mix"].astype(jnp.bfloat16)), TypeError, r"dtype"),
        (head.astype(jnp.bfloat16), TypeError, r"params\['w1'\] has dtype bfloat16.*compiled for float32"),
        (xj.Head(dataclasses.replace(CFG, num_passes=2), head.params), ValueError, r"differs from the compiled"),
        ({k: v for k, v in head.params.items() if k != "w2"}, ValueError, r"missing \['w2'\]"),
    ]
    for new, err, msg in bad:
        with pytest.raises(err, match=msg):
            server.reload(new)
        with serving() as compiles:
            np.testing.assert_array_equal(np.asarray(server(*x)), want2)  # the old weights still serve
        assert compiles() == 0


@pytest.mark.slow
def test_from_checkpoint_and_reload_from(tmp_path, head):
    path = xj.save_params(tmp_path / "a", head)
    path2 = xj.save_params(tmp_path / "b", jax.tree.map(lambda w: w * 1.5, head))
    other = xj.save_params(tmp_path / "c", xj.init_head(dataclasses.replace(CFG, rank=16), jax.random.key(1)))
    server = xj.RefineServer.from_checkpoint(path, buckets=(2,), progress=False)
    x = make_inputs(CFG, 2, seed=8)
    want1 = np.asarray(xj.refine(head, *x))
    with serving() as compiles:
        np.testing.assert_array_equal(np.asarray(server(*x)), want1)
    assert compiles() == 0
    start = len(COMPILES)
    server.reload_from(path2)
    assert len(COMPILES) == start  # restoring checkpoints compiles nothing either
    want2 = np.asarray(xj.refine(jax.tree.map(lambda w: w * 1.5, head), *x))
    with serving():
        np.testing.assert_array_equal(np.asarray(server(*x)), want2)
    with pytest.raises(ValueError, match=r"holds a head with config .*rank=16"):
        server.reload_from(other)
    with serving():
        np.testing.assert_array_equal(np.asarray(server(*x)), want2)


@pytest.mark.slow
def test_host_output_same_tokens_in_pinned_host_memory_without_trace_or_compile(server, head):
    """output="host": every executable puts the tokens in pinned host memory; the same tokens as the
    device-output server for every input kind and every num_valid, and serving never traces or compiles."""
    start = len(COMPILES)
    host = xj.RefineServer(head, buckets=BUCKETS, output="host", progress=False)
    assert len(COMPILES) - start == len(BUCKETS)
    assert host.input_shardings(5)["out"].memory_kind == "pinned_host"
    assert server.input_shardings(5)["out"].memory_kind in (None, "device")
    x = make_inputs(CFG, 5, seed=3)
    placed = [jax.device_put(a, host.input_specs(5)[k].sharding) for a, k in zip(x, ("logits", "h", "anchors",
                                                                                        "prev_ids"))]
    for k in range(1, 6):
        want = expected(head, x, k)
        with serving() as compiles:
            for xs in (x, placed, [np.asarray(a) for a in x]):
                out = host(*xs, num_valid=k)
                assert out.sharding.memory_kind == "pinned_host"
                np.testing.assert_array_equal(np.asarray(out), want)
                np.testing.assert_array_equal(np.asarray(out), np.asarray(server(*xs, num_valid=k)))
            np.testing.assert_array_equal(host.tokens(*[np.asarray(a)[:k] for a in x]), want[:k])  # padded, bucket
        assert compiles() == 0, k
    assert "output='host'" in repr(host)


def test_early_exit_server_same_tokens_without_trace_or_compile(server, head):
    """early_exit=True (and a tuple of checks): the executables stop at the passes' fixed point; the same
    tokens as the plain server for every num_valid, no trace or compile while serving; bad values refused."""
    x = make_inputs(CFG, 5, seed=4)
    for ee in (True, (1,)):
        fast = xj.RefineServer(head, buckets=(5,), early_exit=ee, progress=False)
        with serving() as compiles:
            for k in (1, 3, 5):
                np.testing.assert_array_equal(np.asarray(fast(*x, num_valid=k)), np.asarray(server(*x, num_valid=k)))
        assert compiles() == 0
    with pytest.raises(TypeError, match="early_exit must be a bool or a tuple"):
        xj.RefineServer(head, buckets=(2,), early_exit="yes", progress=False)
    with pytest.raises(ValueError, match="early_exit's pass numbers must lie in"):
        xj.RefineServer(head, buckets=(2,), early_exit=(3,), progress=False)  # K=3: a check after pass 3 skips nothing


@pytest.mark.slow
def test_token_table_server_same_tokens_and_follows_reloads(server, head):
    """token_table (on by default, one device): the same tokens as a server without it for every num_valid,
    before and after a reload (the table is recomputed with the weights); no trace or compile while
    serving; bad values refused."""
    assert server.token_table and "token_table=True" in repr(server)
    plain = xj.RefineServer(head, buckets=(5,), token_table=False, progress=False)
    assert plain._table is None and "token_table=False" in repr(plain)
    x = make_inputs(CFG, 5, seed=6)
    head2 = jax.tree.map(lambda w: w * 1.5, head)
    for weights in (head, head2):
        server.reload(weights)
        plain.reload(weights)
        want = np.asarray(xj.refine(weights, *x))  # rows are independent
        with serving() as compiles:
            for k in (1, 4, 5):
                got = np.asarray(server(*x, num_valid=k))
                np.testing.assert_array_equal(got, np.asarray(plain(*x, num_valid=k)))
                np.testing.assert_array_equal(got[:k], want[:k])
        assert compiles() == 0
    np.testing.assert_array_equal(np.asarray(server._table), np.asarray(xj.token_table(head2)))
    with pytest.raises(TypeError, match="token_table must be None, True or False"):
        xj.RefineServer(head, buckets=(2,), token_table="yes", progress=False)


def test_constructor_refuses_what_it_cannot_serve(head):
    with pytest.raises(ValueError, match=r"output must be 'device' or 'host', got 'pinned'"):
        xj.RefineServer(head, output="pinned")
    with pytest.raises(TypeError, match=r"RefineServer\(head\): head must be a xpress_jax.Head"):
        xj.RefineServer(head.params)
    with pytest.raises(ValueError, match=r"buckets must lie in \[1, max_num_reqs=8\]"):
        xj.RefineServer(head, buckets=(4, 9))
    with pytest.raises(ValueError, match=r"backend must be one of"):
        xj.RefineServer(head, backend="triton")


#: What both child scripts start with: 4 host devices, a counter of XLA compiles, the test head.
_CHILD_PREAMBLE = """
import sys, tempfile
import jax, jax.numpy as jnp, numpy as np, xpress_jax as xj
from jax.sharding import Mesh
from helpers import make_head, make_inputs
assert len(jax.devices()) == 4, jax.devices()
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **kw: compiles.append(name) if "backend_compile" in name else None)
cfg = xj.HeadConfig(**{cfg})
head = xj.Head(cfg, make_head(cfg))
"""

_DEVICES_SCRIPT = """
server = xj.RefineServer(head, buckets=(2,), progress=False)
x = make_inputs(cfg, 2)
on1 = [jax.device_put(a, jax.devices()[1]) for a in x]
start = len(compiles)
with jax.no_tracing():
    try:
        server(on1[0], *x[1:])
        raise SystemExit("an input on another device was accepted")
    except ValueError as e:
        assert "logits is a jax.Array" in str(e) and "CpuDevice(id=1)" in str(e) and "CpuDevice(id=0)" in str(e), e
        assert "jax.device_put(x, server.input_specs(2)['logits'].sharding)" in str(e), e
    try:
        server(*x[:3], on1[3])
        raise SystemExit("prev_ids on another device was accepted")
    except ValueError as e:
        assert "prev_ids is a jax.Array" in str(e) and "input_specs(2)['prev_ids'].sharding" in str(e), e
    try:
        server.reload(jax.device_put(head, jax.devices()[1]))
        raise SystemExit("weights on another device were accepted")
    except ValueError as e:
        assert "params['down_g'] has sharding" in str(e) or "params['w1'] has sharding" in str(e), e
    out = np.asarray(server(*x))
assert len(compiles) == start, compiles[start:]
np.testing.assert_array_equal(out, np.asarray(xj.refine(head, *x)))
print("OK")
"""


def run_on_4_host_devices(script: str) -> str:
    """Run ``_CHILD_PREAMBLE`` + ``script`` (dedented; ``{cfg}`` = the test config, ``{{``/``}}`` = braces)
    on 4 host devices."""
    code = textwrap.dedent(_CHILD_PREAMBLE) + textwrap.dedent(script)
    code = code.replace("{cfg}", repr(dataclasses.asdict(CFG))).replace("{{", "{").replace("}}", "}")
    out = run_on_host_devices(["-c", code], timeout=300)
    assert out.strip().endswith("OK"), out
    return out


@pytest.mark.slow
def test_an_input_or_weights_on_another_device_are_refused():
    run_on_4_host_devices(_DEVICES_SCRIPT)


_MESH_SCRIPT = """
head2 = jax.tree.map(lambda w: w * 1.5, head)
tmp = tempfile.mkdtemp()
path2 = xj.save_params(tmp + "/b", head2)
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
server = xj.RefineServer(head, buckets=(3, 4), mesh=mesh, progress=False)  # 3: the data axis does not divide it
assert sorted(server.executables) == [3, 4]
assert server.param_shardings["w2"].spec == jax.sharding.PartitionSpec("model", None), server.param_shardings
assert server.head.params["w1"].sharding.is_equivalent_to(server.param_shardings["w1"], 2)
x = make_inputs(cfg, 4, seed=2)
want = {{h: np.asarray(xj.refine(hd, *x)) for h, hd in (("1", head), ("2", head2))}}
names = ("logits", "h", "anchors", "prev_ids")
host_args = lambda server, b, xs: [jax.device_put(a, server.input_specs(b)[k].sharding) for a, k in zip(xs, names)]
placed = [jax.device_put(a, server.input_specs(4)[k].sharding) for a, k in zip(x, names)]
host = [np.asarray(a) for a in x]
start = len(compiles)
with jax.no_tracing():
    for k in range(1, 5):
        for xs in (placed, host):
            out = np.asarray(server(*xs, num_valid=k))
            np.testing.assert_array_equal(out[:k], want["1"][:k])
            assert (out[k:] == -1).all()
        np.testing.assert_array_equal(server.tokens(*[a[:k] for a in host]), want["1"][:k])  # buckets 3 and 4
    try:
        server(*x)  # single-device arrays: not where bucket 4 was compiled
        raise SystemExit("an input on one device was accepted by the mesh server")
    except ValueError as e:
        assert "logits is a jax.Array" in str(e) and "NamedSharding" in str(e), e
    try:
        server.reload(head2)  # weights on one device
        raise SystemExit("single-device weights were accepted by the mesh server")
    except ValueError as e:
        assert "has sharding" in str(e) and "param_shardings" in str(e), e
    np.testing.assert_array_equal(np.asarray(server(*placed)), want["1"])
    server.reload({{k: np.asarray(v) for k, v in head2.params.items()}})  # numpy weights: placed
    np.testing.assert_array_equal(np.asarray(server(*placed)), want["2"])
server.reload_from(path2)  # restored onto param_shardings
with jax.no_tracing():
    np.testing.assert_array_equal(np.asarray(server(*placed)), want["2"])
assert len(compiles) == start, compiles[start:]
try:
    xj.RefineServer(head, buckets=(3,), mesh=mesh, progress=False, early_exit=True)
    raise SystemExit("early_exit was accepted with a mesh")
except ValueError as e:
    assert "early_exit=True runs on one device" in str(e), e
try:
    xj.RefineServer(head, buckets=(3,), mesh=mesh, progress=False, token_table=True)
    raise SystemExit("token_table=True was accepted with a mesh")
except ValueError as e:
    assert "token_table=True runs on one device" in str(e), e
assert not server.token_table  # None: off with a mesh
host = xj.RefineServer(head, buckets=(3,), mesh=mesh, progress=False, output="host")  # tokens in host memory
args3 = host_args(host, 3, [np.asarray(a)[:3] for a in x])
start = len(compiles)
with jax.no_tracing():
    out = host(*args3)
assert len(compiles) == start, compiles[start:]
assert out.sharding.memory_kind == "pinned_host", out.sharding
np.testing.assert_array_equal(np.asarray(out), want["1"][:3])
print("OK")
"""


@pytest.mark.slow
def test_on_a_2x2_mesh_same_tokens_as_refine_and_no_compile_after_start_up():
    run_on_4_host_devices(_MESH_SCRIPT)
