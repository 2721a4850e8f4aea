"""Session 16 (issue 16): what the per-pass `loop_convert_fusion_6..11` kernels of a full-vocab refine at N=1 are
(~3.5 µs each in `probe_small.py`'s trace, one per pass, against ~1.2 µs for top-512's `loop_reduce_fusion_1`).
Writes the optimized HLO of the full-vocab and the top-512 refine at N=1 (with a token table) to argv[1]/, prints
the fusions of interest, and traces the full-vocab refine without its pass pick (the fori form) for comparison."""
import dataclasses, os, re, sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import CFG as cfg, kernel_trace  # noqa: E402
from benchmarks.bench_refine import make_problem  # noqa: E402
import xpress_jax as xj  # noqa: E402
from xpress_jax.ops import Ops  # noqa: E402
from xpress_jax.refine import refine_with  # noqa: E402

P = Ops.pallas()
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
params, logits, h, anchors = make_problem(cfg, 1, std=0.02)
T = jax.jit(xj.token_table)(params)
for name, ops, topc in (("full", P, 0), ("topc", P, 512), ("full_fori", dataclasses.replace(P, full_vocab_pass_pick=None), 0)):
    def fn(p, t, l, hh, a, ops=ops, topc=topc):
        return refine_with(ops, p, l, hh, a, config=cfg, topc=topc, token_table=t)
    txt = jax.jit(fn).lower(params, T, logits, h, anchors).compile().as_text()
    open(f"{d}/{name}.hlo.txt", "w").write(txt)
    print(f"== {name}: {len(txt)} chars")
    for fus in ("loop_convert_fusion_6", "loop_convert_fusion_7", "loop_reduce_fusion_1", "loop_convert_fusion"):
        lines = [ln for ln in txt.splitlines() if re.search(rf"%{fus} = ", ln)]
        for ln in lines[:1]:
            print(f"  {ln.strip()[:600]}")
    if name == "full_fori":
        tr = kernel_trace(fn, (params, T, logits, h, anchors), "s16_fori")
        print(f"  trace: {tr['n']} kernels, span {tr['span']} busy {tr['busy']}")
        for k, c, t in tr["top"][:10]:
            print(f"    {k:40s} x{c:2d} {t:7.1f}")
