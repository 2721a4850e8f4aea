"""The certified exact full-vocab mode: ``refine(..., topc=0, full_vocab="certified")`` (`xpress_jax.exact`).

Its tokens must equal ``full_vocab="scan"`` on the same backend; every test also checks, through the
call's stats (or the pick's certified mask), that the path it means to test is the one taken.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax import dispatch
from xpress_jax import reference as ref
from xpress_jax.exact import Certified, CertifiedPrepared, CertifiedStats, _call_data, _decide, prepare_certified
from xpress_jax.kernels.common import gpu_supported
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

from helpers import with_columns

DTYPES = [jnp.bfloat16, jnp.float32]
SLOW = pytest.mark.slow


def _grid(fast, *axes):
    """pytest.params of every combination of ``axes`` (lists of (id, value)), all but the ids in ``fast`` slow."""
    combos = [[]]
    for axis in axes:
        combos = [c + [kv] for c in combos for kv in axis]
    return [pytest.param(*(v for _, v in c), id="-".join(k for k, _ in c),
                         marks=() if "-".join(k for k, _ in c) in fast else SLOW) for c in combos]


_DT = [("bfloat16", jnp.bfloat16), ("float32", jnp.float32)]
V, H, B, R, K = 2000, 48, 6, 32, 3
CFG = xj.HeadConfig(vocab_size=V, hidden_size=H, block_size=B, rank=R, mlp_hidden=32, topc=16, num_passes=K)

# Three regimes (N=8 blocks, 40 draft rows): a peaked drafter (16 ids per row at 6 + 0.5 N(0,1) over N(0,1):
# refinement reorders them, and the C=32 candidates leave every other id far below) -> every row certifies;
# N(0, 2) logits with a std 0.1 head and 32 candidates -> 5-10% of rows fail each pass and fit the subset scan
# (3 blocks = 15 rows); std 0.3 -> the bound certifies nothing: the call falls back after its first pass.
REGIMES = {
    "certified": (0.1, True, Certified(candidates=32)),
    "row_scan": (0.1, False, Certified(candidates=32, scan_blocks=3)),
    "fallback": (0.3, False, Certified(candidates=64, scan_blocks=3)),
}


def _problem(dtype, std, n=8, seed=0, cfg=CFG, peaked=False):
    kp, kl, kh, ka, ki, kv = jax.random.split(jax.random.key(seed), 6)
    params = xj.init_params(cfg, kp, dtype=dtype, std=std)
    shape = (n, cfg.block_size, cfg.vocab_size)
    if peaked:
        ids = jax.random.randint(ki, shape[:2] + (16,), 0, cfg.vocab_size)
        peak = 6 + 0.5 * jax.random.normal(kv, shape[:2] + (16,))
        logits = jax.vmap(jax.vmap(lambda l, i, p: l.at[i].set(p)))(jax.random.normal(kl, shape), ids, peak)
    else:
        logits = jax.random.normal(kl, shape) * 2
    h = jax.random.normal(kh, (n, cfg.block_size, cfg.hidden_size)).astype(dtype)
    anchors = jax.random.randint(ka, (n,), 0, cfg.vocab_size)
    return params, logits.astype(dtype), h, anchors


def _regime(dtype, regime, n=8):
    std, peaked, cert = REGIMES[regime]
    return _problem(dtype, std, n=n, peaked=peaked), cert


@functools.partial(jax.jit, static_argnames=("backend", "interpret", "full_vocab", "unroll", "return_stats"))
def _refine(params, logits, h, anchors, *, backend="xla", interpret=False, full_vocab="scan", unroll=None,
            return_stats=False):
    return xj.refine(params, logits, h, anchors, config=CFG, topc=0, backend=backend, interpret=interpret,
                     full_vocab=full_vocab, unroll=unroll, return_stats=return_stats)


def certified_pick(ops: Ops, logits, lat, w2, cfg: Certified = Certified()):
    """One certified pass on given latents: ``logits`` [N, B, V] (draft slots are the rows), ``lat`` [rows, r].
    Returns (tokens [rows] int32, certified [rows] bool): the candidates' winner where the bound certifies it,
    else ``ops.full_vocab_pick``'s token."""
    d = _call_data(ops, logits, w2, min(int(cfg.candidates), logits.shape[2]))
    rows = lat.shape[0]
    best_id, fail, _, _ = _decide(ops, d, lat, logits.dtype, jnp.ones((rows,), bool), jnp.zeros((), bool))
    return ops.full_vocab_pick(logits, lat, d.fprep, active=fail, fallback=best_id)[0], fail == 0


def _check_regime(stats: CertifiedStats, regime: str):
    st = {k: float(v) for k, v in stats._asdict().items()}
    assert abs(st["passes_certified"] + st["passes_row_scan"] + st["passes_full_scan"] - 1) < 1e-6, st
    if regime == "certified":
        assert st["rows_certified"] == 1.0 and st["passes_certified"] == 1.0, st
    elif regime == "row_scan":
        assert 0.5 < st["rows_certified"] < 1.0 and st["passes_row_scan"] > 0 and st["passes_full_scan"] == 0, st
    else:
        assert st["rows_certified"] < 0.5 and st["passes_full_scan"] == 1.0, st


