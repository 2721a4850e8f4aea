"""Dev benchmark: top-C candidate selection (pallas_kernels.select) vs lax.top_k and torch.topk.

Run on the GPU machine (JAX 0.11.2 + torch on an H200), from the repo root:

    PYTHONPATH=$PWD python3 benchmarks/dev_select.py [--quick]

Shapes: V=151936, C=512, bf16 base logits [rows=15N, V], N in 1,4,16,64,256; inputs: random
normal logits and a heavy-ties copy (rounded to multiples of 0.5: ~20 distinct values, hundreds
tied at the C-th place). Checks kernel == lax.top_k (sets of ids, values bit-exact) and argmax ==
jnp.argmax on the device, then times:
  * JAX device time: `iters` calls chained in one jitted fori_loop (each call's input depends on
    the previous call's output, so nothing is hoisted), wall time / iters, median of 5; a loop
    with the same chaining but no selection is timed too (``loop``) and subtracted (``net``).
  * torch.topk(sorted=False) on the same buffer (DLPack), CUDA events, median of 5.
  * the kernel's stages (stats[+bound], +gather, +finish) at N=1 and N=256, and config variants
    ("measure which"), each at the N it lists (of N=1, 16, 256), most important first, until the
    time budget: the pre-2026-11-30-evening default (``old_default``: strided, G=1024, cap=2048),
    both methods alone, then block-size / warp variants of the blocks method.
A failing variant (compile error, wrong rows) is recorded and the sweep goes on.
Prints a compact table last; writes $OUT/select.json when $OUT is set. Runtime < 150 s.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for torch

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.timing import time_jitted  # noqa: E402
from jax import lax  # noqa: E402

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

from pallas_kernels import select as sel  # noqa: E402

V, C = 151936, 512
NS = (1, 16, 256)
INTERPRET = False  # --cpu-smoke: tiny shapes in interpret mode, to check this script on CPU
HBM_BYTES_PER_S = 4.8e12  # H200 peak; the floor below is one read of the logits
T0 = time.perf_counter()
ALL, BIG = (1, 16, 256), (16, 256)
VARIANTS = {  # name -> (SelectConfig fields, the N to measure it at); "measure which", most important first
    "default": ({}, ALL),  # method="auto": strided below 64 rows (N=1), blocks from there on
    "old_default": (dict(method="strided", groups=1024, cap=2048), ALL),  # the default this morning
    "strided": (dict(method="strided"), ALL),  # strided with the new defaults (G=2048, cap=1024)
    "blocks": (dict(method="blocks"), (1,)),  # blocks at N=1 too (auto picks strided there)
    "blocks_g1024": (dict(method="blocks", groups=1024), BIG),  # cheaper bound, ~20% more blocks read
    "blocks_g4096": (dict(method="blocks", groups=4096), BIG),  # tighter bound, dearer search
    "blocks_bs16": (dict(method="blocks", block=16), BIG),  # half the elements read, 2x block maxima
    "blocks_bs64": (dict(method="blocks", block=64), BIG),
    "blocks_gw8": (dict(method="blocks", gather_warps=8), BIG),
    "blocks_gw2": (dict(method="blocks", gather_warps=2, gather_blocks=32), BIG),
    "blocks_gb128": (dict(method="blocks", gather_blocks=128), BIG),
    "blocks_fw8": (dict(method="blocks", finish_warps=8), BIG),
    "blocks_fw4": (dict(method="blocks", finish_warps=4), BIG),
    "blocks_st64x8": (dict(method="blocks", stats_blocks=64, stats_unroll=8), BIG),
    "blocks_sw4": (dict(method="blocks", num_warps=4, stats_blocks=256), BIG),
    "blocks_scan4k": (dict(method="blocks", scan_blocks=4096, gather_warps=8), BIG),
    "strided_fw8": (dict(method="strided", finish_warps=8), (1,)),
    "progs256": (dict(target_programs=256), (1,)),
}
BUDGET_S = 130  # stop the sweep here (the whole script must stay < 150 s)


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def kernel_fn(cfg=None, upto="finish"):
    return _kernel_fn(tuple(sorted((cfg or {}).items())), upto)


@functools.lru_cache(maxsize=None)
def _kernel_fn(cfg_items, upto):
    cfg = sel.SelectConfig(**dict(cfg_items))
    return jax.jit(functools.partial(sel._select_pallas, c=C, cfg=cfg, interpret=INTERPRET, upto=upto))


@jax.jit
def topk_fn(x):
    return sel.select_candidates_reference(x, C)


@jax.jit
def nothing_fn(x):
    """The chaining alone: a tiny op that reads x (so the loop keeps its update of x)."""
    return (lax.bitcast_convert_type(x[:1, :1], jnp.int16).astype(jnp.int32),)


@functools.lru_cache(maxsize=None)
def chained(fn, iters):
    """jit(fori_loop of `iters` calls); each call's input depends on the previous call's output."""

    def body(_, carry):
        x, acc = carry
        outs = fn(x)
        dep = sum(o.reshape(-1)[0].astype(jnp.int32) + o.reshape(-1)[-1].astype(jnp.int32)
                  for o in outs if jnp.issubdtype(o.dtype, jnp.integer))
        # never true, but XLA cannot know: x (updated in place) depends on this call's output
        x = x.at[0, 0].set(jnp.where(dep == -12345, jnp.zeros((), x.dtype), x[0, 0]))
        return x, acc + dep

    return jax.jit(lambda x: lax.fori_loop(0, iters, body, (x, jnp.int32(0))))


def time_jax(fn, x, iters, reps=5):
    return time_jitted(chained(fn, iters), (x,), reps)[1] / iters * 1e6


def time_torch(t, iters, reps=5):
    import torch

    for _ in range(3):
        torch.topk(t, C, dim=-1, sorted=False)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            torch.topk(t, C, dim=-1, sorted=False)
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / iters * 1e3)
    return statistics.median(ts)


@jax.jit
def _compare(cand, vals, arg, rc, rv, ra):
    o, ro = jnp.argsort(cand, axis=1), jnp.argsort(rc, axis=1)
    ids = jnp.take_along_axis(cand, o, 1) == jnp.take_along_axis(rc, ro, 1)
    bits = lambda v: lax.bitcast_convert_type(v, jnp.int16)  # noqa: E731  (bf16 bit patterns)
    same_v = bits(jnp.take_along_axis(vals, o, 1)) == bits(jnp.take_along_axis(rv, ro, 1))
    return jnp.sum(~jnp.all(ids & same_v, axis=1)), jnp.sum(arg != ra)


def check(x, cfg=None):
    """(rows whose candidate set or values differ from lax.top_k, argmax mismatches)."""
    got = kernel_fn(cfg)(x)
    ref = topk_fn(x)
    bad, bad_arg = _compare(*got, *ref)
    return int(bad), int(bad_arg)


def torch_set_mismatch(t, cand):
    import torch

    _, ti = torch.topk(t, C, dim=-1, sorted=False)
    ours = torch.from_dlpack(cand).long()
    return int((torch.sort(ti, 1).values != torch.sort(ours, 1).values).any(1).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the stage breakdown and the variant sweep")
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--cpu-smoke", action="store_true", help="V=4096, C=64, interpret mode (plumbing check)")
    args = ap.parse_args()
    ns = [int(n) for n in args.ns.split(",")]
    if args.cpu_smoke:
        global V, C, INTERPRET
        V, C, INTERPRET = 4096, 64, True
        VARIANTS.clear()
        VARIANTS.update(default=({}, ALL), old_default=(dict(method="strided", groups=1024, cap=2048), ALL),
                        blocks=(dict(method="blocks", groups=256), ALL))
    try:
        import torch
    except ImportError:
        torch = None
    dev = jax.devices()[0]
    log(f"device {dev.device_kind}, jax {jax.__version__}, torch {getattr(torch, '__version__', None)}")
    res = dict(device=dev.device_kind, jax=jax.__version__, torch=getattr(torch, "__version__", None),
               date=datetime.datetime.now().isoformat(timespec="seconds"), V=V, C=C, dtype="bfloat16",
               method="device time: chained calls in one jitted fori_loop, median of 5; torch: CUDA events",
               rows=[], stages=[], variants=[])
    key = jax.random.key(0)
    for n in ns:
        rows = 15 * n
        normal = jax.random.normal(jax.random.fold_in(key, n), (rows, V), jnp.float32).astype(jnp.bfloat16)
        ties = (jnp.round(normal.astype(jnp.float32) * 2) / 2).astype(jnp.bfloat16)
        floor = rows * V * 2 / HBM_BYTES_PER_S * 1e6
        it_k = 50 if n <= 16 else 20
        it_t = {1: 20, 4: 10, 16: 5}.get(n, 2)
        loop_us = time_jax(nothing_fn, normal, it_k)
        for name, x in (("normal", normal), ("ties", ties)):
            err = bad = bad_arg = k_us = th_bad = None
            try:
                bad, bad_arg = check(x)
                k_us = time_jax(kernel_fn(), x, it_k)
            except Exception as e:  # noqa: BLE001  (keep the GPU run going: the variants may still work)
                err = repr(e)[:300]
            tk_us = time_jax(topk_fn, x, it_t) if name == "normal" else None
            th_us = None
            if torch is not None and not INTERPRET:
                t = torch.from_dlpack(x)
                th_us = time_torch(t, 20 if n <= 16 else 5)
                if err is None:
                    th_bad = torch_set_mismatch(t, kernel_fn()(x)[0])
            row = dict(N=n, rows=rows, input=name, method=sel.SelectConfig().resolved_method(rows), kernel_us=k_us,
                       kernel_net_us=None if k_us is None else k_us - loop_us,
                       loop_us=loop_us, lax_top_k_us=tk_us, torch_topk_us=th_us, floor_us=floor,
                       bad_rows=bad, bad_argmax=bad_arg, torch_set_diff_rows=th_bad)
            if err is not None:
                row["error"] = err
            res["rows"].append(row)
            log(json.dumps(row))
        del normal, ties

    if not args.quick:
        picks = sorted({n for _, vns in VARIANTS.values() for n in vns} & set(ns))  # N=1, 16, 256 by default
        xs = {n: jax.random.normal(jax.random.fold_in(key, n), (15 * n, V), jnp.float32).astype(jnp.bfloat16)
              for n in picks}
        its = {n: 50 if n <= 16 else 20 for n in picks}
        loops = {n: time_jax(nothing_fn, xs[n], its[n]) for n in picks}
        for n in sorted({ns[0], ns[-1]}):
            for upto in ("stats", "gather"):
                try:
                    us = time_jax(kernel_fn(upto=upto), xs[n], its[n])
                    res["stages"].append(dict(N=n, upto=upto, us=us, net_us=us - loops[n]))
                except Exception as e:  # noqa: BLE001  (keep the GPU run going)
                    res["stages"].append(dict(N=n, upto=upto, us=None, net_us=None, error=repr(e)[:300]))
                log(json.dumps(res["stages"][-1]))
        for vname, n in [(vname, n) for vname, (_, vns) in VARIANTS.items() for n in sorted(set(vns) & set(picks))]:
            cfg = VARIANTS[vname][0]
            if time.perf_counter() - T0 > BUDGET_S:
                log(f"time budget: skipping variant {vname} (N={n}) and later ones")
                break
            try:
                bad, _ = check(xs[n], cfg)
                us = time_jax(kernel_fn(cfg), xs[n], its[n])
                row = dict(N=n, variant=vname, cfg=cfg, us=us, net_us=us - loops[n], bad_rows=bad)
            except Exception as e:  # noqa: BLE001
                row = dict(N=n, variant=vname, cfg=cfg, us=None, net_us=None, bad_rows=None, error=repr(e)[:300])
            res["variants"].append(row)
            log(json.dumps(row))
        del xs

    # ---- compact table
    f = lambda v: f"{'-':>9}" if v is None else f"{v:9.1f}"  # noqa: E731
    print(f"\nselect_candidates  V={V} C={C} bf16  (us per call; net = minus the chaining loop)")
    print(f"{'N':>4} {'rows':>5} {'input':>7} {'method':>8} {'kernel':>9} {'net':>9} {'top_k':>9} {'torch':>9} "
          f"{'floor':>9}  check")
    for r in res["rows"]:
        ok = "ok" if r["bad_rows"] == 0 and r["bad_argmax"] == 0 else f"BAD rows={r['bad_rows']} arg={r['bad_argmax']}"
        ok += f" ERROR {r['error']}" if "error" in r else ""
        print(f"{r['N']:>4} {r['rows']:>5} {r['input']:>7} {r['method']:>8} {f(r['kernel_us'])} "
              f"{f(r['kernel_net_us'])} {f(r['lax_top_k_us'])} {f(r['torch_topk_us'])} {f(r['floor_us'])}  {ok}"
              + ("" if r["torch_set_diff_rows"] is None else f" (torch.topk sets differ in {r['torch_set_diff_rows']} rows)"))
    num = lambda v: "ERR" if v is None else f"{v:.1f}"  # noqa: E731
    if res["stages"]:
        print("stages (default, normal input, net us, cumulative): " + ", ".join(
            f"N={s['N']} {s['upto']}={num(s['net_us'])}" for s in res["stages"]))
    if res["variants"]:
        print("variants (normal input, net us per call):")
        vns = sorted({v["N"] for v in res["variants"]})
        print(f"  {'variant':<16}" + "".join(f"{'N=' + str(n):>10}" for n in vns))
        for name in dict.fromkeys(v["variant"] for v in res["variants"]):
            cells = {v["N"]: num(v["net_us"]) + ("" if v["bad_rows"] in (0, None) else "!BAD")
                     for v in res["variants"] if v["variant"] == name}
            print(f"  {name:<16}" + "".join(f"{cells.get(n, '-'):>10}" for n in vns))
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "select.json"), "w") as fh:
            json.dump(res, fh, indent=1)
    log("done")
    bad = any(r["bad_rows"] or r["bad_argmax"] for r in res["rows"]) or any(v["bad_rows"] for v in res["variants"])
    bad = bad or any("error" in v for v in res["rows"] + res["variants"] + res["stages"])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
