"""Which kernel and which config each refine step uses, decided from the static shapes.

One table, `TABLE`, keyed by **draft rows** = N * (B - 1) (the rows every per-pass step works
on: one per draft slot). Each row holds the decision for the draft-row counts up to its
``max_rows`` (inclusive; ``None``: no upper bound). Rows are a unit that holds for any B: the
full-vocab pick's grid, the top-C pick's grid, the selection's grid and the latent pass's
SwiGLU stages all scale with the draft rows. Every decision was measured at B = 16 (serving),
so the N column says which N it was measured at.

What is not in the table is decided by dtype, before the table:

- float64 (exactness runs; no Triton path worth having): every step uses `xpress_jax.reference`.
- float32 (never tuned): the table's choices of step implementation (XLA or which latent
  variant, the selection's block), but the kernels' own heuristics for the full-vocab config
  (`full_vocab.default_config`) and the latent config fields (`latent.default_config`).
- bf16 / f16: the table, all of it.

Sources are sections and rows of ``benchmarks/RESULTS.md`` (H200, JAX 0.11.2).

`plan` is the only entry point; `xpress_jax.ops.Ops.pallas` calls it at trace time, once per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from .kernels import full_vocab, latent, select, topc_pick
from .kernels.common import cdiv, next_pow2

__all__ = ["Row", "TABLE", "Plan", "plan", "capacity_config", "select_config", "SERVING_N", "SMS",
           "SCAN_FAILING_MAX_ROWS", "FULL_VOCAB_ALTERNATE_MAX_ROWS", "FULL_VOCAB_START_SELECT_MIN_ROWS",
           "SELECT_FINISH_WARPS", "SKIP_FINAL_SLOTS_MIN_ROWS", "TOPC_SKIP_FINAL_SLOTS_MIN_ROWS",
           "CERTIFIED_PASS_NUMBERS", "CERTIFIED_SCAN_KEEP", "CERTIFIED_COUNTED_PICK", "CERTIFIED_COUNTED_SCAN",
           "pass_pick_rows", "TABLE_XLA_LATENT_MAX_ROWS", "SPLIT_LATENT_MAX_ROWS", "FULL_VOCAB_KEEP_MIN_ROWS"]

#: The N values the serving configs were measured at (B = 16): draft rows 15 / 60 / 240 / 960 / 3840.
SERVING_N = (1, 4, 16, 64, 256)

#: Streaming multiprocessors of the GPU the table was measured on (H200: 132).
SMS = 132

#: The certified mode's failing rows are scanned in one launch (`full_vocab.scan_failing`: pack, one pick
#: over every row tile in packed order, combine) up to this many draft rows, above it by a packed launch of
#: the failing rows plus an all-rows launch. RESULTS.md "Certified mode: the failing rows' scan in one
#: launch" (seventh session): one launch saves 51-118 µs per refine at N = 16 / 32 / 64 where every row or
#: 97-98% certify (except +8 at N=16, std 0.02), and costs +103 at N=256 (30 row tiles x 132 mostly
#: empty programs per pass) where 97.5% certify.
SCAN_FAILING_MAX_ROWS = 960

#: With a token table (`xpress_jax.token_table`) the latent is XLA's, reading the table, up to this many draft
#: rows even where `TABLE` serves the Pallas latent kernel (which does not read the table). RESULTS.md "One
#: call's floor, PDL, ... a prepared token table", third probe (`latent3.jsonl`, top-512, device µs per refine):
#: N=128 (1920 rows) Pallas latent 1375.1 -> XLA latent with the table 1291.3; N=256 2302.6 -> 2302.7 (equal:
#: the kernel stays there).
TABLE_XLA_LATENT_MAX_ROWS = 1920

#: From this many draft rows a full-vocab refine starts (each draft slot's argmax of its base logits) with the
#: Pallas selection's argmax output (c=1: the same rule, NaN as -inf and the lowest id among equal values)
#: instead of XLA's argmax fusion, which reads the [rows, V] logits at ~2.2 TB/s (523.7 µs of a full-vocab call
#: at N=256, 126.6 at N=64). RESULTS.md "XLA's command-buffer scheduling mode; the full-vocab start through the
#: selection" (eighteenth session; device µs per refine, served -> the selection, min of 5 rounds, with
#: `compiler_options()`): N=32 952.7 -> 939.3, N=64 1565.1 -> 1537.2, N=128 2985.3 -> 2895.4, N=256 5289.6 ->
#: 5159.6; N=16 536.3 -> 537.8 and N=1 207.6 -> 210.1 (XLA's defaults), so not below N=32 at B=16.
FULL_VOCAB_START_SELECT_MIN_ROWS = 480

#: Draft rows up to which a top-C pass hands XLA's latent to the pick kernel as its residual's two float32
#: terms (`xpress_jax.reference.LatentSum`), which the kernel adds and rounds as it loads the latent: XLA's
#: residual kernel is gone. Measured (RESULTS.md "The residual inside the top-C pick", H200, top-512 with a token
#: table, device µs per refine, XLA residual -> in the pick): N=1 100 -> 95, N=4 145 -> 143, N=16 298 -> 314,
#: N=64 768 -> 774. Full-vocab passes never split: the fused pick loading two float32 tiles measured slower
#: at every N (N=1 231 -> 237, N=4 290 -> 597, N=16 533 -> 563); with the latent held once per program (the
#: twenty-eighth session, H100) it gained nothing at N=1 (229.0 -> 229.2) and lost at N=4 (363.1 held, 391.4 held
#: and split, 319.0 served). Top-512 N=16 split measured again then: 270.0 -> 268.0 (within noise; not changed).
SPLIT_LATENT_MAX_ROWS = 60

#: Draft rows up to which an unrolled full-vocab refine alternates the pick's vocabulary order (`Ops`'s
#: ``full_vocab_pass_pick``: pass 2, 4, ... visit each part's tiles from the highest ids down, so a pass
#: starts on the w2 rows still in L2 from the pass before). None: at every row count. RESULTS.md "The full-vocab
#: pick alternating its order" (fifteenth session; device µs per refine, ascending -> alternating): N=1 230.3 ->
#: 207.8, N=2 301.4 -> 300.0, N=4 290.6 -> 277.7; slower above (N=8 512.3 -> 534.7, N=16 536.2 -> 543.0, N=64
#: 1775.1 -> 1839.4; the pick is not bound by HBM there, and the slowdown was not looked into).
FULL_VOCAB_ALTERNATE_MAX_ROWS = 60

#: Draft rows up to which XLA's latent, where it is not split (full-vocab passes), puts the mixer's output and its
#: rounding behind one `lax.optimization_barrier` (`xpress_jax.head.latent`'s ``barrier``): XLA:GPU otherwise emits
#: the gather + mixer twice per pass, once for the gate/up GEMM and once more inside the residual's fusion. The
#: same values. Measured (full vocab with a token table, device µs per refine, served -> barrier, 0 tokens differ):
#: N=1 208.6 -> 203.0 (RESULTS.md sixteenth session), 207.7 -> 201.4 (twenty-first, under the CONCURRENT
#: scheduling mode); slower from N=4: 277.4 -> 282.1, N=16 532.4 -> 537.8, top-512 N=16 287.3 -> 292.5.
MIXER_BARRIER_MAX_ROWS: int | None = 15

#: The full-vocab pick's ``keep`` (`full_vocab.KEEP_POLICIES`) where its config holds the latent (``hold_lat``: the
#: `TABLE` rows from N=5 at B=16; N=1's too, but it is below `FULL_VOCAB_KEEP_MIN_ROWS`): "split", the tile loop
#: split before its last tile, with no L2 hint. Measured as the control of the L2 hints, it does what the hints did
#: (RESULTS.md "The full-vocab loop split; the top-C pick's hot splits", twenty-third session, H100; device µs per
#: refine with a token table, served -> split, 0 tokens differ): N=8 540.3 -> 506.2, N=16 584.2 -> 550.6 and 579.1
#: -> 545.2, N=64 1598.1 -> 1578.4, N=128 2962.9 -> 2870.1, N=256 5203.7 -> 5149.4 ("last", the hint, on an H200 in
#: the twenty-first: N=16 531.1 -> 500.8). Slower in the flat configs (N <= 4): N=4 323.5 -> 391.0 (the second
#: pipeline prologue); there it is None.
FULL_VOCAB_KEEP = "split"


#: Draft rows from which a config that holds the latent gets `FULL_VOCAB_KEEP`. Below (N=1 at B=16, whose config holds
#: the latent since the twenty-eighth session) the loop split measured +44 to +55 µs per refine in the three held
#: configs tried (H100, (16, 64, 6, 0, 4, 3): 229.7 without it, 283.5 with it), as in the flat configs (a second
#: pipeline prologue in a short tile loop).
FULL_VOCAB_KEEP_MIN_ROWS = 16


def full_vocab_keep(config, rows: int) -> str | None:
    """The ``keep`` of the full-vocab pick in ``config`` (a `full_vocab.FullVocabConfig`) over ``rows`` draft rows:
    `FULL_VOCAB_KEEP` where it holds the latent from `FULL_VOCAB_KEEP_MIN_ROWS` rows, else None."""
    return FULL_VOCAB_KEEP if config.hold_lat and rows >= FULL_VOCAB_KEEP_MIN_ROWS else None


#: The top-C pick's L2 hints (`topc_pick.topc_pick`'s ``keep``): the first half of each row's splits gather their
#: ``w2`` rows with evict_last (they stay in L2 for the next pass, which gathers the same rows), the rest with
#: evict_first, where one pass's gather (draft rows x C x rank x itemsize) is in ``TOPC_KEEP_GATHER_BYTES``
#: ``(lo, hi]``: more than L2 holds (50 MB on an H100 or H200) and its hot half not. RESULTS.md "The full-vocab loop
#: split; the top-C pick's hot splits" (twenty-third session, H100, top-512, device µs per refine with a token table,
#: served -> two hot splits of four, 0 tokens differ): N=16 (60 MiB) 284.4 -> 274.9 and 280.8 -> 268.6; slower at
#: N=4 (15 MiB) 135.5 -> 149.1, N=8 (30 MiB) 201.3 -> 209.6, N=32 (120 MiB) 433.5 -> 458.2, N=64 665.0 -> 705.1.
TOPC_KEEP_GATHER_BYTES: tuple[int, int] | None = (48 << 20, 96 << 20)


def topc_keep(rows: int, c: int, rank: int, itemsize: int, splits: int) -> tuple | None:
    """The top-C pick's ``keep`` for ``rows`` draft rows of ``c`` candidates (``splits`` programs per row), or None."""
    window = TOPC_KEEP_GATHER_BYTES
    if window is None or splits < 2 or not window[0] < rows * c * rank * itemsize <= window[1]:
        return None
    return (splits // 2, "evict_last", "evict_first")


#: Draft rows from which an unrolled full-vocab refine skips the draft slots that are final (`pass_pick_rows`);
#: None: never. RESULTS.md "Passes that skip the final draft slots" (sixteenth session; probe_skip.py, device µs
#: per refine with a token table, all rows -> skipping, 0 tokens differ): N=1 208.0 -> 210.2, N=2 277.9 -> 290.5,
#: N=4 277.9 -> 277.6, N=8 511.8 -> 511.1, N=16 535.3 -> 533.5, N=64 1771.2 -> 1569.9, N=128 3440.4 -> 2985.6,
#: N=256 5899.8 -> 5320.5 (the probe skipped wherever it could; at N=2 that cost 12 µs with no row tile fewer).
#: From 240 draft rows (N=16 at B=16), and a pass skips only where its pick then runs fewer row tiles: with the
#: served row tiles, from N=32 at K=6.
SKIP_FINAL_SLOTS_MIN_ROWS: int | None = 240

#: The same for the top-C pick (one program per row and split, so every skipped row is programs fewer). The same
#: probe, top-512: N=1 87.1 -> 86.6, N=2 140.7 -> 144.1, N=4 141.0 -> 149.1, N=8 210.7 -> 210.3, N=16 295.1 ->
#: 288.2, N=64 633.7 -> 625.5, N=128 1037.6 -> 1025.9, N=256 1854.4 -> 1773.6: from N=16 as well.
TOPC_SKIP_FINAL_SLOTS_MIN_ROWS: int | None = 240

#: Whether the certified mode's unrolled passes (`xpress_jax.exact.certified_passes`) tell their steps the pass
#: number: the draft slots that are final then keep their tokens and are left out of its scans (the packing of
#: the failing rows leaves them out even in a full pass; above `SCAN_FAILING_MAX_ROWS` the all-rows launch reads the
#: others through ``row_ids``), and its full-vocab picks read ``w2`` in the pass pick's order and with its L2 hint
#: (in the one-launch scan only with `CERTIFIED_SCAN_KEEP`). The same tokens. False: every pass as in a loop (for
#: benchmarks). Measured on an H200: RESULTS.md "Certified passes that know their number". Prediction (twenty-fourth session, before measuring; H100 fallback/scan today 1.28 / 1.20 / 1.29 /
#: 1.25x at N = 1 / 16 / 64 / 256): where pruning fails, -15 to -25 µs at N=1 (alternation), -10 to -15% of the
#: fallback's scans from N=16 (final slots); nothing where every row certifies (no scan runs there).
CERTIFIED_PASS_NUMBERS: bool = True

#: Whether the certified mode's one-launch scan (up to `SCAN_FAILING_MAX_ROWS` draft rows) takes the scan's loop split
#: (`full_vocab_keep`) over its vocabulary split read at run time. Off: measured slower (twenty-sixth session, H100,
#: std 0.06, every call falling back: N=16 642.8 -> 736.1, N=64 1852.4 -> 1887.9 µs per refine, 0 tokens differ;
#: RESULTS "What the certified mode's scan launches cost ..." part 3) where -20 to -30 µs at N=16 was predicted.
CERTIFIED_SCAN_KEEP: bool = False

#: Whether the certified mode's one pick per pass (where one launch scans its failing rows: N <= 4 at B=16, or no
#: packed scan) is the counted launch (`ops.Ops.gated_pick`): the last program of a row tile combines the tile's
#: parts, so no combine launch runs, and where no row is active (every row certified) the launch writes nothing:
#: the tokens are the certify launch's, aliased. The same tokens. Prediction (twenty-sixth session, before
#: measuring; H100): where every row certifies, the pick and its combine cost 18.0 µs per refine at N=1 and 19.6
#: at N=4 (RESULTS "What the certified mode's scan launches cost"); the combine's launch is about half: -7 to -10
#: µs per refine at N = 1..4; where pruning fails, within +-3 µs (the atomic and the last program's reads against
#: the combine launch, as the top-C pick's counted launch measured in the fourteenth session). Outcome (same session,
#: H100, RESULTS part 4): every row certifying, N=1 105.9 -> 95.0, N=4 179.0 -> 165.9 µs per refine (1.23 / 1.22x
#: top-512); pruning failing, N=1 273.8 -> 272.8; 0 tokens differ; its compiled tests passed. On.
CERTIFIED_COUNTED_PICK: bool = True

#: Whether the certified mode's one-launch scan (packed rows: more than one row tile, up to `SCAN_FAILING_MAX_ROWS`;
#: N = 9..64 at the serving shapes) is counted
#: (`kernels.full_vocab.scan_failing`'s ``counted``): the packing launch also writes the row-tile counters, the
#: pick's last program of a row tile combines the tile's parts and writes through the packed order, so no combine
#: launch runs, and where no row is active (every row certified) nothing is written: the certify launch's tokens,
#: aliased. The same tokens. Prediction (twenty-seventh session, before measuring; H100 twenty-sixth session: the
#: scan step, three launches, costs 36.7 / 87.6 µs per refine at N = 16 / 64 where every row certifies; the counted
#: pick saved 10.9-13.1 of 18.0-19.6 at N <= 4): -10 to -15 µs per refine at N=16 and N=64 where every row
#: certifies (certified 354 -> ~342 at N=16, 1.28x top-512); within +-5 µs where pruning fails. Outcome (same session,
#: H200, RESULTS "The certified mode's one-launch scan counted"): every row certifying, N=16 332.3 -> 319.4, N=64
#: 761.0 -> 726.7 (1.26 / 1.20x top-512); pruning failing, N=16 607.4 -> 599.5, N=64 1798.1 -> 1821.5 (+23: the last
#: program reduces 198 parts where the combine launch spreads them); 0 tokens differ; the whole suite passed compiled. On.
CERTIFIED_COUNTED_SCAN: bool = True

#: Warps of the selection's finish kernel up to C = 512 (the kernel's default, 16, above). RESULTS.md "The full-vocab
#: pick alternating its order; the selection's finish warps; ..." part 3 (fifteenth session; top-512 with a token
#: table, device µs per refine, 16 -> 8 warps):
#: N=1 88.5 -> 87.5, N=16 297.4 -> 294.6, N=64 651.7 -> 639.9, N=256 1890.1 -> 1849.7; the fastest of 15
#: selection variants at each of these N, the same candidates.
SELECT_FINISH_WARPS = 8

#: Draft rows up to which the top-C pick takes 32-candidate tiles (N=2 at B=16; `_topc_config`).
TOPC_SMALL_TILE_MAX_ROWS = 30

_FV_LAZY = dict(prefetch_base=True, lazy=True)
# Full-vocab pick configs (RESULTS.md "Full-vocab pick", evening: "lazy epilogue" + "whole waves";
# one pass at N = 1 / 4 / 16 / 64 / 256: 31.8 / 40.5 / 71.2 / 263.0 / 873.2 µs incl. ~17-24 µs loop).
# N=1: the latent held, whole-rank dots, 12 tiles of 64 per part (198 parts); measured inside refine against the
# flat (16, 128, 3, 64, 4, 4) config of the fourteenth session (RESULTS.md "A held latent at N=1", twenty-eighth).
_FV_15 = dict(row_tile=16, v_tile=64, v_steps=12, k_tile=0, num_warps=4, num_stages=3, hold_lat=True, **_FV_LAZY)
# N=2 (30 draft rows): RESULTS.md "Passes that skip the final draft slots; N=2's full-vocab config; ..." part 3
# (sixteenth session): 272.5 against 282.0 µs per refine for _FV_60 (and 273.3 against 283.9 in the fifteenth
# session's run); at N=3 (45 rows) two 32-row tiles lose (391.6 against 309.6).
_FV_30 = dict(row_tile=32, v_tile=64, v_steps=6, k_tile=64, num_warps=4, num_stages=4, hold_lat=False, flat=True,
              **_FV_LAZY)
_FV_60 = dict(row_tile=64, v_tile=64, v_steps=6, k_tile=64, num_warps=4, num_stages=4, hold_lat=False, flat=True,
              **_FV_LAZY)
_FV_240 = dict(row_tile=128, v_tile=64, v_steps=36, k_tile=0, num_warps=8, num_stages=3, hold_lat=True, **_FV_LAZY)
_FV_960 = dict(row_tile=128, v_tile=64, v_steps=12, k_tile=0, num_warps=8, num_stages=3, hold_lat=True, **_FV_LAZY)
_FV_BIG = dict(row_tile=128, v_tile=64, v_steps=108, k_tile=0, num_warps=8, num_stages=3, hold_lat=True, **_FV_LAZY)


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of `TABLE`: the decisions for draft-row counts up to ``max_rows``.

    full_vocab: `full_vocab.FullVocabConfig` fields of the fused readout + add/argmax pick.
    latent: ``"xla"`` (XLA's fused jnp latent: measured faster inside refine up to N=64), ``"split"``
      (three kernels spreading the weights over many programs) or ``"fused"`` (one kernel).
    latent_blocks_per_program: the fused latent's blocks per program.
    select_block: elements per block of the selection kernel's block maxima.
    source: the measurement behind the row (RESULTS.md section and row).
    """

    max_rows: int | None
    full_vocab: dict
    latent: str
    select_block: int
    source: str
    latent_blocks_per_program: int = 1


#: The decision table for 16-bit dtypes, by draft rows (N at B = 16 in the comments).
TABLE: tuple[Row, ...] = (
    Row(15, _FV_15, "xla", 16,  # N = 1
        "Full-vocab config at N=1 inside refine, twenty-eighth session (held latent 229.0 vs flat 236.4 µs per "
        "refine, H100); Latent pass N=1 (XLA ~0 vs split 1.9 µs); Small-N latency 2026-12-02: "
        "selection bs16 23.6 vs bs32 28.6 µs, refine top-512 113.3 vs 114.1"),
    Row(30, _FV_30, "xla", 16,  # N = 2
        "Full-vocab config at N=2 inside refine, sixteenth session (32-row tiles 272.5 vs 64-row 282.0 µs per "
        "refine); the rest as N = 2..4 below"),
    Row(60, _FV_60, "xla", 16,  # N = 3..4
        "Full-vocab pick N=4 (40.5 µs); Latent pass N=4 (XLA 0.8 vs split 3.5 µs); Small-N latency 2026-12-02: "
        "selection bs16 33.2 vs bs32 38.6 µs at N=4, refine top-512 135.1 vs 140.4 (N=2), 159.4 vs 165.3 (N=4)"),
    Row(239, _FV_240, "xla", 16,  # N = 5..15: between the measured points N=4 and N=16
        "Full-vocab pick N=16 (71.2 µs, 1 wave); Latent in refine N=8 (XLA 249.9 vs split 272.3 µs top-512, "
        "532.4 vs 584.1 full); selection bs16 faster at both neighbours (N=4: 33.2 vs 38.6 µs, N=16: 71.9 vs 89.1)"),
    Row(240, _FV_240, "xla", 16,  # N = 16
        "Full-vocab pick N=16 (71.2 µs); Latent in refine N=16 (XLA 371.5 vs split 410.1 µs top-512, 611.0 vs "
        "648.8 full); Top-C selection N=16 (bs16 56.9 vs bs32 77.9 µs)"),
    Row(960, _FV_960, "xla", 16,  # N = 17..64
        "Full-vocab pick N=64 (263.0 µs, 12 waves); Latent in refine N=32 (XLA 608.3 vs split 634.9 µs "
        "top-512) and N=64 (XLA 1002.3 vs split 1001.5 µs: equal)"),
    Row(1905, _FV_BIG, "fused", 16,  # N = 65..127
        "Full-vocab pick N=256 (873.2 µs, 5 waves); Latent pass (fused above N=64: one program per block)"),
    Row(None, _FV_BIG, "fused", 16,  # N >= 128
        "Full-vocab pick N=256 (873.2 µs); Latent pass N=256 (fused 2 blocks/program 20.8 vs XLA 21.9 µs); "
        "Top-C selection N=256 (bs16 708.8 vs bs32 807.9 µs)", latent_blocks_per_program=2),
)


def select_config(row: Row, c: int) -> dict:
    """The selection kernel's `select.SelectConfig` fields (a dict: only what differs from its defaults)
    for ``c`` candidates per row under table row ``row``.

    The defaults (2048 groups, cap 1024) serve C <= 512. Above that the fast finish needs the elements
    above the bound, ``M``, to fit in ``cap``, and the bound (the C-th largest of the group maxima) to
    be tight, i.e. groups well above C: with the defaults every row of C = 1024 and above took the
    whole-row slow path (H200, N = 1 / 16 / 256: C=1024 454 / 754 / 10102 µs, C=2048 475 / 1025 / 15399
    µs). Here cap = next_pow2(2C) and groups = next_pow2(4C) (both at most 16384), with 16-element
    blocks, 8 above C = 2048 (so that there are more blocks than groups at V = 151936): C=1024 33 /
    94 / 938, C=2048 54 / 139 / 1339, C=4096 88 / 197 / 2144 µs, the same candidates (RESULTS.md
    "Selection above C=512"). Up to C = 512 the finish runs `SELECT_FINISH_WARPS` warps. Every config is
    exact for any input; these only decide the speed.
    """
    sel = {} if row.select_block == select.SelectConfig().block else dict(block=row.select_block)
    sel["finish_warps"] = SELECT_FINISH_WARPS
    if c > 512:
        sel = dict(cap=min(next_pow2(2 * c), 16384), groups=min(next_pow2(4 * c), 16384),
                   block=min(row.select_block, 16) if c <= 2048 else 8)  # the kernel's finish_warps (16)
    return sel


def _topc_config(rows: int) -> topc_pick.TopCConfig:
    """Top-C pick (all rows, any C, rank and dtype): one candidate tile per program (``c_steps=1``, so
    ``splits = cdiv(C, c_tile)`` programs per row); 32-candidate tiles, 128-wide rank chunks and 4 warps up to
    `TOPC_SMALL_TILE_MAX_ROWS` draft rows, 128-candidate tiles, 64-wide chunks and 8 warps above.
    Measured inside refine (RESULTS.md "Top-C pick configs inside refine", fourteenth session): against
    the earlier 128-candidate tiles with ``c_steps`` = half the kernel heuristic's (2-4 steps from N=32),
    -4 to -5 µs per refine at N = 1-2, within noise at N = 4-16, then -50 (N=32), -112 (N=64),
    -187 (N=128) and -400 (N=256)."""
    if rows <= TOPC_SMALL_TILE_MAX_ROWS:
        return topc_pick.TopCConfig(c_tile=32, c_steps=1, k_tile=128, num_warps=4, num_stages=2)
    return topc_pick.TopCConfig(c_tile=128, c_steps=1, k_tile=64, num_warps=8, num_stages=2)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What each step runs at one set of shapes. A ``None`` config means the jnp reference.

    select: selection kernel keyword arguments (`select.SelectConfig` fields), or None.
    latent: `latent.LatentConfig`, or None (XLA's jnp latent).
    full_vocab: `full_vocab.FullVocabConfig`, or None.
    topc: `topc_pick.TopCConfig`, or None (None too when C = 0).
    row: the `TABLE` row used (None for float64 and N = 0).
    """

    select: dict | None
    latent: latent.LatentConfig | None
    full_vocab: full_vocab.FullVocabConfig | None
    topc: topc_pick.TopCConfig | None
    row: Row | None = None


def _row(rows: int) -> Row:
    return next(r for r in TABLE if r.max_rows is None or rows <= r.max_rows)


def plan(n: int, b: int, v: int, r: int, c: int, dtype: Any, *, kernels_everywhere: bool = False) -> Plan:
    """The plan for N blocks of B slots, vocab V, rank r, top-C ``c`` (0: full vocab), ``dtype``.

    ``kernels_everywhere``: use a kernel even where the table prefers XLA for speed (the latent
    at tiny N), so interpret-mode tests exercise every kernel. float64 still gets the reference.
    Every config returned passes its kernel's ``check_shape`` at these shapes: a table config
    that cannot run at this rank is fitted (`full_vocab.fit_shared_memory`; the fused latent
    falls back to split), never handed out broken.
    """
    dtype = jnp.dtype(dtype)
    rows = n * (b - 1)
    if dtype == jnp.float64 or rows == 0:
        return Plan(None, None, None, None)
    row = _row(rows)
    f32 = dtype.itemsize > 2
    if row.latent == "xla" and not kernels_everywhere:
        lat = None
    else:
        variant = "fused" if row.latent == "fused" else "split"
        lat = latent.default_config(n, dtype, variant, rank=r)
        if variant == "fused" and not f32:
            lat = dataclasses.replace(lat, blocks_per_program=row.latent_blocks_per_program)
        if variant == "fused" and lat.smem_bytes(r, dtype) > latent.SMEM_LIMIT:
            lat = latent.default_config(n, dtype, "split", rank=r)
    if f32:  # never tuned: the kernel's heuristic
        fv = full_vocab.default_config(rows, v, r, dtype)
    else:
        fv = full_vocab.fit_shared_memory(full_vocab.FullVocabConfig(**row.full_vocab), r, dtype)
    sel = select_config(row, c)
    if lat is not None:
        lat.check_shape(r, dtype)
    fv.check_shape(rows, v, r, dtype)
    tc = None
    if c:
        tc = _topc_config(rows)
        tc.check_shape(rows, c, r, dtype)
    return Plan(select=sel, latent=lat, full_vocab=fv, topc=tc, row=row)


def pass_pick_rows(n: int, b: int, q: int, row_tile: int, *, min_rows: int | None, everywhere: bool = False) -> int:
    """The first draft slot that pass ``q`` (0-based) of a refine picks, ``s``: the slots before it keep their
    tokens. Draft slot j (block slot j + 1) reads only the slots before it, so it is final after pass j + 1
    and passes ``q > j`` would give it the same token bit for bit (SEMANTICS "One call"): ``s`` is at most
    ``min(q, B-1)`` (``B-1``: nothing left to pick). Skipping pays only where the pick runs fewer row tiles of
    ``row_tile`` rows (the top-C pick: 1), from ``min_rows`` draft rows (`SKIP_FINAL_SLOTS_MIN_ROWS`,
    `TOPC_SKIP_FINAL_SLOTS_MIN_ROWS`; None: never); ``everywhere`` (interpret mode, the tests) skips whenever
    it can."""
    s = min(q, b - 1)
    if s in (0, b - 1) or everywhere:
        return s
    rows = n * (b - 1)
    if min_rows is None or rows < min_rows:
        return 0
    return s if cdiv(n * (b - 1 - s), row_tile) < cdiv(rows, row_tile) else 0


def capacity_config(cfg: full_vocab.FullVocabConfig, vocab: int) -> full_vocab.FullVocabConfig:
    """The all-rows full-vocab config ``cfg`` for a launch on a few packed rows (the kernel's
    ``capacity``): only ``v_steps`` changes, to at most ``ceil(V / v_tile / SMS)``, so that one row tile
    alone spreads the vocabulary over a whole wave of programs (the all-rows configs of large N give a
    row tile ~22 programs: RESULTS.md "Exact mode", capacity launch). Every (row, id) score is computed
    as with ``cfg`` (same tiles, same rank chunks, same instructions), so the tokens are the same bit
    for bit; the vocabulary split does not change the winner (largest score, lowest id)."""
    steps = max(1, cdiv(cdiv(vocab, cfg.v_tile), SMS))
    return dataclasses.replace(cfg, v_steps=min(cfg.v_steps, steps))
