"""Sampled refine (``temperature=T, key=``): the noise, T = 0 and small T, K = 0, the sequential sample at K >= B-1,
the emitted distribution (chi-square), the proposal, non-finite logits, shapes and dtypes, and the errors
(docs/semantics.md, "Sampling").

Every oracle is computed here: the noise from the documented hash (numpy), the picks with numpy argmax, the
scores from the greedy building blocks (`xpress_jax.head.latent`, `xpress_jax.reference`'s readout and rounded sum).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax import reference as R
from xpress_jax.head import hidden_input, latent
from xpress_jax.kernels.common import GUMBEL_MAX, gumbel
from xpress_jax.sampling import row_seeds

from helpers import chi2, make_head, make_inputs

refine_jit = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)

# Odd V, a rank that is not a power of two, B - 1 = 4 draft slots.
CFG = xj.HeadConfig(vocab_size=301, hidden_size=16, block_size=5, rank=12, mlp_hidden=20, topc=9, num_passes=3,
                    max_num_reqs=8)
C = CFG.topc
MODES = pytest.mark.parametrize("topc", [0, C], ids=["full", "topc"])


@pytest.fixture(scope="module")
def setup():
    return make_head(CFG), make_inputs(CFG, 3)


def run(params, x, plain: bool = False, **kw):
    """The jitted refine (K, topc, backend: CFG's, 0, "xla" unless given), as numpy. A sampled call without a
    ``proposal`` runs with ``proposal="scores"`` and returns the tokens only (one compile serves both; the
    temperature and the key are traced), unless ``plain``."""
    kw.setdefault("num_passes", CFG.num_passes)
    kw.setdefault("topc", 0)
    kw.setdefault("backend", "xla")
    tokens_only = kw.get("temperature") is not None and kw.get("proposal") is None and not plain
    if tokens_only:
        kw["proposal"] = "scores"
    out = refine_jit(params, *x, **kw)
    if tokens_only:
        return np.asarray(out[0])
    if isinstance(out, tuple):
        return np.asarray(out[0]), jax.tree.map(np.asarray, out[1])
    return np.asarray(out)


# ----------------------------------------------------------------------------- the noise, spelled out in numpy
G32 = np.uint32(0x9E3779B9)


def np_mix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's finalizer on uint32 (docs/semantics.md, "Sampling")."""
    x = x.astype(np.uint32)
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def np_row_seeds(key, rows: int) -> np.ndarray:
    k0, k1 = np.asarray(jax.random.bits(key, (2,), jnp.uint32))
    row = np.arange(rows, dtype=np.uint32)
    return np_mix32(np_mix32(row * G32 + k0) ^ k1)


def np_uniform(seeds: np.ndarray, vid: np.ndarray) -> np.ndarray:
    m = np_mix32(seeds ^ (vid.astype(np.uint32) * G32)) >> np.uint32(9)
    return ((2 * m.astype(np.int64) + 1) / 2.0**24).astype(np.float32)


def noise(key, rows: int, ids) -> np.ndarray:
    """[rows, len(ids)] float32: the frozen Gumbel noise of draft rows 0..rows-1 at vocab ids ``ids``."""
    seeds = row_seeds(key, rows)
    return np.asarray(gumbel(seeds[:, None], jnp.asarray(ids, jnp.int32)[None, :]))


def inv(t) -> np.float32:
    return np.float32(1) / np.float32(t)


def test_noise_is_the_documented_hash():
    key = jax.random.key(7)
    rows, ids = 37, np.arange(1000)
    seeds = np.asarray(row_seeds(key, rows)).view(np.uint32)
    np.testing.assert_array_equal(seeds, np_row_seeds(key, rows))
    np.testing.assert_array_equal(np.asarray(row_seeds(key, 5, row_offset=30)), np.asarray(row_seeds(key, rows))[30:35])
    u = np_uniform(seeds[:, None], ids[None, :])
    g = noise(key, rows, ids)
    np.testing.assert_allclose(g, -np.log(-np.log(u.astype(np.float64))), rtol=2e-6, atol=2e-6)
    assert g.max() <= GUMBEL_MAX and g.min() >= -np.log(-np.log(2.0**-24)) - 1e-5
    # A standard Gumbel, as the official runtime's noise (mean: Euler's constant 0.5772, variance pi^2 / 6).
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.var() - np.pi**2 / 6) < 0.03
    assert not np.array_equal(noise(jax.random.key(8), rows, ids), g)


