"""Session 7: the certified mode's failing-row scan as one launch (`ops.scan_failing`: pack, one fused pick
in packed order, combine back) against the previous two launches (the packed capacity launch and the
all-rows launch, with XLA's packing), in one run; with the scan and top-512 as references.

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-01/session7/probe_scan_failing.py OUT_DIR

Device µs per refine (chained, optimization-barrier harness of bench_refine), serving shapes, bf16, K=6,
C=512, `certified_prepared` passed. Tokens of every variant are compared with the scan's.

Variants: scan, top512, cert_new (Ops.pallas), cert_old (Ops.pallas without scan_failing), cert_static (one
launch, capacity_config's split for full passes too), cert_one (one launch at any row count).
`scan_failing.jsonl` and `scan_failing_parts_bug.jsonl` (the first run: the static split's grid had one part
per vocab tile, fixed) were measured before exact.py chose between the two scans by
`dispatch.SCAN_FAILING_MAX_ROWS`: cert_new was the one launch at every N and cert_old the two-launch scan.
`FINAL=1 JSONL=final.jsonl`: the committed dispatch (cert_new), and cert_one at N=128. `FLAGS=after`: the
certified mode with top-512 and the scan at N = 1..256 (`flags_after.jsonl`); `FLAGS=before`: the certified
mode alone on the tree before the flags change, in the same lease (`flags_before.jsonl`; run as
PYTHONPATH=.old:$PWD with that tree's xpress_jax copied to .old/).
"""
import dataclasses
import json
import os
import sys

import jax
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chain_length, chained, make_problem, time_device
from xpress_jax import exact
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
small = os.environ.get("SMALL") == "1"  # CPU smoke test: tiny shapes, kernels in interpret mode
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=2000, hidden_size=64, rank=32, mlp_hidden=64, topc=64) if small
                       else SERVING))
new = Ops.pallas(small)
old = dataclasses.replace(new, scan_failing=None)  # before this session's exact.py: the two-launch scan (today: one pick)


def _static_scan_failing(logits, lat, w2, fail, fallen, fallback, limit):
    """`ops._pallas_scan_failing` with one static split (capacity_config's) for full passes too."""
    from xpress_jax import dispatch
    from xpress_jax.kernels import full_vocab

    n, b, v = logits.shape
    fv = dispatch.plan(n, b, v, lat.shape[1], 0, logits.dtype).full_vocab
    return full_vocab.scan_failing(logits.reshape(n * b, v), lat, w2, fail, fallen, fallback, limit=int(limit),
                                   config=dispatch.capacity_config(fv, v), interpret=small, slot_stride=b)


static = dataclasses.replace(new, scan_failing=_static_scan_failing)


def _one_scan_failing(logits, lat, w2, fail, fallen, fallback, limit):
    """The one-launch scan at any row count (no SCAN_FAILING_MAX_ROWS), the plan's split when full."""
    from xpress_jax import dispatch
    from xpress_jax.kernels import full_vocab

    n, b, v = logits.shape
    fv = dispatch.plan(n, b, v, lat.shape[1], 0, logits.dtype).full_vocab
    return full_vocab.scan_failing(logits.reshape(n * b, v), lat, w2, fail, fallen, fallback, limit=int(limit),
                                   config=dispatch.capacity_config(fv, v), v_steps_full=fv.v_steps,
                                   interpret=small, slot_stride=b)


one = dataclasses.replace(new, scan_failing=_one_scan_failing)
PLAN = [  # (std, N, variants)
    (0.02, 16, ("scan", "top512", "cert_old", "cert_new", "cert_static")),
    (0.02, 64, ("scan", "top512", "cert_old", "cert_new", "cert_static")),
    (0.02, 256, ("scan", "top512", "cert_old", "cert_new", "cert_static")),
    (0.02, 32, ("cert_old", "cert_new", "cert_static")),
    (0.01, 32, ("cert_old", "cert_new", "cert_static")),
    (0.01, 16, ("cert_old", "cert_new", "cert_static")),
    (0.01, 64, ("cert_old", "cert_new", "cert_static")),
    (0.01, 256, ("cert_old", "cert_new", "cert_static")),
    (0.06, 16, ("scan", "cert_old", "cert_new", "cert_static")),
    (0.06, 256, ("scan", "cert_old", "cert_new", "cert_static")),
]
if os.environ.get("FINAL") == "1":  # the committed dispatch (Ops.pallas: the one-launch scan up to 960 rows)
    PLAN = ([(0.02, n, ("scan", "cert_new")) for n in (16, 64, 256)]
            + [(0.02, 128, ("scan", "cert_new", "cert_one")), (0.01, 128, ("cert_new", "cert_one"))])
if os.environ.get("FLAGS"):  # the flags change: FLAGS=before (PYTHONPATH=.old:$PWD: the tree before), FLAGS=after
    ref_variants = () if os.environ["FLAGS"] == "before" else ("top512", "scan")
    PLAN = ([(0.01, n, (*ref_variants, "cert_new")) for n in (1, 4, 16, 64, 256)]
            + [(0.02, n, (*ref_variants[1:], "cert_new")) for n in (1, 16)])
rows = []
f = open(os.path.join(out_dir, os.environ.get("JSONL", "scan_failing.jsonl")), "w")
for std, n, variants in (PLAN[:1] + PLAN[-1:] if small else PLAN):
    problem = make_problem(cfg, n, std=std)
    prep = exact.prepare_certified(problem[0]["w2"])
    toks = {}
    for v in variants:
        ops = {"cert_old": old, "cert_static": static, "cert_one": one}.get(v, new)
        topc = 512 if v == "top512" else 0
        fv = exact.Certified() if v.startswith("cert") else "scan"

        def fn(p, l, h, a, ops=ops, topc=topc, fv=fv, stats=False):
            return refine_with(ops, p, l, h, a, config=cfg, topc=topc, full_vocab=fv, return_stats=stats,
                               certified_prepared=prep if fv != "scan" else None)

        toks[v] = np.asarray(jax.jit(fn)(*problem))
        rec = dict(std=std, N=n, variant=v)
        if v.startswith("cert"):
            st = jax.jit(lambda *a: fn(*a, stats=True))(*problem)[1]
            rec.update({k: float(x) for k, x in st._asdict().items()})
        m = 2 if small else chain_length(n, 0, "pallas")
        rec["device_us"] = time_device(chained(cfg, m, refine_fn=fn), problem, 1 if small else 5) / m * 1e6
        if "scan" in toks and v != "scan" and v != "top512":
            rec["differ_from_scan"] = int(np.sum(toks[v] != toks["scan"]))
        if v in ("cert_new", "cert_static", "cert_one") and "cert_old" in toks:
            rec["differ_from_old"] = int(np.sum(toks[v] != toks["cert_old"]))
        rows.append(rec)
        f.write(json.dumps(rec) + "\n")
        f.flush()
        print(json.dumps(rec), flush=True)
print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}")
print(f"{'std':>5} {'N':>4} {'variant':>9} {'µs':>8} {'rows_cert':>9} {'diff':>5}")
for r in rows:
    print(f"{r['std']:>5} {r['N']:>4} {r['variant']:>9} {r['device_us']:8.1f} {r.get('rows_certified', float('nan')):9.3f} "
          f"{r.get('differ_from_scan', r.get('differ_from_old', '-'))!s:>5}")
