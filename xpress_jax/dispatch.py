"""Which kernel and which config each refine step uses, decided from the static shapes.

`TABLE` is one frozen `Table` of `Entry` rows keyed by **draft rows** = N * (B - 1), each serving the row counts
up to its ``max_rows`` (None: no bound), every tuned threshold a column. float64 gets the jnp reference everywhere;
float32 (never tuned) the entry's choices but the kernels' own full-vocab and latent configs; bf16 / f16 the whole
entry. Measured at B = 16 (the comments give N); the numbers are in docs/performance.md. ``Ops.pallas(table=...)``
carries a table (a static jit argument); variants: ``TABLE.replace(...)``, e.g. with entries changed by
``dataclasses.replace``.

Per GPU family (`TABLES`, `table_for`; ``Ops.pallas()`` takes `device_table`): `TABLE` is measured on the
H100/H200 (sm90) only. Every other family (`kernels.common.TARGETS`: sm100, sm80, sm87, sm86, sm89, sm120) and an
unknown GPU (99 KB per block) get `fitted`: the same columns, each full-vocab config fitted to the family's
shared memory per block, the fused latent split where it does not fit, the wave from its SM count. Those tables
are heuristics, never compiled nor timed here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from .kernels import full_vocab, latent, select, topc_pick
from .kernels.common import HOPPER, TARGETS, Target, cdiv, next_pow2, target_of
from .kernels.full_vocab import FullVocabConfig
from .kernels.topc_pick import TopCConfig

__all__ = ["Entry", "Switches", "Thresholds", "Table", "TABLE", "TABLES", "MEASURED", "fitted", "table_for",
           "device_target", "device_table", "Plan", "plan", "pass_pick_rows", "SERVING_N", "SERVING_RANK"]

#: The N values the serving configs were measured at (B = 16): draft rows 15 / 60 / 240 / 960 / 3840.
SERVING_N = (1, 4, 16, 64, 256)


@dataclasses.dataclass(frozen=True)
class Switches:
    """An entry's XLA-fusion and algorithm switches (none is a block size; none changes a token).

    latent_terms: a top-C pass hands XLA's latent to the pick as two float32 terms (`reference.LatentSum`).
    mixer_barrier: XLA's unsplit latent puts the mixer behind an optimization barrier (XLA:GPU computes it once).
    table_latent: with a token table, XLA's latent (which reads the table) even where a kernel serves.
    start_select: a full-vocab refine starts from the selection's argmax (c=1) instead of XLA's.
    alternate: an unrolled full-vocab refine reads ``w2`` descending on odd passes (rows still in L2).
    full_vocab_keep: the full-vocab pick's ``keep`` (`full_vocab.KEEP_POLICIES`) where the config holds the latent.
    skip_final_slots, topc_skip_final_slots: unrolled passes skip the final draft slots (`pass_pick_rows`).
    scan_one_launch: the certified mode scans its failing rows in one launch (`full_vocab.scan_failing`), else
      in a packed launch of the failing rows plus an all-rows launch.
    """

    latent_terms: bool = False
    mixer_barrier: bool = False
    table_latent: bool = True
    start_select: bool = False
    alternate: bool = False
    full_vocab_keep: str | None = "split"
    skip_final_slots: bool = False
    topc_skip_final_slots: bool = False
    scan_one_launch: bool = True


@dataclasses.dataclass(frozen=True)
class Entry:
    """The decisions for draft-row counts up to ``max_rows`` (None: no bound).

    full_vocab, topc: the picks' configs (full_vocab: 16-bit dtypes, fitted to the target's shared memory).
    latent: "xla" (XLA's jnp latent), "split" (three kernels) or "fused" (one kernel).
    select_block: elements per block of the selection's block maxima.
    latent_blocks_per_program: the fused latent's blocks per program (16-bit dtypes).
    switches: the XLA-fusion and algorithm switches (`Switches`).
    """

    max_rows: int | None
    full_vocab: FullVocabConfig
    latent: str
    topc: TopCConfig
    select_block: int = 16
    latent_blocks_per_program: int = 1
    switches: Switches = Switches()

    def keep(self, config: FullVocabConfig) -> str | None:
        return self.switches.full_vocab_keep if config.hold_lat else None


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """The tuned thresholds outside the entries, read by the steps that use them (in blocks N unless named).

    exit_every_pass_from: ``early_exit=True`` checks after every pass from this N, below it every other pass
      (`refine.exit_checks`).
    materialize_xh: the N range (inclusive) where the GPU hidden input puts ``xh`` behind an optimization barrier
      (`reference.hidden_input_gpu`).
    gated_row_tiles: the certified mode's counted (gated) full-vocab launch serves up to this many row tiles,
      the plain pick above.
    scan_blocks_divisor: the certified mode's default ``scan_blocks`` is ``ceil(N / scan_blocks_divisor)``
      (`exact.Certified`).
    auto_min_blocks: ``full_vocab="auto"`` scans buckets of fewer blocks (`exact.Auto.min_blocks`'s default).
    """

    exit_every_pass_from: int = 16
    materialize_xh: tuple[int, int] = (8, 64)
    gated_row_tiles: int = 6
    scan_blocks_divisor: int = 8
    auto_min_blocks: int = 64


@dataclasses.dataclass(frozen=True)
class Table:
    """The dispatch table (frozen, hashable): ``entries`` by ascending ``max_rows``, the last unbounded.

    target: the GPU family its configs fit (`kernels.common.Target`: shared memory per program, for `plan`).
    sms: streaming multiprocessors of the GPU (`capacity_config`'s wave).
    select_finish_warps: warps of the selection's finish kernel up to C = 512.
    topc_keep_bytes: the top-C pick's L2 hints apply where one pass's gather (rows x C x r x itemsize) lies in
      ``(lo, hi]`` (`topc_keep`); None: never.
    thresholds: the thresholds of the steps outside the entries (`Thresholds`).
    """

    entries: tuple[Entry, ...]
    sms: int = 132
    select_finish_warps: int = 8
    topc_keep_bytes: tuple[int, int] | None = (48 << 20, 96 << 20)
    target: Target = HOPPER
    thresholds: Thresholds = Thresholds()

    def __post_init__(self):
        limits = [e.max_rows for e in self.entries]
        if not limits or limits[-1] is not None or None in limits[:-1] or limits[:-1] != sorted(set(limits[:-1])):
            raise ValueError(f"Table entries must have ascending max_rows ending with None; got {limits}")

    def entry(self, rows: int) -> Entry:
        return next(e for e in self.entries if e.max_rows is None or rows <= e.max_rows)

    def replace(self, **changes) -> "Table":
        return dataclasses.replace(self, **changes)

    def select_config(self, entry: Entry, c: int) -> dict:
        """The selection's `select.SelectConfig` fields that differ from its defaults, for ``c``. Above C = 512 the
        fast finish needs ``cap`` and ``groups`` well above C; 8-element blocks above C = 2048. Exact for any input.
        H200: python -m benchmarks.bench_kernels --steps select
        """
        sel = {} if entry.select_block == select.SelectConfig().block else dict(block=entry.select_block)
        sel["finish_warps"] = self.select_finish_warps
        if c > 512:
            sel = dict(cap=min(next_pow2(2 * c), 16384), groups=min(next_pow2(4 * c), 16384),
                       block=min(entry.select_block, 16) if c <= 2048 else 8)  # the kernel's finish_warps
        return sel

    def topc_keep(self, rows: int, c: int, rank: int, itemsize: int, splits: int) -> tuple | None:
        """The top-C pick's ``keep`` (``splits`` programs per row): the first half evict_last, the rest evict_first."""
        window = self.topc_keep_bytes
        if window is None or splits < 2 or not window[0] < rows * c * rank * itemsize <= window[1]:
            return None
        return (splits // 2, "evict_last", "evict_first")

    def capacity_config(self, cfg: FullVocabConfig, vocab: int) -> FullVocabConfig:
        """``cfg`` for a launch on a few packed rows: ``v_steps`` at most ``ceil(V / v_tile / sms)`` (one row tile
        fills a wave). The same scores, and the split does not change the winner: the same tokens."""
        steps = max(1, cdiv(cdiv(vocab, cfg.v_tile), self.sms))
        return dataclasses.replace(cfg, v_steps=min(cfg.v_steps, steps))


_LAZY = dict(prefetch_base=True, lazy=True)
# Full-vocab pick configs. H200: python -m benchmarks.bench_kernels --steps full_vocab
# N=1: the latent held, 12 tiles of 64 per part. H100: python -m benchmarks.bench_refine --n 1 --topc 0
_FV_15 = FullVocabConfig(row_tile=16, v_tile=64, v_steps=12, k_tile=0, num_warps=4, num_stages=3, hold_lat=True,
                         **_LAZY)
# N=2: 32-row tiles. H200: python -m benchmarks.bench_refine --n 2,3 --topc 0
_FV_30 = FullVocabConfig(row_tile=32, v_tile=64, v_steps=6, k_tile=64, num_warps=4, num_stages=4, hold_lat=False,
                         flat=True, **_LAZY)
_FV_60 = FullVocabConfig(row_tile=64, v_tile=64, v_steps=6, k_tile=64, num_warps=4, num_stages=4, hold_lat=False,
                         flat=True, **_LAZY)
_FV_240 = FullVocabConfig(row_tile=128, v_tile=64, v_steps=36, k_tile=0, num_warps=8, num_stages=3, hold_lat=True,
                          **_LAZY)
_FV_960 = FullVocabConfig(row_tile=128, v_tile=64, v_steps=12, k_tile=0, num_warps=8, num_stages=3, hold_lat=True,
                          **_LAZY)
_FV_BIG = FullVocabConfig(row_tile=128, v_tile=64, v_steps=108, k_tile=0, num_warps=8, num_stages=3, hold_lat=True,
                          **_LAZY)
# Top-C pick: 32-candidate tiles up to N=2, 128 above. H200: python -m benchmarks.bench_refine --topc 512
_TC_SMALL = TopCConfig(c_tile=32, c_steps=1, k_tile=128, num_warps=4, num_stages=2)
_TC = TopCConfig(c_tile=128, c_steps=1, k_tile=64, num_warps=8, num_stages=2)

# Columns, each chosen by H200/H100: python -m benchmarks.bench_refine (device time per refine, both modes):
# latent "xla" up to N=64 (the fused kernel above, 2 blocks per program from N=128); latent_terms up to N=4;
# mixer_barrier at N=1; table_latent up to N=128; start_select from N=32; alternate up to N=4; full_vocab_keep
# from N=2 where the config holds the latent; skip_final_slots from N=16; scan_one_launch up to N=64;
# select_block 16 and select_finish_warps 8 (H200: python -m benchmarks.bench_kernels --steps select).
_S = Switches
TABLE = Table(entries=(
    Entry(15, _FV_15, "xla", _TC_SMALL, switches=_S(latent_terms=True, mixer_barrier=True, alternate=True,  # N = 1
                                                    full_vocab_keep=None)),
    Entry(30, _FV_30, "xla", _TC_SMALL, switches=_S(latent_terms=True, alternate=True)),  # N = 2
    Entry(60, _FV_60, "xla", _TC, switches=_S(latent_terms=True, alternate=True)),  # N = 3..4
    Entry(239, _FV_240, "xla", _TC),  # N = 5..15
    Entry(240, _FV_240, "xla", _TC, switches=_S(skip_final_slots=True, topc_skip_final_slots=True)),  # N = 16
    Entry(479, _FV_960, "xla", _TC, switches=_S(skip_final_slots=True, topc_skip_final_slots=True)),  # N = 17..31
    Entry(960, _FV_960, "xla", _TC, switches=_S(start_select=True, skip_final_slots=True,  # N = 32..64
                                                topc_skip_final_slots=True)),
    Entry(1905, _FV_BIG, "fused", _TC, switches=_S(start_select=True, skip_final_slots=True,  # N = 65..127
                                                   topc_skip_final_slots=True, scan_one_launch=False)),
    Entry(1920, _FV_BIG, "fused", _TC, latent_blocks_per_program=2,  # N = 128
          switches=_S(start_select=True, skip_final_slots=True, topc_skip_final_slots=True, scan_one_launch=False)),
    Entry(None, _FV_BIG, "fused", _TC, latent_blocks_per_program=2,  # N > 128
          switches=_S(table_latent=False, start_select=True, skip_final_slots=True, topc_skip_final_slots=True,
                      scan_one_launch=False)),
))

#: The rank and dtype the heuristic tables are fitted at (the serving head's; `plan` fits again at each call's).
SERVING_RANK = 256


def fitted(table: Table, target: Target, rank: int = SERVING_RANK, dtype: Any = jnp.bfloat16) -> Table:
    """``table`` for another GPU family (unmeasured): every full-vocab config fitted to ``target``'s shared memory at
    ``rank`` / ``dtype`` (`full_vocab.fit_shared_memory`), the fused latent replaced by the split one where its
    default config does not fit, the wave from ``target``'s SM count; every other column as measured."""
    def fit(e: Entry) -> Entry:
        fv = full_vocab.fit_shared_memory(e.full_vocab, rank, dtype, target.smem)
        lat = e.latent
        if lat == "fused" and latent.default_config(1, dtype, "fused", rank).smem_bytes(rank, dtype) > target.smem:
            lat = "split"
        return dataclasses.replace(e, full_vocab=fv, latent=lat)

    return table.replace(entries=tuple(fit(e) for e in table.entries), target=target, sms=target.sms)


#: The measured tables by GPU family (`kernels.common.Target.family`): only the H100/H200's.
MEASURED = {HOPPER.family: TABLE}


@functools.lru_cache(maxsize=None)
def table_for(target: Target | None) -> Table:
    """The table for a GPU: the measured one of its family, else `TABLE` `fitted` to it; `TABLE` for None (no GPU:
    interpret mode, or lowering on a CPU)."""
    if target is None:
        return TABLE
    return MEASURED.get(target.family) or fitted(TABLE, target)


#: The table of every known family (`kernels.common.TARGETS`), by family: the measured one or a fitted one.
TABLES = {family: table_for(t) for family, t in TARGETS.items()}


def device_target() -> Target | None:
    """The `Target` of JAX's first device (None off an NVIDIA GPU)."""
    try:
        return target_of(jax.devices()[0])
    except RuntimeError:
        return None


def device_table() -> Table:
    """`table_for` this process's GPU (`device_target`)."""
    return table_for(device_target())


@dataclasses.dataclass(frozen=True)
class Plan:
    """What each step runs at one set of shapes; a ``None`` config means the jnp reference (``topc``: also C = 0).
    ``select`` holds `select.SelectConfig` fields; ``entry`` is the table's `Entry` (its columns hold for every dtype).
    """

    select: dict | None
    latent: latent.LatentConfig | None
    full_vocab: FullVocabConfig | None
    topc: TopCConfig | None
    entry: Entry


def plan(n: int, b: int, v: int, r: int, c: int, dtype: Any, *, table: Table = TABLE,
         kernels_everywhere: bool = False) -> Plan:
    """The plan for N blocks of B slots, vocab V, rank r, top-C ``c`` (0: full vocab), ``dtype``, from ``table``.

    ``kernels_everywhere`` (interpret mode): a kernel even where the table prefers XLA. Every config returned passes
    its kernel's ``check_shape``: one that cannot run at this rank is fitted (the fused latent falls back to split).
    """
    dtype = jnp.dtype(dtype)
    rows = n * (b - 1)
    entry = table.entry(rows)
    if dtype == jnp.float64 or rows == 0:
        return Plan(None, None, None, None, entry)
    f32 = dtype.itemsize > 2
    smem, target = table.target.smem, table.target.name
    lat = None
    if entry.latent != "xla" or kernels_everywhere:
        variant = "fused" if entry.latent == "fused" else "split"
        lat = latent.default_config(n, dtype, variant, rank=r)
        if variant == "fused" and not f32:
            lat = dataclasses.replace(lat, blocks_per_program=entry.latent_blocks_per_program)
        if variant == "fused" and lat.smem_bytes(r, dtype) > smem:
            lat = latent.default_config(n, dtype, "split", rank=r)
        lat.check_shape(r, dtype, smem, target)
    if f32:  # never tuned: the kernel's heuristic
        fv = full_vocab.default_config(rows, v, r, dtype, smem)
    else:
        fv = full_vocab.fit_shared_memory(entry.full_vocab, r, dtype, smem)
    fv.check_shape(rows, v, r, dtype, smem, target)
    tc = entry.topc if c else None
    if c:
        tc.check_shape(rows, c, r, dtype)
    return Plan(select=table.select_config(entry, c), latent=lat, full_vocab=fv, topc=tc, entry=entry)


def pass_pick_rows(n: int, b: int, q: int, row_tile: int, *, skip: bool, everywhere: bool = False) -> int:
    """The first draft slot pass ``q`` (0-based) picks: slot j is final after pass j + 1 (docs/semantics.md), so
    at most ``min(q, B-1)``. Skipped only where ``skip`` says so and the pick then runs fewer row tiles of
    ``row_tile`` rows; ``everywhere`` (interpret mode) skips whenever it can."""
    s = min(q, b - 1)
    if s in (0, b - 1) or everywhere:
        return s
    if not skip:
        return 0
    rows = n * (b - 1)
    return s if cdiv(n * (b - 1 - s), row_tile) < cdiv(rows, row_tile) else 0
