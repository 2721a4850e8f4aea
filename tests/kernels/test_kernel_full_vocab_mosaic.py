"""The Mosaic GPU full-vocab pick (xpress_jax.kernels.full_vocab_mosaic) against the jnp oracle.

On a CPU the kernel runs in Mosaic GPU's interpret mode (its logic: pipeline, masks, tie rule, part combine) and is
lowered for an H100 (the Mosaic GPU IR is built). Token ids are demanded equal: the inputs are "dyadic" (small
integers: every dot and sum exact in any order, with many genuine ties), or random with few rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xpress_jax import reference as R
from xpress_jax.kernels import full_vocab_mosaic as fm

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
if not hasattr(plgpu, "InterpretGPUParams"):  # JAX 0.10.x: Mosaic GPU has no interpret mode, nor this API
    pytest.skip(f"newer JAX: Mosaic GPU's interpret mode needs JAX >= 0.11 (this is {jax.__version__})",
                allow_module_level=True)

C = fm.MosaicFullVocabConfig


def _inputs(rows, vocab, rank, kind, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    if kind == "dyadic":
        base = jax.random.randint(k[0], (rows, vocab), 0, 2).astype(jnp.bfloat16)
        lat = jax.random.randint(k[1], (rows, rank), 0, 2).astype(jnp.bfloat16)
        w2 = (jax.random.uniform(k[2], (vocab, rank)) < 0.25 / rank).astype(jnp.bfloat16)
        return base, lat, w2
    base = (jax.random.normal(k[0], (rows, vocab)) * 2).astype(jnp.bfloat16)
    lat = jax.random.normal(k[1], (rows, rank)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k[2], (vocab, rank)) * 0.06).astype(jnp.bfloat16)
    if kind == "special":
        b = np.array(base.astype(jnp.float32))
        b[0, :] = np.nan  # all NaN: id 0
        b[1, :] = -np.inf  # all -inf: id 0
        b[2, [vocab // 3, vocab - 1]] = np.inf  # the first +inf
        b[3, ::2] = np.nan
        b[3, vocab - 1] = 50.0  # NaN never wins
        b[4, :] = -np.inf
        b[4, vocab - 1] = -1.0  # the only finite score, in the last (partial) tile
        base = jnp.asarray(b).astype(jnp.bfloat16)
    if kind == "tie_lanes":  # equal best scores at one lane of several tiles: the lowest id
        b = np.full((rows, vocab), -8.0, np.float32)
        rng = np.random.default_rng(seed)
        for q in range(rows):
            b[q, rng.integers(0, 256) + 256 * np.sort(rng.choice((vocab - 256) // 256, 3, replace=False))] = 5.0
        base, lat = jnp.asarray(b).astype(jnp.bfloat16), jnp.zeros_like(lat)
    return base, lat, w2


CASES = [
    (17, 1001, 64, "dyadic", None),
    (65, 4097, 128, "dyadic", C(parts=3)),
    (70, 1001, 64, "special", C(v_tile=64, parts=2)),
    (17, 4097, 64, "tie_lanes", C(parts=3)),
    (65, 1001, 64, "dyadic", C(row_tile=128, v_tile=64, parts=2)),
    (17, 1001, 128, "dyadic", C(base_tile_rows=8, stages=3, parts=2)),
    (70, 4097, 64, "special", C(eager=True, parts=3)),
    (17, 4097, 64, "tie_lanes", C(eager=True, v_tile=192, stages=1, parts=2)),
    (130, 4097, 64, "tie_lanes", C(compute_wgs=2, v_tile=64, stages=3, parts=3)),
    (70, 1001, 64, "special", C(compute_wgs=2, v_tile=64, stages=3, eager=True, parts=2)),
    (1, 1000, 256, "random", None),
]


#: Run by default: a dyadic, a special-values and a tie case; the rest under `slow`.
FAST = {0, 2, 3}


def _hopper() -> bool:
    """A GPU of compute capability 9.x (the kernel's wgmma and TMA): the compiled twin runs there."""
    return any(d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9.")
               for d in jax.devices())


CASE_PARAMS = [pytest.param(*c, marks=() if i in FAST else pytest.mark.slow, id=f"{c[0]}x{c[1]}x{c[2]}-{c[3]}-{i}")
               for i, c in enumerate(CASES)]


@pytest.mark.interpret
@pytest.mark.parametrize("rows,vocab,rank,kind,cfg", CASE_PARAMS)
def test_pick_interpret(rows, vocab, rank, kind, cfg):
    base, lat, w2 = _inputs(rows, vocab, rank, kind)
    got = fm.full_vocab_pick(base, lat, w2, config=cfg, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(R.full_vocab_pick(base, lat, w2)))


@pytest.mark.parametrize("rows,vocab,rank,kind,cfg", [pytest.param(*p.values, id=p.id) for p in CASE_PARAMS])
def test_pick_compiled(rows, vocab, rank, kind, cfg):
    """The compiled kernel on a Hopper GPU: the same tokens as the jnp oracle (exact inputs: no rounding can differ)."""
    if not _hopper():
        pytest.skip("GPU only: the Mosaic GPU kernel compiles for sm90")
    base, lat, w2 = _inputs(rows, vocab, rank, kind)
    got = jax.jit(functools.partial(fm.full_vocab_pick, config=cfg))(base, lat, w2)
    want = jax.jit(R.full_vocab_pick)(base, lat, w2)
    if kind == "random":  # float reassociation (wgmma vs XLA's dot) may flip near ties: a one-rounding margin
        s = np.asarray(jax.jit(lambda b, l, w: R.round_sum(b, R.readout(l, w, b.dtype)))(base, lat, w2), np.float32)
        g, w = np.asarray(got), np.asarray(want)
        gap = np.abs(s[np.arange(len(g)), g] - s[np.arange(len(w)), w])
        assert np.all((g == w) | (gap <= np.abs(s[np.arange(len(w)), w]) * 2.0 ** -7)), (g, w, gap)
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("rows,vocab,cfg", [
    (15, 151936, None), pytest.param(3840, 151936, C(compute_wgs=2, v_tile=64, stages=3), marks=pytest.mark.slow),
    (17, 1001, C(eager=True))])
def test_lowers_for_h100(rows, vocab, cfg):
    """The Mosaic GPU kernel lowers for CUDA on a CPU (the IR is built; nothing runs)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    s = jax.ShapeDtypeStruct
    args = (s((rows, vocab), jnp.bfloat16), s((rows, 256), jnp.bfloat16), s((vocab, 256), jnp.bfloat16))
    with jax.sharding.use_abstract_mesh(mesh):
        low = jax.jit(functools.partial(fm.full_vocab_pick, config=cfg)).trace(*args).lower(
            lowering_platforms=("cuda",))
    assert "mosaic_gpu" in low.as_text()


def test_refuses_unsupported_shapes():
    base, lat, w2 = (jnp.zeros((3, 100), jnp.bfloat16), jnp.zeros((3, 96), jnp.bfloat16),
                     jnp.zeros((100, 96), jnp.bfloat16))
    with pytest.raises(ValueError, match="multiple of 64"):
        fm.full_vocab_pick(base, lat, w2)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        fm.full_vocab_pick(base.astype(jnp.float32), lat[:, :64].astype(jnp.float32), w2[:, :64].astype(jnp.float32))
    with pytest.raises(ValueError, match="shared memory"):
        fm.full_vocab_pick(base, lat[:, :64], w2[:, :64], config=C(compute_wgs=2, stages=8))