@pytest.mark.parametrize("dtype,regime", _grid({"float32-row_scan"}, _DT, [(r, r) for r in REGIMES]))
def test_tokens_equal_scan_xla(dtype, regime):
    """XLA backend: the certified tokens are the full scan's, in each regime (certified / a few rows scanned /
    the whole call falls back), and the stats say which regime ran. Loop and unrolled (numbered) passes."""
    x, cert = _regime(dtype, regime)
    want = np.asarray(_refine(*x))
    for unroll in (False, True):
        got, stats = _refine(*x, full_vocab=cert, unroll=unroll, return_stats=True)
        np.testing.assert_array_equal(np.asarray(got), want)
        _check_regime(stats, regime)
    assert (want != np.asarray(ref.full_vocab_start(x[1])).reshape(want.shape)).mean() > 0.1  # refinement acts


@pytest.mark.interpret
@pytest.mark.interpret_refine
@pytest.mark.parametrize("dtype,regime", [pytest.param(jnp.bfloat16, "row_scan", marks=SLOW), (jnp.float32, "fallback"),
                                          pytest.param(jnp.bfloat16, "certified", marks=pytest.mark.slow),
                                          pytest.param(jnp.float32, "row_scan", marks=pytest.mark.slow)],
                         ids=lambda v: jnp.dtype(v).name if not isinstance(v, str) else v)
@pytest.mark.slow
def test_tokens_equal_scan_pallas_interpret(dtype, regime):
    """Pallas kernels in interpret mode: the candidates scored by the top-C kernel (ties="id"), the subset and
    the fallback by the full-vocab kernel; tokens equal the Pallas full scan."""
    x, cert = _regime(dtype, regime, n=4)
    cert = dataclasses.replace(cert, scan_blocks=min(cert.scan_blocks or 1, 2))
    want = np.asarray(_refine(*x, backend="pallas", interpret=True))
    got, stats = _refine(*x, backend="pallas", interpret=True, full_vocab=cert, return_stats=True)
    np.testing.assert_array_equal(np.asarray(got), want)
    _check_regime(stats, regime)


@pytest.mark.interpret
@pytest.mark.interpret_refine
@pytest.mark.parametrize("regime,path", _grid(set(), [(r, r) for r in ("row_scan", "fallback")],
                                              [(p, p) for p in ("pick", "one-launch", "two-launch")]))
def test_unrolled_passes_skip_final_slots(regime, path):
    """Unrolled, each certified pass knows its number: its final draft slots keep their tokens and are not
    scanned, and its full-vocab picks take the pass pick's order and L2 hint. Paths: "pick" (one row tile holds
    every row: the counted pick of the active rows), "one-launch" (the packed scan,
    `kernels.full_vocab.scan_failing`, whose packing leaves the final slots out even in a full pass),
    "two-launch" (the all-rows launch reads the other slots through ``row_ids``); the packed paths are forced
    by a ``full_vocab_capacity`` that always packs (the test shapes fit one row tile). B=6, K=6: passes 2-5
    skip slots, pass 6 (every slot final) runs nothing. Tokens equal the Pallas scan's and the loop's."""
    cfg = dataclasses.replace(CFG, num_passes=6)
    x, cert = _regime(jnp.bfloat16, regime, n=4)
    cert = dataclasses.replace(cert, scan_blocks=2)
    ops = Ops.pallas(True)
    if path != "pick":
        ops = dataclasses.replace(ops, full_vocab_capacity=lambda n, b, v, r, dtype, limit: limit or None)
    if path == "two-launch":
        ops = dataclasses.replace(Ops.pallas(True, table=with_columns(dispatch.TABLE, scan_one_launch=False)),
                                  full_vocab_capacity=ops.full_vocab_capacity)

    def run(o, unroll, full_vocab="scan"):
        f = jax.jit(lambda *a: refine_with(o, *a, config=cfg, topc=0, unroll=unroll, full_vocab=full_vocab,
                                           return_stats=full_vocab != "scan"))
        return f(*x)

    want = np.asarray(run(Ops.pallas(True), False))
    got, stats = run(ops, True, cert)
    np.testing.assert_array_equal(np.asarray(got), want)
    loop, loop_stats = run(ops, False, cert)
    np.testing.assert_array_equal(np.asarray(loop), want)
    st, lst = ({k: float(v) for k, v in t._asdict().items()} for t in (stats, loop_stats))
    if regime == "fallback":  # passes 1-5 fall back (pass 6 runs nothing and counts as certified)
        assert st["passes_full_scan"] == pytest.approx(5 / 6) and st["passes_certified"] == pytest.approx(1 / 6), st
        assert lst["passes_full_scan"] == 1.0, lst
    else:
        assert 0.5 < st["rows_certified"] < 1.0 and st["passes_row_scan"] > 0 and st["passes_full_scan"] == 0, st
    assert (want != np.asarray(ref.full_vocab_start(x[1])).reshape(want.shape)).mean() > 0.1  # refinement acts


@pytest.mark.parametrize("backend", ["xla", pytest.param("pallas", marks=[pytest.mark.interpret_refine, SLOW])])
@pytest.mark.slow
def test_float64(backend):
    """float64 (the jnp path on either backend: the kernels refuse it): tokens equal the scan where most rows
    certify and the rest are scanned."""
    with jax.enable_x64(True):
        for regime in ("row_scan",):
            x, cert = _regime(jnp.float64, regime, n=4)
            want = np.asarray(_refine(*x, backend=backend, interpret=backend == "pallas"))
            got, stats = _refine(*x, backend=backend, interpret=backend == "pallas", full_vocab=cert, return_stats=True)
            np.testing.assert_array_equal(np.asarray(got), want)
            _check_regime(stats, regime)


