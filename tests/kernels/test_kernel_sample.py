"""The sampled picks' kernels (``seeds`` / ``inv_t`` / ``proposal`` of `full_vocab.full_vocab_pick` and
`topc_pick.topc_pick`) against the jnp oracle (`reference.full_vocab_sample`, `reference.topc_sample`).

`TestFullVocabSample` / `TestTopCSample` run the kernels for real (GPU only); their ``Interpret`` twins run the
same tests on CPU in interpret mode. `TestSampleLowering` lowers the sampled launches for an H200 on CPU.

Exactness: on "dyadic" inputs (`helpers.pick_inputs`) every dot is exact in any summation order, so the tokens,
the winner's score and the scores must equal the oracle's bit for bit (lse: the online sum over parts, allclose).
On random inputs the kernel may round a bias the other way than XLA; there the kernel must agree with itself: its
tokens are the winners of the keys of the scores it returns, and those scores lie within one rounding of the
oracle's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import SMALL, lower_triton, make_head, make_inputs, nonfinite_pick_inputs, pick_inputs

import xpress_jax as xj
from xpress_jax import dispatch
from xpress_jax import reference as R
from xpress_jax.kernels import common
from xpress_jax.kernels import full_vocab as fv
from xpress_jax.kernels import topc_pick as tp
from xpress_jax.sampling import inverse_temperature, row_seeds

#: Temperatures each comparison runs (inv_t is a run-time operand: one compile for all of them); 0 is greedy.
TEMPERATURES = (0.0, 0.25, 1.0, 3.0)

# Full-vocab configs: eager epilogue (rank chunks in a loop), flat lazy (prefetched base), held lazy.
FV_CONFIGS = {
    "eager": fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=3, k_tile=16, hold_lat=False),
    "flat-lazy": fv.FullVocabConfig(row_tile=16, v_tile=64, v_steps=4, k_tile=16, hold_lat=False, flat=True,
                                    prefetch_base=True, lazy=True),
    "held-lazy": fv.FullVocabConfig(row_tile=16, v_tile=128, v_steps=4, lazy=True, prefetch_base=True),
}


def _f32(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _inv(t: float) -> jax.Array:
    return inverse_temperature(t)


def _seeds(rows: int, seed: int = 7) -> jax.Array:
    return row_seeds(jax.random.key(seed), rows)


def _check_extras(got, want, exact: bool = True, exact_scores=None):
    """(token_score, lse, scores) of the kernel vs the oracle: exact scores (or within one rounding), lse close.
    ``exact_scores`` (float64 numpy, where the test can compute them): on a mismatch, say which side is exact."""
    (ts, lse, sc), (wts, wlse, wsc) = got, want
    assert ts.dtype == jnp.float32 and lse.dtype == jnp.float32
    if exact:
        if wsc is not None:
            assert sc.dtype == wsc.dtype and sc.shape == wsc.shape
            a, b = _f32(sc), _f32(wsc)
            bad = ~((a == b) | (np.isnan(a) & np.isnan(b)))
            if bad.any() and exact_scores is not None:
                e = exact_scores.astype(np.float32)[bad]
                raise AssertionError(f"{int(bad.sum())} of {a.size} scores differ from the oracle's; equal to the "
                                     f"float64 sum rounded once: kernel {int((a[bad] == e).sum())}, oracle "
                                     f"{int((b[bad] == e).sum())}; first: kernel {a[bad][:4]}, oracle {b[bad][:4]}, "
                                     f"exact {e[:4]}")
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(_f32(ts), _f32(wts))
    np.testing.assert_allclose(_f32(lse), _f32(wlse), rtol=2e-5, atol=1e-5)
    assert (sc is None) == (wsc is None)


def _same_tokens(interpret: bool, got, want, scores, seeds, inv_t, cand=None):
    """The kernel's tokens == the oracle's. Interpreted: exactly. Compiled, Triton's log and fused multiply-add may
    round a key ``s * inv_t + g`` one step from XLA's: a row may differ only where the oracle's keys of the two
    tokens are within 1e-5 (relative) of each other, a near tie (each such row is printed)."""
    got, want = np.asarray(got), np.asarray(want)
    if interpret:
        np.testing.assert_array_equal(got, want)
        return
    s = jnp.asarray(scores).astype(jnp.float32)
    ids = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) if cand is None else jnp.asarray(cand)
    key = np.asarray(common.sample_key(s, inv_t, common.gumbel(seeds[:, None], ids)), np.float64)
    col = (lambda r, t: t) if cand is None else (lambda r, t: int(np.nonzero(np.asarray(cand)[r] == t)[0][0]))
    for r in np.nonzero(got != want)[0]:
        a, b = key[r, col(r, want[r])], key[r, col(r, got[r])]
        print(f"row {r}: kernel {got[r]} (key {b!r}), oracle {want[r]} (key {a!r})")
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), f"row {r} differs without a near tie"


def _fv_self_consistent(tok, extras, seeds, inv_t, interpret=True):
    """The kernel's tokens are the winners (largest key, lowest id) of the keys of its own scores (`_same_tokens`);
    token_score is the winner's score."""
    s = jnp.asarray(extras[2]).astype(jnp.float32)
    ids = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    key = common.sample_key(s, inv_t, common.gumbel(seeds[:, None], ids))
    _same_tokens(interpret, tok, jnp.argmax(key, axis=1), s, seeds, inv_t)
    np.testing.assert_array_equal(_f32(extras[0]), _f32(jnp.take_along_axis(s, tok[:, None], 1)[:, 0]))


