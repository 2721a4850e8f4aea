"""The pruned exact full-vocab mode: ``refine(..., topc=0, full_vocab="pruned")`` and its kernel
(`xpress_jax.kernels.pruned`, `reference.pruned_pick`, `exact.prepare_pruned`).

The kernel's tokens must equal the scan kernel's bit for bit (same row, vocab and rank tiles), and the
jnp spelling's must equal `reference.full_vocab_pick`: both only score what the int8 bound does not
exclude, so a bound that is too small gives a wrong token. Each test also checks, through the counters,
that the path it means to test (pruning, or the fallback) is the one taken.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax import reference as ref
from xpress_jax.exact import Pruned, PrunedPrepared, PrunedStats, prepare_pruned
from xpress_jax.kernels import full_vocab, pruned
from xpress_jax.kernels.common import gpu_supported
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

DTYPES = [jnp.bfloat16, jnp.float32]
V, H, B, R, K = 2000, 48, 6, 32, 3
CFG = xj.HeadConfig(vocab_size=V, hidden_size=H, block_size=B, rank=R, mlp_hidden=32, topc=16, num_passes=K)


def _pick_inputs(dtype, rows, vocab, rank, *, std=0.05, seed=0, flat=False):
    kb, kl, kw = jax.random.split(jax.random.key(seed), 3)
    base = jnp.zeros((rows, vocab)) if flat else jax.random.normal(kb, (rows, vocab)) * 2
    lat = jax.random.normal(kl, (rows, rank))
    w2 = jax.random.normal(kw, (vocab, rank)) * std
    return base.astype(dtype), lat.astype(dtype), w2.astype(dtype)


def _kernel_pick(base, lat, w2, guess, fallen=False, cfg=None, **variant):
    cfg = cfg or full_vocab.FullVocabConfig(row_tile=16, v_tile=32, v_steps=3, k_tile=16, lazy=True)
    p = prepare_pruned(w2)
    tok, need, frac, _ = pruned.pruned_pick(base, lat, w2, p.q, p.scale, p.err, p.max_norm, guess, jnp.asarray(fallen),
                                            config=pruned.pruned_config(cfg, lat.shape[1], base.dtype), interpret=True,
                                            **variant)
    want = full_vocab.full_vocab_pick(base, lat, w2, config=cfg, interpret=True)
    return np.asarray(tok), np.asarray(want), np.asarray(need), float(frac)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("rows,vocab,rank", [(37, 777, 40), pytest.param(20, 1000, 48, marks=pytest.mark.slow),
                                             (5, 97, 16)])
def test_kernel_equals_scan_kernel(dtype, rows, vocab, rank):
    """Odd rows, vocab and a rank that 16-wide chunks do not divide... (40 = 2.5 chunks): the pruned kernel's
    tokens are the scan kernel's, with the best guess, a poor guess (the base argmax) and fallen back."""
    base, lat, w2 = _pick_inputs(dtype, rows, vocab, rank)
    scan = full_vocab.full_vocab_pick(base, lat, w2, config=full_vocab.FullVocabConfig(
        row_tile=16, v_tile=32, v_steps=3, k_tile=16, lazy=True), interpret=True)
    for i, guess in enumerate((scan, jnp.argmax(base, axis=1).astype(jnp.int32), jnp.zeros((rows,), jnp.int32))):
        tok, want, need, frac = _kernel_pick(base, lat, w2, guess)
        np.testing.assert_array_equal(tok, want)
        assert (need >= 1).all()  # every row's winner reached its threshold
        assert i or frac < 1  # with the winner as the guess, it pruned
    tok, want, need, frac = _kernel_pick(base, lat, w2, scan, fallen=True)
    np.testing.assert_array_equal(tok, want)
    assert frac == 1 and (need == 0).all()  # fallen back: every tile exact, no bound


