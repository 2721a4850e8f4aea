"""The int8-pruned full-vocabulary pick: the full scan's tokens, from the scan's own scores, reading an int8 copy of ``w2``.

Same result as `full_vocab.full_vocab_pick` with the same ``row_tile``, ``v_tile`` and ``k_tile``
(the same dots on the same chunks, in another loop: equal as far as Triton compiles them alike; issue 14, ``refine(..., topc=0, full_vocab="pruned")``; the argument is in
`xpress_jax.exact`'s "The pruned mode"). Per program (a row tile and ``v_steps`` vocab tiles):

1. **Threshold.** Each row's ``guess`` id g (any id: the caller passes its best candidate or the
   row's previous token) is scored from its w2 row and base logit, lowered by a rounding-safe
   margin: ``thr = clean(R(fl(base_g + R(d_g - 2 eps))))`` with ``d_g`` = ``lat . w2[g]`` summed in
   float32 in this program's order and ``eps = 2^-11 ||lat|| M`` (M >= every ||w2[v]||). So
   ``thr`` is at most the full scan's own score of g, hence at most the row's winning score.
2. **Per vocab tile, the int8 bound.** ``t = lat @ q_tile.T`` (the int8 rows converted exactly to
   the logits' dtype, float32 accumulation), ``U = fl(t s_v) + fl(||lat|| E_v)`` and
   ``ub = R(fl(base_v + R(U)))`` (not NaN-cleaned: NaN forces the exact step). ``U`` is at least the
   full scan's computed dot ``d_v`` (`xpress_jax.exact.prepare_pruned` folds every rounding into
   ``E_v``), and the score pipeline is monotone, so ``ub`` >= the full scan's score of v.
3. **Exact step only where needed.** If some row of the tile has an id with ``not (ub < thr)``,
   the tile is scored exactly by the full scan's own code (same chunks of the held latent, same
   dots, same lazy epilogue) and ``thr`` rises to each row's best exact score in it; otherwise the
   tile is skipped: every id in it scores below ``thr`` <= the row's winning score, so it can
   neither win nor tie the winner. The winner's tile is never skipped (its ``ub`` >= its score >=
   ``thr``), so each row's best over its parts is the full scan's.
4. ``fallen`` (a device flag): no int8 work, every tile exact (the plain scan's result).

Measured on an H200 (benchmarks/RESULTS.md, "Pruned mode", 2026-12-02): correct (0 tokens differ) and
pruning (at the synthetic std-0.04 head 1.9% / 7% / 7.7% of tiles scored exactly at N = 1 / 16 / 256),
but **not faster than the scan**: the bound's pass costs about what the bf16 scan costs (0.95-1.4x the
scan's pick at N=1, 1.7-2.3x at N=16, 1.9x at N=256 over the variants tried). The scan is not bound by
reading ``w2`` at N >= 16, and the int8 tile converted for a bf16 tensor-core dot adds work.

Outputs: the [parts, rows_pad] best values and ids `full_vocab.combine_partials` reduces, per row
the ids of the part whose bound reached its threshold (counted lane by lane: no per-tile reduction),
and per program the tiles it scored exactly (written to each of its rows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import common
from .common import cdiv, iota, k_chunk
from .full_vocab import MIN_DOT, SMEM_LIMIT, FullVocabConfig, _base_index, _check_inputs, combine_partials

__all__ = ["pruned_config", "pruned_pick", "EPS_SHIFT"]

#: ``eps = 2^-EPS_SHIFT ||lat|| M``: covers twice the float32 dot error (2 gamma_r, r u <= 2^-12). The same
#: value as `xpress_jax.reference.PRUNE_EPS_SHIFT` (this package imports nothing from xpress_jax; a test checks).
EPS_SHIFT = 11


def pruned_config(cfg: FullVocabConfig, rank: int, dtype) -> FullVocabConfig:
    """The pruned kernel's config from the all-rows scan config ``cfg``: the same ``row_tile``,
    ``v_tile`` and ``k_tile`` (the exact step's per-element computation), the latent held, no flat
    loop (the exact step sits under a `lax.cond`), at most 2 pipeline stages."""
    out = dataclasses.replace(cfg, flat=False, hold_lat=True, prefetch_base=False, lazy=True,
                              num_stages=min(cfg.num_stages, 2))
    if smem_bytes(out, rank, dtype) > SMEM_LIMIT:
        out = dataclasses.replace(out, num_stages=1)
    return out


def smem_bytes(cfg: FullVocabConfig, rank: int, dtype) -> int:
    """`FullVocabConfig.smem_bytes` plus the int8 tile's stages."""
    kc = k_chunk(cfg.k_tile, rank, MIN_DOT)
    return cfg.smem_bytes(rank, dtype) + max(1, cfg.num_stages) * cfg.v_tile * kc


def _any(hit: jax.Array) -> jax.Array:
    """Whether any element of a 2-D bool tile is set, reduced one axis at a time: JAX 0.12's lowering for
    an H200 refuses a one-step 2-D -> scalar reduction (a sharding rank mismatch), and Triton has no
    reduce_or."""
    return jnp.max(jnp.max(hit.astype(jnp.int32), axis=1)) > 0


def _pruned_kernel(base_ref, lat_ref, w2_ref, q_ref, qs_ref, qe_ref, m_ref, g_ref, fallen_ref,
                   mv_ref, mi_ref, need_ref, tiles_ref, *, rows: int, vocab: int, rank: int, row_tile: int, v_tile: int,
                   v_steps: int, k_tile: int, dtype, slot_stride: int, two_phase: bool = False,
                   swap: bool = False):
    i, j = pl.program_id(0), pl.program_id(1)
    r0 = i * row_tile
    rix = r0 + iota(row_tile)
    row_ok = rix < rows
    n_k = cdiv(rank, k_tile)
    k_tail = rank % k_tile != 0
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
    lat_mask = jnp.broadcast_to(row_ok[:, None], (row_tile, k_tile))

    def kmask(kk):
        kc = kk * k_tile + iota(k_tile)
        return kc, (kc < rank)[None, :]

    def load_lat(kk):
        kc, kok = kmask(kk)
        return plt.load(lat_ref.at[rix[:, None], kc[None, :]], mask=lat_mask & kok if k_tail else lat_mask,
                        other=0.0)

    held = [load_lat(kk) for kk in range(n_k)]  # [row_tile, k_tile] each, the logits' dtype

    # ||lat|| (>= the real norm: 2^-10 covers float32 summation and the GPU's square root).
    ss = jnp.zeros((row_tile,), jnp.float32)
    for x in held:
        xf = x.astype(jnp.float32)
        ss = ss + jnp.sum(xf * xf, axis=1)
    nl = jnp.sqrt(ss) * (1 + 2.0 ** -10)
    mnorm = m_ref[0]
    eps = (nl * mnorm) * (2.0 ** -EPS_SHIFT)

    # The threshold from each row's guess id.
    g = plt.load(g_ref.at[rix], mask=row_ok, other=0)
    g = jnp.clip(g, 0, vocab - 1)
    d_g = jnp.zeros((row_tile,), jnp.float32)
    for kk, x in enumerate(held):
        kc, kok = kmask(kk)
        wm = jnp.broadcast_to(row_ok[:, None], (row_tile, k_tile))
        w = plt.load(w2_ref.at[g[:, None], kc[None, :]], mask=wm & kok if k_tail else wm, other=0.0)
        d_g = d_g + jnp.sum(x.astype(jnp.float32) * w.astype(jnp.float32), axis=1)
    if slot_stride:
        q = jnp.minimum(rix, rows - 1)
        src = (q // (slot_stride - 1)) * slot_stride + 1 + q % (slot_stride - 1)
    else:
        src = jnp.minimum(rix, rows - 1)
    b_g = plt.load(base_ref.at[src, g], mask=row_ok, other=0.0)
    thr = common.score(b_g, (d_g - 2 * eps).astype(dtype), dtype)  # NaN -> -inf: then every tile is exact
    thr = jnp.where(row_ok, thr, jnp.inf)
    fallen = fallen_ref[0] != 0

    def v_start(t):
        return (j * v_steps + t) * v_tile

    def load_base(v0, valid=True):
        col_ok = (v0 + iota(v_tile)) < vocab
        idx = _base_index(r0, row_tile, v0, v_tile, rows, slot_stride)
        mask = row_ok[:, None] & col_ok[None, :]
        if valid is not True:
            mask = mask & valid
        return plt.load(base_ref.at[idx], mask=mask, other=-jnp.inf)

    def wload(ref, v0, kk, other):
        kc, kok = kmask(kk)
        vm = jnp.broadcast_to(((v0 + iota(v_tile)) < vocab)[:, None], (v_tile, k_tile))
        if k_tail:
            return plt.load(ref.at[(v0 + iota(v_tile))[:, None], kc[None, :]], mask=vm & kok, other=other)
        return plt.load(ref.at[pl.ds(v0, v_tile), pl.ds(kk * k_tile, k_tile)], mask=vm, other=other)

    def dot(x, w):
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    lanes = jax.lax.broadcasted_iota(jnp.int32, (row_tile, v_tile), 1)

    def hits(v0, b, th):  # bool: ids whose bound reaches the row's threshold th ([row_tile, v_tile]; swap: transposed)
        col_ok = (v0 + iota(v_tile)) < vocab
        cols = v0 + iota(v_tile)
        s_v = plt.load(qs_ref.at[cols], mask=col_ok, other=0.0)
        e_v = plt.load(qe_ref.at[cols], mask=col_ok, other=0.0)
        if swap:  # q as the dot's first operand: [v_tile, row_tile]
            t = jnp.zeros((v_tile, row_tile), jnp.float32)
            for kk, x in enumerate(held):
                t = t + jax.lax.dot_general(wload(q_ref, v0, kk, 0).astype(dtype), x, (((1,), (1,)), ((), ())),
                                            precision=precision, preferred_element_type=jnp.float32)
            u = t * s_v[:, None] + nl[None, :] * e_v[:, None]
            ub = (b.astype(jnp.float32) + u.astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
            return jnp.logical_not(ub < th[None, :]) & row_ok[None, :] & col_ok[:, None]
        t = jnp.zeros((row_tile, v_tile), jnp.float32)
        for kk, x in enumerate(held):
            t = t + dot(x, wload(q_ref, v0, kk, 0).astype(dtype))
        u = t * s_v[None, :] + nl[:, None] * e_v[None, :]
        ub = (b.astype(jnp.float32) + u.astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
        return jnp.logical_not(ub < th[:, None]) & row_ok[:, None] & col_ok[None, :]

    def load_base_t(v0, valid=True):  # [v_tile, row_tile]: the base tile transposed (swap)
        cols = v0 + iota(v_tile)
        mask = (cols < vocab)[:, None] & row_ok[None, :]
        if valid is not True:
            mask = mask & valid
        return plt.load(base_ref.at[src[None, :], cols[:, None]], mask=mask, other=-jnp.inf)

    def exact(v0, b, best, bidx, th):  # the scan's own scores of the tile, its lazy epilogue, th raised
        acc = jnp.zeros((row_tile, v_tile), jnp.float32)
        for kk, x in enumerate(held):
            acc = acc + dot(x, wload(w2_ref, v0, kk, 0.0))
        s = (b.astype(jnp.float32) + acc.astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
        better = s > best
        clean = jnp.where(s != s, -jnp.inf, s)
        return jnp.where(better, s, best), jnp.where(better, v0 + lanes, bidx), jnp.maximum(th, jnp.max(clean, axis=1))

    def pruned_step(t, carry):
        best, bidx, th, cnt, n_go = carry
        v0 = v_start(t)
        b = load_base(v0)
        hit = hits(v0, b, th)
        go = _any(hit)
        best, bidx, th = jax.lax.cond(go, lambda o: exact(v0, b, *o), lambda o: o, (best, bidx, th))
        return best, bidx, th, cnt + hit.astype(jnp.int32), n_go + go.astype(jnp.int32)

    def plain_step(t, carry):  # fallen back: every tile exact, no int8 work
        best, bidx, th, cnt, n_go = carry
        v0 = v_start(t)
        best, bidx, th = exact(v0, load_base(v0), best, bidx, th)
        return best, bidx, th, cnt, n_go + (v0 < vocab).astype(jnp.int32)

    init = (jnp.full((row_tile, v_tile), -jnp.inf, jnp.float32), v_start(0) + lanes, thr,
            jnp.zeros((row_tile, v_tile), jnp.int32), jnp.int32(0))
    if not two_phase:
        best, bidx, _, cnt, n_go = jax.lax.cond(
            fallen, lambda c: jax.lax.fori_loop(0, v_steps, plain_step, c),
            lambda c: jax.lax.fori_loop(0, v_steps, pruned_step, c), init)
        cnt = jnp.sum(cnt, axis=1)
    else:
        # Phase 1: the int8 bound of every tile, no conditional in the loop (Triton pipelines its loads);
        # the tiles to score exactly as bits of ceil(v_steps / 32) words. Phase 2: those tiles, exactly.
        n_words = cdiv(v_steps, 32)
        load_b = load_base_t if swap else load_base
        cshape = (v_tile, row_tile) if swap else (row_tile, v_tile)

        def phase1(t, carry):
            words, cnt, b = carry
            b_next = load_b(v_start(t + 1), (t + 1) < v_steps)  # prefetched one step ahead
            hit = hits(v_start(t), b, thr)
            go = _any(hit).astype(jnp.int32)
            w_ix, bit = t >> 5, t & 31  # t >= 0 (jnp's % does not lower to Triton here)
            words = tuple(jnp.where(w_ix == w, wd | (go << bit), wd) for w, wd in enumerate(words))
            return words, cnt + hit.astype(jnp.int32), b_next

        def phase2(words, t, carry):
            best, bidx, th, n_go = carry
            w_ix, bit = t >> 5, t & 31  # t >= 0 (jnp's % does not lower to Triton here)
            wd = words[0]
            for w in range(1, n_words):
                wd = jnp.where(w_ix == w, words[w], wd)
            go = ((wd >> bit) & 1) != 0
            v0 = v_start(t)
            best, bidx, th = jax.lax.cond(go, lambda o: exact(v0, load_base(v0), *o), lambda o: o, (best, bidx, th))
            return best, bidx, th, n_go + go.astype(jnp.int32)

        def run_pruned(c):
            best, bidx, th, _, _ = c
            words, cnt, _ = jax.lax.fori_loop(
                0, v_steps, phase1, (tuple(jnp.int32(0) for _ in range(n_words)), jnp.zeros(cshape, jnp.int32),
                                     load_b(v_start(0))))
            best, bidx, _, n_go = jax.lax.fori_loop(0, v_steps, functools.partial(phase2, words),
                                                    (best, bidx, th, jnp.int32(0)))
            return best, bidx, jnp.sum(cnt, axis=0 if swap else 1), n_go

        def run_plain(c):
            best, bidx, _, cnt, n_go = jax.lax.fori_loop(0, v_steps, plain_step, c)
            return best, bidx, jnp.sum(cnt, axis=1), n_go

        best, bidx, cnt, n_go = jax.lax.cond(fallen, run_plain, run_pruned, init)
    best, bidx = common.best(best, bidx, axis=1)
    mv_ref[...] = best
    mi_ref[...] = bidx
    need_ref[...] = cnt
    tiles_ref[...] = jnp.full((row_tile,), n_go, jnp.int32)


def pruned_pick(base: jax.Array, lat: jax.Array, w2: jax.Array, q: jax.Array, qscale: jax.Array, qerr: jax.Array,
                max_norm: jax.Array, guess: jax.Array, fallen: jax.Array, *, config: FullVocabConfig,
                slot_stride: int = 0, interpret: bool = False, two_phase: bool = False, swap: bool = False):
    """The pruned pick (module doc): ``(tokens [rows] int32, need [rows] int32, exact_frac [] float32,
    V)``: ``need`` = the vocab ids whose bound reached the row's threshold (at least 1: the winner;
    after a fallback, 0), ``exact_frac`` = the
    fraction of (row tile, vocab tile) pairs scored exactly (a tile is, where any of its rows needs it).

    ``base``/``lat``/``w2``/``slot_stride`` as in `full_vocab.full_vocab_pick`; ``q`` [V, r] int8,
    ``qscale`` and ``qerr`` [V] float32, ``max_norm`` [] float32 (`xpress_jax.exact.prepare_pruned`);
    ``guess`` [rows] int (any ids; out-of-range ones are clipped); ``fallen`` a flag
    (`common.flag_operand`). ``config``: the kernel's config (`pruned_config` of the scan's). The
    tokens equal ``full_vocab_pick(base, lat, w2, config=c)`` for any ``c`` with the same
    ``row_tile``, ``v_tile`` and ``k_tile``. ``two_phase`` (static): first the int8 bound of every tile
    of the part (a loop with no conditional), then the flagged tiles exactly; else one loop with the
    exact step under a `lax.cond` per tile. ``swap`` (two_phase only): the bound's dot as ``q @ lat.T``.
    Neither changes a token; on an H200 neither was faster (benchmarks/RESULTS.md, "Pruned mode").
    """
    dtype = _check_inputs(base, lat, w2, slot_stride, "pruned pick kernel")
    vocab = base.shape[1]
    rows, rank = lat.shape
    if q.shape != w2.shape or q.dtype != jnp.int8:
        raise ValueError(f"pruned pick: q must be int8 {w2.shape}, got {q.dtype} {q.shape}")
    for name, a in (("qscale", qscale), ("qerr", qerr)):
        if a.shape != (vocab,):
            raise ValueError(f"pruned pick: {name} must be [V={vocab}], got {a.shape}")
    if guess.shape != (rows,) or not jnp.issubdtype(guess.dtype, jnp.integer):
        raise ValueError(f"pruned pick: guess must be [rows={rows}] int, got {guess.shape} {guess.dtype}")
    cfg = config
    cfg.check_shape(rows, vocab, rank, dtype)
    if cfg.flat or not cfg.hold_lat:
        raise ValueError(f"pruned pick: {cfg} must hold the latent and not be flat (use pruned_config)")
    kc = k_chunk(cfg.k_tile, rank, MIN_DOT)
    parts = cdiv(vocab, cfg.v_tile * cfg.v_steps)
    row_tiles = cdiv(rows, cfg.row_tile)
    out_spec = pl.BlockSpec((None, cfg.row_tile), lambda i, j: (j, i))
    kernel = functools.partial(_pruned_kernel, rows=rows, vocab=vocab, rank=rank, row_tile=cfg.row_tile,
                               v_tile=cfg.v_tile, v_steps=cfg.v_steps, k_tile=kc, dtype=dtype, slot_stride=slot_stride,
                               two_phase=two_phase, swap=swap)
    shape = (parts, row_tiles * cfg.row_tile)
    operands = (base, lat, w2, q, qscale.astype(jnp.float32), qerr.astype(jnp.float32),
                jnp.reshape(max_norm, (1,)).astype(jnp.float32), guess.astype(jnp.int32),
                common.flag_operand(fallen, "fallen"))
    mv, mi, need, tiles = common.pallas_call(
        kernel, name="xpress_full_vocab_pruned", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        interpret=interpret, grid=(row_tiles, parts), in_specs=[pl.no_block_spec] * len(operands),
        out_specs=(out_spec,) * 4,
        out_shape=(jax.ShapeDtypeStruct(shape, jnp.float32),) + (jax.ShapeDtypeStruct(shape, jnp.int32),) * 3,
    )(*operands)
    tok = combine_partials(mv, mi, interpret=interpret)[:rows]
    n_tiles = cdiv(vocab, cfg.v_tile)
    exact_frac = jnp.sum(tiles[:, ::cfg.row_tile]) / (row_tiles * n_tiles)
    return tok, jnp.sum(need[:, :rows], axis=0), exact_frac.astype(jnp.float32), vocab