class TestFullVocabSample:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not common.gpu_supported():
            pytest.skip("needs a CUDA GPU; TestFullVocabSampleInterpret runs these tests on CPU")

    def sample(self, base, lat, w2, seeds, inv_t, config, **kw):
        return fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=config, seeds=seeds, inv_t=inv_t,
                                  **kw)

    @pytest.mark.parametrize("name,dtype", [
        pytest.param(name, dt, id=f"{name}-{jnp.dtype(dt).name}",
                     marks=() if (name, dt) == ("flat-lazy", jnp.bfloat16) else pytest.mark.slow)
        for name in FV_CONFIGS for dt in (jnp.float32, jnp.bfloat16)])
    def test_matches_reference(self, name, dtype):
        """Dyadic inputs (exact dots, many tied scores), odd V = 1001, rank 40, the draft rows of whole logits
        [N*B, V] read in place (slot_stride): tokens, token_score and scores exact, lse close, at several T;
        T = 0 gives the greedy pick's tokens (ties: the lowest id); no proposal gives the same tokens."""
        n, b, vocab, rank = 5, 6, 1001, 40
        rows = n * (b - 1)
        base, lat, w2 = pick_inputs(n * b, vocab, rank, dtype, seed=11, dyadic=True)
        lat = lat[:rows]
        draft = R.draft_rows(base.reshape(n, b, vocab))
        seeds, cfg = _seeds(rows), FV_CONFIGS[name]
        for t in TEMPERATURES:
            inv_t = _inv(t)
            tok, extras = self.sample(base, lat, w2, seeds, inv_t, cfg, slot_stride=b, proposal="scores")
            want, want_x = R.full_vocab_sample(draft, lat, w2, seeds, inv_t, "scores")
            assert tok.dtype == jnp.int32 and tok.shape == (rows,)
            _same_tokens(self.INTERPRET, tok, want, want_x[2], seeds, inv_t)
            _check_extras(extras, want_x)
            plain = self.sample(base, lat, w2, seeds, inv_t, cfg, slot_stride=b)
            _same_tokens(self.INTERPRET, plain, want, want_x[2], seeds, inv_t)
            if t == 0:
                greedy = fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg, slot_stride=b)
                np.testing.assert_array_equal(np.asarray(tok), np.asarray(greedy))
                np.testing.assert_array_equal(np.asarray(tok), np.asarray(R.full_vocab_pick(draft, lat, w2)))
                assert np.isinf(_f32(extras[1])).all()
        assert len(np.unique(np.asarray(tok))) > 1

    @pytest.mark.slow(interpret_only=True)
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
    def test_random_inputs(self, dtype):
        """Random normal inputs (the dot may round a bias the other way than XLA): the kernel agrees with its own
        scores (`_fv_self_consistent`), its scores lie within one rounding of the oracle's, T = 0 gives the greedy
        kernel's tokens (the same dots), and "logprob" the same token_score and lse without the scores."""
        rows, vocab, rank = 25, 1001, 40
        base, lat, w2 = pick_inputs(rows, vocab, rank, dtype, seed=5)
        seeds, cfg = _seeds(rows, 3), FV_CONFIGS["flat-lazy"]
        for t in (0.0, 1.0):
            inv_t = _inv(t)
            tok, extras = self.sample(base, lat, w2, seeds, inv_t, cfg, proposal="scores")
            _fv_self_consistent(tok, extras, seeds, inv_t, self.INTERPRET)
            _, (_, wlse, wsc) = R.full_vocab_sample(base, lat, w2, seeds, inv_t, "scores")
            tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5  # a rounding of the result / the dot's error
            np.testing.assert_allclose(_f32(extras[2]), _f32(wsc), rtol=tol, atol=tol)
            np.testing.assert_allclose(_f32(extras[1]), _f32(wlse), rtol=1e-2 if t else 0)
            tok2, (ts2, lse2, sc2) = self.sample(base, lat, w2, seeds, inv_t, cfg, proposal="logprob")
            assert sc2 is None
            np.testing.assert_array_equal(np.asarray(tok2), np.asarray(tok))
            np.testing.assert_array_equal(_f32(ts2), _f32(extras[0]))
            np.testing.assert_array_equal(_f32(lse2), _f32(extras[1]))
            if t == 0:
                greedy = fv.full_vocab_pick(base, lat, w2, interpret=self.INTERPRET, config=cfg)
                np.testing.assert_array_equal(np.asarray(tok), np.asarray(greedy))

    @pytest.mark.slow(interpret_only=True)
    def test_nonfinite(self):
        """NaN base logits rank as -inf (written as -inf in the scores), +inf wins (key +inf, lse +inf), a row
        without a finite score picks id 0 with lse -inf; the same as the oracle."""
        base, lat, w2 = (jnp.asarray(a) for a in nonfinite_pick_inputs())
        # Dyadic latent and weights: the oracle's dot is exact, so the comparison is exact.
        lat, w2 = jnp.round(lat * 4) / 8, jnp.round(w2 * 4) / 16
        rows = base.shape[0]
        seeds = _seeds(rows, 9)
        for t in (0.0, 0.5):
            inv_t = _inv(t)
            tok, extras = self.sample(base, lat, w2, seeds, inv_t, FV_CONFIGS["eager"], proposal="scores")
            want, want_x = R.full_vocab_sample(base, lat, w2, seeds, inv_t, "scores")
            np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
            exact = np.asarray(base, np.float64) + np.asarray(lat, np.float64) @ np.asarray(w2, np.float64).T
            _check_extras(extras, want_x, exact_scores=np.where(np.isnan(exact), -np.inf, exact))
            np.testing.assert_array_equal(np.asarray(tok)[1:5], [300, 0, 0, 0])
            assert not np.isnan(_f32(extras[2])).any()
            if t:
                np.testing.assert_array_equal(_f32(extras[1])[1:5], [np.inf, -np.inf, -np.inf, -np.inf])

    @pytest.mark.slow(interpret_only=True)
    def test_row_ids_partials_reverse(self):
        """``row_ids`` picks those draft rows (their own seeds), ``partials`` are the parts' (key, id) winners that
        the full-vocab rule combines into the tokens, ``reverse`` and ``keep`` change no token."""
        rows, vocab, rank = 25, 1001, 40
        base, lat, w2 = pick_inputs(rows, vocab, rank, jnp.bfloat16, seed=2, dyadic=True)
        seeds, inv_t, cfg = _seeds(rows, 4), _inv(0.8), FV_CONFIGS["held-lazy"]
        want = np.asarray(R.full_vocab_sample(base, lat, w2, seeds, inv_t)[0])
        ids = jnp.asarray([24, 3, 17, 0], jnp.int32)
        got, (ts, _, sc) = self.sample(base, lat, w2, seeds, inv_t, cfg, row_ids=ids, proposal="scores")
        np.testing.assert_array_equal(np.asarray(got), want[np.asarray(ids)])
        full_tok, (full_ts, _, full_sc) = self.sample(base, lat, w2, seeds, inv_t, cfg, proposal="scores")
        np.testing.assert_array_equal(_f32(sc), _f32(full_sc)[np.asarray(ids)])
        np.testing.assert_array_equal(_f32(ts), _f32(full_ts)[np.asarray(ids)])
        key, idx = self.sample(base, lat, w2, seeds, inv_t, cfg, partials=True)
        assert key.shape[0] > 1
        np.testing.assert_array_equal(np.asarray(R.best_by_score(key, idx, axis=0)[1]), want)
        rev = self.sample(base, lat, w2, seeds, inv_t, cfg, reverse=True, keep="split")
        np.testing.assert_array_equal(np.asarray(rev), want)

    def test_bad_arguments(self):
        base, lat, w2 = pick_inputs(20, 300, 16, jnp.float32, seed=1)
        seeds, inv_t = _seeds(20), _inv(1.0)
        call = functools.partial(fv.full_vocab_pick, base, lat, w2, interpret=True)
        for name, kw in (("active", dict(active=jnp.ones(20, bool))),
                         ("counter", dict(counter=jnp.zeros(8, jnp.int32))),
                         ("fallback", dict(fallback=jnp.zeros(20, jnp.int32)))):
            with pytest.raises(ValueError, match=name):
                call(seeds=seeds, inv_t=inv_t, **kw)
        with pytest.raises(ValueError, match="seeds"):
            call(seeds=seeds[:5], inv_t=inv_t)
        with pytest.raises(ValueError, match="inv_t"):
            call(seeds=seeds)
        with pytest.raises(ValueError, match="inv_t"):
            call(seeds=seeds, inv_t=jnp.ones(2))
        with pytest.raises(ValueError, match="proposal"):
            call(seeds=seeds, inv_t=inv_t, proposal="probs")
        with pytest.raises(ValueError, match="partials"):
            call(seeds=seeds, inv_t=inv_t, proposal="logprob", partials=True)


