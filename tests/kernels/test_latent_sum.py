"""The residual inside the top-C pick (`xpress_jax.reference.LatentSum`, the kernel's ``lat_add``).

Where XLA computes a top-C pass's latent (where the dispatch entry's ``latent_terms`` says so), the
Pallas backend hands the pick the residual's two float32 terms ``(u, d)`` and the kernel forms
``round(u + d)`` as it loads the latent, instead of an XLA kernel doing it. The claim: the same latent,
so the same tokens. Checked:

- the pick kernel with ``lat_add`` against the same kernel given ``round_to(u + d)`` (bit for bit:
  after the load both run the same code on the same values), on random inputs where dropping ``d``
  changes the tokens (so the test would see a kernel that ignored it);
- the rounding itself at halfway points and float16 subnormals, where a truncating, flushing or
  missing rounding picks another id;
- refine with the latent in two terms against refine without it, for top-C (C = 1, 11, V), in float32,
  bfloat16 and float16 (full-vocab passes take the latent itself: the fused pick measured slower with the terms);
- the Pallas steps hand over the terms exactly where the entries' ``latent_terms`` says so.

`TestLatentSum` runs the kernel compiled (GPU only); `TestLatentSumInterpret` runs the same tests in
interpret mode on the CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax import reference as R
from xpress_jax.head import round_to
from xpress_jax.kernels import common
from xpress_jax.kernels import topc_pick as tp
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

from helpers import lower_triton, make_head, make_inputs, pick_inputs

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SLOW = pytest.mark.slow
PICK_CASES = [  # splits, C tail, rank tail; C = 1
    pytest.param(*case, dt, id=f"{'-'.join(map(str, case[:4]))}-{case_id}-{jnp.dtype(dt).name}",
                 marks=() if (case[0], dt) == (6, jnp.bfloat16) else SLOW)
    for case, case_id in (((15, 1000, 100, 32, None), "None"),
                          ((25, 777, 77, 20, tp.TopCConfig(c_tile=16, c_steps=2, k_tile=16)), "config1"),
                          ((6, 301, 1, 20, None), "None"))
    for dt in DTYPES]

# Odd V and B, a rank that is not a power of two (a masked tail chunk in both kernels).
CFG = xj.HeadConfig(vocab_size=301, hidden_size=40, block_size=7, rank=20, mlp_hidden=24, topc=11,
                    num_passes=6, max_num_reqs=16)


def _terms(rows, rank, seed, scale=1.0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    u = jax.random.normal(k1, (rows, rank), jnp.float32) * scale
    d = jax.random.normal(k2, (rows, rank), jnp.float32) * scale
    return u, d


def _topc_inputs(rows, vocab, c, rank, dtype, seed):
    base, _, w2 = pick_inputs(rows, vocab, rank, dtype, seed + 100)
    base_c, cand = jax.lax.top_k(base, c)
    return base_c, cand.astype(jnp.int32), w2


class TestLatentSum:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not common.gpu_supported():
            pytest.skip("compiled Pallas-Triton kernels need an NVIDIA GPU (compute capability >= 8.0)")

    # -- the kernels ------------------------------------------------------------------------------
    @pytest.mark.parametrize("rows,vocab,c,rank,config,dtype", PICK_CASES)
    def test_topc_pick_adds_the_terms(self, rows, vocab, c, rank, config, dtype):
        base_c, cand, w2 = _topc_inputs(rows, vocab, c, rank, dtype, seed=rows)
        u, d = _terms(rows, rank, seed=rows)
        kw = dict(interpret=self.INTERPRET, config=config)
        want = np.asarray(tp.topc_pick(base_c, cand, round_to(u + d, dtype), w2, **kw))
        got = np.asarray(tp.topc_pick(base_c, cand, u, w2, lat_add=d, **kw))
        np.testing.assert_array_equal(got, want)
        if c > 1:  # the inputs see d: without it the tokens change
            assert (np.asarray(tp.topc_pick(base_c, cand, round_to(u, dtype), w2, **kw)) != want).any()

    @pytest.mark.parametrize("dtype", [pytest.param(jnp.bfloat16, marks=pytest.mark.slow), jnp.float16])
    def test_the_rounding_is_to_nearest_even(self, dtype):
        """Zero base logits and ``w2[v] = e_v - e_15``: id v scores ``lat[v] - lat[15]``, exact in
        float32, so the winner shows how each latent value rounded (the bias's own rounding cannot
        hide it: the difference is a small exact number). ``lat[15]`` = 1 in rows 0-2; every row must
        pick id 0 through a tie with id 1 (the lowest id wins):
        row 0: id 0 = 1, id 1 = 1 + ulp/2, which rounds down to 1 (even); unrounded or rounded up: id 1;
        row 1: id 0 = 1 + 1.5 ulp, which rounds up to 1 + 2 ulp (even) = id 1; truncated or unrounded: id 1;
        row 2: id 0 = 1 + 2 ulp, id 1 = 1 + 2.5 ulp, which rounds down to 1 + 2 ulp; otherwise id 1;
        row 3 (float16, ``lat[15]`` = 0): id 0 = 1.5 subnormal ulps, which rounds up to 2 = id 1; a flush
        to zero or truncation: id 1."""
        fi = jnp.finfo(dtype)
        ulp = float(2.0 ** -int(fi.nmant))
        tiny = float(2.0 ** (int(fi.minexp) - int(fi.nmant)))  # the smallest subnormal
        rank = 16
        vals = np.full((4, rank), -4.0, np.float64)
        vals[:3, 15] = 1.0
        vals[0, :2] = (1, 1 + ulp / 2)
        vals[1, :2] = (1 + 1.5 * ulp, 1 + 2 * ulp)
        vals[2, :2] = (1 + 2 * ulp, 1 + 2.5 * ulp)
        if dtype == jnp.float16:
            vals[3, :2], vals[3, 15] = (1.5 * tiny, 2 * tiny), 0.0
        else:
            vals[3] = vals[0]
        want_ids = [0, 0, 0, 0]
        # Split every value into two float32 terms whose float32 sum is the value exactly.
        d = np.where(np.abs(vals) > 1e-3, 0.25, 0.0).astype(np.float32)
        u = (vals - d).astype(np.float32)
        assert np.array_equal(u.astype(np.float64) + d, vals)
        u, d = jnp.asarray(u), jnp.asarray(d)
        w2 = (np.eye(rank) - np.eye(rank)[15][None, :]).astype(np.float32)
        w2 = jnp.asarray(w2, dtype)
        base = jnp.zeros((4, rank), dtype)
        cand = jnp.broadcast_to(jnp.arange(rank, dtype=jnp.int32), (4, rank))
        ref_ids = np.asarray(R.topc_pick(base, cand, round_to(u + d, dtype), R.topc_gather(w2, cand)))
        np.testing.assert_array_equal(ref_ids, want_ids)  # the oracle's rounding, as the docstring says
        unrounded = np.asarray(R.topc_pick(base.astype(jnp.float32), cand, u + d, R.topc_gather(w2, cand).astype(jnp.float32)))
        assert (unrounded[:3] == 1).all()  # without the rounding the other id wins (the test can fail)
        got = tp.topc_pick(base, cand, u, w2, lat_add=d, interpret=self.INTERPRET)
        np.testing.assert_array_equal(np.asarray(got), want_ids)

    def test_lat_add_is_checked(self):
        base_c, cand, w2 = _topc_inputs(6, 301, 11, 20, jnp.bfloat16, seed=0)
        u, d = _terms(6, 20, seed=0)
        with pytest.raises(ValueError, match="lat_add"):
            tp.topc_pick(base_c, cand, u.astype(jnp.bfloat16), w2, lat_add=d, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="lat_add"):
            tp.topc_pick(base_c, cand, u, w2, lat_add=d[:, :4], interpret=self.INTERPRET)


class TestLatentSumInterpret(TestLatentSum):
    INTERPRET = True


# -- refine: the latent's terms give the tokens of the plain one ---------------------------------------
def _xla_latent_terms(params, xh, blk, prev_ids, terms=False):
    return R.latent_pass(params, xh, blk, prev_ids, terms=terms)


@pytest.mark.interpret
@pytest.mark.parametrize("topc,dtype", [
    pytest.param(c, dt, id=f"{c}-{jnp.dtype(dt).name}", marks=() if (c, dt) == (1, jnp.bfloat16) else SLOW)
    for c in (1, 11, 301) for dt in DTYPES])
@pytest.mark.slow
def test_refine_same_tokens_with_the_latent_terms(topc, dtype):
    """Pallas steps (interpret) with XLA's latent: in two terms (the picks add them) against the latent itself."""
    params = make_head(CFG, seed=21, dtype=dtype, std=0.5)
    logits, h, anchors, prev = make_inputs(CFG, 3, seed=22, dtype=dtype)
    ops = dataclasses.replace(Ops.pallas(True), latent=_xla_latent_terms)
    assert ops.latent_terms
    kw = dict(num_passes=CFG.num_passes, topc=topc)
    got = np.asarray(refine_with(ops, params, logits, h, anchors, prev, **kw))
    want = np.asarray(refine_with(dataclasses.replace(ops, latent_terms=False), params, logits, h, anchors, prev, **kw))
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_latent_terms_terms_sum_to_the_latent():
    """`head.latent(terms=True)`'s terms, rounded after their float32 sum, are the latent bit for bit, and
    the pass's `LatentSum` is those terms."""
    params = make_head(CFG, seed=23, dtype=jnp.bfloat16)
    _, h, _, _ = make_inputs(CFG, 4, seed=24, dtype=jnp.bfloat16)
    xh = xj.head.hidden_input(params, h)
    blk = jax.random.randint(jax.random.key(25), (4, CFG.block_size), 0, CFG.vocab_size, jnp.int32)
    lat = R.latent_pass(params, xh, blk, blk[:, 0])
    s = R.latent_pass(params, xh, blk, blk[:, 0], terms=True)
    assert isinstance(s, R.LatentSum) and s.u.dtype == s.d.dtype == jnp.float32 and s.u.shape == lat.shape
    np.testing.assert_array_equal(np.asarray(R.latent_value(s, jnp.bfloat16), np.float32), np.asarray(lat, np.float32))
    assert R.latent_value(lat, jnp.bfloat16) is lat
    assert not np.array_equal(np.asarray(s.d), np.zeros_like(np.asarray(s.d)))


