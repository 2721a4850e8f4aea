"""The dispatch table (`xpress_jax.dispatch`), the `Ops` description and the package's import structure."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from helpers import make_head, make_inputs, pick_inputs, with_columns
from xpress_jax import dispatch
from xpress_jax import reference as xref
from xpress_jax.kernels import common, full_vocab, latent, select, topc_pick
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

PKG = pathlib.Path(xj.__file__).parent
V, R, B, C = 151936, 256, 16, 512  # serving shapes


# ----------------------------------------------------------------------------- the table
# Properties of `dispatch.TABLE`, whatever its measured values: a retuned table passes them unchanged.

T = dispatch.TABLE
SIXTEEN_BIT = (jnp.bfloat16, jnp.float16)


def _ranges():
    """(first, last) draft-row count each entry serves (last: None for the unbounded entry)."""
    lows = [1] + [e.max_rows + 1 for e in T.entries[:-1]]
    return list(zip(lows, [e.max_rows for e in T.entries]))


def _columns():
    """The `Entry` fields that are decisions (every field but ``max_rows``), the `Switches` one by one."""
    return ([f.name for f in dataclasses.fields(dispatch.Entry) if f.name not in ("max_rows", "switches")]
            + [f.name for f in dataclasses.fields(dispatch.Switches)])


def _column(e, name):
    return getattr(e.switches if hasattr(e.switches, name) else e, name)


def test_table_is_ordered_and_ends_unbounded():
    limits = [e.max_rows for e in T.entries]
    assert limits[-1] is None and None not in limits[:-1]
    assert limits[:-1] == sorted(limits[:-1]) and len(set(limits[:-1])) == len(limits) - 1
    for e in T.entries:
        assert e.latent in ("xla", "split", "fused")
        assert e.switches.full_vocab_keep in full_vocab.KEEP_POLICIES
        e.full_vocab.check()
        e.topc.check()
        select.SelectConfig(block=e.select_block)
    hash(T)
    with pytest.raises(dataclasses.FrozenInstanceError):
        T.sms = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="ascending"):
        T.replace(entries=T.entries[:-1])
    with pytest.raises(TypeError, match="Table"):
        Ops.pallas(True, table=T.entries)


def test_every_row_count_has_one_entry_and_every_entry_serves():
    """`Table.entry` gives each draft-row count the first entry whose range holds it: every count from 1 up has
    one, every entry serves a non-empty range, and neighbouring entries differ in some decision (else one
    would be redundant)."""
    ranges = _ranges()
    for e, (lo, hi) in zip(T.entries, ranges):
        assert hi is None or lo <= hi
        for rows in {lo, hi if hi is not None else 10 ** 6, (lo + (hi or lo)) // 2}:
            assert T.entry(rows) is e, rows
    for a, b in zip(T.entries, T.entries[1:]):
        assert any(_column(a, c) != _column(b, c) for c in _columns()), (a, b)


@pytest.mark.parametrize("column", [c for c in _columns() if c != "full_vocab"])
def test_each_column_changes_at_most_once(column):
    """Every decision but the full-vocab config is one threshold in draft rows (a column measured to pay up to
    some N, or from some N): along the entries its value changes at most once."""
    values = [_column(e, column) for e in T.entries]
    assert sum(a != b for a, b in zip(values, values[1:])) <= 1, values


def test_table_variants_reach_ops():
    """A table built with `Table.replace` (entries changed by `dataclasses.replace`) is a new hashable key: a new
    `Ops`."""
    t = with_columns(T, alternate=False)
    assert t != T and not any(e.switches.alternate for e in t.entries)
    assert Ops.pallas(True, table=t) is Ops.pallas(True, table=with_columns(T, alternate=False))
    assert Ops.pallas(True, table=t) is not Ops.pallas(True)
    assert Ops.pallas(True) is Ops.pallas(True, table=T)


@pytest.mark.parametrize("sms", [66, 132, 1000])
def test_capacity_configs_fill_a_wave(sms):
    """`Table.capacity_config`: the served config with at most its ``v_steps``, the fewest that put one row tile's
    parts in one wave of ``sms`` programs (the most parts that still run at once)."""
    t = T.replace(sms=sms)
    for e in t.entries:
        cfg = t.capacity_config(e.full_vocab, V)
        steps, vtiles = cfg.v_steps, -(-V // cfg.v_tile)
        assert cfg == dataclasses.replace(e.full_vocab, v_steps=steps) and 1 <= steps <= e.full_vocab.v_steps
        assert steps == e.full_vocab.v_steps or -(-vtiles // steps) <= sms
        assert steps == 1 or -(-vtiles // (steps - 1)) > sms


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=lambda d: jnp.dtype(d).name)
def test_every_entry_fits_its_target_at_serving_shapes(dtype):
    """At the serving shapes (B=16, V=151936, r=256, C=512) every entry's configs pass their kernels' checks
    for an H200 (tensor-core tiles, `SMEM_LIMIT`) as measured: the plan of each end of its range serves the
    entry's own full-vocab and top-C configs, not ones fitted down, and a fused latent fits too."""
    for e, (lo, hi) in zip(T.entries, _ranges()):
        assert e.full_vocab.smem_bytes(R, dtype) <= common.SMEM_LIMIT
        for rows in (lo, hi or 4 * lo):
            e.full_vocab.check_shape(rows, V, R, dtype)
            e.topc.check_shape(rows, C, R, dtype)
            p = dispatch.plan(rows, 2, V, R, C, dtype)  # B = 2: N = the draft rows
            assert p.entry is e and p.full_vocab == e.full_vocab and p.topc == e.topc
            assert (p.latent is None) == (e.latent == "xla")
            if p.latent is not None:
                assert p.latent.variant == e.latent
                assert e.latent == "split" or p.latent.smem_bytes(R, dtype) <= latent.SMEM_LIMIT


