"""The optimized HLO of the certified refine at N=1 and N=4 (serving shapes, bf16, std 0.01, prepared M), as
XLA:GPU compiles it: argv[1] = out dir; writes hlo_n{N}.txt and prints the per-pass ops that are neither Triton
custom calls nor the latent's (what the certified mode adds to a top-C pass)."""
import os
import re
import sys

import jax

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem
from xpress_jax import exact
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

out = sys.argv[1]
cfg = xj.HeadConfig(**SERVING)
for n in (1, 4):
    p, l, h, a = make_problem(cfg, n, std=0.01)
    prep = exact.prepare_certified(p["w2"])
    f = jax.jit(lambda p, l, h, a: refine_with(Ops.pallas(False), p, l, h, a, config=cfg, topc=0,
                                               full_vocab="certified", certified_prepared=prep))
    text = f.lower(p, l, h, a).compile().as_text()
    open(os.path.join(out, f"hlo_n{n}.txt"), "w").write(text)
    entry = text[text.index("ENTRY"):]
    print(f"== N={n}: ENTRY ops")
    for line in entry.splitlines():
        m = re.match(r"\s*(\S+) = (\S+) (\w[\w-]*)\(", line)
        if m and m.group(3) not in ("parameter", "get-tuple-element", "bitcast", "constant", "tuple"):
            print("   ", line.strip()[:220])