@pytest.mark.interpret
@pytest.mark.parametrize("variant", [dict(two_phase=True), dict(two_phase=True, swap=True)], ids=["2phase", "swap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_kernel_variants(dtype, variant):
    """The two-phase loop (its tile bits span two words: 40 tiles per part) and the transposed bound dot,
    with a NaN and an inf base logit and fallen back: the scan's tokens."""
    base, lat, w2 = _pick_inputs(dtype, 20, 3000, 48)
    base = base.at[0, 5].set(jnp.nan).at[1, 9].set(jnp.inf)
    cfg = full_vocab.FullVocabConfig(row_tile=16, v_tile=32, v_steps=40, k_tile=16, lazy=True)
    scan = full_vocab.full_vocab_pick(base, lat, w2, config=cfg, interpret=True)
    for guess, fallen in ((scan, False), (jnp.zeros((20,), jnp.int32), False), (scan, True)):
        tok, want, need, frac = _kernel_pick(base, lat, w2, guess, fallen, cfg=cfg, **variant)
        np.testing.assert_array_equal(tok, want)
        assert fallen or (need >= 1).all()
        assert frac == 1 if fallen else frac < 1 or guess is not scan


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_kernel_adversarial_and_ties(dtype):
    """Huge w2 norms (the bound excludes little), flat base logits (every score within the quantisation error
    of the others), and exact ties: the lowest id must win, as in the scan."""
    base, lat, w2 = _pick_inputs(dtype, 20, 600, 32, std=3.0, flat=True)
    tok, want, _, frac = _kernel_pick(base, lat, w2, jnp.zeros((20,), jnp.int32))
    np.testing.assert_array_equal(tok, want)
    assert frac > 0.5
    # Ties: w2 rows repeated in blocks of 8, so 8 ids share every score; base flat.
    w2t = jnp.repeat(w2[:75], 8, axis=0)
    tok, want, _, _ = _kernel_pick(base, lat, w2t, jnp.full((20,), 599, jnp.int32))
    np.testing.assert_array_equal(tok, want)
    assert (tok % 8 == 0).all()  # the lowest id of each tied group


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_kernel_nonfinite(dtype):
    """NaN, +inf and -inf base logits, and a latent row with an inf: the scan's tokens."""
    base, lat, w2 = _pick_inputs(dtype, 20, 500, 32)
    base = base.at[0, 7].set(jnp.nan).at[1, 300].set(jnp.inf).at[2].set(-jnp.inf).at[3].set(jnp.nan)
    base = base.at[4, 11].set(jnp.inf).at[4, 5].set(jnp.inf)
    lat = lat.at[5, 3].set(jnp.inf)
    for guess in (jnp.zeros((20,), jnp.int32), jnp.full((20,), 7, jnp.int32)):
        tok, want, _, _ = _kernel_pick(base, lat, w2, guess)
        np.testing.assert_array_equal(tok, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("std", [0.02, 0.1, 1.0])
def test_bound_covers_every_score(dtype, std):
    """The property the mode rests on, id by id: the int8 bound is at least the exact score, and the threshold
    at most the guess's exact score; then the jnp spelling's tokens are the scan's."""
    base, lat, w2 = _pick_inputs(dtype, 24, 1500, 40, std=std, seed=3)
    p = prepare_pruned(w2)
    s = np.asarray(ref.round_sum(base, ref.readout(lat, w2, dtype)).astype(jnp.float32))
    latf = lat.astype(jnp.float32)
    nl = jnp.sqrt(jnp.sum(latf * latf, axis=1)) * (1 + ref.SLACK)
    t = jnp.matmul(latf, p.q.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    u = t * p.scale[None] + nl[:, None] * p.err[None]
    ub = np.asarray(head_round(base, u, dtype))
    assert (ub >= s).all()  # NaN-free inputs: every score is finite
    slack = np.median(ub - s)
    assert slack > 0  # the bound is not the score itself (so the check above is not vacuous)
    want = ref.full_vocab_pick(base, lat, w2)
    for guess in (want, jnp.argmax(base, axis=1).astype(jnp.int32)):
        tok, need, frac, nv = ref.pruned_pick(base, lat, w2, p.q, p.scale, p.err, p.max_norm, guess, False)
        np.testing.assert_array_equal(tok, want)
        assert nv == 1500 and (np.asarray(need) >= 1).all()


def test_margins_agree():
    assert pruned.EPS_SHIFT == ref.PRUNE_EPS_SHIFT


def head_round(base, u, dtype):
    return ref.round_to(base.astype(jnp.float32) + ref.round_to(u, dtype).astype(jnp.float32), dtype).astype(jnp.float32)


def test_a_broken_bound_is_caught():
    """The token checks can fail: with the int8 error term removed the bound is too small, the jnp spelling
    excludes the true winner somewhere and its tokens differ from the scan's."""
    base, lat, w2 = _pick_inputs(jnp.float32, 64, 1500, 40, std=0.5, seed=1)
    p = prepare_pruned(w2)
    want = np.asarray(ref.full_vocab_pick(base, lat, w2))
    guess = jnp.argmax(base, axis=1).astype(jnp.int32)
    # -err: the bound now sits below the int8 estimate; the threshold comes from the base argmax
    tok, *_ = ref.pruned_pick(base, lat, w2, p.q, p.scale, -4 * p.err, p.max_norm, guess, False)
    assert (np.asarray(tok) != want).any()


def _problem(dtype, std, n=8, seed=0, cfg=CFG, peaked=False):
    kp, kl, kh, ka, ki, kv = jax.random.split(jax.random.key(seed), 6)
    params = xj.init_params(cfg, kp, dtype=dtype, std=std)
    shape = (n, cfg.block_size, cfg.vocab_size)
    logits = jax.random.normal(kl, shape) * 2
    if peaked:
        ids = jax.random.randint(ki, shape[:2] + (16,), 0, cfg.vocab_size)
        peak = 6 + 0.5 * jax.random.normal(kv, shape[:2] + (16,))
        logits = jax.vmap(jax.vmap(lambda l, i, p: l.at[i].set(p)))(logits, ids, peak)
    h = jax.random.normal(kh, (n, cfg.block_size, cfg.hidden_size)).astype(dtype)
    anchors = jax.random.randint(ka, (n,), 0, cfg.vocab_size)
    return params, logits.astype(dtype), h, anchors


@functools.partial(jax.jit, static_argnames=("backend", "interpret", "full_vocab", "return_stats"))
def _refine(params, logits, h, anchors, *, backend="xla", interpret=False, full_vocab="scan", return_stats=False):
    return xj.refine(params, logits, h, anchors, config=CFG, topc=0, backend=backend, interpret=interpret,
                     full_vocab=full_vocab, return_stats=return_stats)


# (std, peaked logits, settings, whether the call must fall back)
REGIMES = {
    "prunes": (0.1, True, Pruned(candidates=32), False),
    "previous": (0.1, True, Pruned(guess="previous"), False),
    "fallback": (3.0, False, Pruned(candidates=16, max_exact=0.2), True),
}


def _check(stats: PrunedStats, falls_back: bool):
    st = {k: float(v) for k, v in stats._asdict().items()}
    assert all(0 <= v <= 1 for v in st.values()), st
    if falls_back:
        assert st["passes_full_scan"] > 0, st
    else:
        assert st["passes_full_scan"] == 0 and st["ids_excluded"] > 0.9, st


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_refine_equals_scan_xla(dtype, regime):
    std, peaked, cfg, falls = REGIMES[regime]
    prob = _problem(dtype, std, peaked=peaked)
    want = _refine(*prob)
    got, stats = _refine(*prob, full_vocab=cfg, return_stats=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    _check(stats, falls)


@pytest.mark.interpret
@pytest.mark.interpret_refine
@pytest.mark.parametrize("dtype,regime", [(jnp.bfloat16, "prunes"), (jnp.float32, "fallback"),
                                          pytest.param(jnp.bfloat16, "previous", marks=pytest.mark.slow),
                                          pytest.param(jnp.float32, "prunes", marks=pytest.mark.slow)],
                         ids=lambda x: x if isinstance(x, str) else jnp.dtype(x).name)
def test_refine_equals_scan_pallas_interpret(dtype, regime):
    std, peaked, cfg, falls = REGIMES[regime]
    prob = _problem(dtype, std, n=2, peaked=peaked)
    want = _refine(*prob, backend="pallas", interpret=True)
    got, stats = _refine(*prob, backend="pallas", interpret=True, full_vocab=cfg, return_stats=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    st = {k: float(v) for k, v in stats._asdict().items()}
    assert all(0 <= v <= 1 for v in st.values()), st
    if falls:
        assert st["passes_full_scan"] > 0, st


def test_float64_runs_the_scan():
    jax.config.update("jax_enable_x64", True)
    try:
        prob = _problem(jnp.float64, 0.1, n=2)
        want = _refine(*prob)
        got, stats = _refine(*prob, full_vocab="pruned", return_stats=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert float(stats.passes_full_scan) == 1.0
    finally:
        jax.config.update("jax_enable_x64", False)


def test_prepared_and_bad_arguments():
    prob = _problem(jnp.bfloat16, 0.1, n=2, peaked=True)
    params = prob[0]
    prep = prepare_pruned(params["w2"])
    assert isinstance(prep, PrunedPrepared) and prep.q.dtype == jnp.int8 and prep.q.shape == params["w2"].shape
    assert int(jnp.max(jnp.abs(prep.q.astype(jnp.int32)))) == 127
    want = _refine(*prob)
    got = xj.refine(*prob, config=CFG, topc=0, full_vocab="pruned", certified_prepared=prep)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(TypeError, match="prepare_pruned"):
        xj.refine(*prob, config=CFG, topc=0, full_vocab="pruned",
                  certified_prepared=xj.exact.prepare_certified(params["w2"]))
    with pytest.raises(ValueError, match="int8"):
        xj.refine(*prob, config=CFG, topc=0, full_vocab="pruned",
                  certified_prepared=prep._replace(q=prep.q[:10]))
    with pytest.raises(ValueError, match="guess"):
        Pruned(guess="best")
    with pytest.raises(ValueError, match="max_exact"):
        Pruned(max_exact=2)
    with pytest.raises(ValueError, match="candidates"):
        Pruned(candidates=0)
    with pytest.raises(ValueError, match="full_vocab"):
        xj.refine(*prob, config=CFG, topc=0, full_vocab="prune")
    jax.config.update("jax_enable_x64", True)
    try:
        with pytest.raises(TypeError, match="float64"):
            prepare_pruned(jnp.zeros((4, 16), jnp.float64))
    finally:
        jax.config.update("jax_enable_x64", False)


def test_lowers_for_an_h200():
    """The pruned refine lowers for an H200 at serving rank: the pruned kernel is in the HLO, once per pass,
    and the scan kernel is not (its exact step is inside the pruned kernel)."""
    from xpress_jax.kernels.common import lower_triton

    cfg = xj.HeadConfig(vocab_size=4099, hidden_size=64, block_size=16, rank=256, mlp_hidden=512, topc=512)
    p = jax.eval_shape(lambda: xj.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16))
    S = jax.ShapeDtypeStruct
    for n in (1, 16):
        args = (p, S((n, 16, cfg.vocab_size), jnp.bfloat16), S((n, 16, cfg.hidden_size), jnp.bfloat16),
                S((n,), jnp.int32))
        f = lambda p, l, h, a: refine_with(Ops.pallas(False), p, l, h, a, num_passes=2, topc=0, unroll=True,
                                           full_vocab="pruned")
        text = lower_triton(f, *args).as_text()
        assert text.count('"xpress_full_vocab_pruned"') >= 2 or text.count("xpress_full_vocab_pruned") >= 2, n
        assert "xpress_full_vocab_fused" not in text, n
    # the kernel's other loops (two phases: tile bits in words, shifts and masks; the transposed bound dot)
    rows, v = 45, cfg.vocab_size
    fv = full_vocab.FullVocabConfig(row_tile=64, v_tile=64, v_steps=36, k_tile=0, num_warps=8, lazy=True)
    args = (S((48, v), jnp.bfloat16), S((rows, 256), jnp.bfloat16), S((v, 256), jnp.bfloat16), S((v, 256), jnp.int8),
            S((v,), jnp.float32), S((v,), jnp.float32), S((), jnp.float32), S((rows,), jnp.int32), S((1,), jnp.int32))
    for swap in (False, True):
        g = lambda *a, swap=swap: pruned.pruned_pick(*a, config=pruned.pruned_config(fv, 256, jnp.bfloat16),
                                                     slot_stride=16, two_phase=True, swap=swap)[0]
        assert "xpress_full_vocab_pruned" in lower_triton(g, *args).as_text()


@pytest.mark.skipif(not gpu_supported(), reason="needs a supported NVIDIA GPU (compiled kernels)")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_compiled_on_gpu(dtype):
    for regime in REGIMES:
        std, peaked, cfg, falls = REGIMES[regime]
        prob = _problem(dtype, std, n=4, peaked=peaked)
        want = _refine(*prob, backend="pallas")
        got, stats = _refine(*prob, backend="pallas", full_vocab=cfg, return_stats=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    base, lat, w2 = _pick_inputs(dtype, 100, 3001, 256, std=0.05)
    cfg = full_vocab.FullVocabConfig(row_tile=64, v_tile=64, v_steps=4, k_tile=64, lazy=True, prefetch_base=True)
    p = prepare_pruned(w2)
    want = full_vocab.full_vocab_pick(base, lat, w2, config=cfg)
    for guess in (want, jnp.zeros((100,), jnp.int32)):
        tok, *_ = pruned.pruned_pick(base, lat, w2, p.q, p.scale, p.err, p.max_norm, guess, jnp.asarray(False),
                                     config=pruned.pruned_config(cfg, 256, dtype))
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_sweep_kernel_seeds_and_shapes(dtype, seed):
    rng = np.random.default_rng(seed)
    for _ in range(3):
        rows, vocab, rank = int(rng.integers(1, 70)), int(rng.integers(17, 1500)), int(rng.integers(16, 90))
        std = float(rng.choice([0.01, 0.1, 1.0]))
        base, lat, w2 = _pick_inputs(dtype, rows, vocab, rank, std=std, seed=seed)
        cfg = full_vocab.FullVocabConfig(row_tile=int(rng.choice([16, 32])), v_tile=int(rng.choice([16, 64])),
                                         v_steps=int(rng.integers(1, 5)), k_tile=int(rng.choice([0, 16, 32])),
                                         lazy=True)
        guess = jnp.asarray(rng.integers(0, vocab, rows), jnp.int32)
        tok, want, _, _ = _kernel_pick(base, lat, w2, guess, cfg=cfg)
        np.testing.assert_array_equal(tok, want, err_msg=f"{rows=} {vocab=} {rank=} {std=} {cfg}")


def test_refine_server_runs_the_pruned_mode():
    """`RefineServer(full_vocab="pruned")` keeps the int8 copy with its weights and gives the scan's tokens."""
    head = xj.init_head(CFG, jax.random.key(0), std=0.1)
    _, logits, h, anchors = _problem(jnp.float32, 0.1, n=3, peaked=True)
    args = (np.asarray(logits), np.asarray(h), np.asarray(anchors))
    want = xj.RefineServer(head, buckets=(4,), topc=0, backend="xla")(*args)
    server = xj.RefineServer(head, buckets=(4,), topc=0, full_vocab="pruned", backend="xla")
    assert server.exact_mode(4) == "pruned"
    got = server(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
