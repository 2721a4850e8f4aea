"""Early exit at the passes' fixed point (`refine(..., early_exit=True)`).

The claim: a pass is a function of the block alone, so once a pass returns its input every later
pass would too, and stopping there gives the K-pass tokens. The oracle here is the K-pass loop
itself (``early_exit=False``) and refine with fewer passes (the block after each pass, from which
the true fixed-point pass is read independently of the code under test).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax.ops import Ops
from xpress_jax.modes import Loop
from xpress_jax.refine import exit_checks, prepare, resolve_call, run_passes

from helpers import make_head, make_inputs, sequential_greedy

refine_jit = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)
slow = pytest.mark.slow

# Odd V and B, a rank that is not a power of two; C = 1, a middle C, C = V and full vocab.
CFG = xj.HeadConfig(vocab_size=301, hidden_size=40, block_size=7, rank=20, mlp_hidden=24, topc=11,
                    num_passes=6, max_num_reqs=16)


def _passes(params, logits, h, anchors, prev, *, topc, unroll, checks=True, ops=None, k=None):
    """The passes refine's loop ran (`prepare`'s benchmark-only output) and its tokens."""
    p, q, kk, c, u = resolve_call(params, logits, h, anchors, prev, config=CFG, topc=topc, unroll=unroll,
                                  num_passes=k)
    out, n = jax.jit(lambda p, lg, hh, a, q: run_passes(prepare(ops or Ops.xla("cpu"), p, lg, hh, a, q, kk, c, u,
                                                                early_exit=checks, return_passes=True)))(
        p, logits, h, anchors, q)
    return np.asarray(out), int(n)


def _fixed_point_pass(params, logits, h, anchors, prev, topc):
    """Oracle: the first pass p (1..K) whose block equals the block before it, from refine with
    num_passes = 1..K and early exit off; K+1 if none."""
    blocks = [None]
    for k in range(1, CFG.num_passes + 1):
        blocks.append(np.asarray(xj.refine(params, logits, h, anchors, prev, config=CFG, topc=topc, num_passes=k,
                                           backend="xla", early_exit=False)))
    # The block before pass 1 is the start block: slot b's argmax of the base logits (top-C: the same).
    start = np.asarray(jnp.argmax(jnp.where(jnp.isnan(logits[:, 1:]), -jnp.inf, logits[:, 1:]), axis=-1))
    blocks[0] = start
    for p in range(1, CFG.num_passes + 1):
        if np.array_equal(blocks[p], blocks[p - 1]):
            return p
    return CFG.num_passes + 1


# std: weak (the fixed point comes after 1-2 passes), medium, strong (often not within K).
@pytest.mark.parametrize("unroll,topc,std", [
    pytest.param(u, c, s, id=f"{u}-{c}-{s}", marks=() if f"{u}-{c}-{s}" == "True-0-1.0" else slow)
    for u in (False, True) for c in (0, 1, 11, 301) for s in (0.02, 0.25, 1.0)])
def test_early_exit_gives_the_k_pass_tokens(std, topc, unroll):
    params = make_head(CFG, seed=int(std * 100) + topc, std=std)
    logits, h, anchors, prev = make_inputs(CFG, 5, seed=topc + 7)
    want = np.asarray(xj.refine(params, logits, h, anchors, prev, config=CFG, topc=topc, backend="xla",
                                unroll=unroll, early_exit=False))
    got, n = _passes(params, logits, h, anchors, prev, topc=topc, unroll=unroll)
    np.testing.assert_array_equal(got, want)
    assert 1 <= n <= CFG.num_passes


@pytest.mark.slow
@pytest.mark.parametrize("topc", [0, 11])
@pytest.mark.parametrize("std", [0.02, 0.25, 1.0])
def test_passes_run_stop_at_the_fixed_point(std, topc):
    """The loop stops exactly at the first pass that changed nothing; unrolled with checks, at the
    first checked pass at or after it (or K). (Fast: the loop itself on a toy map,
    `test_run_passes_counts_and_stops`, and `test_weak_head_skips_passes` through refine.)"""
    params = make_head(CFG, seed=3, std=std)
    logits, h, anchors, prev = make_inputs(CFG, 4, seed=11)
    p_star = _fixed_point_pass(params, logits, h, anchors, prev, topc)
    _, n_loop = _passes(params, logits, h, anchors, prev, topc=topc, unroll=False)
    assert n_loop == min(p_star, CFG.num_passes)
    for checks in [(2, 4), (1, 2, 3, 4, 5), (3,), ()]:
        _, n = _passes(params, logits, h, anchors, prev, topc=topc, unroll=True, checks=checks)
        want = min([q for q in checks if q >= p_star] + [CFG.num_passes])
        assert n == want, (checks, p_star)


def test_weak_head_skips_passes():
    """The point of the feature: with weak weights the fixed point comes early, so fewer than K
    passes run (this fails if the check never fires)."""
    params = make_head(CFG, seed=5, std=0.02)
    logits, h, anchors, prev = make_inputs(CFG, 3, seed=2, logit_std=3.0)
    _, n = _passes(params, logits, h, anchors, prev, topc=0, unroll=False)
    assert n < CFG.num_passes


@pytest.mark.interpret
@pytest.mark.slow  # the loop is the XLA refine's (above); the Pallas pass picks: tests/kernels/
@pytest.mark.parametrize("topc", [0, 11])
def test_early_exit_pallas_interpret(topc):
    params = make_head(CFG, seed=9, std=0.25)
    logits, h, anchors, prev = make_inputs(CFG, 3, seed=4)
    want = np.asarray(xj.refine(params, logits, h, anchors, prev, config=CFG, topc=topc, backend="pallas",
                                interpret=True, early_exit=False))
    for unroll in (False, True):
        got, _ = _passes(params, logits, h, anchors, prev, topc=topc, unroll=unroll, ops=Ops.pallas(True))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.float64, marks=slow)])
@pytest.mark.slow
def test_jacobi_exactness_with_early_exit(dtype):
    """K >= B-1 full vocab with early exit == the sequential greedy decode."""
    with jax.enable_x64(dtype == jnp.float64):
        params = make_head(CFG, seed=1, dtype=dtype, std=0.5)
        logits, h, anchors, prev = make_inputs(CFG, 4, seed=6, dtype=dtype)
        for unroll in (False, True):
            got = refine_jit(params, logits, h, anchors, prev, config=CFG, topc=0, num_passes=CFG.block_size - 1,
                             backend="xla", unroll=unroll, early_exit=True)
            np.testing.assert_array_equal(np.asarray(got), sequential_greedy(params, logits, h, anchors, prev))


def test_invalid_rows_and_nan_logits_with_early_exit():
    params = make_head(CFG, seed=2, std=0.25)
    logits, h, anchors, prev = make_inputs(CFG, 4, seed=8)
    logits = logits.at[1, 2, :50].set(jnp.nan).at[2].set(jnp.inf)
    anchors = anchors.at[3].set(-1)
    f = jax.jit(lambda a, ee: xj.refine(params, logits, h, a, prev, config=CFG, topc=0, backend="xla",
                                        early_exit=ee), static_argnums=1)
    want, got = np.asarray(f(anchors, False)), np.asarray(f(anchors, True))
    np.testing.assert_array_equal(got, want)
    assert (got[3] == xj.INVALID_TOKEN).all()


def test_exit_checks_schedule():
    assert exit_checks(1, 6) == (2, 4)
    assert exit_checks(15, 6) == (2, 4)
    assert exit_checks(16, 6) == (2, 3, 4, 5)
    assert exit_checks(256, 1) == ()
    for n in (1, 16):
        for k in range(1, 9):
            assert all(1 <= q < k for q in exit_checks(n, k))


def _toy_loop(step, carry, num_passes, *, unroll, numbered, checks=None, slots=99):
    """`run_passes` on a toy mode: ``carry`` its start, ``step`` its pass, ``slots`` its draft slots per block;
    returns (carry, passes)."""
    class Toy:
        loop = Loop(num_passes, unroll, numbered, checks)

        def start(self):
            return carry

        def pass_(self, c, q):
            return step(c, q)

        def finish(self, c, passes):
            return c, passes

    Toy.slots = slots
    return run_passes(Toy())


def test_run_passes_counts_and_stops():
    """The pass loop on a toy map with a known fixed point: x -> min(x + 1, 3)."""
    step = lambda c, q: (jnp.minimum(c[0] + 1, 3), c[1])
    zero = jnp.zeros((2, 2), jnp.int32)
    for unroll, checks in ((False, ()), (True, (1, 2, 3, 4, 5)), (True, (2, 4))):
        (blk, _), n = _toy_loop(step, (zero, ()), 6, unroll=unroll, numbered=unroll, checks=checks)
        assert (np.asarray(blk) == 3).all()
        assert int(n) == 4  # pass 4 returns 3 unchanged
    (blk, _), n = _toy_loop(step, (jnp.zeros((1,), jnp.int32), ()), 3, unroll=True, numbered=True, checks=(1, 2))
    assert int(n) == 3 and int(blk[0]) == 3  # never fixed within K: all K passes
    for unroll, numbered, checks, want in ((True, True, None, list(range(6))), (True, True, (2, 4), list(range(6))),
                                           (True, False, (2, 4), [None] * 6), (False, False, None, [None]),
                                           (True, False, None, [None])):
        seen = []  # numbered: each pass gets its 0-based number (the picks read it); else None
        (blk, _), n = _toy_loop(lambda c, q: seen.append(q) or step(c, q), (zero, ()), 6, unroll=unroll,
                                numbered=numbered, checks=checks)
        assert seen == want and (np.asarray(blk) == 3).all()
        assert int(n) == (4 if checks else 6)
    # Numbered passes from B-1 on are not run (every draft slot is final); they still count.
    for checks in (None, (2, 4)):
        seen = []
        (blk, _), n = _toy_loop(lambda c, q: seen.append(q) or (c[0] + 1, c[1]), (zero, ()), 6, unroll=True,
                                numbered=True, checks=checks, slots=3)
        assert seen == [0, 1, 2] and (np.asarray(blk) == 3).all() and int(n) == (4 if checks else 6)
    # The mode's state is carried through every form of the loop.
    count = lambda c, q: (c[0], c[1] + 1)
    for unroll, numbered in ((False, False), (True, False), (True, True)):
        (_, k), n = _toy_loop(count, (zero, jnp.int32(0)), 5, unroll=unroll, numbered=numbered)
        assert int(k) == 5 == int(n)


@pytest.mark.parametrize("bad", [1, "yes", (1.0,), (True,), [2]])
def test_early_exit_type_errors(bad):
    params = make_head(CFG)
    logits, h, anchors, prev = make_inputs(CFG, 1)
    with pytest.raises(TypeError, match="early_exit"):
        xj.refine(params, logits, h, anchors, config=CFG, backend="xla", early_exit=bad)


@pytest.mark.parametrize("bad", [(0,), (6,), (2, 7)])
def test_early_exit_range_errors(bad):
    params = make_head(CFG)
    logits, h, anchors, prev = make_inputs(CFG, 1)
    with pytest.raises(ValueError, match="early_exit"):
        xj.refine(params, logits, h, anchors, config=CFG, backend="xla", early_exit=bad)


@pytest.mark.slow
def test_early_exit_is_static_under_jit():
    assert "early_exit" in xj.STATIC_ARGNAMES
    params = make_head(CFG)
    logits, h, anchors, prev = make_inputs(CFG, 2)
    a = refine_jit(params, logits, h, anchors, config=CFG, backend="xla", early_exit=(2,))
    b = refine_jit(params, logits, h, anchors, config=CFG, backend="xla", early_exit=False)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
