"""Session 21 (issue 16): L2 eviction hints on the full-vocab pick's w2 loads.

At N <= 4 a full-vocab pass reads all of w2 (78 MB) in one wave of programs; the H200's L2 holds 50 MB. Passes
alternate their order inside each part (fifteenth session: -4 µs per pass, about 60% of the 26 MB a pass reads
last hitting in L2 for the next pass). `full_vocab.KEEP_POLICIES`: "last" marks the loads of a part's last
visited tile `evict_last` and the others `evict_first` (PTX L2 cache hints), so the rows the next pass starts
on should stay; "last_only" leaves the others normal; "first" marks every load evict_first (control).
Prediction: if the hit rate of the last third rises from ~60% to ~90%, -1.5 to -2 µs per pass, -8 to -12 µs per
refine at N=1, less at N=2..4; nothing at N >= 8 (not bound by w2's bytes; no alternation there, but "last" is
tried at N=8/16 too). Also at N=1 "last" with the mixer behind an optimization barrier (sixteenth session:
-5.6 µs at full N=1) and two other splits of the vocabulary (4 and 6 tiles per part, so that the kept set is
20 / 13 MB). Same kernels, same operations: 0 tokens may differ. Chained device µs per refine with a token
table, 3 interleaved rounds; run with XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT (served).
JSON lines to argv[1]; a trace of N=1's kernels (served vs last) to argv[1] + ".trace". (Ran as one file;
its shared parts moved to probe_keep_common.py afterwards, unchanged.)"""
import dataclasses, json, os, sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import CFG, kernel_trace, time_variants  # noqa: E402
from benchmarks.bench_refine import make_problem  # noqa: E402
import xpress_jax as xj  # noqa: E402
from xpress_jax import dispatch  # noqa: E402
from xpress_jax.refine import refine_with  # noqa: E402
from probe_keep_common import P, barrier_latent, with_config, with_keep  # noqa: E402


out = open(sys.argv[1], "w")
PLANS = {
    1: {"last": with_keep("last"), "last_only": with_keep("last_only"), "first": with_keep("first"),
        "last+barrier": with_keep("last", barrier_latent), "barrier": dataclasses.replace(P, latent=barrier_latent),
        "v4": with_config((16, 128, 4, 64, 4, 4), None), "v4 last": with_config((16, 128, 4, 64, 4, 4), "last"),
        "v64x6 last": with_config((16, 64, 6, 64, 4, 4), "last")},
    2: {"last": with_keep("last"), "last_only": with_keep("last_only")},
    4: {"last": with_keep("last"), "last_only": with_keep("last_only"), "last+barrier": with_keep("last", barrier_latent)},
    8: {"last": with_keep("last")},
    16: {"last": with_keep("last")},
}
for n, variants in PLANS.items():
    served = dispatch.plan(n, CFG.block_size, CFG.vocab_size, CFG.rank, 0, jnp.bfloat16).full_vocab
    time_variants(n, 0, {"served": P, **variants}, 3, out, dict(served_config=str(served)))

# One call's kernels at N=1: the picks' summed time, served vs "last".
params, logits, h, anchors = make_problem(CFG, 1, std=0.02)
T = jax.jit(xj.token_table)(params)
with open(sys.argv[1] + ".trace", "w") as tr:
    for name, ops in (("served", P), ("last", with_keep("last")), ("served", P), ("last", with_keep("last"))):
        fn = lambda p, l, hh, a, ops=ops: refine_with(ops, p, l, hh, a, config=CFG, topc=0, token_table=T)
        t = kernel_trace(fn, (params, logits, h, anchors), f"keep_{name}")
        t["variant"] = name
        tr.write(json.dumps(t) + "\n")
        pick = [x for x in t["top"] if "full_vocab" in x[0]]
        print(f"trace {name:8s} span {t['span']:7.1f} kernels {t['n']} picks {pick}", flush=True)
