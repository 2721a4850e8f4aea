"""Config sweep of the full-vocab pick (pallas_kernels.full_vocab) on one GPU: which tiles to serve.

    PYTHONPATH=$PWD python3 benchmarks/dev_pick_sweep.py [--budget 150] [--n 256,1,16,64,4] [--list]

Written for an H200 (JAX 0.11.2, Triton inside jaxlib). Shapes as benchmarks/dev_pick.py:
V=151936, r=256, bf16, rows = 15 N, w2 ~ N(0, 0.02^2), lat and base ~ N(0, 1).

Per N it times
  * ``xla``: the jnp oracle (`_JnpOps.full_vocab_pick`), whose tokens every other pick is checked
    against (``agree`` = equal tokens out of rows; the fused kernel may differ at bf16 near ties);
  * ``api``: what `pallas_kernels.api.full_vocab_config` serves today;
  * ``gemm``: the bare XLA readout GEMM ``dtype(lat @ w2.T)`` (its [rows, V] output written to HBM),
    i.e. XLA's GEMM speed at this shape;
  * a list of add_argmax (``A...``) and fused (``F...``) configs: GEMM-shaped tiles at N=64/256,
    bandwidth-shaped ones (few long programs, deep pipelines) at N=1/4/16;
  * at N=1 also ``probe/loop`` (the chain with a trivial pick: per-iteration overhead) and
    ``probe/read_w2`` (an XLA max over w2, 78 MB: what a plain read of w2 costs in this loop);
  * at N=1/4/16 the stage-2 combine alone (``combine``: [parts, rows_pad] partials -> tokens,
    pallas kernel vs XLA reduction, for several part counts).

Config names: ``F{row_tile}x{v_tile} k{k_tile} s{stages} w{warps}`` + ``hold`` (latent tile loaded
once), ``flat`` (one loop over vocab tile x rank chunk, epilogue under a cond), ``pf`` (next base
tile prefetched), ``vs{v_steps}`` (vocab tiles per program), ``p{parts}`` (programs along V),
``cX`` (XLA combine; default pallas). ``smem`` = estimate of shared bytes (stages * (row_tile +
v_tile) * k_tile * 2 + epilogue); configs over 227 KB are skipped without compiling.

Timing as dev_pick.py: one jitted chain of M picks in a fori_loop, pick i's first token perturbs
lat for pick i+1 (nothing is hoisted); device time per pick = chain wall time / M, median of 5
after a compile+warm-up call. ``floor`` = max(bytes (w2 + base) / 4.8 TB/s, 2 rows V r / 790
TFLOP/s); ``%flr`` = floor / time; ``TF/s`` = 2 rows V r / time.

Robustness: tasks run in a child process that records each result in a state file; if the child
dies (e.g. a Triton compiler abort) the parent records that task as crashed and starts a new child
for the remaining tasks. Compile errors are reported per config. No new task starts after
--budget seconds (compile time counts); tasks run in priority order (tier 0 of every N first), so
the budget cuts the least informative ones. Prints a compact table last (``*`` = fastest config
of that N whose tokens agree with xla up to 1% of rows); writes $OUT/pick_sweep.json and the table
as $OUT/pick_sweep.txt (both rewritten after every task).

--small: CPU smoke test of this script (V=4099, rows 15..75, interpret mode, chain of 3).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

V, R = 151936, 256
HBM, FLOPS = 4.8e12, 790e12
SMEM_LIMIT = 227 * 1024
M_SMALL_N, M_LARGE_N, REPS = 100, 40, 5
INTERPRET = False
LAZY = "off"  # --lazy
EXTRA: list = []  # --extra
SMALL = False
N_ORDER = (256, 1, 16, 64, 4)  # priority among N within a tier

# --------------------------------------------------------------------------------------------
# The task list (pure Python: the parent never touches a device).


def rows_for(n):
    if SMALL:  # tiny but distinct row counts, so every list runs in interpret mode
        return 15 * {1: 1, 4: 2, 16: 3, 64: 4, 256: 5}.get(n, 1)
    return 15 * n


def cdiv(a, b):
    return -(-a // b)


def k_eff(k_tile, rank=None):
    rank = rank or R
    low = rank & -rank
    return min(k_tile, low) if k_tile else low


def vs_for(rows, rt, vt, programs):
    """Largest power-of-two v_steps (<= 64) that still leaves >= `programs` programs."""
    s = 1
    while s < 64 and cdiv(rows, rt) * cdiv(cdiv(V, vt), 2 * s) >= programs:
        s *= 2
    return s


def smem_estimate(variant, c):
    """Shared bytes, roughly as Triton 3.9 allocates them for sm_90a (bf16; checked offline against
    its compiler for the configs below): pipeline buffers + epilogue. wgmma tiles (row_tile >= 64)
    get num_stages buffers, mma.sync ones num_stages - 1."""
    if variant != "fused":
        return 0
    k = k_eff(c["k_tile"])
    rt, vt = c["row_tile"], c["v_tile"]
    bufs = max(1, c["num_stages"] if rt >= 64 else c["num_stages"] - 1)
    if c["hold_lat"]:
        pipe = rt * R * 2 + bufs * vt * R * 2
    elif c["flat"] or R // k > 1:
        pipe = bufs * (rt + vt) * k * 2
    else:
        pipe = bufs * (rt + vt) * R * 2
    return pipe + rt * vt * 2


def F(rows, rt, vt, k, st, w, *, hold=False, flat=False, pf=False, programs=1024, wave=None, vs=None, comb="pallas"):
    """A fused config. v_steps: given (vs), or sized so that about `wave` programs run (one wave:
    132 SMs x the blocks per SM that its shared memory and registers allow), or the largest power
    of two that leaves >= `programs` programs."""
    if vs is None and wave:
        vs = cdiv(cdiv(V, vt), max(1, wave // cdiv(rows, rt)))
    return dict(row_tile=rt, v_tile=vt, v_steps=vs or vs_for(rows, rt, vt, programs), k_tile=k, num_warps=w,
                num_stages=st, combine=comb, hold_lat=hold, flat=flat, prefetch_base=pf)


def A(rows, rt, vt, w, *, programs=1024, vs=None, comb="pallas"):
    return dict(row_tile=rt, v_tile=vt, v_steps=vs or vs_for(rows, rt, vt, programs), k_tile=0, num_warps=w,
                num_stages=1, combine=comb, hold_lat=True, flat=False, prefetch_base=False)


def describe(variant, c):
    if c is None:
        return ""
    parts = cdiv(V, c["v_tile"] * c["v_steps"])
    tail = f"vs{c['v_steps']} p{parts}" + (" cX" if c["combine"] == "xla" else "")
    if variant == "add_argmax":
        return f"A{c['row_tile']}x{c['v_tile']} w{c['num_warps']} {tail}"
    flags = "".join(f" {f}" for f, on in (("hold", c["hold_lat"]), ("flat", c["flat"]), ("pf", c["prefetch_base"]))
                    if on)
    return (f"F{c['row_tile']}x{c['v_tile']} k{k_eff(c['k_tile'])} s{c['num_stages']} w{c['num_warps']}{flags} "
            + tail + (" lazy" if c.get("lazy") else ""))


SMS = 132  # H200


def pick_configs(n):
    """[(tier, variant, config dict)] for N=n (names come from `describe`).

    Offline Triton 3.9 compile for sm_90a (bf16, r=256) of these kernels: 128x128 k64 flat w8 =
    128 KB shared, ~220 regs (1 block/SM); 64x128 / 128x64 w4 = 80 / 104 KB, ~215 regs (2 blocks/SM);
    128x256 or 256x128 tiles spill at 8 warps (255 regs) and at 16 warps (128-reg cap): left out.
    Row tiles < 64 use mma.sync (no wgmma): fine where the pick is bandwidth-bound (N <= 4)."""
    rows = rows_for(n)
    if n >= 64:  # GEMM-shaped (FLOP-bound): wgmma tiles, deep pipelines, base prefetch
        out = [
            (0, "fused", F(rows, 128, 128, 64, 3, 8, flat=True, pf=True, programs=2048)),
            (0, "fused", F(rows, 64, 128, 64, 3, 4, flat=True, pf=True, programs=2048)),
            (0, "fused", F(rows, 128, 64, 64, 4, 4, flat=True, pf=True, programs=2048)),
            (0 if n >= 256 else 1, "fused", F(rows, 128, 128, 64, 3, 8, flat=True, programs=2048)),
            (0 if n >= 256 else 1, "fused", F(rows, 128, 128, 64, 4, 8, flat=True, pf=True, programs=2048)),
            (1, "fused", F(rows, 128, 128, 64, 2, 8, flat=True, pf=True, programs=2048)),
            (1, "fused", F(rows, 128, 128, 128, 2, 8, programs=2048)),  # nested rank loop
            (1, "fused", F(rows, 128, 64, 0, 3, 8, hold=True, pf=True, programs=2048)),
            (1, "fused", F(rows, 128, 128, 0, 2, 8, hold=True, pf=True, programs=2048)),
            (1, "fused", F(rows, 128, 128, 64, 3, 8, flat=True, pf=True, programs=512)),  # long programs
            (1, "fused", F(rows, 64, 128, 64, 3, 4, flat=True, pf=True, programs=8192)),  # short programs
            (1, "fused", F(rows, 64, 128, 0, 2, 4, programs=2048)),  # whole rank per dot, V loop pipelined
            (1, "fused", F(rows, 128, 128, 64, 3, 8, flat=True, pf=True, programs=2048, comb="xla")),
        ]
        if n < 256:
            out.insert(0, (0, "fused", F(rows, 64, 128, 128, 2, 8, programs=1024)))  # dev_pick fused/b
            out.insert(1, (0, "add_argmax", A(rows, 16, 512, 4, comb="xla")))  # dev_pick add_argmax/b
        return out
    if n >= 16:  # in between: FLOP floor ~ bytes floor; one wave of long programs
        return [
            (0, "fused", F(rows, 256, 64, 64, 3, 8, flat=True, pf=True, wave=SMS)),
            (0, "fused", F(rows, 128, 128, 64, 3, 8, flat=True, pf=True, wave=SMS)),
            (0, "fused", F(rows, 64, 128, 64, 3, 4, flat=True, pf=True, wave=2 * SMS)),
            (1, "fused", F(rows, 256, 64, 64, 4, 8, flat=True, pf=True, wave=SMS)),
            (1, "fused", F(rows, 256, 64, 0, 2, 8, hold=True, pf=True, wave=SMS)),
            (1, "fused", F(rows, 128, 128, 0, 2, 8, hold=True, pf=True, wave=SMS)),
            (1, "fused", F(rows, 128, 64, 64, 4, 4, flat=True, pf=True, wave=2 * SMS)),
            (1, "fused", F(rows, 64, 128, 128, 2, 8, programs=1024)),  # dev_pick fused/b
            (1, "fused", F(rows, 128, 128, 64, 3, 8, flat=True, pf=True, programs=1024)),  # several waves
            (1, "add_argmax", A(rows, 16, 2048, 8, vs=1, comb="xla")),
        ]
    # N=1, 4: bandwidth-bound (read w2 once): one wave of long programs, deep pipelines.
    if n <= 1:  # 16-row tiles: mma.sync; blocks/SM from the offline compile
        return [
            (0, "fused", F(rows, 16, 128, 0, 3, 4, hold=True, pf=True, wave=SMS)),  # 138 KB
            (0, "fused", F(rows, 16, 128, 64, 4, 4, flat=True, pf=True, wave=4 * SMS)),  # 56 KB, 80 regs
            (0, "add_argmax", A(rows, 16, 4096, 16, vs=1)),
            (1, "add_argmax", A(rows, 16, 2048, 16, vs=1, comb="xla")),
            (1, "add_argmax", A(rows, 16, 512, 4, vs=1)),
            (1, "fused", F(rows, 16, 64, 0, 4, 4, hold=True, wave=2 * SMS)),  # 106 KB
            (1, "fused", F(rows, 16, 256, 64, 3, 8, flat=True, pf=True, wave=3 * SMS)),  # 72 KB
            (1, "fused", F(rows, 16, 128, 0, 3, 8, hold=True, pf=True, wave=SMS)),
            (1, "fused", F(rows, 16, 64, 64, 4, 4, flat=True, pf=True, wave=7 * SMS)),  # 32 KB, 50 regs
            (1, "fused", F(rows, 16, 128, 0, 3, 4, hold=True, pf=True, wave=SMS, comb="xla")),
            (1, "fused", F(rows, 16, 128, 64, 4, 4, flat=True, pf=True, programs=1024)),  # several waves
        ]
    return [  # N=4: 60 rows in one 64-row tile (wgmma)
        (0, "fused", F(rows, 64, 128, 64, 4, 4, flat=True, pf=True, wave=2 * SMS)),  # 104 KB
        (0, "fused", F(rows, 64, 128, 0, 2, 4, hold=True, pf=True, wave=SMS)),
        (0, "add_argmax", A(rows, 16, 4096, 16, vs=1)),
        (1, "fused", F(rows, 64, 64, 0, 4, 4, hold=True, wave=SMS)),  # 168 KB
        (1, "fused", F(rows, 64, 256, 64, 3, 8, flat=True, pf=True, wave=SMS)),  # 136 KB
        (1, "fused", F(rows, 64, 64, 64, 4, 4, flat=True, pf=True, wave=3 * SMS)),  # 72 KB
        (1, "fused", F(rows, 64, 128, 0, 3, 4, hold=True, pf=True, wave=SMS)),  # ~232 KB: skipped
        (1, "fused", F(rows, 64, 128, 64, 4, 4, flat=True, pf=True, wave=2 * SMS, comb="xla")),
        (1, "add_argmax", A(rows, 16, 2048, 16, vs=1, comb="xla")),
    ]


def combine_parts(n):
    return (38, 149, 297, 1187, 2374) if n <= 1 else (149, 297, 1187)


def build_tasks(ns):
    """All tasks, priority order. A task: dict(id, tier, N, kind, name, variant, config)."""
    tasks = []
    for n in ns:
        rows = rows_for(n)
        t = [dict(tier=0, kind="pick", name="xla", variant="xla", config=None),
             dict(tier=0, kind="pick", name="api", variant="api", config=None),
             dict(tier=0, kind="gemm", name="gemm", variant="gemm", config=None)]
        if n == 1:
            t += [dict(tier=0, kind="probe", name="probe/loop", variant="probe", config=None),
                  dict(tier=0, kind="probe", name="probe/read_w2", variant="probe", config=None)]
        if LAZY != "off":
            t.append(dict(tier=0, kind="pick", name="api lazy", variant="api-lazy", config=None))
        seen = set()
        configs = pick_configs(n)
        if LAZY != "off":  # each fused config with the lazy (elementwise running best) epilogue
            lazy = [(tier, v, dict(c, lazy=True)) for tier, v, c in configs if v == "fused"]
            configs = lazy if LAZY == "only" else [x for pair in zip(configs, lazy) for x in pair] + configs[len(lazy):]
        for en, over in EXTRA:  # --extra: the served config of this N with some fields changed
            if en == n:
                import jax.numpy as jnp

                from pallas_kernels import api

                _, c = api.full_vocab_config(rows, V, R, jnp.bfloat16)
                configs.insert(0, (0, "fused", dict(dataclasses.asdict(c), **over)))
        for tier, variant, cfg in configs:
            key = (variant, json.dumps(cfg, sort_keys=True))
            if key in seen:  # (--small: different tiles can collapse onto one config)
                continue
            seen.add(key)
            t.append(dict(tier=tier, kind="pick", name=describe(variant, cfg), variant=variant, config=cfg))
        if n <= 16:
            # rows_pad as stage 1 pads with 16-row tiles (the add_argmax default): 16 / 64 / 240
            rows_pad = cdiv(rows, 16) * 16
            for p in combine_parts(n):
                for how in ("xla", "pallas"):
                    t.append(dict(tier=0 if n == 1 else 1, kind="combine", name=f"combine {how} p{p}x{rows_pad}",
                                  variant=how, config=dict(parts=p, rows_pad=rows_pad)))
        for x in t:
            x.update(N=n, rows=rows, id=f"N{n}:{x['name']}")
        tasks += t
    rank = {n: i for i, n in enumerate(N_ORDER)}
    # Stable: within (tier, N) keep list order (xla first: the reference for agreement).
    tasks.sort(key=lambda x: (x["tier"], rank.get(x["N"], len(rank)), 0))
    return tasks


def floors(rows):
    by_bytes = (V * R * 2 + rows * V * 2) / HBM * 1e6
    by_flops = 2 * rows * V * R / FLOPS * 1e6
    return max(by_bytes, by_flops), by_bytes, by_flops


# --------------------------------------------------------------------------------------------
# Child: measures (imports JAX).


def child_main(args, state_path, deadline):
    import warnings

    warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.timing import time_jitted
    from pallas_kernels import api
    from pallas_kernels import full_vocab as fv
    from xpress_jax.head import precision_for
    from xpress_jax.refine import _JnpOps

    DT = jnp.bfloat16
    state = _load(state_path)
    done = {r["id"] for r in state["results"]}
    dev = jax.devices()[0]
    state["meta"].update(device=dev.device_kind, jax=jax.__version__, backend=jax.default_backend())
    _save(state_path, state)
    crash_on = os.environ.get("DEV_PICK_SWEEP_CRASH")  # test aid: abort the child at this task id

    def chain(pick, m, n_tok, y_spec=None):
        """jit(m picks in a fori_loop), the first arg perturbed by each pick's first token.

        pick(x, *args) -> tokens [rows], or with ``y_spec = (shape, dtype)`` (tokens, y): y is
        carried and returned, so XLA must materialise it in every iteration."""

        def run(x, *args):
            def body(i, carry):
                x, first, acc, y = carry
                out = pick(x, *args)
                tok, y = out if y_spec else (out, y)
                first = jnp.where(i == 0, tok, first)
                x = x.at[0, 0].add((tok[0] & 1).astype(x.dtype) * jnp.asarray(2.0**-8, x.dtype))
                return x, first, acc + tok[-1], y

            y0 = jnp.zeros(*y_spec) if y_spec else jnp.int32(0)
            init = (x, jnp.zeros((n_tok,), jnp.int32), jnp.int32(0), y0)
            _, first, acc, y = jax.lax.fori_loop(0, m, body, init)
            return first, acc, y

        return jax.jit(run)

    def measure(pick, m, operands, n_tok, y_spec=None):
        out, t, compile_s = time_jitted(chain(pick, m, n_tok, y_spec), operands, REPS)
        return np.asarray(out[0]), t / m * 1e6, compile_s

    problems = {}

    def problem(n):
        if n not in problems:
            rows = rows_for(n)
            kb, kl, kw = jax.random.split(jax.random.key(n), 3)
            base = jax.random.normal(kb, (rows, V), jnp.float32).astype(DT)
            lat = jax.random.normal(kl, (rows, R), jnp.float32).astype(DT)
            w2 = (0.02 * jax.random.normal(kw, (V, R), jnp.float32)).astype(DT)
            problems[n] = jax.block_until_ready((base, lat, w2))
        return problems[n]

    def partials(parts, rows_pad):
        k1, k2 = jax.random.split(jax.random.key(parts * 7 + rows_pad))
        mv = jnp.round(jax.random.normal(k1, (parts, rows_pad), jnp.float32) * 8) / 8  # many ties
        mi = jax.random.randint(k2, (parts, rows_pad), 0, V, jnp.int32)
        return mv, mi

    for task in build_tasks(args.ns):
        if task["id"] in done or (args.tier is not None and task["tier"] > args.tier):
            continue
        if args.only and not any(s in task["id"] for s in args.only):
            continue
        n, rows, name, variant, cfg = task["N"], task["rows"], task["name"], task["variant"], task["config"]
        floor, _, _ = floors(rows)
        row = {k: task[k] for k in ("id", "N", "rows", "kind", "name", "variant", "tier")}
        row.update(config=cfg, floor_us=round(floor, 2))
        if task["kind"] == "pick" and variant == "fused":
            row["smem_est"] = smem_estimate(variant, cfg)
        state["running"] = task["id"]
        _save(state_path, state)
        if time.time() > deadline:
            row["error"] = "skipped: budget"
        elif row.get("smem_est", 0) > SMEM_LIMIT:
            row["error"] = f"skipped: smem est {row['smem_est'] // 1024} KB > 227 KB"
        else:
            if crash_on and crash_on in task["id"]:
                os.abort()
            m = M_SMALL_N if rows < 2000 else M_LARGE_N
            if SMALL:
                m = 3
            try:
                y_spec, n_tok = None, rows
                if task["kind"] == "combine":
                    n_tok = cfg["rows_pad"]
                    mv, mi = partials(cfg["parts"], cfg["rows_pad"])
                    pick = lambda mv, mi, how=variant: fv.combine_partials(mv, mi, interpret=INTERPRET, how=how)  # noqa: E731
                    operands = (mv, mi)
                else:
                    base, lat, w2 = problem(n)
                    operands = (lat, base, w2)
                    if variant == "xla":
                        pick = lambda lat, base, w2: _JnpOps.full_vocab_pick(base, lat, w2)  # noqa: E731
                    elif variant in ("api", "api-lazy"):
                        v, c = api.full_vocab_config(rows, V, R, DT)
                        if variant == "api-lazy":
                            c = dataclasses.replace(c, lazy=True)
                        row["config"] = dataclasses.asdict(c)
                        row["name"] = f"api: {describe(v, row['config'])}"
                        pick = lambda lat, base, w2, v=v, c=c: fv.full_vocab_pick(  # noqa: E731
                            base, lat, w2, variant=v, config=c, interpret=INTERPRET)
                    elif variant == "gemm":
                        y_spec = ((rows, V), DT)

                        def pick(lat, base, w2):
                            y = jnp.dot(lat, w2.T, precision=precision_for(DT),
                                        preferred_element_type=jnp.float32).astype(DT)
                            tok = jnp.broadcast_to((y[0, 0] > 1e4).astype(jnp.int32), (lat.shape[0],))
                            return tok, y
                    elif name == "probe/loop":
                        def pick(lat, base, w2):
                            return jnp.broadcast_to((lat[0, 0] > 1e4).astype(jnp.int32), (lat.shape[0],))
                    elif name == "probe/read_w2":
                        def pick(lat, base, w2):
                            big = jnp.max(w2 * lat[0, 0]) > 1e4
                            return jnp.broadcast_to(big.astype(jnp.int32), (lat.shape[0],))
                    else:
                        c = fv.FullVocabConfig(**cfg)
                        pick = lambda lat, base, w2, v=variant, c=c: fv.full_vocab_pick(  # noqa: E731
                            base, lat, w2, variant=v, config=c, interpret=INTERPRET)
                first, us, compile_s = measure(pick, m, operands, n_tok, y_spec)
                row.update(device_us=round(us, 2), compile_s=round(compile_s, 2), chain=m)
                if task["kind"] == "gemm":
                    row["tflops"] = round(2 * rows * V * R / us / 1e6, 1)
                ref_key = f"N{n}" if task["kind"] == "pick" else (
                    f"N{n}:comb:{cfg['parts']}" if task["kind"] == "combine" else None)
                if ref_key is not None:
                    if variant == "xla":
                        state["refs"][ref_key] = first.tolist()
                    elif ref_key in state["refs"]:
                        row["agree"] = int(np.sum(first == np.asarray(state["refs"][ref_key])))
                        row["agree_of"] = int(first.shape[0])
            except Exception as e:  # a config that does not build must not sink the run
                msg = str(e).strip().splitlines()
                row["error"] = f"{type(e).__name__}: {' '.join(msg[-1:] + msg[:1])[:240] if msg else ''}"
                print(traceback.format_exc(limit=1)[-600:], file=sys.stderr, flush=True)
        state["results"].append(row)
        state["running"] = None
        _save(state_path, state)
        _write_out(state)  # so that a run killed from outside still leaves its results
        print(_short_line(row), flush=True)
    return 0


def _write_out(state):
    """$OUT/pick_sweep.json (meta + every result) and $OUT/pick_sweep.txt (the table), if OUT is set."""
    out = os.environ.get("OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "pick_sweep.json"), "w") as f:
        json.dump(dict(meta=state["meta"], results=state["results"]), f, indent=1)
    with open(os.path.join(out, "pick_sweep.txt"), "w") as f:
        f.write(table(state["results"], state["meta"]) + "\n")


def _short_line(r):
    if "error" in r:
        res = r["error"][:90]
    else:
        res = f"{r['device_us']:9.1f} us  compile {r['compile_s']:.1f} s"
        if "agree" in r:
            res += f"  agree {r['agree']}/{r['agree_of']}"
    return f"[{r['id']}] {res}"


def _load(path):
    with open(path) as f:
        return json.load(f)


def _save(path, state):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Parent: runs children until every task has a result, then prints the table.


def parent_main(args, argv):
    t_start = time.time()
    deadline = t_start + args.budget
    state_path = args.state or os.path.join(tempfile.mkdtemp(prefix="pick_sweep_"), "state.json")
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), V=V, r=R, dtype="bfloat16", reps=REPS,
                chain=f"{M_SMALL_N} (rows < 2000) / {M_LARGE_N}", budget_s=args.budget, small=SMALL)
    if not os.path.exists(state_path):
        _save(state_path, dict(meta=meta, results=[], refs={}, running=None))
    print(f"# dev_pick_sweep {meta['date']}: {len(_selected(args))} tasks, budget {args.budget:.0f} s", flush=True)
    crashes = 0
    while True:
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", state_path, "--deadline", str(deadline)]
        if args.no_isolate:
            rc = child_main(args, state_path, deadline)
        else:
            rc = subprocess.call(cmd)
        state = _load(state_path)
        if rc == 0:
            break
        crashes += 1
        running = state.get("running")
        why = f"exit {rc}"
        if rc < 0:
            try:
                why = f"signal {signal.Signals(-rc).name}"
            except ValueError:
                why = f"signal {-rc}"
        print(f"# child died ({why}) while running {running!r}", flush=True)
        if running is None or crashes > 10:
            state.setdefault("meta", {})["aborted"] = f"child died ({why}) outside a task"
            _save(state_path, state)
            break
        task = next((t for t in build_tasks(args.ns) if t["id"] == running), None)
        row = {k: task[k] for k in ("id", "N", "rows", "kind", "name", "variant", "tier")} if task else dict(id=running)
        row.update(config=task["config"] if task else None, error=f"crashed: process died ({why})")
        state["results"].append(row)
        state["running"] = None
        _save(state_path, state)
    state["meta"]["total_s"] = round(time.time() - t_start, 1)
    state["meta"]["child_crashes"] = crashes
    _write_out(state)
    print(table(state["results"], state["meta"]))
    return 0


def _selected(args):
    return [t for t in build_tasks(args.ns)
            if (args.tier is None or t["tier"] <= args.tier) and (not args.only or any(s in t["id"] for s in args.only))]


# --------------------------------------------------------------------------------------------
# The table.


def _agree_ok(r):
    return "agree" not in r or r["agree_of"] - r["agree"] <= max(0, r["agree_of"] // 100)


def table(results, meta):
    lines = [f"dev_pick_sweep: {meta.get('device', '?')}, jax {meta.get('jax', '?')}, V={V} r={R} bf16; "
             f"device us per pick (chain {meta.get('chain')}, median {REPS}); total {meta.get('total_s')} s"
             + (f"; {meta['child_crashes']} child crash(es)" if meta.get("child_crashes") else ""),
             "cols: us | %flr = floor/us | TF/s | agree (!k = k tokens differ from xla) | smem est KB | "
             "compile s | config  (* = best agreeing pick per N)"]
    for n in sorted({r["N"] for r in results if "N" in r}):
        rs = [r for r in results if r.get("N") == n]
        rows = rs[0]["rows"]
        floor, by_b, by_f = floors(rows)
        picks = [r for r in rs if r["kind"] == "pick" and "device_us" in r]
        best = min((r for r in picks if _agree_ok(r)), key=lambda r: r["device_us"], default=None)
        xla = next((r for r in picks if r["variant"] == "xla"), None)
        head = f"N={n} rows={rows}: floor {floor:.1f} us (bytes {by_b:.1f}, flops {by_f:.1f})"
        if best is not None:
            head += f"; best {best['device_us']:.1f}"
            if xla is not None:
                head += f" = {xla['device_us'] / best['device_us']:.2f}x xla"
        lines += ["", head]
        ok = sorted((r for r in rs if "device_us" in r and r["kind"] != "combine"), key=lambda r: r["device_us"])
        for r in ok:
            us = r["device_us"]
            agree = ""
            if "agree" in r:
                bad = r["agree_of"] - r["agree"]
                agree = "ok" if bad == 0 else f"!{bad}"
            flops = 2 * rows * V * R / us / 1e6 if r["kind"] in ("pick", "gemm") else None
            smem = f"{r['smem_est'] // 1024}" if r.get("smem_est") else ""
            mark = "*" if r is best else " "
            pct = f"{100 * floor / us:3.0f}%" if r["kind"] != "probe" else ""
            lines.append(f"{mark}{us:8.1f} {pct:>4} {(f'{flops:4.0f}' if flops else ''):>4} {agree:>3} {smem:>3} "
                         f"{r['compile_s']:4.1f} {r['name'][:70]}")
        for how in ("xla", "pallas"):
            comb = sorted((r for r in rs if r["kind"] == "combine" and r["variant"] == how and "device_us" in r),
                          key=lambda r: r["config"]["parts"])
            if comb:
                cells = " ".join(f"p{r['config']['parts']}={r['device_us']:.1f}" + ("" if _agree_ok(r) else "!")
                                 for r in comb)
                lines.append(f"  combine alone, {how:>6}, [parts x {comb[0]['config']['rows_pad']}] us: {cells}")
        budget = [r for r in rs if r.get("error", "").startswith("skipped: budget")]
        for r in rs:
            if "error" in r and r not in budget:
                lines.append(f"  ERR {r['name'][:44]}: {r['error'][:60]}")
        if budget:
            lines.append(f"  not run (budget): {len(budget)} tasks")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default=",".join(map(str, N_ORDER)))
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; no new task starts after it")
    ap.add_argument("--tier", type=int, default=None, help="run tasks of tier <= this only (0 = the short list)")
    ap.add_argument("--only", default="", help="comma list of substrings of task ids (e.g. 'N256:F128x128,N1:')")
    ap.add_argument("--lazy", choices=("off", "both", "only"), default="off",
                    help="also (both) or only time the fused configs with lazy=True (elementwise running best)")
    ap.add_argument("--extra", default="[]",
                    help='JSON [[N, {field: value}], ...]: also time the served config of N with these fields')
    ap.add_argument("--list", action="store_true", help="print the task list (no device) and exit")
    ap.add_argument("--small", action="store_true", help="CPU smoke test: V=4099, interpret mode, chain 3")
    ap.add_argument("--no-isolate", action="store_true", help="run in this process (no crash recovery)")
    ap.add_argument("--state", default=None, help="state file (resume a run)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.ns = [int(x) for x in args.n.split(",") if x]
    args.only = [s for s in args.only.split(",") if s]
    global LAZY, EXTRA
    LAZY = args.lazy
    EXTRA = [(int(n), dict(o)) for n, o in json.loads(args.extra)]
    if args.small:
        global V, M_SMALL_N, M_LARGE_N, REPS, INTERPRET, SMALL
        V, M_SMALL_N, M_LARGE_N, REPS, INTERPRET, SMALL = 4099, 3, 3, 2, True, True
    if args.list:
        for t in _selected(args):
            est = smem_estimate(t["variant"], t["config"]) if t["kind"] == "pick" and t["config"] else 0
            print(f"tier {t['tier']}  {t['id']:<56} smem_est {est // 1024:>4} KB"
                  + ("  (skipped: > 227 KB)" if est > SMEM_LIMIT else ""))
        return 0
    if args.child:
        return child_main(args, args.child, args.deadline)
    # The child gets the same argv (minus parent-only flags it ignores).
    return parent_main(args, [a for a in argv if a != "--no-isolate"])


if __name__ == "__main__":
    sys.exit(main())