@pytest.mark.slow
def test_padding_rows_never_force_a_fallback():
    """Rows of invalid blocks (anchor -1 under jit, as RefineServer pads) with flat logits, which could never
    certify, do not count: the call stays certified, valid rows equal the scan's, padding rows are -1."""
    (params, logits, h, anchors), cert = _regime(jnp.float32, "certified")
    logits = logits.at[5:].set(0.0)
    anchors = anchors.at[5:].set(-1)
    want = np.asarray(_refine(params, logits, h, anchors))
    got, stats = _refine(params, logits, h, anchors, full_vocab=cert, return_stats=True)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert (want[5:] == xj.INVALID_TOKEN).all() and (want[:5] >= 0).all()
    _check_regime(stats, "certified")
    # The same flat rows made valid cannot certify (tau = best): the call scans them.
    _, stats = _refine(params, logits, h, anchors.at[5:].set(0), full_vocab=cert, return_stats=True)
    assert float(stats.passes_certified) == 0.0


@pytest.mark.parametrize("dtype", [pytest.param(jnp.bfloat16, marks=SLOW), jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_adversarial_heads_fall_back_and_stay_exact(dtype):
    """Huge w2 rows (a few ids with norm 100x the rest) and flat base logits: the bound fails for every row,
    the fallback runs, tokens equal the scan. Also with no subset (scan_blocks=0) and a subset of every row."""
    params, logits, h, anchors = _problem(dtype, 0.05, seed=3)
    rng = np.random.default_rng(0)
    big = rng.random((V, 1)) < 0.01
    params = dict(params, w2=(params["w2"].astype(jnp.float32) * jnp.asarray(np.where(big, 100.0, 1.0))).astype(dtype))
    logits = (logits.astype(jnp.float32) * 1e-3).astype(dtype)  # flat: base spread << any bias
    want = np.asarray(_refine(params, logits, h, anchors))
    for cert in (Certified(candidates=64), Certified(candidates=64, scan_blocks=0), Certified(scan_blocks=100)):
        got, stats = _refine(params, logits, h, anchors, full_vocab=cert, return_stats=True)
        np.testing.assert_array_equal(np.asarray(got), want)
        _check_regime(stats, "fallback")


@pytest.mark.slow
def test_one_pass():
    """K = 1 (no pass before the last: the loop runs zero times), unrolled and in a loop."""
    x, cert = _regime(jnp.float32, "row_scan")
    run = jax.jit(lambda *a, **k: xj.refine(*a, config=CFG, topc=0, backend="xla", num_passes=1, **k),
                  static_argnames=("full_vocab", "return_stats", "unroll"))
    want = np.asarray(run(*x))
    for unroll in (True, False):
        got, stats = run(*x, full_vocab=cert, return_stats=True, unroll=unroll)
        np.testing.assert_array_equal(np.asarray(got), want)
        _check_regime(stats, "row_scan")


@pytest.mark.slow
def test_all_candidates():
    """C >= V: every id is a candidate, every row certifies by construction (no bound needed)."""
    cfg = dataclasses.replace(CFG, vocab_size=97, draft_vocab_size=None, topc=16)
    x = _problem(jnp.float32, 0.3, n=3, cfg=cfg)
    run = jax.jit(lambda *a, **k: xj.refine(*a, config=cfg, topc=0, backend="xla", **k),
                  static_argnames=("full_vocab", "return_stats"))
    got, stats = run(*x, full_vocab=Certified(candidates=1000), return_stats=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(run(*x)))
    _check_regime(stats, "certified")


@pytest.mark.parametrize("unroll", [pytest.param(True, marks=SLOW), False])
@pytest.mark.slow
def test_no_conditional(unroll):
    """The compiled mode holds no conditional at all (the decisions are device values that the kernels read, no
    host round trip), in every regime's configuration; in a loop, one while loop (the passes)."""
    import re

    for regime in ("certified", "fallback"):
        x, cert = _regime(jnp.float32, regime)
        f = jax.jit(lambda *a: xj.refine(*a, config=CFG, topc=0, backend="xla", full_vocab=cert, unroll=unroll))
        text = f.lower(*x).compile().as_text()
        assert not re.findall(r"\bconditional\(", text)
        assert len(re.findall(r"\bwhile\(", text)) == (0 if unroll else 1)


# ----------------------------------------------------------------------------- one pass: the bound at ties


def _pick(dtype, base, lat, w2, c=16, backend="xla"):
    """certified_pick on rows given directly: logits [rows, 2, V] with slot 0 unused."""
    ops = Ops.xla() if backend == "xla" else Ops.pallas(True)
    base, lat, w2 = (jnp.asarray(a, dtype) for a in (base, lat, w2))
    logits = jnp.stack([jnp.zeros_like(base), base], axis=1)
    tok, cert = jax.jit(certified_pick, static_argnums=(0, 4))(ops, logits, lat, w2, Certified(candidates=c))
    want = ref.full_vocab_pick(base, lat, w2)
    return np.asarray(tok), np.asarray(cert), np.asarray(want)


def _tie_rows():
    """Rows where the bound lands exactly on the best score in bf16 (not in float32).

    V=256, r=8, C=16, lat = e0 (norm 1), max row norm 1: U = 1 (1 + 2^-9)(1 + 2^-10)^2 rounds to 1.0 in bf16,
    so beta = bf16(3 + 1) = 4 = best; in float32 beta = 4.004 > best. Row 0: candidates are ids 0..15 (m = 16),
    best id 10 < m: certified in bf16, and non-candidate 200 (base = tau = 3, w2 = e0) really ties 4.0 and
    loses to id 10. Row 1: id 5 is not a candidate (m = 5 < best id 10): not certified; id 5 scores 2.0.
    Row 2: as row 0, but the best is 4.0 - one bf16 ulp at the winner (3.96875): beta > best, not certified.
    Row 3: the best candidate is id 250 and non-candidate 200 (base = tau, w2 = e0) ties it with a LOWER id:
    m = 15 < 250, not certified, and the scan's token 200 is the answer (certifying would give 250)."""
    v, r = 256, 8
    base = np.full((4, v), -2.0, np.float32)
    lat = np.zeros((4, r), np.float32)
    lat[:, 0] = 1.0
    w2 = np.zeros((v, r), np.float32)
    w2[200, 0] = 1.0  # the largest row norm: 1
    for row in (0, 2):
        base[row, :16] = 3.0
        base[row, 10] = 4.0 if row == 0 else 3.96875
        base[row, 200] = 3.0  # tied with the C-th candidate, larger id: not a candidate
    base[1, 6:22] = 3.0
    base[1, 10] = 4.0
    base[1, 5] = 2.0
    base[3, :15] = 3.0
    base[3, 200] = 3.0  # tied at the C-th place with ids 0..14: the larger id stays out
    base[3, 250] = 4.0
    return base, lat, w2


@pytest.mark.parametrize("dtype,backend", [pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.interpret]
                                                         if p.values[1] == "pallas" else p.marks)
                                           for p in _grid({"float32-xla"}, _DT, [("xla", "xla"), ("pallas", "pallas")])])