# ----------------------------------------------------------------------------- determinism, T = 0, small T
@pytest.mark.slow
@pytest.mark.parametrize("topc", [0, C], ids=["full", "topc"])
def test_fixed_key_is_deterministic_other_keys_differ(setup, topc):
    params, x = setup
    a = run(params, x, topc=topc, temperature=1.0, key=jax.random.key(3))
    b = run(params, x, topc=topc, temperature=1.0, key=jax.random.key(3), plain=True)  # without a proposal
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(run(params, x, topc=topc, temperature=1.0, key=jax.random.key(3)), a)
    c = run(params, x, topc=topc, temperature=1.0, key=jax.random.key(4))
    assert np.mean(a != c) > 0.3  # 12 draft tokens; each differs unless both keys sample the same id
    greedy = run(params, x, topc=topc)
    assert np.mean(a != greedy) > 0.3
    # The passes are a deterministic function of the block: stopping at the fixed point changes nothing.
    np.testing.assert_array_equal(run(params, x, topc=topc, temperature=1.0, key=jax.random.key(3), early_exit=True,
                                      plain=True), a)


@MODES
def test_temperature_zero_is_greedy(setup, topc):
    params, x = setup
    greedy = run(params, x, topc=topc)
    for k in (0, 1, 5):
        np.testing.assert_array_equal(run(params, x, topc=topc, temperature=0.0, key=jax.random.key(k)), greedy)
    np.testing.assert_array_equal(run(params, x, topc=topc, num_passes=0, temperature=0, key=jax.random.key(0)),
                                  run(params, x, topc=topc, num_passes=0))


@pytest.mark.parametrize("topc", [pytest.param(0, marks=pytest.mark.slow), C], ids=["full", "topc"])
def test_small_temperature_is_greedy_where_scores_are_separated(topc):
    """Where every pass's two best scores lie further apart than T times the noise's range (checked on the greedy
    passes' scores), the sampled picks are the greedy ones."""
    K = 2
    params = make_head(CFG)
    x = make_inputs(CFG, 3, seed=15, logit_std=3.0)
    gap = np.inf
    for k in range(K + 1):  # T = 0: the greedy passes and their scores
        greedy, prop = run(params, x, topc=topc, num_passes=k, temperature=0.0, key=jax.random.key(0),
                           proposal="scores")
        top2 = np.sort(prop.scores.astype(np.float32), axis=-1)[..., -2:]
        gap = min(gap, float(np.min(top2[..., 1] - top2[..., 0])))
    T = min(1e-3, gap / (2 * (GUMBEL_MAX + 2.83)))
    assert T > 1e-5, "inputs not separated enough"
    for k in range(3):
        np.testing.assert_array_equal(run(params, x, topc=topc, num_passes=K, temperature=T, key=jax.random.key(k)),
                                      greedy)


@MODES
def test_traced_temperature_does_not_retrace(setup, topc):
    params, x = setup
    traces = []

    def f(params, logits, h, anchors, prev, temperature, key, **kw):
        traces.append(1)
        return xj.refine(params, logits, h, anchors, prev, temperature=temperature, key=key, **kw)

    fj = jax.jit(f, static_argnames=xj.STATIC_ARGNAMES)
    kw = dict(topc=topc, num_passes=CFG.num_passes, backend="xla")
    key = jax.random.key(2)
    for t in (1.0, 0.5, 2.0):
        got = np.asarray(fj(params, *x, jnp.float32(t), key, **kw))
        np.testing.assert_array_equal(got, run(params, x, topc=topc, temperature=t, key=key))
    np.testing.assert_array_equal(np.asarray(fj(params, *x, jnp.float32(0.0), key, **kw)),
                                  run(params, x, topc=topc))
    np.testing.assert_array_equal(np.asarray(fj(params, *x, jnp.float32(0.5), jax.random.key(9), **kw)),
                                  run(params, x, topc=topc, temperature=0.5, key=jax.random.key(9)))
    assert len(traces) == 1


# ----------------------------------------------------------------------------- K = 0: the seed block
def topc_candidates(base: np.ndarray, c: int) -> np.ndarray:
    """[rows, V] -> [rows, C]: the C largest (NaN as -inf), lowest ids first among equal values."""
    clean = np.where(np.isnan(base), -np.inf, base)
    return np.argsort(-clean, axis=-1, kind="stable")[:, :c]


