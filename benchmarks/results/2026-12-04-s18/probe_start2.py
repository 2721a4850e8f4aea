"""The full-vocab start through the Pallas selection (c=1), again, with the shipped compile options
(eighteenth session).

Session 16's `probe_start.py` ran in this session's third device call (XLA's default options): "select1" (the
selection's argmax output instead of XLA's argmax fusion) 5318.6 -> 5148.2 µs at N=256 (rounds 5148-5277 vs
5319-5350), 1562.1 -> 1537.2 at N=64 (noise: 1537-1574 vs 1562-1568), +1.5 at N=16, +2.4 at N=1; XLA's argmax
(`input_reduce_fusion`) took 523.7 µs of a full N=256 call (1.17 GB: 2.2 TB/s) and 126.6 at N=64. This run:
XLA_FLAGS with the scheduling mode CONCURRENT (what `xpress_jax.compiler_options()` gives RefineServer; under
it the start may overlap the hidden-input GEMMs), N = 32, 64, 128, 256, 5 interleaved rounds. Prediction:
-100..-170 at N=256, -40..-90 at N=128, within ±20 at N <= 64. JSON lines to argv[1].
Run: XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT PYTHONPATH=$PWD python3 <this> F
"""
import dataclasses, os, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import time_variants  # noqa: E402
from xpress_jax.ops import Ops  # noqa: E402

P = Ops.pallas()
S1 = dataclasses.replace(P, name="select1", start=lambda logits: P.select(logits, 1)[2])
out = open(sys.argv[1], "w")
print("XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""), flush=True)
for n in (32, 64, 128, 256):
    time_variants(n, 0, {"served": P, "select1": S1}, 5, out)