def test_ties_at_the_bound(dtype, backend):
    """beta == best certifies only when every non-candidate id exceeds the best id; tokens always equal the scan."""
    tok, cert, want = _pick(dtype, *_tie_rows(), backend=backend)
    np.testing.assert_array_equal(tok, want)
    assert want.tolist() == [10, 10, 200, 200]
    if dtype == jnp.bfloat16:
        assert cert.tolist() == [True, False, False, False]  # row 2: non-candidate 200 scores 4.0 > 3.96875, wins
    else:
        assert cert.tolist() == [False, False, False, False]


@pytest.mark.parametrize("dtype,rows,compiled", [  # interpret mode: slow (the certify launch runs in the refine above)
    pytest.param(d, n, c, id=f"{jnp.dtype(d).name}-{n}-{'gpu' if c else 'interpret'}",
                 marks=() if c else [pytest.mark.interpret, SLOW]) for c in (False, True) for n in (1, 40, 200)
    for d in DTYPES])
def test_certify_kernel_equals_jnp(dtype, rows, compiled):
    """`kernels.topc_pick.certify` (the pick kernel and the certify launch) decides every row as the jnp
    spelling (`exact.certify_rows` on `reference.candidates_best`): the same winner, failing rows and scan
    rows, for every ``valid`` mask, ``fallen`` and ``limit`` (none, 0, a few, all: the single-program count),
    at a rank that is not a power of two. Inputs are dyadic (every dot and norm exact in any order), with
    about half the rows certified and rows whose candidates are ids 0..C-1 (mex = C)."""
    from xpress_jax.exact import certify_rows, lowest_missing
    from xpress_jax.kernels import topc_pick

    if compiled and not gpu_supported():
        pytest.skip("compiled kernels need a CUDA GPU (the interpret case runs here)")
    v, r, c = 3001, 24, 16
    rng = np.random.default_rng(rows)
    base = np.round(rng.normal(size=(rows, v)) * 16) / 8
    base[::3, :c] = 20.0  # candidates 0..C-1: mex = C
    lat = rng.integers(-2, 3, (rows, r)) / 4
    w2 = rng.integers(-3, 4, (v, r)) / 32
    base, lat, w2 = (jnp.asarray(a, dtype) for a in (base, lat, w2))
    cand, base_c, _ = ref.select_candidates(base, c)
    tau = jnp.min(ref.clean(base_c).astype(jnp.float32), axis=1)
    m = prepare_certified(w2).max_norm
    mex = lowest_missing(cand)
    best, best_id = ref.candidates_best(base_c, cand, lat, ref.topc_gather(w2, cand))
    for valid in (np.ones(rows, bool), rng.random(rows) < 0.7):
        for fallen in (False, True):
            for limit in (None, 0, 3, rows):
                args = (tau, m, mex, jnp.asarray(valid), jnp.asarray(fallen))
                want = certify_rows(best, best_id, lat, *args, limit, dtype)
                got = topc_pick.certify(base_c, cand, lat, w2, *args, slack=2.0 ** -10, limit=limit,
                                        interpret=not compiled)
                msg = f"valid {valid.mean():.2f} fallen {fallen} limit {limit}"
                if not fallen:
                    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]), err_msg=msg)
                np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]), err_msg=msg)
                np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]), err_msg=msg)
                assert got[0].shape == got[1].shape == got[2].shape == (rows,), msg  # whole rows: nothing to slice
                if limit is None:
                    assert got[3] is None and want[3] is None
                else:  # [full, #fail, 0...]: the next pass's fallen flag as the kernels read it
                    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]), err_msg=msg)
                    f = np.asarray(want[1])
                    assert int(got[3][1]) == f.sum() and bool(got[3][0]) == (fallen or f.sum() > limit), msg
    fail = np.asarray(certify_rows(best, best_id, lat, tau, m, mex, jnp.ones(rows, bool), jnp.asarray(False),
                                   None, dtype)[1])
    if rows > 1:  # the test separates the outcomes
        assert 0.2 < fail.mean() < 0.8, fail.mean()
    assert (np.asarray(mex)[::3] == c).all()
    with pytest.raises(ValueError, match="limit needs rows"):
        big = jnp.zeros((topc_pick.CERTIFY_SINGLE_ROWS + 1, c), dtype)
        topc_pick.certify(big, big.astype(jnp.int32), jnp.zeros((big.shape[0], r), dtype), w2,
                          jnp.zeros(big.shape[0]), m, jnp.zeros(big.shape[0], jnp.int32), jnp.ones(big.shape[0], bool),
                          jnp.asarray(False), slack=2.0 ** -10, limit=1, interpret=True)