def seed_oracle(logits, key, T, topc):
    """argmax(base * (1/T) + g) per draft row (top-C: among the candidates); numpy."""
    base = np.asarray(logits, np.float32)[:, 1:].reshape(-1, logits.shape[-1])
    base = np.where(np.isnan(base), -np.inf, base)
    rows, V = base.shape
    g = noise(key, rows, np.arange(V))
    k = base * inv(T) + g
    if topc:
        cand = topc_candidates(base, topc)
        return np.take_along_axis(cand, np.argmax(np.take_along_axis(k, cand, -1), -1)[:, None], -1)[:, 0]
    return np.argmax(k, axis=-1)


@MODES
@pytest.mark.parametrize("T", [1.0, 0.37])
def test_k0_is_the_seed_block(setup, topc, T):
    params, x = setup
    n, B = x[0].shape[:2]
    key = jax.random.key(5)
    got = run(params, x, topc=topc, num_passes=0, temperature=T, key=key)
    np.testing.assert_array_equal(got.reshape(-1), seed_oracle(x[0], key, T, topc))
    # Greedy K = 0: the full-vocabulary argmax of the base logits, in either mode.
    np.testing.assert_array_equal(run(params, x, topc=topc, num_passes=0),
                                  np.argmax(np.asarray(x[0])[:, 1:], axis=-1))
    if topc:
        cand = topc_candidates(np.asarray(x[0])[:, 1:].reshape(n * (B - 1), -1), topc)
        assert all(t in c for t, c in zip(got.reshape(-1), cand))


# ----------------------------------------------------------------------------- K >= B-1: the sequential sample
@jax.jit
def pass_scores(params, x, blk_tokens, cand):
    """The scores a pass computes from the block whose draft is ``blk_tokens`` ([N, B-1]), jitted as refine is:
    full vocab [N, B-1, V] (``cand`` None), or the candidates' ``cand`` [N*(B-1), C]."""
    logits, h, anchors, prev_ids = x
    N, B, V = logits.shape
    blk = jnp.concatenate([anchors[:, None].astype(jnp.int32), blk_tokens], axis=1)
    prev = jnp.concatenate([prev_ids[:, None].astype(jnp.int32), blk[:, :-1]], axis=1)
    lat = latent(params, hidden_input(params, h), prev).reshape(N * (B - 1), -1)
    base = logits[:, 1:].reshape(N * (B - 1), V)
    if cand is None:
        return R.round_sum(base, R.readout(lat, params["w2"], logits.dtype)).reshape(N, B - 1, V)
    base_c = jnp.take_along_axis(base, cand, axis=-1)
    return R.topc_scores(base_c, lat, jnp.take(params["w2"], cand, axis=0)).reshape(N, B - 1, -1)


def sequential_sample(params, logits, h, anchors, prev_ids, key, T):
    """Decode the draft slot by slot: slot b = argmax(s * (1/T) + g) with s the rounded score given the final
    earlier slots and g the frozen noise of row n*(B-1) + b-1."""
    N, B, V = logits.shape
    acc = np.float64 if logits.dtype == jnp.float64 else np.float32
    g = noise(key, N * (B - 1), np.arange(V)).reshape(N, B - 1, V).astype(acc)
    draft = np.zeros((N, B - 1), np.int32)
    for j in range(B - 1):  # slot j + 1's score depends only on the slots before it, final by now
        s = np.asarray(pass_scores(params, (logits, h, anchors, prev_ids), jnp.asarray(draft), None)[:, j], acc)
        draft[:, j] = np.argmax(s * acc(inv(T)) + g[:, j], axis=-1)
    return draft


@pytest.mark.parametrize("dtype", ["float32", pytest.param("float64", marks=pytest.mark.slow)])
def test_enough_passes_give_the_sequential_sample(dtype):
    with jax.enable_x64(dtype == "float64"):
        params = make_head(CFG, dtype=jnp.dtype(dtype))
        x = make_inputs(CFG, 3, seed=2, dtype=jnp.dtype(dtype))
        key, T = jax.random.key(11), 0.8
        want = sequential_sample(params, *x, key, T)
        assert np.mean(want != run(params, x, num_passes=0, temperature=T, key=key)) > 0.2  # the passes matter
        assert np.mean(want != sequential_sample(params, *x, jax.random.key(12), T)) > 0.3  # the noise matters
        for k in (CFG.block_size - 1, CFG.block_size + 1)[: 1 if dtype == "float64" else 2]:
            np.testing.assert_array_equal(run(params, x, num_passes=k, temperature=T, key=key), want)