@pytest.mark.interpret
@pytest.mark.slow
@pytest.mark.parametrize("i", [pytest.param(i, id=f"rows-{lo}-{hi or 'up'}")
                               for i, (lo, hi) in enumerate(_ranges())])
def test_every_entry_gives_the_reference_tokens(i):
    """Each entry, served alone (interpret mode), picks the reference's tokens on every row: the full-vocab
    pick in an odd pass's order with its hints (reversed where the entry alternates; the kernels' tests cover
    the plain order) and the top-C pick, on dyadic inputs (every dot exact in any order, many tied scores: the
    tie rules decide)."""
    e = T.entries[i]
    alone = T.replace(entries=(dataclasses.replace(e, max_rows=None),))
    ops = Ops.pallas(True, table=alone)
    n, b, v, r, c = 5, 5, 1001, 24, 150  # several vocab parts and candidate tiles; a row tile's tail
    base, lat, w2 = pick_inputs(n * (b - 1), v, r, jnp.bfloat16, seed=i, dyadic=True)
    logits = jnp.concatenate([jnp.full((n, 1, v), 1e4, base.dtype), base.reshape(n, b - 1, v)], axis=1)
    assert dispatch.plan(n, b, v, r, 0, base.dtype, table=alone).full_vocab == e.full_vocab
    want = np.asarray(xref.full_vocab_pick(base, lat, w2))
    tok, s = ops.full_vocab_pick(logits, lat, w2, q=1)  # pass 1: the draft slots from s on
    np.testing.assert_array_equal(np.asarray(tok), want.reshape(n, b - 1)[:, s:].reshape(-1))
    cand, base_c, _ = xref.select_candidates(base, c)
    want = np.asarray(xref.topc_pick(base_c, cand, lat, xref.topc_gather(w2, cand)))
    np.testing.assert_array_equal(np.asarray(ops.topc_pick(base_c, cand, lat, ops.topc_prepare(w2, cand))[0]), want)
    assert len(set(want.tolist())) > 1


def test_topc_programs_hold_one_candidate_tile():
    """Every top-C config the table serves runs one candidate tile per program, at any row count and any C."""
    for lo, hi in _ranges():
        for rows in (lo, hi or 4 * lo):
            for c in (1, 33, 512, 4096):
                assert dispatch.plan(rows, 2, V, R, c, jnp.bfloat16).topc.c_steps == 1


