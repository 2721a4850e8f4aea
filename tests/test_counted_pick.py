"""The counted top-C pick: one launch, the last program of each row combining its splits.

`kernels.topc_pick.topc_pick(..., counter=)` counts each program's arrival on its row's counter (an
acquire-release atomic); the program that arrives last reads the row's partial winners and writes the
row's id, then sets the counter back to 0. The claim: the same ids as the plain pick (whose second
launch, `combine_splits`, reduces the same partials by the same rule), and counters that come back
zeros, so refine can thread them from pass to pass. Checked:

- the counted pick against the plain pick on fresh random inputs: several splits with a partial last
  split, a C tail inside a tile, one split (the counter untouched), C = 1, rank tails, float32 /
  bfloat16 / float16, with ``lat_add`` and with ``skip``; the counter comes back zeros;
- (GPU) many counted picks in one jitted loop, each on other inputs, threading the counter, with up
  to 64 splits per row racing on it: a missed or early combine anywhere shows as a differing id;
- refine with the counters against refine without them (`Ops.topc_counter`), plain and early exit;
- the counted kernel builds for an H200 at serving shapes (atomic and barrier in its Triton IR);
- bad counters are refused, naming the argument.

`TestCountedPick` runs compiled (GPU only); `TestCountedPickInterpret` runs the same tests in interpret
mode on the CPU (there the programs run one after another, so only the GPU run exercises the race).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax.kernels import common
from xpress_jax.kernels import topc_pick as tp
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

from conftest import make_head, make_inputs, pick_inputs

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

# (rows, V, C, r, config): splits = cdiv(C, c_tile * c_steps).
SHAPES = [
    (15, 1000, 512, 32, tp.TopCConfig(c_tile=64, c_steps=1, k_tile=16)),  # 8 splits, N=1-like
    (25, 5000, 500, 20, tp.TopCConfig(c_tile=64, c_steps=3, k_tile=16)),  # 3 splits, the last partial; rank tail
    (7, 301, 77, 24, tp.TopCConfig(c_tile=16, c_steps=1, k_tile=8)),  # 5 splits, C tail in the last tile
    (9, 400, 33, 16, tp.TopCConfig(c_tile=64, c_steps=1)),  # one split: the counter is not touched
    (11, 300, 1, 8, tp.TopCConfig(c_tile=1, c_steps=1)),  # C = 1
]


def _inputs(rows, vocab, c, rank, dtype, seed):
    base, lat, w2 = pick_inputs(rows, vocab, rank, dtype, seed)
    base_c, cand = jax.lax.top_k(base, c)
    perm = jax.random.permutation(jax.random.key(seed + 1), c)
    return base_c[:, perm], cand[:, perm].astype(jnp.int32), lat, w2


class TestCountedPick:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not common.gpu_supported():
            pytest.skip("needs a CUDA GPU; TestCountedPickInterpret runs these tests on CPU")

    @pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"rows{s[0]}-C{s[2]}-r{s[3]}")
    def test_same_ids_as_the_plain_pick(self, shape, dtype):
        rows, vocab, c, rank, cfg = shape
        base_c, cand, lat, w2 = _inputs(rows, vocab, c, rank, dtype, seed=rows + c)
        want = np.asarray(tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=cfg))
        ids, cnt = tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=cfg,
                                counter=tp.new_counter(rows))
        np.testing.assert_array_equal(np.asarray(ids), want)
        assert np.asarray(ids).dtype == np.int32 and np.asarray(ids).shape == (rows,)
        np.testing.assert_array_equal(np.asarray(cnt), np.zeros(rows, np.int32))

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
    def test_with_lat_add_and_skip(self, dtype):
        """The latent's residual terms (``lat_add``) and the skip flag work as in the plain pick: the same ids,
        and a skipped pick gives `BIG` for every row (its counters zeros again)."""
        rows, vocab, c, rank, cfg = SHAPES[2]
        base_c, cand, _, w2 = _inputs(rows, vocab, c, rank, dtype, seed=5)
        k1, k2 = jax.random.split(jax.random.key(6))
        u = jax.random.normal(k1, (rows, rank), jnp.float32)
        d = jax.random.normal(k2, (rows, rank), jnp.float32)
        kw = dict(interpret=self.INTERPRET, config=cfg)
        want = np.asarray(tp.topc_pick(base_c, cand, u, w2, lat_add=d, **kw))
        assert not np.array_equal(want, np.asarray(tp.topc_pick(base_c, cand, u.astype(dtype), w2, **kw)))
        ids, cnt = tp.topc_pick(base_c, cand, u, w2, lat_add=d, counter=tp.new_counter(rows), **kw)
        np.testing.assert_array_equal(np.asarray(ids), want)
        for off, on in ((jnp.bool_(False), jnp.bool_(True)), (jnp.int32(0), jnp.int32(3))):
            ids, cnt = tp.topc_pick(base_c, cand, u, w2, lat_add=d, counter=cnt, skip=off, **kw)
            np.testing.assert_array_equal(np.asarray(ids), want)
            ids, cnt = tp.topc_pick(base_c, cand, u, w2, lat_add=d, counter=cnt, skip=on, **kw)
            assert (np.asarray(ids) == common.BIG).all()
            assert not np.asarray(cnt).any()

    @pytest.mark.parametrize("splits", [8, 64])
    def test_many_picks_threading_the_counter(self, splits):
        """40 counted picks in one jitted loop, each on its own latent, the counter threaded through: every
        pick's ids equal the plain pick's. On a GPU the programs of a row race on its counter (up to 64);
        a program that combined before the last partial landed, or read a stale one, would show here."""
        rows, vocab, c, rank, dtype = 15, 4000, 512, 32, jnp.bfloat16
        cfg = tp.TopCConfig(c_tile=512 // splits, c_steps=1, k_tile=32)
        base_c, cand, _, w2 = _inputs(rows, vocab, c, rank, dtype, seed=splits)
        steps = 40 if not self.INTERPRET else 3
        lats = jax.random.normal(jax.random.key(splits + 1), (steps, rows, rank), jnp.float32).astype(dtype)
        plain = jax.jit(jax.vmap(lambda x: tp.topc_pick(base_c, cand, x, w2, interpret=self.INTERPRET, config=cfg)))
        want = np.asarray(plain(lats))

        @jax.jit
        def chain(lats):
            def body(i, carry):
                out, cnt = carry
                ids, cnt = tp.topc_pick(base_c, cand, lats[i], w2, interpret=self.INTERPRET, config=cfg, counter=cnt)
                return out.at[i].set(ids), cnt

            return jax.lax.fori_loop(0, steps, body, (jnp.zeros((steps, rows), jnp.int32), tp.new_counter(rows)))

        got, cnt = chain(lats)
        bad = np.argwhere(np.asarray(got) != want)
        assert bad.size == 0, f"{len(bad)} ids differ (step, row): {bad[:8].tolist()}"
        assert not np.asarray(cnt).any()

    def test_bad_counter(self):
        base_c, cand, lat, w2 = _inputs(15, 300, 40, 8, jnp.float32, seed=4)
        kw = dict(interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="counter"):
            tp.topc_pick(base_c, cand, lat, w2, counter=jnp.zeros((14,), jnp.int32), **kw)
        with pytest.raises(ValueError, match="counter"):
            tp.topc_pick(base_c, cand, lat, w2, counter=jnp.zeros((15,), jnp.float32), **kw)
        with pytest.raises(ValueError, match="partials"):
            tp.topc_pick(base_c, cand, lat, w2, counter=tp.new_counter(15), partials=True, **kw)


class TestCountedPickInterpret(TestCountedPick):
    INTERPRET = True


# -- refine: the counters give the tokens of the two-launch pick -------------------------------------
CFG = xj.HeadConfig(vocab_size=301, hidden_size=40, block_size=7, rank=20, mlp_hidden=24, topc=11,
                    num_passes=4, max_num_reqs=16)


@pytest.mark.interpret
@pytest.mark.parametrize("topc,dtype", [  # each C and each dtype once in the default run, the rest slow
    pytest.param(c, dt, id=f"C{c}-{jnp.dtype(dt).name}", marks=pytest.mark.slow if i != j else ())
    for i, c in enumerate([1, 77, 301]) for j, dt in enumerate(DTYPES)])
def test_refine_same_tokens_with_the_counters(topc, dtype):
    """Pallas steps (interpret): refine threading the counters (`Ops.topc_counter`) against the combine launch,
    with a fixed number of passes and with early exit (while loop and unrolled)."""
    params = make_head(CFG, seed=31, dtype=dtype, std=0.5)
    logits, h, anchors, prev = make_inputs(CFG, 3, seed=32, dtype=dtype)
    ops = Ops.pallas(True)
    assert ops.topc_counter and not Ops.xla().topc_counter
    plain = dataclasses.replace(ops, topc_counter=False)
    kw = dict(num_passes=CFG.num_passes, topc=topc)
    want = np.asarray(refine_with(plain, params, logits, h, anchors, prev, **kw))
    np.testing.assert_array_equal(np.asarray(refine_with(ops, params, logits, h, anchors, prev, **kw)), want)
    for unroll in (False, True):
        got = refine_with(ops, params, logits, h, anchors, prev, early_exit=True, unroll=unroll, **kw)
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("rows", [15, 240])
def test_counted_pick_lowers_for_an_h200(rows):
    """The counted kernel builds for an H200 at serving shapes (on a CPU: Triton lowering): one launch, no
    combine launch, an atomic and a barrier in the kernel, the counter aliased to an output."""
    V, C, r, dt = 151936, 512, 256, jnp.bfloat16
    S = jax.ShapeDtypeStruct
    cfg = tp.default_config(rows, C, r, dt)
    assert common.cdiv(C, cfg.c_tile * cfg.c_steps) > 1
    f = functools.partial(tp.topc_pick, config=cfg)
    hlo = common.lower_triton(lambda b, c, u, w, d, k: f(b, c, u, w, lat_add=d, counter=k), S((rows, C), dt),
                              S((rows, C), jnp.int32), S((rows, r), jnp.float32), S((V, r), dt),
                              S((rows, r), jnp.float32), S((rows,), jnp.int32)).as_text()
    assert 'name = "xpress_topc_pick_counted"' in hlo and "xpress_topc_combine" not in hlo
    assert "atomic_rmw" in hlo and "barrier" in hlo and "output_operand_alias" in hlo
