"""Full-vocabulary pick: ``argmax_v float(dtype(base + dtype(lat @ w2.T)))``, lowest vocab id on ties.

The spec is `xpress_jax.reference.full_vocab_pick`; the [rows, V] sum is never stored. Stage 1 (`_fused_kernel`,
grid ``(row tiles, vocab parts)``, dim 0 fastest so the row tiles sharing a w2 tile run together) computes
``lat_tile @ w2_tile.T`` on the tensor cores, rounds, adds base, rounds again and writes each part's best value
and lowest id to ``[parts, rows_pad]``; a part is ``v_steps`` tiles of ``v_tile`` ids. Stage 2
(`combine_partials`) keeps the largest value, lowest id. The float32 dot may sum in another order than XLA's, so
tokens differ only at near ties. Float64 is refused (``TypeError``).

The sampled pick (``seeds``, ``inv_t``; `xpress_jax.reference.full_vocab_sample`) compares the keys
``common.sample_key(s, inv_t, common.gumbel(seed, id))`` instead of the scores, recomputing the noise in the
epilogue; with a proposal the same launch also keeps each part's winner score and running logsumexp, and writes
the scores once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import common
from .common import plt, BIG, MIN_DOT, SMEM_LIMIT, cdiv, iota, k_chunk, next_pow2, score, src_row

__all__ = ["FullVocabConfig", "default_config", "fit_shared_memory", "full_vocab_pick", "combine_partials",
           "pack_active", "scan_failing"]

_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class FullVocabConfig:
    """Static block sizes of the full-vocab pick (hashable: a jit static arg).

    row_tile, v_tile: rows per program and vocab ids per step (powers of two; tails masked).
    v_steps: vocab tiles looped inside one program (a "part"); parts = cdiv(V, v_tile * v_steps).
    k_tile: rank columns per dot step (0 = the whole rank; else a power of two >= 16; `k_chunk`).
    num_warps, num_stages: Triton launch parameters of stage 1.
    hold_lat: load the latent tile once, before the vocab loop (else once per vocab tile, the rank loop a
      `fori_loop` Triton can pipeline).
    flat: (``hold_lat=False``) one loop over (vocab tile, rank chunk) pairs, so the pipelined loads run across tiles.
    prefetch_base: load the next vocab tile's base block one step ahead (its latency hides behind the dots).
    lazy: keep a running best per (row, lane) across the part's tiles and reduce the lanes once per part."""

    row_tile: int = 16
    v_tile: int = 128
    v_steps: int = 1
    k_tile: int = 0
    num_warps: int = 4
    num_stages: int = 1
    hold_lat: bool = True
    flat: bool = False
    prefetch_base: bool = False
    lazy: bool = False

    def check(self) -> None:
        for name in ("row_tile", "v_tile"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        if self.k_tile < 0 or (self.k_tile and self.k_tile & (self.k_tile - 1)):
            raise ValueError(f"k_tile={self.k_tile} must be 0 or a power of two")
        if self.v_steps < 1:
            raise ValueError(f"v_steps={self.v_steps} must be >= 1")
        if self.flat and self.hold_lat:
            raise ValueError(f"flat={self.flat} needs hold_lat=False (the rank chunk index is dynamic)")

    def check_shape(self, rows: int, vocab: int, rank: int, dtype, smem_limit: int = SMEM_LIMIT,
                    target: str = "H100/H200") -> None:
        """`check`, then refuse (ValueError) what the ``target`` GPU cannot run: dot tiles < `MIN_DOT`, shared
        memory (`smem_bytes`) above ``smem_limit`` bytes per program (default: an H100/H200's, `SMEM_LIMIT`)."""
        self.check()
        for name, v in (("rows", rows), ("vocab", vocab), ("rank", rank)):
            if v < 1:
                raise ValueError(f"full-vocab pick needs {name} >= 1, got {v}")
        for name in ("row_tile", "v_tile"):
            if getattr(self, name) < MIN_DOT:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {MIN_DOT} (a tensor-core dot dimension)")
        if self.k_tile and self.k_tile < MIN_DOT:
            raise ValueError(f"k_tile={self.k_tile} must be 0 or >= {MIN_DOT} (the dot's K dimension)")
        need = self.smem_bytes(rank, dtype)
        if need > smem_limit:
            raise ValueError(
                f"{self} at rank={rank}, {jnp.dtype(dtype).name} stages ~{need // 1024} KB in shared memory, "
                f"more than the {smem_limit // 1024} KB a {target} program may use (lower row_tile/v_tile/k_tile/"
                f"num_stages, or hold_lat=False)")

    def smem_bytes(self, rank: int, dtype) -> int:
        """Estimate of the fused kernel's shared memory: the held latent tile plus ``num_stages`` copies of each
        pipelined dot operand."""
        item = jnp.dtype(dtype).itemsize
        kc = k_chunk(self.k_tile, rank, MIN_DOT)
        held = self.row_tile * kc * cdiv(rank, kc) * item if self.hold_lat else 0
        stage = (self.v_tile + (0 if self.hold_lat else self.row_tile)) * kc * item
        return held + max(1, self.num_stages) * stage


def default_config(rows: int, vocab: int, rank: int, dtype, smem_limit: int = SMEM_LIMIT) -> FullVocabConfig:
    """Heuristic block sizes (float32; `xpress_jax.dispatch` holds the measured serving configs)."""
    itemsize = jnp.dtype(dtype).itemsize
    row_tile = min(64 if itemsize >= 4 else 128, max(16, next_pow2(rows)))
    v_tile = 64
    k_tile = 64 if itemsize >= 4 else 0
    num_warps = 8 if row_tile >= 64 else 4
    num_stages = 1 if itemsize >= 4 else 2
    hold_lat = row_tile * rank * itemsize <= 64 * 1024
    # Enough programs to fill an H200 a few times; the rest goes into v_steps (few partials for stage 2).
    programs = cdiv(rows, row_tile) * cdiv(vocab, v_tile)
    v_steps = 1
    while v_steps < 16 and programs // (2 * v_steps) >= 1024:
        v_steps *= 2
    cfg = FullVocabConfig(row_tile, v_tile, v_steps, k_tile, num_warps, num_stages, hold_lat=hold_lat)
    return fit_shared_memory(cfg, rank, dtype, smem_limit)


def fit_shared_memory(cfg: FullVocabConfig, rank: int, dtype, smem_limit: int = SMEM_LIMIT) -> FullVocabConfig:
    """``cfg``, or the nearest config that fits ``smem_limit`` bytes (default `SMEM_LIMIT`) at this rank: each step
    below in turn."""
    steps = (
        lambda c: dataclasses.replace(c, hold_lat=False),
        lambda c: dataclasses.replace(c, k_tile=min(c.k_tile or 64, 64)),
        lambda c: dataclasses.replace(c, num_stages=c.num_stages - 1) if c.num_stages > 1 else c,
        lambda c: dataclasses.replace(c, row_tile=c.row_tile // 2) if c.row_tile > MIN_DOT else c,
        lambda c: dataclasses.replace(c, v_tile=c.v_tile // 2) if c.v_tile > MIN_DOT else c,
        lambda c: dataclasses.replace(c, k_tile=c.k_tile // 2) if c.k_tile > MIN_DOT else c,
    )
    for step in steps:
        while cfg.smem_bytes(rank, dtype) > smem_limit:
            nxt = step(cfg)
            if nxt == cfg:
                break
            cfg = nxt
    return cfg


# Stage 1 kernels.


def _base_index(r0, row_tile: int, v0, v_tile: int, rows: int, slot_stride: int):
    """Index of the base tile [row_tile, v_tile] at draft rows r0.. and columns v0.. (`common.src_row`)."""
    if not slot_stride:
        return (pl.ds(r0, row_tile), pl.ds(v0, v_tile))
    src = src_row(jnp.minimum(r0 + iota(row_tile), rows - 1), slot_stride)
    return (src[:, None], (v0 + iota(v_tile))[None, :])


#: ``keep`` (the fused pick's L2 hint for its ``w2`` loads) -> (policy of the part's last visited tile, policy of
#: the others). "split": the tile loop split before its last tile, no hint (served where the config holds the latent).
KEEP_POLICIES = {None: (None, None), "split": ("evict_normal", None)}


def _keep_segments(keep, v_steps):
    """[(first visit, end visit, eviction policy)] for ``keep`` (`KEEP_POLICIES`) over ``v_steps`` visits."""
    last, rest = KEEP_POLICIES[keep]
    if last == rest:
        return [(0, v_steps, rest)]
    return [(0, v_steps - 1, rest), (v_steps - 1, v_steps, last)]  # v_steps may be traced (`scan_failing`)


@dataclasses.dataclass(frozen=True)
class _Launch:
    """The static facts of one `_fused_kernel` launch besides its config.

    rows, vocab, rank, dtype: the kernel rows (packed or picked where a row map is given), V, r, the dtype.
    slot_stride: 0, or B where base is the whole logits [N*B, V] (`_base_index`).
    has_active: an int32 [rows] active operand follows (the row map, if any, first).
    row_map: an int32 [rows] operand maps kernel rows to base rows; lat_map: to draft rows (base and lat).
    v_steps_full: a run-time split: the flags operand's element 0 set means this many vocab tiles per part.
    reverse, keep: the vocabulary visit order and L2 hint (`full_vocab_pick`).
    counted: the counted launch's parts (0: the plain launch), its counters from ``counter_at``, and
      ``barrier`` (compiled: a CTA barrier before the arrival count, volatile loads after it).
    sample: the sampled pick (`full_vocab_pick`'s ``seeds``): seeds [draft rows] int32 and inv_t [1] float32
      follow the other inputs; the values compared are the keys ``common.sample_key`` (largest, lowest id).
    extras: with ``sample``, the proposal wanted (None, "logprob", "scores"): three more [parts, rows_pad] float32
      outputs (the part winner's score, the running max and sum of ``exp(s * inv_t - max)``), and with "scores"
      the scores [rows, V] in the logits' dtype.
    """

    rows: int
    vocab: int
    rank: int
    dtype: jnp.dtype
    slot_stride: int = 0
    has_active: bool = False
    row_map: bool = False
    lat_map: bool = False
    v_steps_full: int = 0
    reverse: bool = False
    keep: str | None = None
    counted: int = 0
    counter_at: int = 0
    barrier: bool = False
    sample: bool = False
    extras: str | None = None

    @property
    def n_out(self) -> int:
        """The outputs besides the counted launch's: (value, id), then the extras' three and the scores."""
        return 2 + (3 if self.extras else 0) + (self.extras == "scores")


def _fused_kernel(
    base_ref,  # [rows, V] whole array
    lat_ref,  # [rows, r] whole array
    w2_ref,  # [V, r] whole array
    *refs,  # in order: map_ref [rows] int32 (row_map); active_ref [rows] int32 (has_active); flags (v_steps_full);
    #   seeds_ref [draft rows] int32, invt_ref [1] float32 (sample); then mv_ref, mi_ref: [row_tile] blocks of
    #   [parts, rows_pad] (counted: whole arrays, then tok_ref, cnt_ref); extras: ms_ref, mm_ref, ml_ref (blocks
    #   like mv_ref) and sc_ref [rows, V] (whole array, "scores")
    cfg: FullVocabConfig,
    launch: _Launch,
):
    rows, vocab, rank, dtype, slot_stride = launch.rows, launch.vocab, launch.rank, launch.dtype, launch.slot_stride
    has_active, row_map, lat_map, reverse = launch.has_active, launch.row_map, launch.lat_map, launch.reverse
    v_steps_full, counted = launch.v_steps_full, launch.counted
    row_tile, v_tile, v_steps, hold_lat = cfg.row_tile, cfg.v_tile, cfg.v_steps, cfg.hold_lat
    flat, prefetch_base, lazy = cfg.flat, cfg.prefetch_base, cfg.lazy
    k_tile = k_chunk(cfg.k_tile, rank, MIN_DOT)
    refs = list(refs)
    map_ref = refs.pop(0) if row_map else None
    active_ref = refs.pop(0) if has_active else None
    sample, extras = launch.sample, launch.extras
    if sample:  # no v_steps_full with sample: the flags operand is absent
        seeds_ref, invt_ref = refs.pop(0), refs.pop(0)
    if counted:  # the counted launch (`_fused_call`): tokens and counter aliased in and out
        mv_ref, mi_ref, tok_ref, cnt_ref = refs[-4:]
    else:
        mv_ref, mi_ref, *x_refs = refs[-launch.n_out:]
    i, j = pl.program_id(0), pl.program_id(1)
    live = None  # v_steps_full: whether this program's part holds any vocab id
    live_parts = None  # v_steps_full: the parts that hold a vocab id (the counted launch's arrivals per row tile)
    if v_steps_full:  # a run-time split (`scan_failing`): v_steps_full vocab tiles per part when full_ref[0]
        is_full = refs[0][0] != 0
        v_steps = jnp.where(is_full, jnp.int32(v_steps_full), jnp.int32(v_steps))
        live = j * v_steps * v_tile < vocab
        live_parts = (vocab + v_steps * v_tile - 1) // (v_steps * v_tile)
    r0 = i * row_tile
    row_ok = (r0 + iota(row_tile)) < rows
    if row_map:  # the base row each kernel row reads (masked rows: row 0, never used)
        src_rows = plt.load(map_ref.at[r0 + iota(row_tile)], mask=row_ok, other=0)
        if lat_map:  # the map names draft rows: kernel row q reads lat row map[q] and its base row
            lat_rows = src_rows
            src_rows = src_row(lat_rows, slot_stride)
    if sample:  # each kernel row's noise seed (by draft row) and 1 / T, read once
        seed = plt.load(seeds_ref.at[lat_rows if lat_map else r0 + iota(row_tile)], mask=row_ok, other=0)
        inv_t = invt_ref[0]
    n_k = cdiv(rank, k_tile)
    # A masked tail chunk loads with index arrays: never a slice past the end (JAX >= 0.12 refuses one).
    k_tail = rank % k_tile != 0
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
    lat_mask = jnp.broadcast_to(row_ok[:, None], (row_tile, k_tile))

    def v_start(t):  # first column of this part's vocab tile t
        return (j * v_steps + t) * v_tile

    def visit(t):  # the part's t-th visited vocab tile: ascending, or descending with ``reverse``
        return v_steps - 1 - t if reverse else t

    def load_lat(k0):
        if lat_map:  # kernel row q reads lat row map[q] too (`scan_failing`: packed rows, nothing copied)
            kc = k0 + iota(k_tile)
            msk = lat_mask & (kc < rank)[None, :] if k_tail else lat_mask
            return plt.load(lat_ref.at[lat_rows[:, None], kc[None, :]], mask=msk, other=0.0)
        if k_tail:
            kc = k0 + iota(k_tile)
            idx = ((r0 + iota(row_tile))[:, None], kc[None, :])
            return plt.load(lat_ref.at[idx], mask=lat_mask & (kc < rank)[None, :], other=0.0)
        return plt.load(lat_ref.at[pl.ds(r0, row_tile), pl.ds(k0, k_tile)], mask=lat_mask, other=0.0)

    def dot_chunk(acc, v0, k0, x=None, evict=None):  # acc + lat[:, k0:k0+k_tile] @ w2[v0:v0+v_tile, k0:...].T
        x = load_lat(k0) if x is None else x  # [row_tile, k_tile]
        w_mask = jnp.broadcast_to(((v0 + iota(v_tile)) < vocab)[:, None], (v_tile, k_tile))
        if k_tail:
            kc = k0 + iota(k_tile)
            idx = ((v0 + iota(v_tile))[:, None], kc[None, :])
            w = plt.load(w2_ref.at[idx], mask=w_mask & (kc < rank)[None, :], other=0.0, eviction_policy=evict)
        else:  # [v_tile, k_tile]
            w = plt.load(w2_ref.at[pl.ds(v0, v_tile), pl.ds(k0, k_tile)], mask=w_mask, other=0.0,
                         eviction_policy=evict)
        return acc + jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )

    def load_base(v0, valid=True):  # [row_tile, v_tile]; valid=False (traced) reads nothing
        col_ok = (v0 + iota(v_tile)) < vocab
        mask = row_ok[:, None] & col_ok[None, :]
        if valid is not True:
            mask = mask & valid
        if row_map:  # kernel row q reads base row map[q] (in range for every q < rows)
            idx = (src_rows[:, None], (v0 + iota(v_tile))[None, :])
        else:
            idx = _base_index(r0, row_tile, v0, v_tile, rows, slot_stride)
        return plt.load(base_ref.at[idx], mask=mask, other=-jnp.inf if lazy else 0.0)

    def next_base(t):  # the tile visited after visit t, or nothing after the last one
        return load_base(v_start(visit(t + 1)), (t + 1) < v_steps)

    def key_of(s, cols):  # the value compared: the score, or with ``sample`` its key (`common.sample_key`)
        return common.sample_key(s, inv_t, common.gumbel(seed[:, None], cols[None, :])) if sample else s

    def side(s, cols, st):  # extras: the running logsumexp of s * inv_t; "scores": s written once
        if extras is None:
            return st
        if extras == "scores":
            out = (r0 + iota(row_tile))[:, None], cols[None, :]
            plt.store(x_refs[3].at[out], s.astype(x_refs[3].dtype), mask=row_ok[:, None] & (cols < vocab)[None, :])
        return (*st[:3], *common.online_lse(st[3], st[4], s * inv_t, axis=1))

    def epilogue_eager(acc, b, v0, st):  # round, add base, keep each row's best
        cols = v0 + iota(v_tile)
        col_ok = cols < vocab
        s = jnp.where(col_ok[None, :], score(b, acc.astype(dtype), dtype), -jnp.inf)
        key = jnp.where(col_ok[None, :], key_of(s, cols), -jnp.inf) if sample else s
        ids = jnp.where(col_ok, cols, BIG)
        m, k = common.best(key, jnp.broadcast_to(ids[None, :], s.shape), axis=1)
        best, bidx = st[:2]
        take = (m > best) | ((m == best) & (k < bidx))  # `common.merge`
        st = (jnp.where(take, m, best), jnp.where(take, k, bidx), *st[2:])
        if extras:  # the winner's score
            s_k = jnp.max(jnp.where(ids[None, :] == k[:, None], s, -jnp.inf), axis=1)
            st = (*st[:2], jnp.where(take, s_k, st[2]), *st[3:])
        return side(s, cols, st)

    lanes = jax.lax.broadcasted_iota(jnp.int32, (row_tile, v_tile), 1)

    def epilogue_lazy(acc, b, v0, st):  # elementwise: each (row, lane) keeps its best
        # Past-V columns: b = -inf (masked load) and acc = 0 -> s = -inf never beats best.
        s = (b.astype(jnp.float32) + acc.astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
        best, bidx = st[:2]
        if sample:
            s = jnp.where(s == s, s, -jnp.inf)  # NaN ranks as -inf; keys are never NaN
            key = key_of(s, v0 + iota(v_tile))
        else:
            key = s
        if reverse:  # tiles visited from the highest ids down: the last equal score seen has the lowest id
            key = jnp.where(key == key, key, -jnp.inf)  # NaN ranks as -inf (ascending order gets this from `>`)
            better = key >= best
        else:
            better = key > best
        st = (jnp.where(better, key, best), jnp.where(better, v0 + lanes, bidx), *st[2:])
        if extras:
            st = (*st[:2], jnp.where(better, s, st[2]), *st[3:])
            return side(s, v0 + iota(v_tile), st)
        return st

    def part():  # this program's part: each row's best (score or key, lowest id) over its vocab tiles
        zeros = jnp.zeros((row_tile, v_tile), jnp.float32)
        if lazy:
            epilogue = epilogue_lazy
            init = (jnp.full((row_tile, v_tile), -jnp.inf, jnp.float32), v_start(0) + lanes)
        else:
            epilogue = epilogue_eager
            init = (jnp.full((row_tile,), -jnp.inf, jnp.float32), jnp.full((row_tile,), BIG, jnp.int32))
        if extras:  # the winner's score (like best), the running max and sum of exp (per row)
            init = (*init, init[0], jnp.full((row_tile,), -jnp.inf, jnp.float32), jnp.zeros((row_tile,), jnp.float32))
        # The carried base tile (prefetch_base) or an unused stand-in.
        b0 = load_base(v_start(visit(0))) if prefetch_base else jnp.zeros((), jnp.int32)

        if flat:
            # t -> (vocab tile t // n_k, rank chunk t % n_k): a shift and a mask when n_k is a power of two.
            shift = n_k.bit_length() - 1

            def flat_step(t, carry, evict=None):
                acc, st, b = carry
                if n_k & (n_k - 1) == 0:
                    vt, kk = t >> shift, t & (n_k - 1)
                else:
                    vt, kk = jax.lax.div(t, jnp.int32(n_k)), jax.lax.rem(t, jnp.int32(n_k))
                v0 = v_start(visit(vt))
                acc = dot_chunk(acc, v0, kk * k_tile, evict=evict)

                def finish(ops):
                    acc, st, b = ops
                    st = epilogue(acc, b if prefetch_base else load_base(v0), v0, st)
                    return zeros, st, next_base(vt) if prefetch_base else b

                if n_k == 1:
                    return finish((acc, st, b))
                return jax.lax.cond(kk == n_k - 1, finish, lambda ops: ops, (acc, st, b))

            carry = (zeros, init, b0)
            for lo, hi, evict in _keep_segments(launch.keep, v_steps):  # the visits sharing one eviction policy
                carry = jax.lax.fori_loop(lo * n_k, hi * n_k, functools.partial(flat_step, evict=evict), carry)
            _, st, _ = carry
        else:
            # hold_lat: the latent tile is loop-invariant, load it once (n_k chunks of [row_tile, k_tile]).
            held = [load_lat(kk * k_tile) for kk in range(n_k)] if hold_lat else None

            def step(t, carry, evict=None):
                st, b = carry
                v0 = v_start(visit(t))
                b_next = next_base(t) if prefetch_base else b  # issued before the dots
                acc = zeros
                if hold_lat:
                    for kk in range(n_k):
                        acc = dot_chunk(acc, v0, kk * k_tile, held[kk], evict=evict)
                elif n_k == 1:
                    acc = dot_chunk(acc, v0, 0, evict=evict)
                else:
                    acc = jax.lax.fori_loop(0, n_k, lambda kk, a: dot_chunk(a, v0, kk * k_tile, evict=evict), acc)
                st = epilogue(acc, b if prefetch_base else load_base(v0), v0, st)
                return st, b_next

            carry = (init, b0)
            for lo, hi, evict in _keep_segments(launch.keep, v_steps):
                carry = jax.lax.fori_loop(lo, hi, functools.partial(step, evict=evict), carry)
            st, _ = carry
        if lazy:  # one reduction over the lanes per part (lanes hold distinct ids)
            best, bidx = common.best(st[0], st[1], axis=1)
            if extras:
                s_k = jnp.max(jnp.where(st[1] == bidx[:, None], st[2], -jnp.inf), axis=1)
                return best, bidx, s_k, *st[3:]
            return best, bidx
        return st

    if counted:
        # Only row tiles with an active row (and, with v_steps_full, live parts) store their part's winners and
        # count their arrival; the last to arrive writes the tile's tokens (`_combine_if_last`). Other tiles
        # keep the tokens aliased in. With a row map the tokens go to the draft rows the map names.
        act = plt.load(active_ref.at[r0 + iota(row_tile)], mask=row_ok, other=0)
        go = jnp.max((act != 0).astype(jnp.int32)) > 0

        @pl.when(go if live is None else go & live)
        def _():
            best, bidx = part()
            mv_ref[j, pl.ds(r0, row_tile)] = best
            mi_ref[j, pl.ds(r0, row_tile)] = bidx
            # Lanes past the rows go past the tokens' end, so no two lanes name one row (interpret mode's masked
            # scatter writes the old value back on masked lanes).
            out_rows = jnp.where(row_ok, lat_rows, rows + iota(row_tile)) if row_map else None
            _combine_if_last(mv_ref, mi_ref, tok_ref, cnt_ref, i, r0, (act != 0) & row_ok, parts=counted,
                             row_tile=row_tile, counter_at=launch.counter_at, barrier=launch.barrier,
                             live_parts=live_parts, out_rows=out_rows)
        return
    if not has_active:
        best, bidx, *more = part()
        for ref, x in zip(x_refs, more):  # extras: the winner's score, the running max and sum
            ref[...] = x
    else:
        # Row tiles without an active row read nothing and write the "no winner" partials (-inf, BIG).
        act = plt.load(active_ref.at[r0 + iota(row_tile)], mask=row_ok, other=0)
        none = (jnp.full((row_tile,), -jnp.inf, jnp.float32), jnp.full((row_tile,), BIG, jnp.int32))
        go = jnp.max((act != 0).astype(jnp.int32)) > 0
        best, bidx = jax.lax.cond(go if live is None else go & live, part, lambda: none)
    mv_ref[...] = best
    mi_ref[...] = bidx


def _combine_if_last(mv_ref, mi_ref, tok_ref, cnt_ref, i, r0, write, *, parts: int, row_tile: int, counter_at: int,
                     barrier: bool, live_parts=None, out_rows=None):
    """The counted launch's end of program (i, j), after it stored its part's winners: count the arrival on
    ``cnt[counter_at + i]``; the last to arrive (of ``parts`` or ``live_parts``) reduces the tile's parts, writes
    the rows in ``write`` (to ``out_rows`` where given) and zeroes the counter. It sees every part: each program's
    stores precede a CTA barrier and its acquire-release atomic increment, and the last program's loads are
    volatile."""
    if barrier:
        plt.debug_barrier()
    old = plt.atomic_add(cnt_ref, (counter_at + i,), jnp.int32(1))

    @pl.when(old == (parts if live_parts is None else live_parts) - 1)
    def _():
        rix = r0 + iota(row_tile)

        def load(p0, p, ok):
            if live_parts is not None:
                ok = ok & (p < live_parts)[:, None]
            idx = (p[:, None], rix[None, :])
            return (plt.load(mv_ref.at[idx], mask=ok, other=-jnp.inf, volatile=barrier),
                    plt.load(mi_ref.at[idx], mask=ok, other=BIG, volatile=barrier))

        bidx = _reduce_parts(load, parts=parts, part_tile=min(next_pow2(parts), max(1, 8192 // row_tile)),
                             row_tile=row_tile)
        plt.store(tok_ref.at[rix if out_rows is None else out_rows], bidx, mask=write)
        cnt_ref[counter_at + i] = jnp.int32(0)


# Stage 2: reduce the parts.


def _reduce_parts(load, *, parts: int, part_tile: int, row_tile: int):
    """In a kernel: the winning ids [row_tile] over ``parts`` parts, ``part_tile`` per step. ``load(p0, p, ok)``
    returns the (value, id) tiles [part_tile, row_tile] of parts ``p = p0 + iota(part_tile)`` (``ok``: p < parts;
    ``p0`` a Python int where one step covers every part)."""
    shape = (part_tile, row_tile)

    def step(t, carry):
        p0 = t * part_tile
        p = p0 + iota(part_tile)
        ok = jnp.broadcast_to((p < parts)[:, None], shape)
        v, ix = load(p0, p, ok)
        m, k = common.best(jnp.where(ok, v, -jnp.inf), jnp.where(ok, ix, BIG), axis=0)
        return common.merge(*carry, m, k)

    init = (jnp.full((row_tile,), -jnp.inf, jnp.float32), jnp.full((row_tile,), BIG, jnp.int32))
    n_t = cdiv(parts, part_tile)
    return (step(0, init) if n_t == 1 else jax.lax.fori_loop(0, n_t, step, init))[1]


def _combine_kernel(
    mv_ref,  # [parts, rows_pad] float32, whole array
    mi_ref,  # [parts, rows_pad] int32, whole array
    *refs,  # act_ref, fb_ref [rows] int32 whole arrays (fallback only); o_ref [row_tile] block of [rows_pad] int32
    parts: int,
    row_tile: int,
    part_tile: int,
    fallback_rows: int = 0,
):
    o_ref = refs[-1]
    r0 = pl.program_id(0) * row_tile
    rix = r0 + iota(row_tile)

    def load(p0, _, ok):
        if isinstance(p0, int) and p0 + part_tile > parts:
            # A static slice past the end: JAX >= 0.12 refuses it, so index with arrays (the same addresses).
            idx = ((p0 + iota(part_tile))[:, None], rix[None, :])
        else:
            idx = (pl.ds(p0, part_tile), pl.ds(r0, row_tile))
        return plt.load(mv_ref.at[idx], mask=ok, other=-jnp.inf), plt.load(mi_ref.at[idx], mask=ok, other=BIG)

    bidx = _reduce_parts(load, parts=parts, part_tile=part_tile, row_tile=row_tile)
    if fallback_rows:  # inactive rows take the caller's token
        rok = rix < fallback_rows
        act = plt.load(refs[0].at[rix], mask=rok, other=1)
        fb = plt.load(refs[1].at[rix], mask=rok, other=BIG)
        bidx = jnp.where(act != 0, bidx, fb)
    o_ref[...] = bidx


def _combine_row_tile(rows_pad: int) -> int:
    """Up to 128 rows per program, but at least 8 programs where 16-row tiles allow it (latency-bound).
    H200: python -m benchmarks.bench_refine --n 16 --topc 0 --backends pallas@certified"""
    t = 1
    while t < 128 and rows_pad % (2 * t) == 0 and (t < 16 or rows_pad // (2 * t) >= 8):
        t *= 2
    return t


def combine_partials(mv: jax.Array, mi: jax.Array, *, interpret: bool = False, active: jax.Array | None = None,
                     fallback: jax.Array | None = None) -> jax.Array:
    """[parts, rows_pad] float32 best values + int32 ids -> [rows_pad] int32 winners. ``active``, ``fallback``
    ([rows <= rows_pad], both or neither): row q gets ``fallback[q]`` where ``active[q]`` is false."""
    parts, rows_pad = mv.shape
    operands, fallback_rows = (mv, mi), None
    if (active is None) != (fallback is None):
        raise ValueError("combine_partials: give both active and fallback, or neither")
    if active is not None:
        n = active.shape[0]
        if fallback.shape != (n,) or n > rows_pad:
            raise ValueError(f"combine_partials: active {active.shape} and fallback {fallback.shape} must be "
                             f"[rows <= {rows_pad}]")
        if parts == 1:
            return jnp.concatenate([jnp.where(active, mi[0, :n], fallback.astype(jnp.int32)), mi[0, n:]])
        operands = (mv, mi, active.astype(jnp.int32), fallback.astype(jnp.int32))
        fallback_rows = n
    call = _combine_call(parts, rows_pad, interpret=interpret, fallback_rows=fallback_rows)
    return mi[0] if call is None else common.pallas_call(**call)(*operands)


def _combine_call(parts: int, rows_pad: int, *, interpret: bool, fallback_rows: int | None = None) -> dict | None:
    """The `common.pallas_call` arguments of the combine launch on (value, id) [parts, rows_pad] (with
    ``fallback_rows``, also on that many active and fallback rows: `combine_partials`), which the caller calls with
    them; None for one part (its ids win)."""
    if parts == 1:
        return None
    row_tile = _combine_row_tile(rows_pad)
    # Up to 16K partials per load: few sequential steps even for ~2K parts (N=1, 64-wide tiles).
    part_tile = min(next_pow2(parts), max(1, 16384 // row_tile))
    extra = {} if fallback_rows is None else dict(fallback_rows=fallback_rows)
    return dict(
        kernel=functools.partial(_combine_kernel, parts=parts, row_tile=row_tile, part_tile=part_tile, **extra),
        name="xpress_pick_combine", num_warps=8 if part_tile * row_tile >= 8192 else 4, interpret=interpret,
        grid=(rows_pad // row_tile,), in_specs=[pl.no_block_spec] * (2 if fallback_rows is None else 4),
        out_specs=pl.BlockSpec((row_tile,), lambda i: (i,)), out_shape=jax.ShapeDtypeStruct((rows_pad,), jnp.int32),
    )


# Wrappers.


def _check_inputs(base, lat, w2, slot_stride: int, who: str):
    """The shape and dtype checks of every fused-pick wrapper; returns the dtype."""
    if slot_stride and (slot_stride < 2 or base.ndim != 2 or base.shape[0] % slot_stride):
        raise ValueError(f"slot_stride={slot_stride} needs base [N*B, V] with B={slot_stride}; got {base.shape}")
    if base.ndim != 2 or lat.ndim != 2 or w2.ndim != 2:
        raise ValueError(f"need base [rows,V], lat [rows,r], w2 [V,r]; got {base.shape=} {lat.shape=} {w2.shape=}")
    rows = base.shape[0] // slot_stride * (slot_stride - 1) if slot_stride else base.shape[0]  # the draft rows
    if lat.shape[0] != rows or w2.shape != (base.shape[1], lat.shape[1]):
        raise ValueError(f"shapes disagree: {base.shape=} {lat.shape=} {w2.shape=}")
    if not (base.dtype == lat.dtype == w2.dtype):
        raise ValueError(f"dtypes must agree: {base.dtype=} {lat.dtype=} {w2.dtype=}")
    dtype = jnp.dtype(base.dtype)
    if dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{who}: dtype {dtype.name} is not supported (bf16, f16, f32); "
                        "xpress_jax routes float64 to xpress_jax.reference.full_vocab_pick")
    return dtype


def _fused_call(n: int, cfg: FullVocabConfig, launch: _Launch, *, interpret: bool, parts: int | None = None,
                counted=()) -> dict:
    """The `common.pallas_call` arguments of one `_fused_kernel` launch on ``n`` operands, which the wrapper calls
    with the operands and ``counted``: the [parts, rows_pad] float32 best values and int32 ids. ``counted``: the
    counted pick's (tokens, counter) (`full_vocab_pick`'s ``counter``, `scan_failing`), aliased in and out and
    returned after them; the last program of each row tile combines its parts (`_combine_if_last`). ``launch.extras``:
    three more float32 [parts, rows_pad] outputs, and with "scores" the scores [rows, V] (`_Launch`)."""
    parts = cdiv(launch.vocab, cfg.v_tile * cfg.v_steps) if parts is None else parts
    row_tiles = cdiv(launch.rows, cfg.row_tile)
    shape = (parts, row_tiles * cfg.row_tile)
    more = ()
    if counted:
        launch = dataclasses.replace(launch, has_active=True, counted=parts, barrier=not interpret)
        out_specs = (pl.no_block_spec,) * 4
        more = tuple(jax.ShapeDtypeStruct(a.shape, jnp.int32) for a in counted)
    else:
        out_specs = (pl.BlockSpec((None, cfg.row_tile), lambda i, j: (j, i)),) * (2 + 3 * bool(launch.extras))
        if launch.extras:
            more = (jax.ShapeDtypeStruct(shape, jnp.float32),) * 3
        if launch.extras == "scores":
            out_specs = (*out_specs, pl.no_block_spec)
            more = (*more, jax.ShapeDtypeStruct((launch.rows, launch.vocab), launch.dtype))
    return dict(
        kernel=functools.partial(_fused_kernel, cfg=cfg, launch=launch),
        name="xpress_full_vocab_counted" if counted else
        ("xpress_full_vocab_sample" if launch.sample else "xpress_full_vocab_fused"),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret, grid=(row_tiles, parts),
        in_specs=[pl.no_block_spec] * (n + len(counted)), out_specs=out_specs,
        out_shape=(jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32), *more),
        input_output_aliases={n: 2, n + 1: 3} if counted else {},
    )


@functools.partial(jax.jit, static_argnames=("interpret", "config", "slot_stride", "partials", "capacity", "reverse",
                                             "keep", "counter_at", "proposal"))
def full_vocab_pick(
    base: jax.Array,
    lat: jax.Array,
    w2: jax.Array,
    *,
    interpret: bool = False,
    config: FullVocabConfig | None = None,
    slot_stride: int = 0,
    partials: bool = False,
    active: jax.Array | None = None,
    capacity: int | None = None,
    fallback: jax.Array | None = None,
    reverse: bool = False,
    row_ids: jax.Array | None = None,
    keep: str | None = None,
    counter: jax.Array | None = None,
    counter_at: int = 0,
    seeds: jax.Array | None = None,
    inv_t: jax.Array | None = None,
    proposal: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """[rows,V], [rows,r], [V,r] -> [rows] int32: argmax_v float(dtype(base + dtype(lat @ w2.T))).

    Lowest vocab id on ties, NaN as -inf. ``config`` default: `default_config`. Float64 raises ``TypeError``. An
    option never changes a computed row's result.
    ``slot_stride=B``: ``base`` is the whole logits [N*B, V] (`common.src_row`).
    ``partials=True``: stage 1's per-part winners ``(score [parts, rows] float32, id [parts, rows] int32)``.
    ``active`` ([rows] bool or int, a device value): only these rows are wanted; a row tile without one reads
    nothing and writes "no winner" partials (-inf, `BIG`).
    ``capacity`` (static int, with ``active``, without ``partials``): the active rows packed to the front, the
    kernel runs on the first ``capacity`` of them; active rows beyond read ``BIG``.
    ``fallback`` ([rows] int, with ``active``, without ``capacity`` and ``partials``): inactive rows return it.
    ``reverse`` (static): each program visits its tiles from the highest ids down. ``keep`` (static, a key of
    `KEEP_POLICIES`): the L2 hints / loop split on the ``w2`` loads.
    ``row_ids`` ([M] int32 in [0, rows)): pick only these rows, in this order (``active`` then by position).
    ``counter`` (int32 [k], with ``active`` and ``fallback``, without ``capacity``, ``partials``, ``row_ids``;
    entries ``counter_at`` .. ``counter_at + row tiles - 1`` zero, and zero again after): one launch returning
    ``(tokens, counter)`` (`_fused_call`) that writes nothing where no row is active.
    ``seeds`` ([rows] int32, by draft row = lat row), ``inv_t`` (float32 scalar, 1 / T; 0 = greedy): the sampled
    pick, the largest ``common.sample_key(s, inv_t, common.gumbel(seeds[row], id))``, lowest id on ties (with
    ``row_ids``, ``reverse``, ``keep``, ``partials``: the keys; not with ``active``, ``capacity``, ``fallback``,
    ``counter``). ``proposal`` ("logprob" / "scores", with ``seeds``, without ``partials``): returns ``(tokens,
    (token_score [rows] float32: the winner's s, lse [rows] float32: logsumexp(s * inv_t) over V, +inf where
    inv_t is 0, scores [rows, V] in the logits' dtype or None))``, the scores written once by the pick."""
    dtype = _check_inputs(base, lat, w2, slot_stride, "full-vocab pick kernel")
    vocab = base.shape[1]
    rows, rank = lat.shape
    if seeds is not None or inv_t is not None or proposal is not None:
        for name, v in (("active", active), ("capacity", capacity), ("fallback", fallback), ("counter", counter)):
            if v is not None:
                raise ValueError(f"{name} is for the greedy pick (the certified mode); the sampled pick (seeds) "
                                 f"goes without it")
        return _sample(base, lat, w2, seeds, inv_t, proposal, config=config, interpret=interpret,
                       slot_stride=slot_stride, partials=partials, reverse=reverse, row_ids=row_ids, keep=keep)
    n_act = rows if row_ids is None else row_ids.shape[0]  # active is by kernel row: row_ids' positions
    if active is not None and (active.shape != (n_act,) or not (active.dtype == jnp.bool_
                                                                  or jnp.issubdtype(active.dtype, jnp.integer))):
        raise ValueError(f"active must be [{'rows' if row_ids is None else 'row_ids'}={n_act}] bool or int; "
                         f"got {active.shape} {active.dtype}")
    if capacity is not None:
        if active is None or partials:
            raise ValueError("capacity needs active (the rows to compute) and goes without partials")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    if fallback is not None and (active is None or capacity is not None or partials or fallback.shape != (rows,)
                                 or not jnp.issubdtype(fallback.dtype, jnp.integer)):
        raise ValueError(f"fallback must be [rows={rows}] int, with active and without capacity or partials; "
                         f"got {fallback.shape} {fallback.dtype}")
    if counter is not None:
        if fallback is None or row_ids is not None:
            raise ValueError("counter needs active and fallback, and goes without capacity, partials and row_ids")
        cfg = config or default_config(rows, vocab, rank, dtype)
        cfg.check_shape(rows, vocab, rank, dtype)
        tiles = cdiv(rows, cfg.row_tile)
        if (counter.ndim != 1 or counter.dtype != jnp.int32 or isinstance(counter_at, bool)
                or not isinstance(counter_at, int) or counter_at < 0 or counter.shape[0] < counter_at + tiles):
            raise ValueError(f"counter must be int32 [k >= counter_at + row tiles = {counter_at} + {tiles}]; got "
                             f"{counter.shape} {counter.dtype}, counter_at={counter_at!r}")
        act = active if active.dtype == jnp.int32 else (active != 0).astype(jnp.int32)
        launch = _Launch(rows, vocab, rank, dtype, slot_stride, reverse=reverse, keep=keep, counter_at=counter_at)
        counted = (fallback.astype(jnp.int32), counter)
        return tuple(common.pallas_call(**_fused_call(4, cfg, launch, interpret=interpret, counted=counted))(
            base, lat, w2, act, *counted)[2:])
    if row_ids is not None:
        if (capacity is not None or fallback is not None or row_ids.ndim != 1 or row_ids.shape[0] < 1
                or row_ids.dtype != jnp.int32):
            raise ValueError(f"row_ids must be [M >= 1] int32 (without capacity and fallback); got "
                             f"{row_ids.shape} {row_ids.dtype}")
        cfg = config or default_config(rows, vocab, rank, dtype)
        cap = row_ids.shape[0]
        cfg.check_shape(cap, vocab, rank, dtype)
        operands = (base, lat, w2, row_ids)
        if active is not None:
            operands = (*operands, active if active.dtype == jnp.int32 else (active != 0).astype(jnp.int32))
        launch = _Launch(cap, vocab, rank, dtype, slot_stride, has_active=active is not None, row_map=True,
                         lat_map=True, reverse=reverse, keep=keep)
        mv, mi = common.pallas_call(**_fused_call(len(operands), cfg, launch, interpret=interpret))(*operands)
        if partials:
            return mv[:, :cap], mi[:, :cap]
        call = _combine_call(*mv.shape, interpret=interpret)  # the parts' winners (`combine_partials`)
        return (mi[0] if call is None else common.pallas_call(**call)(mv, mi))[:cap]
    cap = rows if capacity is None else min(capacity, rows)  # the rows the kernel runs on
    cfg = config or default_config(cap, vocab, rank, dtype)
    cfg.check_shape(cap, vocab, rank, dtype)
    row_tiles = cdiv(cap, cfg.row_tile)
    operands = (base, lat, w2)
    extra = {}
    pos = None  # packed: original row q's result is packed row pos[q]
    if active is not None:
        act = active  # int32 (nonzero: active) goes to the kernel as it is: no XLA op in between
        if capacity is not None and (cap < rows or row_tiles > 1):  # one tile of all rows: nothing to pack
            pos, src, lat_p, act = _pack_rows(active != 0, lat, slot_stride)
            operands = (base, lat_p[:cap], w2, src[:cap])
            act = act[:cap]
            extra["row_map"] = True
        operands = (*operands, act if act.dtype == jnp.int32 else (act != 0).astype(jnp.int32))
        extra["has_active"] = True
    launch = _Launch(cap, vocab, rank, dtype, slot_stride, reverse=reverse, keep=keep, **extra)
    mv, mi = common.pallas_call(**_fused_call(len(operands), cfg, launch, interpret=interpret))(*operands)
    if partials:
        return mv[:, :cap], mi[:, :cap]
    if fallback is not None:
        return combine_partials(mv, mi, interpret=interpret, active=active, fallback=fallback)[:rows]
    call = _combine_call(*mv.shape, interpret=interpret)  # the parts' winners (`combine_partials`)
    tok = (mi[0] if call is None else common.pallas_call(**call)(mv, mi))[:cap]
    return tok if pos is None else jnp.where(pos < cap, tok[jnp.minimum(pos, cap - 1)], BIG)


def _sample(base, lat, w2, seeds, inv_t, proposal, *, config, interpret, slot_stride, partials, reverse, row_ids,
            keep):
    """`full_vocab_pick` with ``seeds`` (its docstring): one launch, then the parts combined (the keys by the
    stage-2 kernel; the extras' winner score and logsumexp in XLA)."""
    dtype = jnp.dtype(base.dtype)
    vocab = base.shape[1]
    rows, rank = lat.shape
    common.check_noise(seeds, inv_t, proposal, rows, "draft row")
    if proposal is not None and partials:
        raise ValueError("proposal goes without partials (the extras need the parts combined)")
    inv_t = jnp.reshape(jnp.asarray(inv_t), (1,)).astype(jnp.float32)
    operands = (base, lat, w2)
    extra = {}
    cap = rows
    if row_ids is not None:
        if row_ids.ndim != 1 or row_ids.shape[0] < 1 or row_ids.dtype != jnp.int32:
            raise ValueError(f"row_ids must be [M >= 1] int32; got {row_ids.shape} {row_ids.dtype}")
        cap = row_ids.shape[0]
        operands = (*operands, row_ids)
        extra = dict(row_map=True, lat_map=True)
    cfg = config or default_config(cap, vocab, rank, dtype)
    cfg.check_shape(cap, vocab, rank, dtype)
    launch = _Launch(cap, vocab, rank, dtype, slot_stride, reverse=reverse, keep=keep, sample=True, extras=proposal,
                     **extra)
    operands = (*operands, seeds.astype(jnp.int32), inv_t)
    out = common.pallas_call(**_fused_call(len(operands), cfg, launch, interpret=interpret))(*operands)
    mv, mi = out[:2]
    if partials:
        return mv[:, :cap], mi[:, :cap]
    call = _combine_call(*mv.shape, interpret=interpret)  # the parts' winners (`combine_partials`)
    tok = (mi[0] if call is None else common.pallas_call(**call)(mv, mi))[:cap]
    if proposal is None:
        return tok
    ms, mm, ml = (x[:, :cap] for x in out[2:5])
    token_score = jnp.max(jnp.where(mi[:, :cap] == tok[None, :], ms, -jnp.inf), axis=0)  # the winner's part
    return tok, (token_score, common.finish_lse(mm, ml, inv_t[0]), out[5] if proposal == "scores" else None)


# The certified mode's scan of its failing rows: pack, one pick in packed order, combine back.


def _pack_kernel(fail_ref, fallen_ref, pos_ref, src_ref, actp_ref, act_ref, flag_ref, *cnt_ref, rows: int, limit: int,
                 skip_slots: int = 0, slots: int = 1):
    """One program over every row: the rows to scan first (`pack_active`); ``cnt_ref`` (``counters``) zeroed."""
    n_pad = src_ref.shape[0]
    q = iota(n_pad)
    rok = q < rows
    f = (plt.load(fail_ref.at[q], mask=rok, other=0) != 0) & rok
    n_fail = jnp.sum(f.astype(jnp.int32))
    full = (fallen_ref[0] != 0) | (n_fail > limit)
    a = (f | full) & rok
    if skip_slots:
        a = a & (jax.lax.rem(q, jnp.int32(slots)) >= skip_slots)
    ai = a.astype(jnp.int32)
    n_act = jnp.sum(ai)
    # Active rows first in row order, then the others (padding last): a permutation of 0..n_pad-1.
    pos = jnp.where(a, jnp.cumsum(ai) - 1, n_act + jnp.cumsum(1 - ai) - 1)
    plt.store(pos_ref.at[q], pos, mask=rok)
    plt.store(src_ref.at[pos], q)  # every slot written once
    actp_ref[...] = (q < n_act).astype(jnp.int32)
    plt.store(act_ref.at[q], ai, mask=rok)
    flag_ref[...] = common.flags_row(full, n_fail)
    if cnt_ref:
        cnt_ref[0][...] = jnp.zeros(cnt_ref[0].shape, jnp.int32)


def pack_active(fail: jax.Array, fallen: jax.Array, *, limit: int, interpret: bool = False, skip_slots: int = 0,
                slots: int = 1, counters: int = 0):
    """[rows] ``fail`` (nonzero: failed), a flag ``fallen`` -> the certified mode's rows to scan, in one launch.

    ``full = fallen | (sum(fail) > limit)``; the active rows are ``act = fail | full``, except rows ``q`` with
    ``q % slots < skip_slots`` (final draft slots, still counted in ``sum(fail)``). Returns int32 ``(pos [rows],
    src [n_pad], act_p [n_pad], act [rows], flags [8])``, ``n_pad = next_pow2(rows)``: row q's packed position
    (active rows first, in order), the row at each position, ``p < #active``, ``act``, [full, sum(fail), 0, ...].
    ``counters`` (static int >= 0): a sixth output, int32 zeros [next_pow2(counters)] (the row-tile counters)."""
    rows = fail.shape[0]
    if fail.ndim != 1:
        raise ValueError(f"pack_active: need fail [rows]; got {fail.shape}")
    fallen = common.flag_operand(fallen, "fallen")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"pack_active: limit must be an int >= 0, got {limit!r}")
    if skip_slots and not 0 < skip_slots < slots:
        raise ValueError(f"pack_active: skip_slots must lie in [0, slots={slots}), got {skip_slots!r}")
    n_pad = next_pow2(rows)
    if n_pad > 2 ** 20:
        raise ValueError(f"pack_active: {rows} rows are more than one program holds (2^20)")
    if isinstance(counters, bool) or not isinstance(counters, int) or counters < 0:
        raise ValueError(f"pack_active: counters must be an int >= 0, got {counters!r}")
    by_row, padded = jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((n_pad,), jnp.int32)
    shapes = (by_row, padded, padded, by_row, jax.ShapeDtypeStruct((8,), jnp.int32))
    if counters:
        shapes = (*shapes, jax.ShapeDtypeStruct((next_pow2(counters),), jnp.int32))
    return tuple(common.pallas_call(
        functools.partial(_pack_kernel, rows=rows, limit=int(limit), skip_slots=int(skip_slots), slots=int(slots)),
        name="xpress_pack_active", num_warps=4 if n_pad <= 1024 else 8, interpret=interpret, grid=(1,),
        in_specs=[pl.no_block_spec] * 2, out_specs=(pl.no_block_spec,) * len(shapes), out_shape=shapes,
    )(fail if fail.dtype == jnp.int32 else fail.astype(jnp.int32), fallen))


@functools.partial(jax.jit, static_argnames=("interpret", "config", "slot_stride", "limit", "v_steps_full",
                                             "skip_slots"))
def scan_failing(base: jax.Array, lat: jax.Array, w2: jax.Array, fail: jax.Array, fallen: jax.Array,
                 fallback: jax.Array, *, limit: int, interpret: bool = False, config: FullVocabConfig | None = None,
                 slot_stride: int = 0, v_steps_full: int | None = None, skip_slots: int = 0):
    """The certified mode's scan of the rows its bound did not certify: two launches, no XLA op.

    `pack_active` orders the rows ``fail | full`` first, then a counted pick runs on every row in that order through
    the packed index map: a row tile without an active row returns at once, and the last program of a tile writes
    its active rows' tokens (``fallback`` aliased in as the tokens). Returns ``(tokens [rows] int32, flags [8])``;
    an active row's token is `full_vocab_pick`'s. ``v_steps_full`` (static): the vocab tiles per part when the pass
    is full, read at run time. ``skip_slots`` (static, with ``slot_stride``): draft slots never scanned."""
    dtype = _check_inputs(base, lat, w2, slot_stride, "scan_failing")
    vocab = base.shape[1]
    rows, rank = lat.shape
    for name, a in (("fail", fail), ("fallback", fallback)):
        if a.shape != (rows,):
            raise ValueError(f"scan_failing: {name} must be [rows={rows}], got {a.shape}")
    if skip_slots and not slot_stride:
        raise ValueError("scan_failing: skip_slots needs slot_stride (the draft rows per block)")
    cfg = config or default_config(rows, vocab, rank, dtype)
    cfg.check_shape(rows, vocab, rank, dtype)
    _, src, act_p, _, flags, counters = pack_active(fail, fallen, limit=limit, interpret=interpret,
                                                    skip_slots=skip_slots, slots=max(slot_stride - 1, 1),
                                                    counters=cdiv(rows, cfg.row_tile))
    vs_full = cfg.v_steps if v_steps_full is None else int(v_steps_full)
    if vs_full < 1:
        raise ValueError(f"scan_failing: v_steps_full must be >= 1, got {v_steps_full!r}")
    if vs_full == cfg.v_steps:
        vs_full = 0  # one split: static
    parts = cdiv(vocab, cfg.v_tile * min(cfg.v_steps, vs_full or cfg.v_steps))  # the finer split's parts
    # The kernel reads rows < `rows` of src and act_p ([n_pad]) and element 0 of flags (the pass's full).
    operands = (base, lat, w2, src, act_p, *((flags,) if vs_full else ()))
    launch = _Launch(rows, vocab, rank, dtype, slot_stride, row_map=True, lat_map=True, v_steps_full=vs_full)
    counted = (fallback.astype(jnp.int32), counters)
    tok = common.pallas_call(**_fused_call(len(operands), cfg, launch, interpret=interpret, parts=parts,
                                           counted=counted))(*operands, *counted)[2]
    return tok, flags


def _pack_rows(act: jax.Array, lat: jax.Array, slot_stride: int):
    """Active rows first, in order: (row q's packed position, the base row each packed row reads, lat in packed
    order, packed active mask), each [rows]."""
    rows = act.shape[0]
    # The mask is materialised first: fused into the cumsum, XLA:GPU recomputes it for every prefix element.
    a = jax.lax.optimization_barrier(act.astype(jnp.int32))
    n = jnp.sum(a)
    pos = jnp.where(act, jnp.cumsum(a) - 1, n + jnp.cumsum(1 - a) - 1).astype(jnp.int32)
    perm = jnp.zeros((rows,), jnp.int32).at[pos].set(jnp.arange(rows, dtype=jnp.int32), unique_indices=True)
    src = src_row(perm, slot_stride)
    return pos, src.astype(jnp.int32), lat[perm], jnp.arange(rows, dtype=jnp.int32) < n