class TestFullVocabSampleInterpret(TestFullVocabSample):
    INTERPRET = True


def _topc_inputs(rows, vocab, c, rank, dtype, seed, dyadic=True):
    base, lat, w2 = pick_inputs(rows, vocab, rank, dtype, seed=seed, dyadic=dyadic)
    cand, base_c, _ = R.select_candidates(base, c)
    return base_c, cand, lat, w2


class TestTopCSample:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and not common.gpu_supported():
            pytest.skip("needs a CUDA GPU; TestTopCSampleInterpret runs these tests on CPU")

    def sample(self, base_c, cand, lat, w2, seeds, inv_t, config=None, **kw):
        return tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=config, seeds=seeds, inv_t=inv_t,
                            **kw)

    @pytest.mark.parametrize("c,dtype,config", [
        pytest.param(37, jnp.bfloat16, tp.TopCConfig(c_tile=8, c_steps=2, k_tile=16), id="C37-splits-bf16"),
        pytest.param(37, jnp.float32, tp.TopCConfig(c_tile=16, c_steps=4, k_tile=32), id="C37-one-split-f32",
                     marks=pytest.mark.slow),
        pytest.param(1, jnp.bfloat16, tp.TopCConfig(c_tile=16, c_steps=1, k_tile=16), id="C1-bf16",
                     marks=pytest.mark.slow(interpret_only=True)),
        pytest.param(1001, jnp.bfloat16, tp.TopCConfig(c_tile=128, c_steps=2, k_tile=16), id="CV-bf16",
                     marks=pytest.mark.slow(interpret_only=True)),
    ])
    def test_matches_reference(self, c, dtype, config):
        """Dyadic inputs, V = 1001, rank 40: tokens, token_score and the candidates' scores exact, lse close, at
        several T; T = 0 gives the greedy top-C pick (ties: the larger base logit, then the lowest id)."""
        rows, vocab, rank = 21, 1001, 40
        base_c, cand, lat, w2 = _topc_inputs(rows, vocab, c, rank, dtype, seed=c)
        w2c = R.topc_gather(w2, cand)
        seeds = _seeds(rows, 5)
        for t in TEMPERATURES:
            inv_t = _inv(t)
            tok, extras = self.sample(base_c, cand, lat, w2, seeds, inv_t, config, proposal="scores")
            want, want_x = R.topc_sample(base_c, cand, lat, w2c, seeds, inv_t, "scores")
            _same_tokens(self.INTERPRET, tok, want, want_x[2], seeds, inv_t, cand)
            _check_extras(extras, want_x)
            plain = self.sample(base_c, cand, lat, w2, seeds, inv_t, config)
            _same_tokens(self.INTERPRET, plain, want, want_x[2], seeds, inv_t, cand)
            if t == 0:
                greedy = tp.topc_pick(base_c, cand, lat, w2, interpret=self.INTERPRET, config=config)
                np.testing.assert_array_equal(np.asarray(tok), np.asarray(greedy))
                np.testing.assert_array_equal(np.asarray(tok), np.asarray(R.topc_pick(base_c, cand, lat, w2c)))

    @pytest.mark.slow(interpret_only=True)
    def test_ties_nonfinite_and_random(self):
        """At T = 0 (keys = scores) tied scores go to the larger base logit, then the lowest id (constructed ties,
        NaN / +inf / -inf base logits); at T > 0 NaN never wins and +inf does. Random inputs: the kernel's tokens
        are the top-C winners of the keys of its own scores."""
        rows, c, rank, vocab = 6, 20, 16, 300
        rng = np.random.default_rng(0)
        cand = np.stack([rng.permutation(vocab)[:c] for _ in range(rows)]).astype(np.int32)
        base_c = np.full((rows, c), -2.0, np.float32)
        lat, w2 = np.zeros((rows, rank), np.float32), np.zeros((vocab, rank), np.float32)
        cand[0, [3, 15]] = [200, 100]; base_c[0, [3, 15]] = [1.0, 1.5]; lat[0, 0] = 1; w2[200, 0] = 0.5  # base wins
        cand[1, [2, 12]] = [250, 50]; base_c[1, [2, 12]] = 1.0  # equal base: the lower id (50)
        base_c[2] = np.nan; base_c[2, 7] = -1.0  # NaN ranks as -inf
        base_c[3, [4, 9]] = np.inf  # +inf: the lower id of the two
        base_c[4] = -np.inf  # no finite score: the lowest id
        base_c[5] = np.nan
        args = (jnp.asarray(base_c), jnp.asarray(cand), jnp.asarray(lat), jnp.asarray(w2))
        w2c = R.topc_gather(args[3], args[1])
        cfg = tp.TopCConfig(c_tile=8, c_steps=1, k_tile=16)
        seeds = _seeds(rows, 6)
        for t in (0.0, 0.5):
            inv_t = _inv(t)
            tok, extras = self.sample(*args, seeds, inv_t, cfg, proposal="scores")
            want, want_x = R.topc_sample(*args[:3], w2c, seeds, inv_t, "scores")
            np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
            _check_extras(extras, want_x)
            assert not np.isnan(_f32(extras[2])).any()
            tok = np.asarray(tok)
            assert tok[2] == cand[2, 7] and tok[3] == min(cand[3, 4], cand[3, 9])
            assert tok[4] == cand[4].min() and tok[5] == cand[5].min()
            if t == 0:
                assert tok[0] == 100 and tok[1] == 50
        base_c, cand, lat, w2 = _topc_inputs(12, 500, 40, 24, jnp.bfloat16, seed=8, dyadic=False)
        seeds, inv_t = _seeds(12, 8), _inv(1.0)
        tok, (ts, _, s) = self.sample(base_c, cand, lat, w2, seeds, inv_t, cfg, proposal="scores")
        sf = s.astype(jnp.float32)
        key = common.sample_key(sf, inv_t, common.gumbel(seeds[:, None], cand))
        _same_tokens(self.INTERPRET, tok, R.best_by_topc_rule(key, R.clean(base_c).astype(jnp.float32), cand)[2], sf,
                     seeds, inv_t, cand)
        np.testing.assert_array_equal(_f32(ts), _f32(jnp.max(jnp.where(cand == tok[:, None], sf, -jnp.inf), 1)))

    @pytest.mark.slow(interpret_only=True)
    def test_lat_add_row_ids_partials(self):
        """``lat_add`` (a `reference.LatentSum`) samples as its rounded sum does; ``row_ids`` picks those rows with
        their own seeds; ``partials`` combine by the top-C rule into the tokens."""
        rows, vocab, c, rank = 10, 400, 33, 24
        base_c, cand, lat, w2 = _topc_inputs(rows, vocab, c, rank, jnp.bfloat16, seed=3)
        u = jnp.asarray(np.random.default_rng(1).integers(-4, 5, (rows, rank)) / 8, jnp.float32)
        d = lat.astype(jnp.float32) - u
        seeds, inv_t, cfg = _seeds(rows, 2), _inv(0.6), tp.TopCConfig(c_tile=8, c_steps=2, k_tile=16)
        want, want_x = R.topc_sample(base_c, cand, lat, R.topc_gather(w2, cand), seeds, inv_t, "scores")
        got, extras = self.sample(base_c, cand, u, w2, seeds, inv_t, cfg, lat_add=d, proposal="scores")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        _check_extras(extras, want_x)
        ids = jnp.asarray([9, 0, 4], jnp.int32)
        got = self.sample(base_c, cand, lat, w2, seeds, inv_t, cfg, row_ids=ids)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[np.asarray(ids)])
        key, b, idx = self.sample(base_c, cand, lat, w2, seeds, inv_t, cfg, partials=True)
        assert key.shape[0] > 1
        np.testing.assert_array_equal(np.asarray(R.best_by_topc_rule(key, b, idx, axis=0)[2]), np.asarray(want))

    def test_bad_arguments(self):
        base_c, cand, lat, w2 = _topc_inputs(4, 100, 8, 16, jnp.float32, seed=0)
        seeds, inv_t = _seeds(4), _inv(1.0)
        call = functools.partial(tp.topc_pick, base_c, cand, lat, w2, interpret=True)
        with pytest.raises(ValueError, match="skip"):
            call(seeds=seeds, inv_t=inv_t, skip=False)
        with pytest.raises(ValueError, match="ties"):
            call(seeds=seeds, inv_t=inv_t, ties="id")
        with pytest.raises(ValueError, match="seeds"):
            call(seeds=seeds[:2], inv_t=inv_t)
        with pytest.raises(ValueError, match="inv_t"):
            call(seeds=seeds, inv_t=jnp.ones(3))
        with pytest.raises(ValueError, match="partials"):
            call(seeds=seeds, inv_t=inv_t, proposal="scores", partials=True)


