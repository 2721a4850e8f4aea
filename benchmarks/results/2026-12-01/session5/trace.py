import sys; sys.path.insert(0, ".")
"""Per-kernel device time of one refine (perfetto trace): argv = N,topc,std,full_vocab ..."""
import collections, glob, gzip, importlib.util, json, os, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem
OUT = os.environ.get("OUT", "/tmp/out")
cfg = xj.HeadConfig(**SERVING)
res = {}

# The fourth session's trace script (its parser and trace loop; same folder layout under results/).
_spec = importlib.util.spec_from_file_location("s4_trace", os.path.join(os.path.dirname(__file__), "..", "issue14c", "s4_trace.py"))
_s4 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_s4)

for spec in sys.argv[1:]:
    n, c, std, fv = spec.split(",")
    n, c, std = int(n), int(c), float(std)
    r = _s4.trace_refine(n, spec.replace(",", "_"), std=std, **(dict(topc=c) if c else dict(topc=0, full_vocab=fv)))
    res[spec] = r
    print(f"== {spec}: span {r['span']:.0f} busy {r['busy']:.0f} n {r['n']}", flush=True)
    for k in r["kernels"]: print("   ", k)
json.dump(res, open(f"{OUT}/trace.json", "w"), indent=1)