# ----------------------------------------------------------------------------- the emitted distribution
def softmax(s: np.ndarray, T: float) -> np.ndarray:
    z = np.asarray(s, np.float64) / T
    p = np.exp(z - z.max())
    return p / p.sum()


# V = 16 so that every token is expected often; N identical blocks, so draft rows differ only in their noise.
DCFG = xj.HeadConfig(vocab_size=16, hidden_size=8, block_size=5, rank=12, mlp_hidden=16, topc=6, num_passes=3,
                     max_num_reqs=2048)


def identical_blocks(n: int, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    row = jax.random.normal(k[0], (DCFG.vocab_size,)) * 1.2
    logits = jnp.broadcast_to(row, (n, DCFG.block_size, DCFG.vocab_size))
    h = jnp.broadcast_to(jax.random.normal(k[1], (DCFG.block_size, DCFG.hidden_size)),
                         (n, DCFG.block_size, DCFG.hidden_size))
    return np.asarray(row), (logits, h, jnp.full((n,), 3, jnp.int32), jnp.full((n,), 11, jnp.int32))


def counts_of(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens.reshape(-1), minlength=DCFG.vocab_size)


def support(probs: np.ndarray, topc: int, base: np.ndarray) -> np.ndarray:
    """``probs`` restricted to the top-C candidates of ``base`` and renormalised (top-C: the sampling support)."""
    if not topc:
        return probs
    mask = np.zeros_like(probs, bool)
    mask[topc_candidates(base[None], topc)[0]] = True
    p = np.where(mask, probs, 0.0)
    return p / p.sum()


def softmax_on(s: np.ndarray, T: float, topc: int, base: np.ndarray) -> np.ndarray:
    return support(softmax(s, T), topc, base)


@pytest.mark.parametrize("topc", [0, DCFG.topc], ids=["full", "topc"])
@pytest.mark.parametrize("T", [1.0, pytest.param(0.5, marks=pytest.mark.slow)])
def test_k0_tokens_are_distributed_as_softmax_base_over_t(topc, T):
    params = make_head(DCFG)
    base, x = identical_blocks(2048)
    tok = run(params, x, topc=topc, num_passes=0, temperature=T, key=jax.random.key(1))
    counts = counts_of(tok)  # 8192 draws: 2048 blocks x 4 slots
    stat, crit = chi2(counts, softmax_on(base, T, topc, base))
    assert stat < crit, (stat, crit)
    # The test has power: the same draws are far from a wrong temperature's distribution, draws at 2T are far
    # from softmax(base / T), and greedy draws (no noise) are far from it.
    assert chi2(counts, softmax_on(base, 2 * T, topc, base))[0] > 2 * crit
    hot = run(params, x, topc=topc, num_passes=0, temperature=2 * T, key=jax.random.key(1))
    assert chi2(counts_of(hot), softmax_on(base, T, topc, base))[0] > 2 * crit
    cold = run(params, x, topc=topc, num_passes=0, temperature=0.0, key=jax.random.key(1))
    assert chi2(counts_of(cold), softmax_on(base, T, topc, base))[0] > 2 * crit


@pytest.mark.parametrize("topc", [0, DCFG.topc], ids=["full", "topc"])
def test_first_slot_after_passes_is_distributed_as_softmax_q_over_t(topc):
    """Slot 1's latent depends only on the anchor, the token before it and h, so across identical blocks its
    proposal q1 is one vector and its token an exact sample of softmax(q1 / T)."""
    T = 1.0
    params = make_head(DCFG, std=0.5)
    base, x = identical_blocks(2048, seed=4)
    tok, prop = run(params, x, topc=topc, temperature=T, key=jax.random.key(2), proposal="scores")
    q1 = prop.scores[:, 0].astype(np.float32)
    assert np.all(q1 == q1[0])
    if topc:
        assert np.all(prop.ids[:, 0] == prop.ids[0, 0])
        q = np.full(DCFG.vocab_size, -np.inf, np.float32)
        q[prop.ids[0, 0]] = q1[0]
    else:
        q = q1[0]
    counts = counts_of(tok[:, 0])
    stat, crit = chi2(counts, softmax(q, T))
    assert stat < crit, (stat, crit)
    # Negative control: the refinement moved slot 1's distribution away from the drafter's.
    assert chi2(counts, softmax_on(base, T, topc, base))[0] > 2 * crit


# ----------------------------------------------------------------------------- the proposal
def scores_after(params, x, blk_tokens, topc):
    """(scores, candidates [N, B-1, C] or None) of a pass from the block whose draft is ``blk_tokens``."""
    N, B, V = x[0].shape
    cand = topc_candidates(np.asarray(x[0])[:, 1:].reshape(N * (B - 1), V), topc) if topc else None
    s = np.asarray(pass_scores(params, x, jnp.asarray(blk_tokens), None if cand is None else jnp.asarray(cand)))
    return s, None if cand is None else cand.reshape(N, B - 1, topc)


@MODES
@pytest.mark.parametrize("K", [0, 1, pytest.param(3, marks=pytest.mark.slow)])
def test_proposal_is_the_last_pass_scores(setup, topc, K):
    params, x = setup
    N, B, V = x[0].shape
    key, T = jax.random.key(6), 0.7
    tok, prop = run(params, x, topc=topc, num_passes=K, temperature=T, key=key, proposal="scores")
    np.testing.assert_array_equal(tok, run(params, x, topc=topc, num_passes=K, temperature=T, key=key))
    if K == 0:
        base = np.asarray(x[0])[:, 1:]
        if topc:
            cand = topc_candidates(base.reshape(N * (B - 1), V), topc).reshape(N, B - 1, topc)
            np.testing.assert_array_equal(np.sort(prop.ids, -1), np.sort(cand, -1))
            want = np.take_along_axis(base, prop.ids, -1)
        else:
            want = base
    else:  # recomputed from the block the previous pass left (the refine with K - 1 passes, the same noise)
        prev_blk = run(params, x, topc=topc, num_passes=K - 1, temperature=T, key=key)
        want, cand = scores_after(params, x, prev_blk, topc)
        if topc:
            np.testing.assert_array_equal(prop.ids, cand)
    if jax.default_backend() == "gpu" and K:
        # Two XLA programs (the refine and the oracle's latent) on random float32 inputs: on a GPU each picks its own
        # GEMM algorithm (summation order), so a score may land one rounding away; the checks below stay exact,
        # since they read the refine's own scores.
        a, b = prop.scores.astype(np.float64), want.astype(np.float64)
        one = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(want.dtype)).astype(np.float64)
        far = ~((a == b) | (np.abs(a - b) <= one))
        assert not far.any(), f"{int(far.sum())} scores beyond one rounding of the oracle's"
        print(f"scores one rounding from the oracle's: {int((a != b).sum())} of {a.size}")
    else:
        np.testing.assert_array_equal(prop.scores, want)
    assert prop.scores.dtype == x[0].dtype and prop.token_score.dtype == np.float32 and prop.lse.dtype == np.float32
    # The tokens are the sampled picks of these scores with the row's noise.
    ids = prop.ids if topc else np.broadcast_to(np.arange(V), prop.scores.shape)
    g = noise(key, N * (B - 1), np.arange(V)).reshape(N, B - 1, V)
    k = prop.scores.astype(np.float32) * inv(T) + np.take_along_axis(g, ids, -1)
    np.testing.assert_array_equal(tok, np.take_along_axis(ids, np.argmax(k, -1)[..., None], -1)[..., 0])
    # token_score: the score at the token; lse: logsumexp(scores / T) over the support; log_prob: log q(token).
    at = np.argmax(ids == tok[..., None], axis=-1)
    np.testing.assert_array_equal(prop.token_score, np.take_along_axis(prop.scores, at[..., None], -1)[..., 0])
    s64 = prop.scores.astype(np.float64) / T
    lse = np.log(np.sum(np.exp(s64 - s64.max(-1, keepdims=True)), -1)) + s64.max(-1)
    np.testing.assert_allclose(prop.lse, lse, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(xj.Proposal(*map(jnp.asarray, prop[:2])).log_prob(T)),
                               np.take_along_axis(s64, at[..., None], -1)[..., 0] - lse, rtol=1e-5, atol=1e-5)
    # "logprob": the same two arrays, no scores.
    tok2, lp = run(params, x, topc=topc, num_passes=K, temperature=T, key=key, proposal="logprob")
    np.testing.assert_array_equal(tok2, tok)
    assert lp.scores is None and lp.ids is None
    np.testing.assert_array_equal(lp.token_score, prop.token_score)
    np.testing.assert_array_equal(lp.lse, prop.lse)