class TestTopCSampleInterpret(TestTopCSample):
    INTERPRET = True


class TestSampleLowering:
    """The sampled launches lower to Triton for an H200 at serving shapes (bf16, V = 151936, r = 256), with the
    served configs (`dispatch.plan`), in every proposal mode."""

    @pytest.mark.parametrize("n", [1, pytest.param(4, marks=pytest.mark.slow), 16])
    def test_full_vocab(self, n):
        b, vocab, rank, dt = 16, 151936, 256, jnp.bfloat16
        rows = n * (b - 1)
        cfg = dispatch.plan(n, b, vocab, rank, 0, dt).full_vocab
        S = jax.ShapeDtypeStruct
        args = (S((n * b, vocab), dt), S((rows, rank), dt), S((vocab, rank), dt), S((rows,), jnp.int32),
                S((), jnp.float32))
        for proposal in (None, "logprob", "scores"):
            f = functools.partial(_fv_call, config=cfg, slot_stride=b, proposal=proposal)
            assert "xpress_full_vocab_sample" in lower_triton(f, *args).as_text()

    @pytest.mark.parametrize("rows", [15, 240])
    def test_topc(self, rows):
        vocab, c, rank, dt = 151936, 512, 256, jnp.bfloat16
        cfg = dispatch.plan(rows, 2, vocab, rank, c, dt).topc
        S = jax.ShapeDtypeStruct
        args = (S((rows, c), dt), S((rows, c), jnp.int32), S((rows, rank), dt), S((vocab, rank), dt),
                S((rows,), jnp.int32), S((), jnp.float32))
        for proposal in (None, "scores"):
            f = functools.partial(_tc_call, config=cfg, proposal=proposal)
            assert "xpress_topc_sample" in lower_triton(f, *args).as_text()