@pytest.mark.parametrize("dtype,compiled", [  # interpret mode: slow (the Pallas certified tokens: checked above)
    pytest.param(d, c, id=f"{jnp.dtype(d).name}-{'gpu' if c else 'interpret'}",
                 marks=() if c else [pytest.mark.interpret, SLOW]) for c in (False, True) for d in DTYPES])
def test_kernel_differences_are_only_near_ties(dtype, compiled):
    """Pallas (interpret on CPU; compiled on a GPU): certified rows take the top-C kernel's winner, the scan
    takes the full-vocab kernel's; the two sum each dot in different orders. Every row where the certified
    pick differs from the scan must be a near tie (`helpers.near_tie_rows`: another summation order could
    change the scan's own pick), most rows must certify (the candidates' path is what is compared), and the
    near ties must be rare."""
    from helpers import near_tie_rows, pick_inputs

    if compiled and not gpu_supported():
        pytest.skip("compiled kernels need a CUDA GPU (the interpret case runs here)")
    rows, v, r = 48, 1000, 32
    base, lat, w2 = pick_inputs(rows, v, r, dtype, seed=5)
    base = (base.astype(jnp.float32) * 3).astype(dtype)  # a wide spread: most rows certify with C=64
    logits = jnp.stack([jnp.zeros_like(base), base], axis=1)
    ops = Ops.pallas(not compiled)
    tok, cert = jax.jit(certified_pick, static_argnums=(0, 4))(ops, logits, lat, w2, Certified(candidates=64))
    scan = np.asarray(ops.full_vocab_pick(logits, lat, w2)[0])
    near = near_tie_rows(base, lat, w2, np.asarray(ref.full_vocab_pick(base, lat, w2)))
    differ = np.asarray(tok) != scan
    assert not (differ & ~near).any(), np.nonzero(differ & ~near)
    assert np.asarray(cert).mean() > 0.7 and near.mean() < 0.1, (np.asarray(cert).mean(), near.mean())


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_compiled_refine_on_gpu(dtype, regime):
    """The compiled Pallas refine on a GPU (skipped elsewhere; interpret mode runs above): the certified tokens
    equal the Pallas scan's in each regime, N = 8 and N = 24, the stats say which regime ran, unrolled and in a
    loop; and through the one-launch scan at N = 8, 24, 48 (forced: these shapes fit one row tile below N=48), whose
    last program per row tile combines and writes through the packed order.
    These inputs hold no near tie (a difference would fail here and be traced)."""
    if not gpu_supported():
        pytest.skip("needs a CUDA GPU")
    # The test shapes fit one row tile up to N=24, where refine scans with one pick; these steps always pack
    # (the one-launch scan, `scan_failing`), and at N=48 (240 rows) over two row tiles.
    packed = dataclasses.replace(Ops.pallas(False), full_vocab_capacity=lambda n, b, v, r, dtype, limit: limit or None)
    for n in (8, 24, 48):
        x, cert = _regime(dtype, regime, n=n)
        want = np.asarray(_refine(*x, backend="pallas"))
        for unroll in (True, False):
            if n <= 24:
                f = jax.jit(lambda *a: xj.refine(*a, config=CFG, topc=0, backend="pallas", full_vocab=cert,
                                                 unroll=unroll, return_stats=True))
                got, stats = f(*x)
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"N={n} unroll={unroll}")
                _check_regime(stats, regime)
            g = jax.jit(lambda *a: refine_with(packed, *a, config=CFG, topc=0, unroll=unroll, full_vocab=cert))
            np.testing.assert_array_equal(np.asarray(g(*x)), want, err_msg=f"packed N={n} unroll={unroll}")