@pytest.mark.slow
def test_pallas_steps_hand_over_the_terms_up_to_the_dispatch_bound():
    """The compiled Pallas steps' latent (XLA's where the plan says so: jnp, runs on a CPU too) is two terms
    up to the table's last ``latent_terms`` draft-row count and not one block above; never without ``terms``."""
    from xpress_jax import dispatch

    cfg = dataclasses.replace(CFG, block_size=16)
    params = make_head(cfg, seed=29, dtype=jnp.bfloat16)
    ops = Ops.pallas()
    last = max(e.max_rows for e in dispatch.TABLE.entries if e.switches.latent_terms)
    n_in = last // (cfg.block_size - 1)
    assert not dispatch.TABLE.entry(last + 1).switches.latent_terms
    for n, want in ((n_in, True), (n_in + 1, False)):
        assert dispatch.plan(n, cfg.block_size, cfg.vocab_size, cfg.rank, 0, jnp.bfloat16).latent is None
        _, h, _, _ = make_inputs(cfg, n, seed=30, dtype=jnp.bfloat16)
        xh = xj.head.hidden_input(params, h)
        blk = jnp.zeros((n, cfg.block_size), jnp.int32)
        assert isinstance(ops.latent(params, xh, blk, blk[:, 0], terms=True), R.LatentSum) == want
        assert not isinstance(ops.latent(params, xh, blk, blk[:, 0]), R.LatentSum)


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, id="float32"),
                                   pytest.param(jnp.bfloat16, id="bfloat16", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_mixer_barrier_same_latent_up_to_the_dispatch_bound(dtype):
    """`head.latent(barrier=True)` (the mixer's output behind an optimization barrier) is the latent bit for
    bit, jitted, in two terms or not; the compiled Pallas steps use it for the latent itself up to
    the table's last ``mixer_barrier`` draft-row count and not one block above (the barrier is in the HLO)."""
    from xpress_jax import dispatch

    cfg = dataclasses.replace(CFG, block_size=16)
    params = make_head(cfg, seed=31, dtype=dtype, std=0.5)
    last = max(e.max_rows for e in dispatch.TABLE.entries if e.switches.mixer_barrier)
    n_in = last // (cfg.block_size - 1)
    assert not dispatch.TABLE.entry(last + 1).switches.mixer_barrier
    assert n_in >= 1
    for n in (n_in, n_in + 1):
        _, h, _, _ = make_inputs(cfg, n, seed=32, dtype=dtype)
        xh = xj.head.hidden_input(params, h)
        blk = jax.random.randint(jax.random.key(33), (n, cfg.block_size), 0, cfg.vocab_size, jnp.int32)
        for terms in (False, True):
            f = jax.jit(lambda x, b, barrier, terms=terms: R.latent_pass(params, x, b, b[:, 0], terms=terms,
                                                                          barrier=barrier), static_argnums=2)
            assert "opt-barrier" in f.lower(xh, blk, True).as_text("hlo")
            assert "opt-barrier" not in f.lower(xh, blk, False).as_text("hlo")
            for a, b in zip(jax.tree.leaves(f(xh, blk, True)), jax.tree.leaves(f(xh, blk, False))):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        served = jax.jit(lambda x, b: Ops.pallas().latent(params, x, b, b[:, 0])).lower(xh, blk).as_text("hlo")
        assert ("opt-barrier" in served) == (n == n_in), n


@pytest.mark.parametrize("rows", [pytest.param(15, marks=pytest.mark.slow), 60])
def test_lat_add_lowers_for_an_h200(rows):
    """The kernel with ``lat_add`` builds for an H200 at serving shapes (on a CPU: Triton lowering), with
    one more operand than the plain kernel."""
    import functools

    V, C, r, dt = 151936, 512, 256, jnp.bfloat16
    S = jax.ShapeDtypeStruct
    cfg = tp.default_config(rows, C, r, dt)
    f = functools.partial(tp.topc_pick, config=cfg)
    hlo = lower_triton(lambda b, c, u, w, d: f(b, c, u, w, lat_add=d), S((rows, C), dt), S((rows, C), jnp.int32),
                              S((rows, r), jnp.float32), S((V, r), dt), S((rows, r), jnp.float32)).as_text()
    call = "__gpu$xla.gpu.triton"
    line = next(ln for ln in hlo.splitlines() if call in ln and 'name = "xpress_topc_pick"' in ln)
    assert len(line.split(call + "(")[1].split(")")[0].split(",")) == 5