def _fv_call(base, lat, w2, seeds, inv_t, **kw):
    return fv.full_vocab_pick(base, lat, w2, seeds=seeds, inv_t=inv_t, **kw)


def _tc_call(base_c, cand, lat, w2, seeds, inv_t, **kw):
    return tp.topc_pick(base_c, cand, lat, w2, seeds=seeds, inv_t=inv_t, **kw)


@pytest.mark.interpret_refine
@pytest.mark.parametrize("topc", [pytest.param(0, marks=pytest.mark.slow), pytest.param(23, marks=pytest.mark.slow)])
def test_refine_pallas_matches_xla(topc):
    """``refine(backend="pallas", interpret=True)`` with a temperature and ``proposal="scores"`` (the kernels in
    every pass but the seed) == the XLA backend: the same tokens; the proposal within one rounding (the kernels'
    dots sum in their own order)."""
    cfg = xj.HeadConfig(**dict(SMALL, vocab_size=301, topc=23, block_size=4))
    params = make_head(cfg, dtype=jnp.bfloat16)
    logits, h, anchors, prev = make_inputs(cfg, 3, dtype=jnp.bfloat16)
    kw = dict(config=cfg, topc=topc, temperature=0.8, key=jax.random.key(3), proposal="scores")
    want, wp = xj.refine(params, logits, h, anchors, prev, backend="xla", **kw)
    got, gp = xj.refine(params, logits, h, anchors, prev, backend="pallas", interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    g_sc, w_sc = _f32(gp.scores), _f32(wp.scores)
    if topc:  # the same candidate sets; the selection kernel may list them in another order
        g_ord, w_ord = np.argsort(np.asarray(gp.ids), -1), np.argsort(np.asarray(wp.ids), -1)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(gp.ids), g_ord, -1),
                                      np.take_along_axis(np.asarray(wp.ids), w_ord, -1))
        g_sc, w_sc = np.take_along_axis(g_sc, g_ord, -1), np.take_along_axis(w_sc, w_ord, -1)
    for a, b in ((_f32(gp.token_score), _f32(wp.token_score)), (g_sc, w_sc)):
        np.testing.assert_allclose(a, b, rtol=2.0**-7, atol=2.0**-7)
    np.testing.assert_allclose(_f32(gp.lse), _f32(wp.lse), rtol=1e-3)