@pytest.mark.parametrize("regime", list(REGIMES))
def test_compiled_one_pick_on_gpu(regime):
    """The compiled one-pick path (one row tile holds every row: N = 1, 2, 4), the counted launch (programs racing
    on a counter, the last one combining; no launch writes anything where no row fails): the certified tokens
    equal the Pallas scan's, unrolled and in a loop."""
    if not gpu_supported():
        pytest.skip("needs a CUDA GPU")
    for n in (1, 2, 4):
        x, cert = _regime(jnp.bfloat16, regime, n=n)
        want = np.asarray(_refine(*x, backend="pallas"))
        for unroll in (True, False):
            f = jax.jit(lambda *a: xj.refine(*a, config=CFG, topc=0, backend="pallas", full_vocab=cert, unroll=unroll))
            np.testing.assert_array_equal(np.asarray(f(*x)), want, err_msg=f"N={n} unroll={unroll}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_nonfinite_logits(dtype):
    """NaN counts as -inf; +inf wins; all -inf or all NaN rows pick id 0 (certified: tau = best = -inf and id 0
    is a candidate); as the scan. The certified rows are the expected ones."""
    from helpers import nonfinite_pick_inputs

    base, lat, w2 = nonfinite_pick_inputs()
    w2 = w2 * 0.01
    tok, cert, want = _pick(dtype, base, lat, w2)
    np.testing.assert_array_equal(tok, want)
    assert [int(want[i]) for i in (1, 2, 3, 4)] == [300, 0, 0, 0]
    assert cert[1:5].all()


def test_prepare_certified_margin():
    """M is the largest row norm with the 2^-9 margin, in the accumulation dtype."""
    w2 = jnp.zeros((10, 4), jnp.bfloat16).at[3, :].set(2.0)
    m = prepare_certified(w2).max_norm
    assert m.dtype == jnp.float32 and float(m) == pytest.approx(4.0 * (1 + 2.0**-9), rel=1e-7)
    with pytest.raises(ValueError, match="rank"):
        prepare_certified(jnp.zeros((10, 8192), jnp.float32))


# ----------------------------------------------------------------------------- API


def test_bad_arguments():
    params, logits, h, anchors = _problem(jnp.float32, 0.02, n=2)
    kw = dict(config=CFG, backend="xla")
    with pytest.raises(ValueError, match="full_vocab"):
        xj.refine(params, logits, h, anchors, topc=0, full_vocab="exact", **kw)
    with pytest.raises(ValueError, match="full_vocab"):
        xj.refine(params, logits, h, anchors, topc=0, full_vocab=None, **kw)
    with pytest.raises(ValueError, match="return_stats"):
        xj.refine(params, logits, h, anchors, topc=0, return_stats=True, **kw)
    with pytest.raises(ValueError, match="return_stats"):
        xj.refine(params, logits, h, anchors, topc=16, full_vocab="certified", return_stats=True, **kw)
    with pytest.raises(TypeError, match="return_stats"):
        xj.refine(params, logits, h, anchors, topc=0, full_vocab="certified", return_stats=1, **kw)
    with pytest.raises(ValueError, match="candidates"):
        Certified(candidates=0)
    with pytest.raises(ValueError, match="scan_blocks"):
        Certified(scan_blocks=-1)
    # topc > 0: full_vocab is unused (the same program as without it)
    f = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)
    a = f.lower(params, logits, h, anchors, topc=16, full_vocab="certified", **kw).as_text()
    assert a == f.lower(params, logits, h, anchors, topc=16, **kw).as_text()
    assert "full_vocab" in xj.STATIC_ARGNAMES and "return_stats" in xj.STATIC_ARGNAMES


def test_refine_with_vocab_sharded_ops_is_refused():
    from xpress_jax.sharded import vocab_sharded_ops

    params, logits, h, anchors = _problem(jnp.float32, 0.02, n=2)
    with pytest.raises(ValueError, match="candidates_best"):
        refine_with(vocab_sharded_ops(Ops.xla(), "model"), params, logits, h, anchors, config=CFG, topc=0,
                    full_vocab="certified")


@SLOW
def test_refine_server_passes_the_mode():
    """RefineServer(full_vocab="certified") serves the scan's tokens; a bad value or a mesh is refused."""
    cfg = dataclasses.replace(CFG, max_num_reqs=4, topc=0)
    params, logits, h, anchors = _problem(jnp.float32, 0.02, n=4, cfg=cfg)
    head = xj.Head(cfg, params)
    server = xj.RefineServer(head, buckets=(4,), backend="xla", full_vocab="certified", progress=False)
    want = xj.refine(head, logits, h, anchors, backend="xla")
    np.testing.assert_array_equal(np.asarray(server(logits, h, anchors.astype(jnp.int32))), np.asarray(want))
    text = server.executables[4].as_text()
    low = text.lower()
    # the certified passes' selection (XLA:CPU keeps a TopK, XLA:GPU sorts); no conditional
    assert ("topk" in low or "sort" in low) and "conditional" not in text
    scan = xj.RefineServer(head, buckets=(4,), backend="xla", full_vocab="scan", progress=False)
    assert not any(w in scan.executables[4].as_text().lower() for w in ("topk", "sort"))  # the plain scan selects nothing
    with pytest.raises(ValueError, match="full_vocab"):
        xj.RefineServer(head, buckets=(1,), backend="xla", full_vocab="fast", progress=False)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="full_vocab"):
        xj.RefineServer(head, buckets=(1,), backend="xla", full_vocab="certified", mesh=mesh, progress=False)


@pytest.mark.slow
def test_certified_prepared():
    """``certified_prepared`` (prepare_certified of the same w2) gives the scan's tokens; a wrong one is used,
    not recomputed: M = 0 certifies rows the bound should not, and the tokens then differ from the scan (the
    test can fail); errors name the argument."""
    x, cert = _regime(jnp.float32, "fallback")
    params = x[0]
    want = np.asarray(_refine(*x))
    f = jax.jit(lambda p, l, h, a, prep: xj.refine(p, l, h, a, config=CFG, topc=0, backend="xla", full_vocab=cert,
                                                   certified_prepared=prep))
    prep = prepare_certified(params["w2"])
    np.testing.assert_array_equal(np.asarray(f(*x, prep)), want)
    wrong = np.asarray(f(*x, CertifiedPrepared(jnp.zeros((), jnp.float32))))
    assert (wrong != want).any()
    with pytest.raises(TypeError, match="certified_prepared"):
        xj.refine(*x, config=CFG, topc=0, full_vocab="certified", certified_prepared=prep.max_norm)
    with pytest.raises(ValueError, match="certified_prepared"):
        xj.refine(*x, config=CFG, topc=0, full_vocab="scan", certified_prepared=prep)
    with pytest.raises(ValueError, match="certified_prepared"):
        xj.refine(*x, config=CFG, topc=0, full_vocab="certified",
                  certified_prepared=CertifiedPrepared(jnp.zeros((2,), jnp.float32)))


