import sys; sys.path.insert(0, ".")
"""Every kernel of one refine (perfetto trace), the certified mode with its prepared weight data:
argv = N,topc,std,full_vocab ...; writes $OUT/trace_all.json and prints per-kernel (µs, count)."""
import importlib.util, json, os

OUT = os.environ.get("OUT", "/tmp/out")
# The fourth session's trace script (its parser and trace loop), keeping every kernel.
_spec = importlib.util.spec_from_file_location("s4_trace", os.path.join(os.path.dirname(__file__), "..", "issue14c", "s4_trace.py"))
_s4 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_s4)
_s4.TOP = 1000
res = {}
for spec in sys.argv[1:]:
    n, c, std, fv = spec.split(",")
    n, c, std = int(n), int(c), float(std)
    kw = dict(topc=c) if c else dict(topc=0, full_vocab=fv, prepared=fv == "certified")
    r = _s4.trace_refine(n, spec.replace(",", "_"), std=std, **kw)
    res[spec] = r
    if isinstance(r, str):
        print(spec, r); continue
    print(f"== {spec}: span {r['span']:.0f} busy {r['busy']:.0f} kernels {r['n']}", flush=True)
    for k in r["kernels"]: print("    %-50s %7.1f %3d" % tuple(k))
json.dump(res, open(f"{OUT}/trace_all.json", "w"), indent=1)