def test_plan_is_in_draft_rows_for_any_block_size():
    """Same draft rows, same decisions, whatever B (the table's unit): at each end of every entry's range."""
    ends = sorted({x for lo, hi in _ranges() for x in (lo, hi or 4 * lo)})
    for rows in ends:
        by_b = {b: dispatch.plan(rows // (b - 1), b, V, R, C, jnp.bfloat16)
                for b in (2, 3, 4, 5, 6, 16, 61, rows + 1) if rows % (b - 1) == 0}
        assert len(by_b) >= 2 or rows == 1, rows
        assert len({p.entry for p in by_b.values()}) == 1
        assert len({p.full_vocab for p in by_b.values()}) == 1, (rows, by_b.keys())
        assert len({(p.latent is None, p.latent and p.latent.variant) for p in by_b.values()}) == 1
        assert len({tuple(p.select.items()) for p in by_b.values()}) == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("rank", [1, 24, 37, 256, 1024, 4096])
def test_every_plan_passes_the_kernels_shape_checks(rank, dtype):
    for n, b in ((1, 2), (1, 16), (4, 16), (16, 16), (64, 16), (128, 16), (256, 16), (3, 7)):
        for c in (0, 1, 512):
            p = dispatch.plan(n, b, 1001, rank, c, dtype)  # raises if a config cannot run
            if p.latent is not None:
                assert p.latent.variant == "split" or p.latent.smem_bytes(rank, dtype) <= latent.SMEM_LIMIT


def test_float64_plans_the_reference():
    p = dispatch.plan(4, 16, 1001, 24, 7, jnp.float64)
    assert (p.select, p.latent, p.full_vocab, p.topc) == (None, None, None, None)


@pytest.mark.interpret_refine
@pytest.mark.parametrize("topc", [pytest.param(0, marks=pytest.mark.slow), 7])
@pytest.mark.slow
def test_float64_refine_with_pallas_backend_is_the_reference(topc):
    """backend="pallas" routes float64 to the jnp reference (the kernels refuse it): same tokens as XLA."""
    cfg = xj.HeadConfig(vocab_size=97, hidden_size=16, block_size=5, rank=24, mlp_hidden=32, topc=topc)
    with jax.enable_x64(True):
        head = xj.Head(cfg, make_head(cfg, dtype=jnp.float64))
        x = make_inputs(cfg, 2, dtype=jnp.float64)
        want = np.asarray(xj.refine(head, *x, backend="xla"))
        np.testing.assert_array_equal(np.asarray(xj.refine(head, *x, backend="pallas", interpret=True)), want)


# ----------------------------------------------------------------------------- Ops


def test_ops_are_typed_and_cached():
    assert Ops.xla() is Ops.xla("cpu") and Ops.pallas(True) is Ops.pallas(True)
    assert Ops.xla("gpu") != Ops.xla("cpu")
    fields = {f.name for f in dataclasses.fields(Ops)}
    assert fields == {"name", "select", "topc_prepare", "topc_pick", "full_vocab_prepare", "full_vocab_pick", "latent", "start",
                      "full_vocab_best", "topc_best", "full_vocab_sample", "topc_sample", "candidates_best",
                      "full_vocab_capacity", "certify", "scan_failing", "gated_pick", "hidden", "latent_terms",
                      "numbered", "float64", "thresholds"}
    assert Ops.pallas(True).numbered and not Ops.xla().numbered
    assert Ops.xla().gated_pick is None and Ops.pallas(True).gated_pick is not None
    # float64 is settled where the steps are chosen: the Pallas Ops' jnp steps, XLA's own
    assert Ops.pallas(True).for_dtype(jnp.float64) is Ops.pallas(True).float64 is not None
    assert Ops.pallas(True).for_dtype(jnp.bfloat16) is Ops.pallas(True)
    assert Ops.xla().for_dtype(jnp.float64) is Ops.xla()
    assert Ops.pallas().latent_terms and Ops.pallas(True).latent_terms and not Ops.xla().latent_terms
    with pytest.raises(dataclasses.FrozenInstanceError):
        Ops.xla().name = "x"  # type: ignore[misc]
    with pytest.raises(ValueError, match="platform"):
        Ops.xla("cuda")


@pytest.mark.slow
def test_refine_with_refuses_what_is_not_ops():
    cfg = xj.HeadConfig(vocab_size=97, hidden_size=16, block_size=5, rank=24, mlp_hidden=32, topc=7)
    head = xj.Head(cfg, make_head(cfg))
    with pytest.raises(TypeError, match="Ops"):
        refine_with("pallas", head, *make_inputs(cfg, 1))


@pytest.mark.parametrize("n,topc", [(3, 0), pytest.param(1, 0, marks=pytest.mark.slow),
                                    pytest.param(1, 7, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_xla_gpu_spelling_gives_the_same_tokens(n, topc):
    """Ops.xla("gpu") only changes how the readout dot (the 16-bit result written directly) and the hidden
    input (`reference.hidden_input_gpu`: N=1 padded, xh behind a barrier) are spelled."""
    cfg = xj.HeadConfig(vocab_size=301, hidden_size=16, block_size=5, rank=24, mlp_hidden=32, topc=topc)
    head = xj.Head(cfg, make_head(cfg, dtype=jnp.bfloat16))
    x = make_inputs(cfg, n, dtype=jnp.bfloat16)
    a = refine_with(Ops.xla("cpu"), head, *x)
    np.testing.assert_array_equal(np.asarray(refine_with(Ops.xla("gpu"), head, *x)), np.asarray(a))
    assert Ops.xla("gpu").hidden is xref.hidden_input_gpu and Ops.xla("cpu").hidden is None
    assert Ops.pallas(False).hidden.func is xref.hidden_input_gpu and Ops.pallas(True).hidden is None


@pytest.mark.interpret_refine
@pytest.mark.parametrize("early_exit", [pytest.param(False, id="plain", marks=pytest.mark.slow),
                                        pytest.param((2,), id="early-exit")])
@pytest.mark.slow
def test_full_vocab_pass_pick(monkeypatch, early_exit):
    """An unrolled full-vocab refine tells `Ops.full_vocab_pick` each pass's number: pass q (0-based) picks only
    the draft slots from min(q, B-1) on (interpret mode skips wherever it can; at B=5, K=6 the last two passes
    are not run) and reads w2 in descending order on odd q where the entry's ``alternate`` says so. The tokens are
    those of the plain pick of every row on every pass (an `Ops` that is not ``numbered``), bit for bit; a loop
    (``unroll=False``) runs the plain pick."""
    cfg = xj.HeadConfig(vocab_size=1001, hidden_size=16, block_size=5, rank=24, mlp_hidden=32, topc=0)
    head = xj.Head(cfg, make_head(cfg, dtype=jnp.bfloat16))
    x = make_inputs(cfg, 2, dtype=jnp.bfloat16, logit_std=0.5)  # 8 draft rows
    assert dispatch.plan(2, 5, 1001, 24, 0, jnp.bfloat16, kernels_everywhere=True).full_vocab.v_steps > 1
    seen, orig = [], full_vocab.full_vocab_pick

    def spy(*a, **kw):
        ids = kw.get("row_ids")
        seen.append((kw.get("reverse", False), None if ids is None else np.asarray(ids).tolist()))
        return orig(*a, **kw)

    monkeypatch.setattr(full_vocab, "full_vocab_pick", spy)
    P = Ops.pallas(True)

    def orders(ops, unroll=True, passes=6):
        seen.clear()
        tok = np.asarray(refine_with(ops, head, *x, num_passes=passes, unroll=unroll, early_exit=early_exit))
        return tok, list(seen)

    plain = dataclasses.replace(P, numbered=False)
    for passes in (3, 6):
        want, o = orders(plain, passes=passes)  # may trace one pass in a loop
        assert o and not any(r or i for r, i in o)
        tok, o = orders(P, passes=passes)
        # draft rows of block m are 4m..4m+3; pass q picks slots q.. of both blocks
        ids = [None, [1, 2, 3, 5, 6, 7], [2, 3, 6, 7], [3, 7]]
        assert o == [(q % 2 == 1, ids[q]) for q in range(min(passes, 4))]
        np.testing.assert_array_equal(tok, want)
        assert len(set(map(tuple, want))) > 1
    tok, o = orders(P, unroll=False)  # one traced pass in a loop: the pass number is not static
    assert o and not any(r or i for r, i in o)
    np.testing.assert_array_equal(tok, want)
    tok, o = orders(Ops.pallas(True, table=with_columns(dispatch.TABLE, alternate=False)))  # ascending
    assert [r for r, _ in o] == [False] * 4
    np.testing.assert_array_equal(tok, want)


@pytest.mark.interpret_refine
@pytest.mark.parametrize("early_exit", [pytest.param(False, id="plain", marks=pytest.mark.slow),
                                        pytest.param((2,), id="early-exit")])
@pytest.mark.slow
def test_topc_pass_pick(monkeypatch, early_exit):
    """The same for top-C passes (`Ops.topc_pick`): pass q's top-C pick runs only draft slots min(q, B-1)..
    (interpret mode), the residual's terms included, with the tokens of the plain pick of every row."""
    from xpress_jax.kernels import topc_pick as tpk

    cfg = xj.HeadConfig(vocab_size=1001, hidden_size=16, block_size=5, rank=24, mlp_hidden=32, topc=7)
    head = xj.Head(cfg, make_head(cfg, dtype=jnp.bfloat16))
    x = make_inputs(cfg, 2, dtype=jnp.bfloat16, logit_std=0.5)  # 8 draft rows
    seen, orig = [], tpk.topc_pick

    def spy(*a, **kw):
        ids = kw.get("row_ids")
        seen.append(None if ids is None else np.asarray(ids).tolist())
        return orig(*a, **kw)

    monkeypatch.setattr(tpk, "topc_pick", spy)
    P = Ops.pallas(True)

    def run(ops, unroll=True, passes=6):
        seen.clear()
        return np.asarray(refine_with(ops, head, *x, num_passes=passes, unroll=unroll, early_exit=early_exit))

    plain = dataclasses.replace(P, numbered=False)
    want = run(plain)
    assert seen and not any(seen)
    tok = run(P)
    assert seen == [None, [1, 2, 3, 5, 6, 7], [2, 3, 6, 7], [3, 7]]
    np.testing.assert_array_equal(tok, want)
    np.testing.assert_array_equal(run(P, unroll=False), want)
    assert seen and not any(seen)
    assert len(set(map(tuple, want))) > 1


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="compiled kernels (interpret mode: the tests above)")
@pytest.mark.parametrize("topc", [0, 7])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pass_pick_compiled(monkeypatch, topc, dtype):
    """Compiled (GPU): with skipping on from one draft row, an unrolled refine's passes run the pick on fewer
    rows (``row_ids``) by the served rule (`dispatch.pass_pick_rows`: full vocab only where a row tile is
    saved), and the tokens are the plain pick's of every row on every pass, bit for bit, and the loop's."""
    from xpress_jax.kernels import topc_pick as tpk

    jax.clear_caches()  # traces from other tests at these shapes would hide the spy
    cfg = xj.HeadConfig(vocab_size=1001, hidden_size=16, block_size=5, rank=24, mlp_hidden=32, topc=topc)
    head = xj.Head(cfg, make_head(cfg, dtype=dtype))
    x = make_inputs(cfg, 64, dtype=dtype, logit_std=0.5)  # 256 draft rows
    mod, name = (tpk, "topc_pick") if topc else (full_vocab, "full_vocab_pick")
    seen, orig = [], getattr(mod, name)

    def spy(*a, **kw):
        seen.append(kw.get("row_ids") is not None)
        return orig(*a, **kw)

    monkeypatch.setattr(mod, name, spy)
    P = Ops.pallas(False, table=with_columns(dispatch.TABLE, skip_final_slots=True, topc_skip_final_slots=True))
    plain = dataclasses.replace(P, numbered=False)
    want = np.asarray(refine_with(plain, head, *x, num_passes=6, unroll=True))
    assert seen and not any(seen)
    seen.clear()
    tok = np.asarray(refine_with(P, head, *x, num_passes=6, unroll=True))
    assert any(seen), "no pass skipped a row"
    np.testing.assert_array_equal(tok, want)
    np.testing.assert_array_equal(np.asarray(refine_with(P, head, *x, num_passes=6, unroll=False)), want)
    assert len(set(map(tuple, want))) > 1


def test_served_keeps():
    """The picks' served ``keep`` (L2 hints; none changes a token): the full-vocab loop's only where the config
    holds the latent (`Entry.keep`). The top-C hints apply on one contiguous
    range of N, exactly where one pass's gather (rows x C x r x itemsize) lies in the table's window, with half
    of a row's splits kept hot; never with one split."""
    for e in T.entries:
        assert e.keep(e.full_vocab) == (e.switches.full_vocab_keep if e.full_vocab.hold_lat else None)
        assert e.keep(dataclasses.replace(e.full_vocab, hold_lat=False, flat=True)) is None
    lo_bytes, hi_bytes = T.topc_keep_bytes or (0, 0)  # None: no window
    for itemsize in (2, 4):
        hinted = []
        for n in range(1, 257):
            rows = n * (B - 1)
            keep = T.topc_keep(rows, C, R, itemsize, 4)
            assert keep == ((2, "evict_last", "evict_first") if lo_bytes < rows * C * R * itemsize <= hi_bytes
                            else None)
            assert T.topc_keep(rows, C, R, itemsize, 1) is None  # one split: nothing to split in two
            hinted += [n] * (keep is not None)
        if hinted:
            assert hinted == list(range(hinted[0], hinted[-1] + 1))
    assert T.replace(topc_keep_bytes=None).topc_keep(16 * (B - 1), C, R, 2, 4) is None


@pytest.mark.slow  # fast: the kernels' keep (test_kernel_*::test_l2_hints_are_the_same_pick), the rule above
@pytest.mark.parametrize("topc", [0, 300])  # C=300: 3 splits per row, 1 hot
def test_served_keeps_are_the_same_tokens(monkeypatch, topc):
    """With the served ``keep`` forced on (the top-C window open at any size; the full-vocab shapes in a config
    that holds the latent), an unrolled refine's passes hand the pick its hints, and the tokens are those of the
    same refine with no hints, bit for bit (interpreted on a CPU; compiled on a GPU)."""
    jax.clear_caches()  # traces from other tests at these shapes would hide the spy
    interpret = jax.default_backend() == "cpu"
    cfg = xj.HeadConfig(vocab_size=611, hidden_size=16, block_size=5, rank=40, mlp_hidden=32, topc=topc)
    head = xj.Head(cfg, make_head(cfg, dtype=jnp.bfloat16))
    n = 16  # 64 draft rows
    x = make_inputs(cfg, n, dtype=jnp.bfloat16, logit_std=0.5)
    if not topc:
        assert dispatch.plan(n, 5, 611, 40, 0, jnp.bfloat16).full_vocab.hold_lat
    mod, name = (topc_pick, "topc_pick") if topc else (full_vocab, "full_vocab_pick")
    seen, orig = [], getattr(mod, name)

    def spy(*a, **kw):
        seen.append(kw.get("keep"))
        return orig(*a, **kw)

    monkeypatch.setattr(mod, name, spy)
    P = Ops.pallas(interpret, table=dispatch.TABLE.replace(topc_keep_bytes=(0, 1 << 40)))
    tok = np.asarray(refine_with(P, head, *x, num_passes=3, unroll=True))
    splits = -(-topc // dispatch.plan(n * 4, 2, 611, 40, topc, jnp.bfloat16).topc.c_tile) if topc else 0
    want_keep = (splits // 2, "evict_last", "evict_first") if topc else "split"
    assert not topc or splits == 3
    assert seen and all(k == want_keep for k in seen), (seen, want_keep)
    seen.clear()
    P = Ops.pallas(interpret, table=with_columns(dispatch.TABLE.replace(topc_keep_bytes=None), full_vocab_keep=None))
    want = np.asarray(refine_with(P, head, *x, num_passes=3, unroll=True))
    assert seen and not any(seen)
    np.testing.assert_array_equal(tok, want)
    assert len(set(map(tuple, want))) > 1


def _start_logits(n, b, v, dtype, seed):
    """[n, b, v] logits whose draft rows hold every kind of argmax case: NaN and -inf rows, ties at the top
    (the lowest id wins), -0.0 against +0.0, a maximum at the last id, flat rows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, b, v))
    rows = x.reshape(n * b, v)
    k = len(rows)
    rows[1 % k, : v // 2] = np.nan                      # NaN read as -inf
    rows[2 % k, :] = -np.inf                            # all -inf: id 0
    rows[3 % k, :] = 0.0
    rows[3 % k, 1::2] = -0.0                            # -0.0 == +0.0: id 0
    rows[4 % k, [v // 3, v - 1]] = 50.0                 # a tie at the top: the lower id
    rows[5 % k, v - 1] = 60.0                           # the last id
    rows[6 % k, :] = 1.25                               # flat
    rows[7 % k] = np.round(rows[7 % k] * 2) / 2         # many ties below the top
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("n,b,v,dtype", [
    pytest.param(2, 4, 7, jnp.float32, id="2-4-7-float32"),
    pytest.param(5, 3, 1, jnp.bfloat16, id="5-3-1-bfloat16", marks=pytest.mark.slow),
    *(pytest.param(n, b, v, dt, id=f"{n}-{b}-{v}-{jnp.dtype(dt).name}", marks=pytest.mark.slow)
      for n, b, v, dt in ((3, 5, 301, jnp.bfloat16), (3, 5, 301, jnp.float32), (2, 4, 7, jnp.bfloat16),
                          (1, 16, 4099, jnp.bfloat16), (1, 16, 4099, jnp.float32), (5, 3, 1, jnp.float32))),
])
@pytest.mark.slow
def test_full_vocab_start_through_the_selection(monkeypatch, n, b, v, dtype):
    """Where the entry's ``start_select`` says so a Pallas full-vocab refine starts with the
    selection's argmax output (c=1): equal to `reference.full_vocab_start` on every kind of row (NaN, -inf,
    ties, -0.0, V=1, odd V and B), interpreted on a CPU, compiled on a GPU; below the bound XLA's argmax."""
    interpret = jax.default_backend() == "cpu"
    logits = _start_logits(n, b, v, dtype, seed=n * v)
    want = np.asarray(xref.full_vocab_start(logits))
    seen, orig = [], select.select_candidates

    def spy(*a, **kw):
        seen.append(a[1])
        return orig(*a, **kw)

    monkeypatch.setattr(select, "select_candidates", spy)
    P = Ops.pallas(interpret, table=with_columns(dispatch.TABLE, start_select=False))
    np.testing.assert_array_equal(np.asarray(P.start(logits)), want)
    assert seen == []  # XLA's argmax
    got = np.asarray(Ops.pallas(interpret, table=with_columns(dispatch.TABLE, start_select=True)).start(logits))
    assert seen == [1], "the selection did not run"
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_full_vocab_refine_starting_through_the_selection(monkeypatch):
    """A full-vocab refine that starts through the selection gives the tokens of one that starts with XLA's
    argmax, bit for bit (compiled on a GPU; on a CPU, interpreted, also the XLA backend's)."""
    cfg = xj.HeadConfig(vocab_size=301, hidden_size=16, block_size=5, rank=24, mlp_hidden=32, topc=0)
    head = xj.Head(cfg, make_head(cfg, dtype=jnp.bfloat16))
    x = make_inputs(cfg, 3, dtype=jnp.bfloat16, logit_std=0.5)
    interpret = jax.default_backend() == "cpu"
    seen, orig = [], select.select_candidates
    monkeypatch.setattr(select, "select_candidates", lambda *a, **kw: seen.append(a[1]) or orig(*a, **kw))
    P = Ops.pallas(interpret, table=with_columns(dispatch.TABLE, start_select=False))
    want = np.asarray(refine_with(P, head, *x, num_passes=2))
    assert seen == []
    P = Ops.pallas(interpret, table=with_columns(dispatch.TABLE, start_select=True))
    np.testing.assert_array_equal(np.asarray(refine_with(P, head, *x, num_passes=2)), want)
    assert seen == [1]
    assert len(set(map(tuple, want))) > 1
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(refine_with(Ops.xla("cpu"), head, *x, num_passes=2)), want)


def test_pass_pick_rows():
    """`dispatch.pass_pick_rows`: pass q never skips a slot that may still change (s <= min(q, B-1)), never
    skips at q=0, skips everything once every draft slot is final, and (compiled) only where ``skip`` says so
    and the pick then runs fewer row tiles (row_tile 1: the top-C pick)."""
    for n, b, tile in ((1, 16, 16), (16, 16, 128), (64, 16, 128), (3, 7, 16), (256, 16, 128), (4, 16, 1)):
        for q in range(0, 20):
            s_all = dispatch.pass_pick_rows(n, b, q, tile, skip=False, everywhere=True)
            assert s_all == min(q, b - 1)
            for skip in (False, True):
                s = dispatch.pass_pick_rows(n, b, q, tile, skip=skip)
                assert s in (0, s_all) and (q > 0 or s == 0)
                if q >= b - 1:
                    assert s == b - 1
                elif not skip:
                    assert s == 0
    assert dispatch.pass_pick_rows(64, 16, 5, 128, skip=True) == 5  # 960 -> 640 rows: 8 -> 5 row tiles
    assert dispatch.pass_pick_rows(16, 16, 5, 128, skip=True) == 0  # 240 -> 160 rows: 2 row tiles either way
    assert dispatch.pass_pick_rows(1, 16, 5, 16, skip=True) == 0
    assert dispatch.pass_pick_rows(1, 16, 5, 1, skip=True) == 5  # one program per row (top-C)


@pytest.mark.parametrize("dtype,n", [
    pytest.param(jnp.float32, 2, id="float32-2"),
    *(pytest.param(dt, n, id=f"{jnp.dtype(dt).name}-{n}", marks=pytest.mark.slow)
      for dt, n in ((jnp.float32, 1), (jnp.float32, 8), (jnp.bfloat16, 1), (jnp.bfloat16, 2), (jnp.bfloat16, 8))),
])
def test_hidden_input_gpu_is_the_same_sums(n, dtype):
    """`reference.hidden_input_gpu` == `head.hidden_input` bit for bit where every summation order is exact
    (small dyadic values: the padded row, the slice and the barriers must change nothing), and within float32
    rounding on random values (XLA may order a padded GEMM's sums unlike a strength-reduced GEMV's)."""
    from xpress_jax.head import hidden_input

    rng = np.random.default_rng(n)
    B, H, r = 4, 64, 16
    def dyadic(shape, scale):
        return jnp.asarray((rng.integers(-4, 5, shape) * scale).astype(np.float32)).astype(dtype)
    p = {"w1": jnp.zeros((3, r), dtype), "down_h": dyadic((H, r), 2.0**-4), "down_g": dyadic((H, r), 2.0**-4),
         "in_proj_hidden": dyadic((2 * r, r), 2.0**-5)}
    h = dyadic((n, B, H), 2.0**-2)  # slot sums of 4 values / 4: exact; products and sums exact in f32
    want = np.asarray(hidden_input(p, h))
    np.testing.assert_array_equal(np.asarray(xref.hidden_input_gpu(p, h)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(xref.hidden_input_gpu)(p, h)), want)
    assert np.abs(want).max() > 0
    p = {k: jnp.asarray(rng.standard_normal(v.shape).astype(np.float32) * 0.2).astype(dtype) for k, v in p.items()}
    h = jnp.asarray(rng.standard_normal((n, B, H)).astype(np.float32)).astype(dtype)
    got, want = (np.asarray(f(p, h)).astype(np.float32) for f in (xref.hidden_input_gpu, hidden_input))
    tol = 1e-6 if dtype == jnp.float32 else 2.0**-7
    assert np.abs(got - want).max() <= tol * np.abs(want).max()


# ----------------------------------------------------------------------------- import structure


def _imports(path: pathlib.Path) -> set[str]:
    """Modules of this package that ``path`` imports (anywhere in it, lazy imports included)."""
    mod = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    if path.name == "__init__.py":
        mod = pkg
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            if n.split(".")[0] == "xpress_jax" and n != mod:
                out.add(n)
    return out


def _graph() -> dict[str, set[str]]:
    files = {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PKG.rglob("*.py")}
    return {m: {n for n in _imports(p) if n in files and n != m} for m, p in files.items()}


def test_kernels_are_a_leaf():
    """xpress_jax.kernels imports nothing from the rest of xpress_jax."""
    for mod, deps in _graph().items():
        if mod.startswith("xpress_jax.kernels"):
            outside = {d for d in deps if not d.startswith("xpress_jax.kernels")}
            assert not outside, f"{mod} imports {outside}"


def test_no_import_cycles():
    """No module imports (directly or through others) a module that imports it back. Package
    ``__init__`` files are left out: they only re-export."""
    g = {m: {d for d in deps if not (PKG / "/".join(d.split(".")[1:]) / "__init__.py").exists()}
         for m, deps in _graph().items()}
    for start in g:
        seen, stack = set(), list(g[start])
        while stack:
            m = stack.pop()
            assert m != start, f"import cycle through {start}"
            if m not in seen:
                seen.add(m)
                stack.extend(g.get(m, ()))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,ops_name", [
    pytest.param(jnp.float32, "pallas-interpret", id="float32-pallas-interpret"),
    pytest.param(jnp.float32, "xla", id="float32-xla", marks=pytest.mark.slow),
    pytest.param(jnp.bfloat16, "xla", id="bfloat16-xla", marks=pytest.mark.slow),
    pytest.param(jnp.bfloat16, "pallas-interpret", id="bfloat16-pallas-interpret", marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_best_steps_agree_with_the_picks(ops_name, dtype):
    """`full_vocab_best` / `topc_best` (the picks with their winning values, what the vocabulary-sharded
    path combines) give the picks' ids, and the scores the reference computes for those ids."""
    from xpress_jax import reference as ref

    ops = Ops.xla() if ops_name == "xla" else Ops.pallas(True)
    n, b, v, r, c = 3, 5, 613, 40, 37
    base, lat, w2 = pick_inputs(n * (b - 1), v, r, dtype, seed=11)
    logits = jnp.concatenate([jnp.full((n, 1, v), 1e4, dtype), base.reshape(n, b - 1, v)], axis=1)
    score, idx = ops.full_vocab_best(logits, lat, w2)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ops.full_vocab_pick(logits, lat, w2)[0]))
    s_all = ref.round_sum(base, ref.readout(lat, w2, dtype)).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(score), np.asarray(s_all[jnp.arange(idx.shape[0]), idx]))
    cand, base_c, _ = ref.select_candidates(base, c)
    prepared = ops.topc_prepare(w2, cand)
    s, bb, i = ops.topc_best(base_c, cand, lat, prepared)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ops.topc_pick(base_c, cand, lat, prepared)[0]))
    pos = jnp.argmax(cand == i[:, None], axis=-1)
    np.testing.assert_array_equal(np.asarray(bb), np.asarray(base_c[jnp.arange(i.shape[0]), pos].astype(jnp.float32)))