@pytest.mark.slow
def test_server_keeps_the_bound_data_with_the_weights():
    """RefineServer(full_vocab="certified") computes prepare_certified at start-up and on reload (not per call):
    its M always equals the serving weights' M, a failed reload keeps both, and the tokens equal the scan's."""
    cfg = dataclasses.replace(CFG, max_num_reqs=8, topc=0)
    params, logits, h, anchors = _problem(jnp.float32, 0.1, n=8, cfg=cfg)
    server = xj.RefineServer(xj.Head(cfg, params), buckets=(8,), backend="xla", full_vocab="certified",
                             progress=False)
    # M as the server computes it (in its own executable) against an eager computation: on a GPU the
    # float32 sum of squares may be ordered differently (seen on the H200: 0.7819722 vs 0.78197217), which
    # the bound's margin covers (r u <= 2^-12, `prepare_certified`); a stale M (w2 x 3) is 3x off.
    def same_m(w2):
        want = float(prepare_certified(w2).max_norm)
        return abs(float(server._extra[0].max_norm) - want) <= want * 2.0**-12

    m0 = float(prepare_certified(params["w2"]).max_norm)
    assert same_m(params["w2"])
    params2 = dict(params, w2=params["w2"] * 3)
    server.reload(params2)
    assert same_m(params2["w2"]) and not same_m(params["w2"]) and float(server._extra[0].max_norm) > 2 * m0
    np.testing.assert_array_equal(np.asarray(server(logits, h, anchors.astype(jnp.int32))),
                                  np.asarray(xj.refine(xj.Head(cfg, params2), logits, h, anchors, backend="xla")))
    with pytest.raises(ValueError):
        server.reload(dict(params2, w2=params2["w2"][:-1]))
    assert same_m(params2["w2"])
    scan = xj.RefineServer(xj.Head(cfg, params), buckets=(8,), backend="xla", progress=False)
    assert scan._extra == ()


@pytest.mark.slow
def test_lowers_for_an_h200():
    """The Pallas certified refine lowers for an H200: the selection, the top-C pick (with its skip flag), the
    full-vocab pick (with its active rows, packed through a row map) and the latent kernels are all in the HLO,
    and there is no conditional (no `stablehlo.case`)."""
    from helpers import lower_triton, triton_operand_counts, triton_operands

    cfg = xj.HeadConfig(vocab_size=4099, hidden_size=64, block_size=16, rank=256, mlp_hidden=512, topc=512)
    p = jax.eval_shape(lambda: xj.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16))
    n = 72  # 1080 draft rows: the dispatch serves its fused latent kernel there (XLA's latent up to 960 rows)
    S = jax.ShapeDtypeStruct
    args = (p, S((n, 16, cfg.vocab_size), jnp.bfloat16), S((n, 16, cfg.hidden_size), jnp.bfloat16), S((n,), jnp.int32))
    f = lambda p, l, h, a: refine_with(Ops.pallas(False), p, l, h, a, num_passes=2, topc=0, unroll=True,
                                       full_vocab="certified")

    def lowered(n):  # the HLO at N blocks
        shapes = (S((n, 16, cfg.vocab_size), jnp.bfloat16), S((n, 16, cfg.hidden_size), jnp.bfloat16),
                  S((n,), jnp.int32))
        return lower_triton(lambda *a: f(*a), p, *shapes).as_text()

    text = lower_triton(f, *args).as_text()
    for name in ("xpress_latent_pass", "xpress_topc_pick", "select_bgather", "xpress_full_vocab", "xpress_certify"):
        assert name in text, f"{name} missing from the lowered HLO"
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    # above the table's one-launch scan rows, two full-vocab launches per pass: the packed failing rows (base,
    # packed lat, w2, row map, active) and all rows (base, lat, w2, active)
    assert sorted(set(triton_operand_counts(text, "xpress_full_vocab_fused"))) == [4, 5]
    assert "xpress_pack_active" not in text
    assert triton_operands(text, "xpress_topc_pick") == 5  # base_c, cand, lat, w2, skip
    # the certify launch: partial scores and ids, lat, tau, mex, valid, M, fallen
    assert triton_operands(text, "xpress_certify") == 8
    # N = 16 (240 rows, 2 row tiles; the one-launch scan): the failing rows packed first by `xpress_pack_active`
    # (fail, fallen; it also writes the row-tile counters), then the counted pick reading them through the row map
    # (base, lat, w2, row map, active, the pass's full flag, the certify launch's tokens and the counters, both
    # aliased: no combine launch).
    counted = lowered(16)
    assert set(triton_operand_counts(counted, "xpress_full_vocab_counted")) == {8}
    assert set(triton_operand_counts(counted, "xpress_pack_active")) == {2}
    assert "xpress_full_vocab_fused" not in counted and "xpress_pick_combine" not in counted
    # Both sides of the table's one-launch scan rows (960 draft rows: N = 64 / 65 at B = 16).
    assert (dispatch.TABLE.entry(64 * 15).switches.scan_one_launch
            and not dispatch.TABLE.entry(64 * 15 + 1).switches.scan_one_launch)
    for n, one_launch in ((64, True), (65, False)):
        text = lowered(n)
        assert ("xpress_pack_active" in text) == one_launch, n
        if one_launch:
            assert set(triton_operand_counts(text, "xpress_full_vocab_counted")) == {8}, n
            assert "xpress_full_vocab_fused" not in text and "xpress_pick_combine" not in text, n
        else:
            assert sorted(set(triton_operand_counts(text, "xpress_full_vocab_fused"))) == [4, 5], n
    # N = 4 (60 rows in one tile): one full-vocab launch per pass, the counted pick (base, lat, w2, active, the
    # certify launch's tokens and flags, both aliased: no combine launch), and the single-program certify launch.
    counted = lowered(4)
    assert set(triton_operand_counts(counted, "xpress_full_vocab_counted")) == {6}
    assert "xpress_full_vocab_fused" not in counted and "xpress_pick_combine" not in counted
    assert triton_operands(counted, "xpress_certify") == 8


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_sweep_seeds_and_shapes(dtype, regime, seed):
    """More seeds, N = 1 / 3 / 8, B = 6, V = 2000 (not a power of two), default scan_blocks: the XLA tokens equal
    the scan's in every case (equal dots in both spellings on the CPU: no near-tie excuse needed)."""
    std, peaked, cert = REGIMES[regime]
    for n in (1, 3, 8):
        x = _problem(dtype, std, n=n, seed=seed, peaked=peaked)
        want = np.asarray(_refine(*x))
        for c in (cert, Certified(candidates=cert.candidates)):
            np.testing.assert_array_equal(np.asarray(_refine(*x, full_vocab=c)), want)