@pytest.mark.parametrize("topc", [pytest.param(0, marks=pytest.mark.slow), C], ids=["full", "topc"])
def test_proposal_at_temperature_zero(setup, topc):
    params, x = setup
    tok, prop = run(params, x, topc=topc, temperature=0.0, key=jax.random.key(0), proposal="scores")
    np.testing.assert_array_equal(tok, run(params, x, topc=topc))
    assert np.all(prop.lse == np.inf)
    best = prop.scores.astype(np.float32).max(-1)
    np.testing.assert_array_equal(prop.token_score, best)


# ----------------------------------------------------------------------------- non-finite logits
def nonfinite_inputs(dtype):
    params = make_head(CFG, dtype=dtype)
    logits, h, a, p = make_inputs(CFG, 3, seed=9, dtype=dtype)
    lg = np.array(logits.astype(jnp.float32))
    V = CFG.vocab_size
    lg[0, 1, :] = np.nan
    lg[0, 1, 5] = 0.0                      # NaN everywhere but id 5
    lg[0, 2, 7] = np.inf                   # +inf at id 7
    lg[0, 3, [3, 200]] = np.inf            # two +inf: the lowest id wins (top-C: equal base, then the lowest id)
    lg[0, 4, :] = np.nan                   # nothing above -inf: id 0 (top-C: the lowest-id candidate, also 0)
    lg[1, 1, :] = -np.inf
    lg[1, 1, [17, 290]] = [0.0, 0.3]       # only two finite ids
    lg[1, 2, ::2] = np.nan                 # NaN at every even id: never picked
    lg[1, 3, :V // 2] = -np.inf
    return params, (jnp.asarray(lg).astype(dtype), h, a, p)


@pytest.mark.parametrize("topc,dtype", [
    pytest.param(0, jnp.float32, id="float32-full"), pytest.param(C, jnp.float32, id="float32-topc"),
    pytest.param(0, jnp.bfloat16, id="bfloat16-full", marks=pytest.mark.slow),
    pytest.param(C, jnp.bfloat16, id="bfloat16-topc", marks=pytest.mark.slow),
])
def test_nonfinite_logits(topc, dtype):
    params, x = nonfinite_inputs(dtype)
    for K in (0, CFG.num_passes):
        seen = set()
        for k in range(6):
            tok, prop = run(params, x, topc=topc, num_passes=K, temperature=1.0, key=jax.random.key(k),
                            proposal="scores")
            assert tok[0, 0] == 5 and tok[0, 1] == 7 and tok[0, 2] == 3 and tok[0, 3] == 0
            assert tok[1, 0] in (17, 290) and tok[1, 1] % 2 == 1 and tok[1, 2] >= CFG.vocab_size // 2
            seen.add(int(tok[1, 0]))
            assert not np.isnan(prop.scores.astype(np.float32)).any()
            assert not np.isnan(prop.lse).any() and not np.isnan(prop.token_score).any()
            assert prop.token_score[0, 1] == np.inf and prop.lse[0, 1] == np.inf
        if not topc:
            assert seen == {17, 290}  # both finite ids are sampled (probabilities 0.43 and 0.57 at K = 0)
        # The greedy tokens follow the same rules.
        g = run(params, x, topc=topc, num_passes=K)
        assert list(g[0]) == [5, 7, 3, 0]


# ----------------------------------------------------------------------------- shapes and dtypes
@pytest.mark.parametrize("topc,dtype", [
    *[pytest.param(c, jnp.float32, id=f"float32-C{c}", marks=[pytest.mark.slow] if c in (0, 1, CFG.vocab_size) else [])
      for c in (0, 1, C, CFG.vocab_size)],
    *[pytest.param(c, jnp.bfloat16, id=f"bfloat16-C{c}", marks=[pytest.mark.slow] if c != 0 else [])
      for c in (0, 1, C, CFG.vocab_size)],
])
def test_shapes_and_dtypes(topc, dtype):
    params = make_head(CFG, dtype=dtype)
    x = make_inputs(CFG, 3, seed=4, dtype=dtype)
    key, T = jax.random.key(13), 1.3
    seed = run(params, x, topc=topc, num_passes=0, temperature=T, key=key)
    np.testing.assert_array_equal(seed.reshape(-1), seed_oracle(x[0].astype(jnp.float32), key, T, topc))
    tok, prop = run(params, x, topc=topc, temperature=T, key=key, proposal="scores")
    assert tok.shape == (3, CFG.block_size - 1) and tok.dtype == np.int32
    assert prop.scores.shape == (3, CFG.block_size - 1, topc or CFG.vocab_size) and prop.scores.dtype == dtype
    np.testing.assert_array_equal(run(params, x, topc=topc, temperature=0.0, key=key), run(params, x, topc=topc))
    if topc == 1:  # one candidate: the drafter's argmax, whatever the noise
        np.testing.assert_array_equal(tok, np.argmax(np.asarray(x[0].astype(jnp.float32))[:, 1:], -1))
    if topc == CFG.vocab_size:  # every id is a candidate: the same seed block as full-vocab mode
        np.testing.assert_array_equal(seed, run(params, x, num_passes=0, temperature=T, key=key))


# ----------------------------------------------------------------------------- Pallas (interpret) = XLA
@pytest.mark.interpret_refine
@pytest.mark.slow
@pytest.mark.parametrize("topc", [0, C], ids=["full", "topc"])
def test_pallas_interpret_equals_xla(setup, topc):
    params, x = setup
    kw = dict(topc=topc, num_passes=2, temperature=0.9, key=jax.random.key(4), proposal="scores")
    want_tok, want = run(params, x, **kw)
    got_tok, got = run(params, x, backend="pallas", interpret=True, **kw)
    # The tokens are equal; the scores agree to float32 rounding (the latent kernel sums in another order).
    np.testing.assert_array_equal(got_tok, want_tok)
    close = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.token_score, want.token_score, **close)
    np.testing.assert_allclose(got.lse, want.lse, **close)
    if topc:  # the candidates may come in another order: compare (id, score) pairs sorted by id
        for p in (got, want):
            assert np.all(np.sort(p.ids, -1)[..., 1:] > np.sort(p.ids, -1)[..., :-1])
        order = lambda p: np.argsort(p.ids, -1)  # noqa: E731
        np.testing.assert_array_equal(np.take_along_axis(got.ids, order(got), -1),
                                      np.take_along_axis(want.ids, order(want), -1))
        np.testing.assert_allclose(np.take_along_axis(got.scores, order(got), -1),
                                   np.take_along_axis(want.scores, order(want), -1), **close)
    else:
        np.testing.assert_allclose(got.scores, want.scores, **close)


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_argument(setup):
    params, x = setup
    key = jax.random.key(0)
    kw = dict(num_passes=2, topc=0, backend="xla")
    with pytest.raises(ValueError, match="key"):
        xj.refine(params, *x, key=key, **kw)
    with pytest.raises(ValueError, match="key"):
        xj.refine(params, *x, temperature=1.0, **kw)
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            xj.refine(params, *x, temperature=bad, key=key, **kw)
    with pytest.raises(ValueError, match="temperature"):
        xj.refine(params, *x, temperature=jnp.ones(2), key=key, **kw)
    with pytest.raises(ValueError, match="proposal"):
        xj.refine(params, *x, proposal="scores", **kw)
    with pytest.raises(ValueError, match="proposal"):
        xj.refine(params, *x, temperature=1.0, key=key, proposal="logits", **kw)
    with pytest.raises(TypeError, match="key"):
        xj.refine(params, *x, temperature=1.0, key=0, **kw)
    with pytest.raises(ValueError, match="key"):
        xj.refine(params, *x, temperature=1.0, key=jax.random.split(key, 2), **kw)
    with pytest.raises(ValueError, match="key"):  # raw uint32 keys: one, of jax.random.PRNGKey's shape
        xj.refine(params, *x, temperature=1.0, key=jnp.zeros((3, 2), jnp.uint32), **kw)
    with pytest.raises(ValueError, match="full_vocab"):
        xj.refine(params, *x, temperature=1.0, key=key, full_vocab="certified", **kw)
    n, d = x[0].shape[0], CFG.block_size - 1
    logprob_only = xj.Proposal(jnp.zeros((n, d)), jnp.zeros((n, d)))  # what proposal="logprob" returns
    with pytest.raises(ValueError, match="scores"):
        xj.sampling.accept(jnp.zeros((n, d, CFG.vocab_size)), jnp.zeros((n, d), jnp.int32), logprob_only, 1.0, key)
