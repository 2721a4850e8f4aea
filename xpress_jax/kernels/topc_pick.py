"""Top-C pick: the best of each row's C candidates, ``s = float(dtype(base_c + dtype(w2[cand] . lat)))``.

The spec is `xpress_jax.reference.topc_pick` on `xpress_jax.reference.topc_gather` (w2, cand): among equal scores
the **larger base logit**, then the **lowest vocab id** (vLLM's rule); ``ties="id"`` breaks them by the lowest id
alone (the full-vocabulary rule, for the certified mode).

Kernel: grid ``(rows, splits)``. Program (n, j) gathers its candidates' w2 rows straight from ``w2``, loops over
``c_steps`` tiles of ``c_tile`` candidates (the tail of C masked), computes each bias as a float32
multiply-and-sum over the rank in ``k_tile`` chunks (no tensor cores) and keeps the best (score, base logit, id);
`combine_splits` reduces the splits. The bias sums in another order than XLA's einsum, so tokens differ from the
reference only near rounding boundaries. Float64 is refused (``TypeError``).

The sampled pick (``seeds``, ``inv_t``; `xpress_jax.reference.topc_sample`) applies the rule to the candidates'
keys ``common.sample_key(s, inv_t, common.gumbel(seed, id))``; with a proposal each split also returns its winner's
score and running logsumexp, and the candidates' scores are written once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import common
from .common import plt, BIG, best3, cdiv, iota, k_chunk, merge3, next_pow2, score

__all__ = ["TopCConfig", "TIES", "default_config", "topc_pick", "combine_splits", "certify", "CERTIFY_SINGLE_ROWS"]


@dataclasses.dataclass(frozen=True)
class TopCConfig:
    """Static block sizes of the top-C pick (hashable: a jit static arg).

    c_tile: candidates per step (power of two). c_steps: steps per program; splits = cdiv(C, c_tile * c_steps)
      programs per row. k_tile: rank chunk per step (power of two; 0 = the whole rank; `k_chunk`).
    """

    c_tile: int = 64
    c_steps: int = 8
    k_tile: int = 0
    num_warps: int = 4
    num_stages: int = 1

    def check(self) -> None:
        if self.c_tile < 1 or self.c_tile & (self.c_tile - 1):
            raise ValueError(f"c_tile={self.c_tile} must be a power of two")
        if self.k_tile < 0 or (self.k_tile and self.k_tile & (self.k_tile - 1)):
            raise ValueError(f"k_tile={self.k_tile} must be 0 or a power of two")
        if self.c_steps < 1:
            raise ValueError(f"c_steps={self.c_steps} must be >= 1")

    def check_shape(self, rows: int, c: int, rank: int, dtype) -> None:
        """`check`, then refuse empty shapes and unsupported dtypes (no tensor-core dot: no minimum tile)."""
        self.check()
        for name, v in (("rows", rows), ("c", c), ("rank", rank)):
            if v < 1:
                raise ValueError(f"top-C pick needs {name} >= 1, got {v}")
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
            raise TypeError(f"top-C pick kernel: dtype {jnp.dtype(dtype).name} not supported (bf16, f16, f32)")


def default_config(rows: int, c: int, rank: int, dtype) -> TopCConfig:
    """Heuristic: one program per row when there are enough rows, else split C over programs."""
    c_tile = min(64, next_pow2(c))
    k_tile = 64 if jnp.dtype(dtype).itemsize >= 4 else 128
    tiles = cdiv(c, c_tile)
    splits = 1
    while splits < tiles and rows * splits < 512:
        splits *= 2
    return TopCConfig(c_tile=c_tile, c_steps=cdiv(tiles, splits), k_tile=k_tile, num_warps=4, num_stages=2)


def _topc_kernel(
    base_ref,  # [rows, C] whole array
    cand_ref,  # [rows, C] int32 whole array
    lat_ref,  # [rows, r] whole array
    w_ref,  # [V, r] (w2), whole array
    *refs,  # in order: add_ref [rows, r] float32 whole array (has_add only: the latent is
    #   round(lat + add)); rows_ref [M] int32 (has_rows only: program n picks row rows_ref[n]); skip_ref [k]
    #   int32 (has_skip only: element 0 nonzero = return at once); seeds_ref [rows] int32, invt_ref [1] float32
    #   (sample only); then the outputs mv_ref [] block of [splits, rows_pad] float32: best score (sample: key);
    #   mb_ref (same) float32: the largest base logit holding it; mi_ref (same) int32: the lowest vocab id holding
    #   both; extras only: ms_ref, mm_ref, ml_ref (same, float32): the winner's score, the running max and sum of
    #   exp(s * inv_t - max); "scores" only: sc_ref [programs, C] (whole array, the logits' dtype)
    c: int,
    rank: int,
    c_tile: int,
    c_steps: int,
    k_tile: int,
    dtype,
    ties: str = "base",
    has_skip: bool = False,
    has_add: bool = False,
    has_rows: bool = False,
    keep: tuple | None = None,
    sample: bool = False,
    extras: str | None = None,
):
    refs = list(refs)
    add_ref = refs.pop(0) if has_add else None
    rows_ref = refs.pop(0) if has_rows else None
    skip_ref = refs.pop(0) if has_skip else None
    if sample:
        seeds_ref, invt_ref = refs.pop(0), refs.pop(0)
    mv_ref, mb_ref, mi_ref, *x_refs = refs
    n, j = pl.program_id(0), pl.program_id(1)
    out_row = n
    if has_rows:  # program n picks input row rows_ref[n] (its output stays at column n)
        n = rows_ref[n]
    if sample:  # the row's noise seed (by draft row) and 1 / T
        seed, inv_t = seeds_ref[n], invt_ref[0]
    n_k = cdiv(rank, k_tile)
    # A masked tail chunk loads with index arrays: never a static slice past the end (JAX >= 0.12 refuses one).
    k_tail = rank % k_tile != 0

    def kcols(kk):  # rank columns of chunk kk and their mask (None: all inside the rank)
        kc = kk * k_tile + iota(k_tile)
        return kc, (kc < rank if k_tail and kk == n_k - 1 else None)

    def load_one(ref, kk):
        kc, km = kcols(kk)
        if km is None:
            return ref[n, pl.ds(kk * k_tile, k_tile)]
        return plt.load(ref.at[n, kc], mask=km, other=0.0)

    def load_x(kk):  # has_add: the residual sum, formed in float32 and rounded to the logits' dtype here
        if has_add:
            return (load_one(lat_ref, kk) + load_one(add_ref, kk)).astype(dtype)
        return load_one(lat_ref, kk)

    def run(evict=None):  # this program's split of row n: (score, base logit, id) of its best candidate
        xs = [load_x(kk).astype(jnp.float32) for kk in range(n_k)]

        def step(t, carry):
            c0 = (j * c_steps + t) * c_tile
            ok = (c0 + iota(c_tile)) < c
            ids = plt.load(cand_ref.at[n, pl.ds(c0, c_tile)], mask=ok, other=0)  # [c_tile]
            ids = jnp.where(ok, ids, 0)
            b = plt.load(base_ref.at[n, pl.ds(c0, c_tile)], mask=ok, other=0.0)  # [c_tile]
            acc = jnp.zeros((c_tile,), jnp.float32)
            for kk in range(n_k):  # static: the rank is small (256)
                k0 = kk * k_tile
                kc, km = kcols(kk)
                if km is not None:  # [c_tile, k_tile] row gather, rank tail masked
                    w = plt.load(w_ref.at[ids[:, None], kc[None, :]],
                                 mask=jnp.broadcast_to(km[None, :], (c_tile, k_tile)), other=0.0, eviction_policy=evict)
                elif evict is None:
                    w = w_ref[ids, pl.ds(k0, k_tile)]  # [c_tile, k_tile] row gather (masked lanes read row 0)
                else:  # the same row gather, as index arrays (the form interpret mode's load takes with a hint)
                    w = plt.load(w_ref.at[ids[:, None], kc[None, :]], eviction_policy=evict)
                acc = acc + jnp.sum(w.astype(jnp.float32) * xs[kk][None, :], axis=1)
            s = jnp.where(ok, score(b, acc.astype(dtype), dtype), -jnp.inf)
            bf = b.astype(jnp.float32)
            bf = jnp.where(ok & (bf == bf), bf, -jnp.inf)  # NaN base (and masked lanes) rank as -inf
            if ties == "id":  # every real candidate ranks alike on base: equal scores go to the lowest id
                bf = jnp.where(ok, 0.0, -jnp.inf)
            # The value compared: the score, or (sample) its key; masked lanes have s = key = -inf.
            key = jnp.where(ok, common.sample_key(s, inv_t, common.gumbel(seed, ids)), -jnp.inf) if sample else s
            idm = jnp.where(ok, ids, BIG)
            m, mb, k = best3(key, bf, idm, axis=0)
            if not extras:
                return merge3(*carry, m, mb, k)
            best, bbase, bidx, bs, lm, ll = carry
            take = (m > best) | ((m == best) & ((mb > bbase) | ((mb == bbase) & (k < bidx))))  # `common.merge3`
            s_k = jnp.max(jnp.where(idm == k, s, -jnp.inf))  # the winner's score
            if extras == "scores":
                plt.store(x_refs[3].at[out_row, c0 + iota(c_tile)], s.astype(x_refs[3].dtype), mask=ok)
            return (*merge3(best, bbase, bidx, m, mb, k), jnp.where(take, s_k, bs),
                    *common.online_lse(lm, ll, s * inv_t, axis=0))

        init = (jnp.array(-jnp.inf, jnp.float32), jnp.array(-jnp.inf, jnp.float32), jnp.array(BIG, jnp.int32))
        if extras:
            init = (*init, jnp.array(-jnp.inf, jnp.float32), jnp.array(-jnp.inf, jnp.float32),
                    jnp.array(0.0, jnp.float32))
        return step(0, init) if c_steps == 1 else jax.lax.fori_loop(0, c_steps, step, init)

    def write(best, bbase, bidx, *more):
        mv_ref[...] = best
        mb_ref[...] = bbase
        mi_ref[...] = bidx
        for ref, x in zip(x_refs, more):  # extras: the winner's score, the running max and sum
            ref[...] = x

    def run_write():
        if keep is None:
            write(*run())
            return
        # keep = (hot splits, their L2 policy, the others'): the hint is static per load, so two branches.
        hot_splits, hot, rest = keep
        is_hot = j < hot_splits
        pl.when(is_hot)(lambda: write(*run(hot)))
        pl.when(jnp.logical_not(is_hot))(lambda: write(*run(rest)))

    if not has_skip:
        run_write()
    else:
        # skip: read nothing, write the "no winner" triple (a cond returning constants does not lower to Triton).
        go = skip_ref[0] == 0
        pl.when(go)(run_write)
        pl.when(jnp.logical_not(go))(lambda: write(jnp.float32(-jnp.inf), jnp.float32(-jnp.inf), jnp.int32(BIG)))


TIES = ("base", "id")


@functools.partial(jax.jit, static_argnames=("interpret", "config", "partials", "ties", "keep", "proposal"))
def topc_pick(
    base_c: jax.Array,
    cand: jax.Array,
    lat: jax.Array,
    w2: jax.Array,
    *,
    interpret: bool = False,
    config: TopCConfig | None = None,
    partials: bool = False,
    ties: str = "base",
    skip: jax.Array | None = None,
    lat_add: jax.Array | None = None,
    row_ids: jax.Array | None = None,
    keep: tuple | None = None,
    seeds: jax.Array | None = None,
    inv_t: jax.Array | None = None,
    proposal: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
    """[rows,C], [rows,C] int, [rows,r], [V,r] -> [rows] int32 vocab ids (candidate ids in [0, V)).

    ``partials=True``: each split's winner ``(score, base logit, id)``, each [splits, rows] (float32, float32,
    int32), for the caller to combine by the same rule. ``ties``: ``"base"`` (the top-C rule) or ``"id"`` (the
    full-vocab rule; the partials' base logit is then 0).
    ``skip`` (a device flag, `common.flag_operand`; None: no extra operand): when true every program returns at
    once and writes "no winner" partials (-inf, -inf, `BIG`).
    ``lat_add`` ([rows, r] float32, with ``lat`` float32): the latent is ``round(lat + lat_add)`` to the logits'
    dtype, formed as each program loads it (`xpress_jax.reference.LatentSum`): the same values.
    ``row_ids`` ([M] int32 in [0, rows)): pick only these rows, in this order; each as without ``row_ids``.
    ``keep`` (static; None: no hints): ``(hot, hot_policy, rest_policy)``: splits ``j < hot`` gather ``w2`` with
    ``hot_policy``, the others with ``rest_policy`` (L2 hints only: the same result).
    ``seeds`` ([rows] int32, by input row), ``inv_t`` (float32 scalar, 1 / T; 0 = greedy): the sampled pick, the top-C
    rule on ``(common.sample_key(s, inv_t, common.gumbel(seeds[row], cand)), base logit, id)`` (with ``lat_add``,
    ``row_ids``, ``keep``, ``partials``: the keys; not with ``skip`` or ``ties="id"``). ``proposal`` ("logprob" /
    "scores", with ``seeds``, without ``partials``): returns ``(tokens, (token_score [rows] float32: the winner's s,
    lse [rows] float32: logsumexp(s * inv_t) over the C candidates, +inf where inv_t is 0, scores [rows, C] in the
    logits' dtype or None))``; candidate ids distinct within a row."""
    sampled = seeds is not None or inv_t is not None or proposal is not None
    if sampled:
        if skip is not None or ties != "base":
            raise ValueError("skip and ties='id' are for the certified mode's greedy pick; the sampled pick (seeds) "
                             "goes without them")
        if proposal is not None and partials:
            raise ValueError("proposal goes without partials (the extras need the splits combined)")
    call, operands = _pick_call(base_c, cand, lat, w2, interpret=interpret, config=config, ties=ties, skip=skip,
                                lat_add=lat_add, row_ids=row_ids, keep=keep,
                                sample=(seeds, inv_t, proposal) if sampled else None)
    out = common.pallas_call(**call)(*operands)
    mv, mb, mi = out[:3]
    rows = base_c.shape[0] if row_ids is None else row_ids.shape[0]
    if partials:
        return mv[:, :rows], mb[:, :rows], mi[:, :rows]
    call = _combine_call(*mv.shape, interpret=interpret)  # the splits' winners by the top-C rule (`combine_splits`)
    tok = (mi[0] if call is None else common.pallas_call(**call)(mv, mb, mi))[:rows]
    if proposal is None:
        return tok
    ms, mm, ml = (x[:, :rows] for x in out[3:6])
    token_score = jnp.max(jnp.where(mi[:, :rows] == tok[None, :], ms, -jnp.inf), axis=0)  # the winner's split
    lse = common.finish_lse(mm, ml, jnp.reshape(inv_t, ()).astype(jnp.float32))
    return tok, (token_score, lse, out[6] if proposal == "scores" else None)


def _pick_call(base_c, cand, lat, w2, *, interpret, config, ties, skip, lat_add=None, row_ids=None, keep=None,
               sample=None) -> tuple[dict, tuple]:
    """The pick kernel's launch, checked: its `common.pallas_call` arguments and its operands, which the wrapper
    calls. It returns ``(score, base, id)`` each [splits, rows_pad] (rows_pad: rows rounded up to 16).
    ``sample`` = (seeds, inv_t, proposal): the keys; with a proposal three more [splits, rows_pad] float32 (the
    winner's score, the running max and sum of exp) and with "scores" the [rows, C] scores."""
    if ties not in TIES:
        raise ValueError(f"ties must be one of {TIES}, got {ties!r}")
    if base_c.ndim != 2 or cand.shape != base_c.shape or lat.ndim != 2 or lat.shape[0] != base_c.shape[0]:
        raise ValueError(f"need base_c [rows,C], cand [rows,C], lat [rows,r]; got {base_c.shape=} {cand.shape=} "
                         f"{lat.shape=}")
    rows, c = base_c.shape
    rank = lat.shape[1]
    if w2.ndim != 2 or w2.shape[1] != rank:
        raise ValueError(f"w2 must be [V, {rank}]; got {w2.shape}")
    if lat_add is not None:
        if lat_add.shape != lat.shape or lat.dtype != jnp.float32 or lat_add.dtype != jnp.float32:
            raise ValueError(f"lat_add needs lat and lat_add both float32 [rows, r]; got {lat.shape} {lat.dtype}, "
                             f"{lat_add.shape} {lat_add.dtype}")
        if base_c.dtype != w2.dtype:
            raise ValueError(f"dtypes must agree: {base_c.dtype=} {w2.dtype=}")
    elif not (base_c.dtype == lat.dtype == w2.dtype):
        raise ValueError(f"dtypes must agree: {base_c.dtype=} {lat.dtype=} {w2.dtype=}")
    dtype = jnp.dtype(base_c.dtype)
    cfg = config or default_config(rows, c, rank, dtype)
    cfg.check_shape(rows, c, rank, dtype)
    if row_ids is not None:
        if row_ids.ndim != 1 or row_ids.shape[0] < 1 or row_ids.dtype != jnp.int32:
            raise ValueError(f"row_ids must be [M >= 1] int32; got {row_ids.shape} {row_ids.dtype}")
        rows = row_ids.shape[0]  # the programs (and output columns) from here on
    k_tile = k_chunk(cfg.k_tile, rank)
    splits = cdiv(c, cfg.c_tile * cfg.c_steps)
    operands = (base_c, cand.astype(jnp.int32), lat, w2)
    extra = {}
    if lat_add is not None:
        operands = (*operands, lat_add)
        extra["has_add"] = True
    if row_ids is not None:
        operands = (*operands, row_ids)
        extra["has_rows"] = True
    if skip is not None:
        operands = (*operands, common.flag_operand(skip, "skip"))
        extra["has_skip"] = True
    proposal = None
    if sample is not None:
        seeds, inv_t, proposal = sample
        n_in = base_c.shape[0]
        common.check_noise(seeds, inv_t, proposal, n_in, "input row")
        operands = (*operands, seeds.astype(jnp.int32), jnp.reshape(jnp.asarray(inv_t), (1,)).astype(jnp.float32))
        extra.update(sample=True, extras=proposal)
    if keep is not None:
        policies = (None, "evict_first", "evict_last", "evict_normal")
        if (not isinstance(keep, tuple) or len(keep) != 3 or isinstance(keep[0], bool) or not isinstance(keep[0], int)
                or keep[1] not in policies or keep[2] not in policies):
            raise ValueError(f"keep must be (hot splits: int, policy, policy) with policies from {policies}; "
                             f"got {keep!r}")
        extra["keep"] = keep
    kernel = functools.partial(
        _topc_kernel, c=c, rank=rank, c_tile=cfg.c_tile, c_steps=cfg.c_steps, k_tile=k_tile, dtype=dtype, ties=ties,
        **extra
    )
    rows_pad = cdiv(rows, 16) * 16  # padding rows are never written; combine_splits gets >= 16-row tiles
    out_spec = pl.BlockSpec((None, None), lambda n, j: (j, n))
    f32, i32 = (jax.ShapeDtypeStruct((splits, rows_pad), t) for t in (jnp.float32, jnp.int32))
    out_specs, out_shape = (out_spec,) * 3, (f32, f32, i32)
    if proposal:
        out_specs, out_shape = (*out_specs, *(out_spec,) * 3), (*out_shape, f32, f32, f32)
    if proposal == "scores":
        out_specs, out_shape = (*out_specs, pl.no_block_spec), (*out_shape, jax.ShapeDtypeStruct((rows, c), dtype))
    call = dict(
        kernel=kernel, name="xpress_topc_sample" if sample is not None else "xpress_topc_pick",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret, grid=(rows, splits),
        in_specs=[pl.no_block_spec] * len(operands), out_specs=out_specs, out_shape=out_shape,
    )
    return call, operands


def _combine_kernel(mv_ref, mb_ref, mi_ref, o_ref, *, splits: int, row_tile: int, split_tile: int):
    """Reduce [splits, rows_pad] (score, base, id) triples to each row's winner; grid over row tiles."""
    r0 = pl.program_id(0) * row_tile
    shape = (split_tile, row_tile)

    def step(t, carry):
        p0 = t * split_tile
        ok = jnp.broadcast_to(((p0 + iota(split_tile)) < splits)[:, None], shape)
        if isinstance(p0, int) and p0 + split_tile > splits:
            # A static slice past the end: JAX >= 0.12 refuses it, so index with arrays (the same addresses).
            idx = ((p0 + iota(split_tile))[:, None], (r0 + iota(row_tile))[None, :])
        else:
            idx = (pl.ds(p0, split_tile), pl.ds(r0, row_tile))
        v = jnp.where(ok, plt.load(mv_ref.at[idx], mask=ok, other=-jnp.inf), -jnp.inf)
        b = jnp.where(ok, plt.load(mb_ref.at[idx], mask=ok, other=-jnp.inf), -jnp.inf)
        ix = jnp.where(ok, plt.load(mi_ref.at[idx], mask=ok, other=BIG), BIG)
        return merge3(*carry, *best3(v, b, ix, axis=0))

    init = (jnp.full((row_tile,), -jnp.inf, jnp.float32), jnp.full((row_tile,), -jnp.inf, jnp.float32),
            jnp.full((row_tile,), BIG, jnp.int32))
    n_t = cdiv(splits, split_tile)
    _, _, bidx = step(0, init) if n_t == 1 else jax.lax.fori_loop(0, n_t, step, init)
    o_ref[...] = bidx


def _combine_call(splits: int, rows_pad: int, *, interpret: bool) -> dict | None:
    """The `common.pallas_call` arguments of the combine launch on (score, base, id) [splits, rows_pad], which the
    caller calls with the three; None for one split (its ids are the winners)."""
    if splits == 1:
        return None
    row_tile = 16
    while row_tile < 128 and rows_pad % (2 * row_tile) == 0:
        row_tile *= 2
    split_tile = min(next_pow2(splits), max(1, 8192 // row_tile))
    return dict(
        kernel=functools.partial(_combine_kernel, splits=splits, row_tile=row_tile, split_tile=split_tile),
        name="xpress_topc_combine", interpret=interpret, grid=(rows_pad // row_tile,),
        in_specs=[pl.no_block_spec] * 3, out_specs=pl.BlockSpec((row_tile,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((rows_pad,), jnp.int32),
    )


def combine_splits(mv: jax.Array, mb: jax.Array, mi: jax.Array, *, interpret: bool = False) -> jax.Array:
    """[splits, rows_pad] (score, base logit, id) -> [rows_pad] int32 by the top-C rule (rows_pad: a multiple of 16)."""
    call = _combine_call(*mv.shape, interpret=interpret)
    return mi[0] if call is None else common.pallas_call(**call)(mv, mb, mi)


# The certified exact mode's per-pass decision (`xpress_jax.exact`), in one launch after the pick.


def _certify_kernel(mv_ref, mi_ref, lat_ref, tau_ref, mex_ref, valid_ref, m_ref, fallen_ref, best_ref, fail_ref,
                    act_ref, *flag_ref, rows: int, splits: int, row_tile: int, split_tile: int, rank: int, k_tile: int,
                    dtype, slack: float, limit: int | None):
    """Per row tile: the candidates' winner by the full-vocab rule over the splits, the bound and the decision
    (`certify`); each program stores its own rows of the whole [rows] outputs (masked)."""
    r0 = pl.program_id(0) * row_tile
    rix = r0 + iota(row_tile)
    rok = rix < rows

    def step(t, carry):
        p0 = t * split_tile
        ok = ((p0 + iota(split_tile)) < splits)[:, None] & rok[None, :]  # [split_tile, row_tile]
        idx = ((p0 + iota(split_tile))[:, None], rix[None, :])
        v = jnp.where(ok, plt.load(mv_ref.at[idx], mask=ok, other=-jnp.inf), -jnp.inf)
        ix = jnp.where(ok, plt.load(mi_ref.at[idx], mask=ok, other=BIG), BIG)
        return common.merge(*carry, *common.best(v, ix, axis=0))

    init = (jnp.full((row_tile,), -jnp.inf, jnp.float32), jnp.full((row_tile,), BIG, jnp.int32))
    n_t = cdiv(splits, split_tile)
    best, bidx = step(0, init) if n_t == 1 else jax.lax.fori_loop(0, n_t, step, init)

    ss = jnp.zeros((row_tile,), jnp.float32)
    for kk in range(cdiv(rank, k_tile)):  # static: sum of squares of the row's latent, float32
        kc = kk * k_tile + iota(k_tile)
        msk = rok[:, None] & (kc < rank)[None, :]
        x = plt.load(lat_ref.at[rix[:, None], kc[None, :]], mask=msk, other=0.0).astype(jnp.float32)
        ss = ss + jnp.sum(x * x, axis=1)
    nrm = jnp.sqrt(ss) * (1 + slack)
    mn = m_ref[0] * nrm
    u = mn + slack * mn

    def rnd(x):
        return x.astype(dtype).astype(jnp.float32)

    tau = plt.load(tau_ref.at[rix], mask=rok, other=-jnp.inf)
    beta = rnd(tau + rnd(u))
    mex = plt.load(mex_ref.at[rix], mask=rok, other=0)
    cert = (beta < best) | ((beta == best) & (bidx < mex))
    fallen = fallen_ref[0] != 0
    valid = plt.load(valid_ref.at[rix], mask=rok, other=0) != 0
    fail = rok & valid & jnp.logical_not(cert) & jnp.logical_not(fallen)
    plt.store(best_ref.at[rix], bidx, mask=rok)
    plt.store(fail_ref.at[rix], fail.astype(jnp.int32), mask=rok)
    if limit is None:
        plt.store(act_ref.at[rix], fail.astype(jnp.int32), mask=rok)
    else:
        n_fail = jnp.sum(fail.astype(jnp.int32))
        full = fallen | (n_fail > limit)
        plt.store(act_ref.at[rix], (fail | full).astype(jnp.int32), mask=rok)
        flag_ref[0][...] = common.flags_row(full, n_fail)


#: Rows one certify program holds when its launch must see every row (``limit``).
CERTIFY_SINGLE_ROWS = 256


@functools.partial(jax.jit, static_argnames=("interpret", "config", "slack", "limit"))
def certify(base_c: jax.Array, cand: jax.Array, lat: jax.Array, w2: jax.Array, tau: jax.Array, max_norm: jax.Array,
            mex: jax.Array, valid: jax.Array, fallen: jax.Array, *, slack: float, limit: int | None = None,
            interpret: bool = False, config: TopCConfig | None = None):
    """The certified mode's candidates step: the pick kernel (``ties="id"``, skipped when ``fallen``) and one
    launch that decides every row. Returns ``(best_id, fail, act, flags)``, the first three [rows] int32:

    - ``best_id``: the candidates' winner by the full-vocab rule (`BIG` when ``fallen``);
    - ``fail``: ``valid & ~certified & ~fallen``; certified iff ``beta < best`` or (``beta == best`` and
      ``best_id < mex``), ``beta = R(fl(tau + R(U)))``, ``U = fl(M n) (1 + slack)``, ``n = ||lat|| (1 + slack)``
      (docs/certified.md);
    - ``act``: with ``limit``, ``fail | full``, ``full = fallen | (sum(fail) > limit)`` (else ``fail``);
    - ``flags``: with ``limit``, int32 [8] = [full, sum(fail), 0, ...]; None without.

    ``tau`` [rows]: each row's C-th largest base logit; ``max_norm`` []: ``M``; ``mex`` [rows]: the lowest id that is
    not a candidate; ``valid`` [rows] bool; ``fallen``: a flag. ``limit``: at most `CERTIFY_SINGLE_ROWS` rows."""
    rows, c = base_c.shape
    rank = lat.shape[1]
    for name, a, want in (("tau", tau, (rows,)), ("mex", mex, (rows,)), ("valid", valid, (rows,)),
                          ("max_norm", max_norm, ())):
        if jnp.shape(a) != want:
            raise ValueError(f"certify: {name} must have shape {want}, got {jnp.shape(a)}")
    if limit is not None and rows > CERTIFY_SINGLE_ROWS:
        raise ValueError(f"certify: limit needs rows <= {CERTIFY_SINGLE_ROWS} (one program), got {rows}")
    fallen = common.flag_operand(fallen, "fallen")
    call, operands = _pick_call(base_c, cand, lat, w2, interpret=interpret, config=config, ties="id", skip=fallen)
    mv, _, mi = common.pallas_call(**call)(*operands)
    splits, rows_pad = mv.shape
    if limit is not None:
        row_tile = next_pow2(rows_pad)
    else:
        row_tile = 16
        while row_tile < 64 and rows_pad % (2 * row_tile) == 0 and rows_pad // (2 * row_tile) >= 8:
            row_tile *= 2
    grid = cdiv(rows_pad, row_tile)
    split_tile = min(next_pow2(splits), max(1, 4096 // row_tile))
    k_tile = min(next_pow2(rank), max(16, 4096 // row_tile))
    kernel = functools.partial(_certify_kernel, rows=rows, splits=splits, row_tile=row_tile, split_tile=split_tile,
                               rank=rank, k_tile=k_tile, dtype=jnp.dtype(base_c.dtype), slack=float(slack),
                               limit=None if limit is None else int(limit))
    out = jax.ShapeDtypeStruct((rows,), jnp.int32)
    n_out = 3 if limit is None else 4
    outs = common.pallas_call(
        kernel, name="xpress_certify", interpret=interpret, grid=(grid,), in_specs=[pl.no_block_spec] * 8,
        out_specs=(pl.no_block_spec,) * n_out, out_shape=(out, out, out, jax.ShapeDtypeStruct((8,), jnp.int32))[:n_out],
    )(mv, mi, lat, tau.astype(jnp.float32), mex.astype(jnp.int32), valid.astype(jnp.int32),
      jnp.reshape(max_norm, (1,)).astype(jnp.float32), fallen)
    return (*outs, None) if limit is None else tuple(outs)