def test_full_vocab_capacity():
    """Which steps get a packed launch for the failing rows: the Pallas steps where more than one row tile
    holds the rows (N=72 at B=16: 1080 rows, 128-row tiles), not where one tile holds them all (N=4: 60 rows
    in one 64-row tile), not for float64 (the jnp reference) or a zero limit; the jnp steps never."""
    bf16 = jnp.bfloat16
    cap = Ops.pallas(True).full_vocab_capacity
    assert cap(72, 16, 4099, 256, bf16, 135) == 135
    assert cap(4, 16, 4099, 256, bf16, 15) is None
    assert cap(72, 16, 4099, 256, jnp.float64, 135) is None and cap(72, 16, 4099, 256, bf16, 0) is None
    assert Ops.xla().full_vocab_capacity is None


@pytest.mark.slow
def test_server_auto_policy():
    """RefineServer(full_vocab=Auto(...)): small buckets scan (one executable); large ones start certified and,
    where the calls fall back (pruning fails), switch to the scan for ``retry_after`` calls, then try again;
    where rows certify they stay certified. Tokens equal the scan's at every call; serving never compiles."""
    from xpress_jax.exact import Auto

    cfg = dataclasses.replace(CFG, max_num_reqs=8, topc=0)
    auto = Auto(min_blocks=4, check_every=1, retry_after=2, certified=Certified(candidates=64, scan_blocks=3))
    for std, peaked, fallback in ((0.3, False, True), (0.1, True, False)):
        params, logits, h, anchors = _problem(jnp.float32, std, n=8, cfg=cfg, peaked=peaked)
        head = xj.Head(cfg, params)
        output = "host" if fallback else "device"  # both executables of a bucket put the tokens in host memory
        server = xj.RefineServer(head, buckets=(2, 8), backend="xla", full_vocab=auto, progress=False, output=output)
        assert set(server.certified_executables) == {8} and server.exact_mode(2) == "scan"
        want = np.asarray(xj.refine(head, logits, h, anchors, backend="xla"))
        ids = anchors.astype(jnp.int32)
        modes = []
        small = (logits[:2], h[:2], ids[:2])
        with jax.no_tracing():
            for _ in range(7):
                out = server(logits, h, ids)
                assert out.sharding.memory_kind == ("pinned_host" if output == "host" else "device")
                modes.append(server.exact_mode(8))  # how that call ran
                np.testing.assert_array_equal(np.asarray(out), want)  # waits: the stats are ready next call
            np.testing.assert_array_equal(np.asarray(server(*small)), want[:2])
        if fallback:  # certified (falls back) -> scan x2 -> certified (probe, falls back) -> scan x2 -> certified
            assert modes == ["certified", "scan", "scan", "certified", "scan", "scan", "certified"], modes
            assert server._policy.state[8].switches >= 2
        else:
            assert modes == ["certified"] * 7 and server._policy.state[8].switches == 0
    small = xj.RefineServer(head, buckets=(2, 8), backend="xla", progress=False)  # the default: "auto", min_blocks 64
    assert small.full_vocab == "auto"
    assert small.certified_executables == {} and small._extra == () and small.exact_mode(8) == "scan"
    # "auto" on a mesh or in top-C mode: the scan (nothing to decide)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    for kw in (dict(mesh=mesh), dict(topc=16)):
        other = xj.RefineServer(head, buckets=(2,), backend="xla", progress=False, **kw)
        assert other.certified_executables == {} and other.exact_mode(2) == "scan"
    with pytest.raises(ValueError, match="min_blocks"):
        Auto(min_blocks=0)
    with pytest.raises(ValueError, match="max_fallback"):
        Auto(max_fallback=2.0)
