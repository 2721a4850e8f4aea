"""Refine benchmark: device time per refine and one call's wall latency, per backend and mode.

    PYTHONPATH=$PWD python3 -m benchmarks.bench_refine --out bench_out/  # on a GPU
    PYTHONPATH=$PWD python3 -m benchmarks.bench_refine --small           # smoke test on a CPU (XLA backend)
    PYTHONPATH=$PWD python3 -m benchmarks.bench_refine --n 1 --wall-only --walls 5 --no-select   # CPU, serving shapes

Sweeps N (blocks per call) x topc x backend at serving shapes (V=151936,
H=4096, B=16, r=256, mlp=512, C=512, K=6, bf16). Device time per refine:
M refines chained inside one jit (call i's output feeds call i+1's anchors, and the
logits and h pass through an optimization barrier with it, so nothing can be hoisted
out of the loop and nothing is copied), divided by M; median of R repeats after a warm-up.
Wall latency: one jitted call, host clock around dispatch + block_until_ready (and the enqueue: the call without the wait),
median of 20 (``--walls``); and to the tokens in a numpy array, with the output on the device (then copied)
and in pinned host memory (``RefineServer(output="host")``). Also, per N, top-C selection alone: the Pallas kernel vs
XLA's (`xpress_jax.xla_ops`) vs lax.top_k (and torch.topk where torch sees a GPU). Writes bench.jsonl (each result as it is
measured), then bench.json, bench.md (tables) and bench.png (time vs N). Off a GPU the
default backend is xla only (``--backends pallas`` there runs the kernels in interpret mode).
The refines compile with `xpress_jax.compiler_options()` as `RefineServer` does (``--xla-options off``:
XLA's defaults; ``both``: each backend both ways, compared).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from benchmarks.timing import time_jitted
from xpress_jax import exact, xla_ops
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with

SERVING = dict(vocab_size=151936, hidden_size=4096, block_size=16, rank=256, mlp_hidden=512,
               topc=512, num_passes=6, max_num_reqs=256)


def make_problem(cfg, n, seed=0, dtype=jnp.bfloat16, std=0.02):
    kp, kl, kh, ka = jax.random.split(jax.random.key(seed), 4)
    params = xj.init_params(cfg, kp, dtype=dtype, std=std)
    logits = (jax.random.normal(kl, (n, cfg.block_size, cfg.draft_vocab_size), jnp.float32) * 2).astype(dtype)
    h = jax.random.normal(kh, (n, cfg.block_size, cfg.hidden_size), jnp.float32).astype(dtype)
    anchors = jax.random.randint(ka, (n,), 0, cfg.vocab_size, jnp.int32)
    return params, logits, h, anchors


def chained(cfg, m, empty=False, refine_fn=None, compiler_options=None, **kw):
    """jit(M refines in a fori_loop), each depending on the previous one's output.

    ``empty=True`` replaces refine by a trivial op: the loop's own cost per iteration
    (on GPUs an XLA while loop costs ~15 µs per iteration), reported as loop_us.
    ``refine_fn(params, logits, h, anchors)``: what to chain instead of ``xj.refine(..., **kw)``.
    ``compiler_options``: XLA's, for the jit (`xpress_jax.compiler_options`; None: XLA's defaults).
    """

    def run(params, logits, h, anchors):
        def body(i, carry):
            logits, h, anchors, acc = carry
            if empty:
                out = jnp.broadcast_to(anchors[:, None], (anchors.shape[0], cfg.block_size - 1)) + 1
            elif refine_fn is not None:
                out = refine_fn(params, logits, h, anchors)
            else:
                out = xj.refine(params, logits, h, anchors, config=cfg, **kw)
            tok = out[:, -1]
            # logits and h pass through a barrier with the last output, so XLA cannot treat them as
            # loop invariants (no step is hoisted out of the chain) and nothing is copied (an in-place
            # write instead would make XLA copy the logits and h every iteration).
            logits, h, tok = jax.lax.optimization_barrier((logits, h, tok))
            return logits, h, tok, acc + out.sum()

        return jax.lax.fori_loop(0, m, body, (logits, h, anchors, jnp.int32(0)))[3]

    return jax.jit(run, compiler_options=compiler_options)


def select_rows(cfg, n, reps, interpret=False, pallas=True):
    """Top-C selection alone at N blocks: the Pallas kernel vs XLA's (`xpress_jax.xla_ops`) vs lax.top_k (and
    torch.topk if importable).

    Same chaining as the refines: each call's first candidate is written into the next
    call's logits. Returns {backend: device µs per call}.
    """
    _, logits, _, _ = make_problem(cfg, n)
    c = cfg.topc
    out = {}
    impls = {"xla (lax.top_k)": Ops.xla(jax.default_backend(), reference=True),
             "xla": Ops.xla(jax.default_backend())}
    if pallas:
        impls["pallas"] = Ops.pallas(interpret)
    for name, ops in impls.items():
        m = 2 if name.startswith("xla (") and n >= 64 else 20

        def run(logits, ops=ops, m=m):
            def body(i, carry):
                logits, acc = carry
                cand, vals, am = ops.select(logits, c)
                logits, cand = jax.lax.optimization_barrier((logits, cand))  # the next call depends on this one; no copy
                return logits, acc + am.sum() + cand[0, 0]

            return jax.lax.fori_loop(0, m, body, (logits, jnp.int32(0)))[1]

        out[name] = time_device(jax.jit(run), (logits,), reps) / m * 1e6
    try:
        import torch

        if torch.cuda.is_available():
            t = torch.utils.dlpack.from_dlpack(logits[:, 1:].reshape(-1, cfg.draft_vocab_size))
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ts = []
            for _ in range(reps + 1):
                ev[0].record()
                for _ in range(20):
                    torch.topk(t, c, dim=-1, sorted=False)
                ev[1].record()
                torch.cuda.synchronize()
                ts.append(ev[0].elapsed_time(ev[1]) * 1e3 / 20)
            out["torch.topk"] = statistics.median(ts[1:])
    except ImportError:
        pass
    return out


def host_walls(single, refine_fn, args, want, walls, compiler_options=None):
    """One call's wall time to the tokens in a numpy array, median of ``walls`` calls, two ways:
    ``wall_np_us`` = ``single`` (device output) then ``np.asarray`` (a device-to-host copy);
    ``wall_host_us`` = the same refine jitted with its output in pinned host memory
    (``RefineServer(output="host")``), then ``np.asarray``. Asserts both give ``want``."""
    dev = jax.devices()[0]
    pinned = jax.sharding.make_single_device_sharding(dev, memory_kind="pinned_host")
    host = jax.jit(refine_fn, out_shardings=pinned, compiler_options=compiler_options)
    got = np.asarray(host(*args))
    if not np.array_equal(got, want):
        raise AssertionError(f"pinned-host output gave other tokens: {int(np.sum(got != want))} differ")
    out = {}
    for key, fn in (("wall_np_us", single), ("wall_host_us", host)):
        np.asarray(fn(*args))  # warm
        ts = []
        for _ in range(walls):
            t0 = time.perf_counter()
            np.asarray(fn(*args))
            ts.append(time.perf_counter() - t0)
        out[key] = statistics.median(ts) * 1e6
    return out


def time_device(fn, args, reps):
    return time_jitted(fn, args, reps)[1]


#: The suffix of a backend run with XLA's default compile options (``--xla-options both``).
DEFAULT_XLA = "/xla-default"


def spec_of(backend: str) -> str:
    """A backend's name and flag (``pallas@table``) without the `DEFAULT_XLA` suffix."""
    return backend.removesuffix(DEFAULT_XLA)


#: Kernel steps a benchmark backend name can add to XLA ("xla+latent+pick"): `Ops` fields per step.
STEPS = {"latent": ("latent",), "pick": ("topc_prepare", "topc_pick", "full_vocab_prepare", "full_vocab_pick"),
         "select": ("select",)}


#: ``xla-<variant>`` backend names: the XLA steps with the plain reference's selection, or the fast selection
#: spelled one way (`xpress_jax.xla_ops.METHODS`) whatever the platform's default.
XLA_VARIANTS = ("reference", *xla_ops.METHODS)


def bench_ops(name, interpret):
    """The `Ops` a benchmark backend name stands for: ``xla``, ``xla-reference`` (every step the plain jnp
    reference: ``lax.top_k`` over the vocabulary), ``xla-top_k`` / ``xla-threshold`` (`xpress_jax.xla_ops`'s
    selection spelled that way), ``pallas``, ``pallas-xlares`` (the Pallas steps with the latent's residual summed
    by XLA, not inside the picks: ``latent_terms=False``), or ``xla+<step>[+<step>...]`` (XLA with the named steps,
    from `STEPS`, as Pallas kernels; built with `dataclasses.replace`)."""
    base, *steps = name.split("+")
    if base == "pallas" and not steps:
        return Ops.pallas(interpret)
    if base == "pallas-xlares" and not steps:  # the residual in XLA's own kernel (before the picks added it)
        return dataclasses.replace(Ops.pallas(interpret), name=name, latent_terms=False)
    variant = base.removeprefix("xla-") if base.startswith("xla-") else None
    if variant in XLA_VARIANTS and not steps:
        if variant == "reference":
            return Ops.xla(jax.default_backend(), reference=True)
        select = functools.partial(_fast_select, method=variant)
        return dataclasses.replace(Ops.xla(jax.default_backend()), name=name, select=select)
    if base != "xla" or not set(steps) <= set(STEPS):
        raise SystemExit(f"bench_refine: backend {name!r} must be xla, xla-<{'|'.join(XLA_VARIANTS)}>, pallas, "
                         f"pallas-xlares or xla+<steps> (steps: {sorted(STEPS)})")
    ops, kernels = Ops.xla(jax.default_backend()), Ops.pallas(interpret)
    fields = {f: getattr(kernels, f) for s in steps for f in STEPS[s]}
    return dataclasses.replace(ops, name=name, **fields) if fields else ops


def uses_kernels(backend):
    """Whether a backend name runs Pallas kernels (interpret mode off a GPU)."""
    base = spec_of(backend).partition("@")[0]
    return base.startswith("pallas") or "+" in base


def _fast_select(logits, c, *, method):
    n, b, v = logits.shape
    return xla_ops.select_candidates(logits[:, 1:].reshape(n * (b - 1), v), c, method=method)


def certified_flag(flag):
    """"certified" / "certified-c2048" / "certified-c2048-s4" -> `xpress_jax.exact.Certified` (C candidates,
    scan_blocks S); anything else -> None."""
    from xpress_jax.exact import Certified

    if not flag.startswith("certified"):
        return None
    kw = {}
    for part in flag.removeprefix("certified").split("-")[1:]:
        key = {"c": "candidates", "s": "scan_blocks"}.get(part[:1])
        if key is None or not part[1:].isdigit():
            raise SystemExit(f"bench_refine: {flag!r} must look like certified, certified-c2048 or certified-c2048-s4")
        kw[key] = int(part[1:])
    return Certified(**kw)


#: ``@sample`` flags -> the proposal asked for (`xpress_jax.sampling.PROPOSALS`; "sample" alone: none).
SAMPLE_FLAGS = {"sample": None, "sample-logprob": "logprob", "sample-scores": "scores"}


def sample_flag(flag):
    """"sample" / "sample-logprob" / "sample-scores" -> (True, proposal); anything else -> (False, None)."""
    if not flag.startswith("sample"):
        return False, None
    if flag not in SAMPLE_FLAGS:
        raise SystemExit(f"bench_refine: {flag!r} must be one of {sorted(SAMPLE_FLAGS)}")
    return True, SAMPLE_FLAGS[flag]


def with_proposal(out):
    """The tokens of a sampled refine, made to depend on its `xpress_jax.Proposal` (every array of it, a slice
    each) so XLA keeps the proposal's computation; the dependence is always false and changes no token."""
    if not (isinstance(out, tuple) and isinstance(out[1], xj.Proposal)):  # tokens, or (tokens, certified stats)
        return out
    tokens, prop = out
    x = sum(a.reshape(a.shape[0], -1)[:, :1].astype(jnp.float32) for a in prop if a is not None)
    return tokens + ((x != x) & (x == x)).astype(tokens.dtype)


def make_mesh(spec):
    """"mesh2x1" -> a ("data", "model") Mesh of the first 2*1 devices (blocks x vocabulary)."""
    from jax.sharding import Mesh

    try:
        d, m = (int(x) for x in spec.removeprefix("mesh").split("x"))
    except ValueError:
        raise SystemExit(f"bench_refine: mesh {spec!r} must look like mesh2x1 (blocks x vocabulary)")
    devs = jax.devices()
    if d * m > len(devs):
        raise SystemExit(f"bench_refine: {spec} needs {d * m} devices, this machine has {len(devs)}")
    return Mesh(np.array(devs[: d * m]).reshape(d, m), ("data", "model"))


def chain_length(n, topc, backend):
    if backend.startswith("xla-reference") and topc:  # lax.top_k: ~0.7 ms (N=1) .. ~100 ms (N=256) per call
        return {1: 20, 4: 10, 16: 5, 64: 3, 256: 2}.get(n, 2)
    return {1: 200, 4: 200, 16: 100, 64: 40, 256: 12}.get(n, 10)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", help="comma list of N (blocks per call) (default: 1,4,16,64,256; with --small: 1,4,16)")
    ap.add_argument("--topc", default="512,0", help="comma list of C (0 = full vocabulary; with --small 512 becomes 64)")
    ap.add_argument("--backends",
                    help="comma list of xla | xla-reference (every step the plain jnp reference: lax.top_k over "
                         "the vocabulary) | xla-top_k | xla-threshold (xpress_jax.xla_ops's selection spelled that "
                         "way) | pallas | pallas-xlares (the residual summed by XLA, not in the picks) | "
                         "xla+<steps> (e.g. xla+latent+pick: XLA with those steps as "
                         "Pallas kernels; steps: latent, pick, select), each optionally @meshDxM (xla or pallas: "
                         "xpress_jax.sharded.refine_sharded on a D (blocks) x M (vocabulary) mesh of the first D*M "
                         "devices, inputs and weights placed as it expects) or "
                         "@loop (passes in a lax.fori_loop instead of unrolled) or @certified[-c<C>][-s<S>] (full "
                         "vocab as refine(full_vocab=Certified(candidates=C, scan_blocks=S)): same tokens; top-C rows "
                         "skip it; adds its stats to the row) or @sample[-logprob|-scores] (refine(temperature="
                         "--temperature, key=jax.random.key(0), proposal=None|'logprob'|'scores'): sampled tokens; "
                         "the proposal kept alive by a false dependence of the tokens on it) or @table (refine with "
                         "a prepared xj.token_table, as RefineServer keeps; '-table' after another flag adds it to "
                         "that one). "
                         "Default: xla,pallas on a GPU, "
                         "xla elsewhere (pallas off a GPU runs in interpret mode: slow)")
    ap.add_argument("--xla-options", choices=("on", "off", "both"), default="on",
                    help="XLA compile options for the refines: on = xpress_jax.compiler_options() (what RefineServer "
                         "uses; on a GPU the CUDA graph's kernels overlap where they can), off = XLA's defaults, "
                         "both = each backend twice, the second as '<backend>/xla-default' (same tokens, compared). "
                         "Mesh backends always take XLA's defaults, as RefineServer does")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="the temperature of the @sample backends (0: the greedy tokens through the sampled path)")
    ap.add_argument("--reps", type=int, default=5, help="timed repeats of each chained measurement (median)")
    ap.add_argument("--walls", type=int, default=20, help="single calls timed for the wall latency (median)")
    ap.add_argument("--wall-only", action="store_true",
                    help="only the single-call wall latency (no chained device time): for slow machines")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"),
                    help="folder for bench.jsonl (one line per result, written as it comes), bench.json, bench.md, bench.png")
    ap.add_argument("--small", action="store_true", help="tiny shapes (smoke test on CPU)")
    ap.add_argument("--draft-vocab-size", type=int,
                    help="a reduced draft vocabulary of this size (a random d2t map; logits and w2 over it, w1 over "
                         "V), as vLLM's speculators library trains them; e.g. 32768 at serving shapes")
    ap.add_argument("--no-select", action="store_true", help="skip the selection-alone rows")
    ap.add_argument("--std", type=float, default=0.02,
                    help="std of the synthetic head's weights (0.02: weak refinement; 0.04-0.06: strong, where the "
                         "certified mode's bound certifies nothing)")
    args = ap.parse_args(argv)
    for name in ("reps", "walls"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    shape = dict(SERVING)
    if args.small:
        shape.update(vocab_size=4099, hidden_size=128, rank=64, mlp_hidden=128, topc=64)
    if args.draft_vocab_size:
        shape.update(draft_vocab_size=args.draft_vocab_size)
    cfg = xj.HeadConfig(**shape)
    ns = [int(x) for x in (args.n or ("1,4,16" if args.small else "1,4,16,64,256")).split(",")]
    topcs = [cfg.topc if (args.small and int(x) == 512) else int(x) for x in args.topc.split(",")]
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    backends = (args.backends or ("xla,pallas" if on_gpu else "xla")).split(",")
    if args.xla_options == "both":
        backends = [x for b in backends for x in (b, b + DEFAULT_XLA)]
    interpret = not on_gpu  # Pallas-Triton compiles for CUDA GPUs only; elsewhere interpret mode
    impls = {b: bench_ops(spec_of(b).partition("@")[0], interpret) for b in backends}
    meshes = {b: make_mesh(spec_of(b).partition("@")[2]) for b in backends
              if spec_of(b).partition("@")[2].startswith("mesh")}
    certs = {b: certified_flag(spec_of(b).partition("@")[2].removesuffix("-table")) for b in backends}
    samples = {b: sample_flag(spec_of(b).partition("@")[2].removesuffix("-table")) for b in backends}
    if not on_gpu and any(uses_kernels(b) for b in backends):
        print(f"# note: no GPU ({dev.platform}): Pallas kernels run in interpret mode (slow, for checking only)",
              flush=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), device=dev.device_kind, platform=dev.platform,
                jax=jax.__version__, shape=shape, K=cfg.num_passes, dtype="bfloat16", wall_only=args.wall_only,
                std=args.std, temperature=args.temperature, xla_flags=os.environ.get("XLA_FLAGS", ""),
                xla_options=args.xla_options,
                compiler_options=xj.compiler_options())
    os.makedirs(args.out, exist_ok=True)
    stream = open(os.path.join(args.out, "bench.jsonl"), "w")

    def emit(kind, rec):
        print(json.dumps(rec), flush=True)
        stream.write(json.dumps(dict(kind=kind, **rec)) + "\n")
        stream.flush()

    print(f"# refine benchmark {meta['date']} on {dev.device_kind}, jax {jax.__version__}; "
          f"results stream to {os.path.join(args.out, 'bench.jsonl')}", flush=True)
    emit("meta", meta)
    rows, sel = [], []
    for n in ns:
        problem = make_problem(cfg, n, std=args.std)
        loop_us = 0.0
        if not args.wall_only:
            m = chain_length(n, 0, "pallas") if not args.small else 3
            loop_us = time_device(chained(cfg, m, empty=True), problem, args.reps) / m * 1e6
            emit("loop", dict(N=n, loop_us=loop_us))
        for topc in topcs:
            outs = {}
            for backend in backends:
                name, _, flag = spec_of(backend).partition("@")
                opts = ({} if args.xla_options == "off" or backend.endswith(DEFAULT_XLA) or backend in meshes
                        else xj.compiler_options())
                table = flag == "table" or flag.endswith("-table")  # a prepared xj.token_table, as a server keeps
                flag = "" if flag == "table" else flag.removesuffix("-table")
                ops, unroll = impls[backend], False if flag == "loop" else None
                cert = certs[backend]
                sampled, proposal = samples[backend]
                sample_kw = dict(temperature=args.temperature, proposal=proposal) if sampled else {}
                if cert is not None and topc:
                    continue  # the certified mode is a way to compute topc=0
                # With a token table the params argument is (params, table): an argument, not a constant.
                placed = ((problem[0], xj.token_table(problem[0])), *problem[1:]) if table else problem
                # The bound's weight-only data, computed once as a server does (RefineServer: at
                # start-up and reload), not inside every timed call.
                prep = None if cert is None else exact.prepare_certified(problem[0]["w2"])

                def refine_fn(p, l, h, a, ops=ops, topc=topc, unroll=unroll, cert=cert, stats=False, prep=prep,
                              table=table, sample_kw=sample_kw):
                    p, t = p if table else (p, None)
                    if sample_kw:  # the noise key a constant of the call
                        sample_kw = dict(sample_kw, key=jax.random.key(0))
                    return with_proposal(refine_with(ops, p, l, h, a, config=cfg, topc=topc, unroll=unroll,
                                                     full_vocab=cert or "scan", return_stats=stats,
                                                     certified_prepared=prep, token_table=t, **sample_kw))

                if backend in meshes:
                    from xpress_jax.sharded import input_shardings, param_shardings, refine_sharded

                    mesh = meshes[backend]
                    ins = input_shardings(mesh, num_blocks=n, vocab_size=cfg.draft_vocab_size)
                    ps = param_shardings(mesh, vocab_size=cfg.vocab_size,
                                         draft_vocab_size=cfg.draft_vocab_size if cfg.reduced else None)
                    placed = (jax.device_put(problem[0], ps), jax.device_put(problem[1], ins["logits"]),
                              jax.device_put(problem[2], ins["h"]), jax.device_put(problem[3], ins["ids"]))

                    def refine_fn(p, l, h, a, mesh=mesh, topc=topc, name=name):
                        return refine_sharded(p, l, h, a, mesh=mesh, config=cfg, topc=topc, backend=name,
                                              interpret=interpret and name == "pallas")

                single = jax.jit(refine_fn, compiler_options=opts)
                t0 = time.perf_counter()
                outs[backend] = np.asarray(single(*placed).block_until_ready())
                compile_s = time.perf_counter() - t0
                walls, enqueues = [], []
                for _ in range(args.walls):
                    t0 = time.perf_counter()
                    out = single(*placed)
                    t1 = time.perf_counter()
                    out.block_until_ready()
                    walls.append(time.perf_counter() - t0)
                    enqueues.append(t1 - t0)
                row = dict(N=n, topc=topc, backend=backend, wall_us=statistics.median(walls) * 1e6,
                           enqueue_us=statistics.median(enqueues) * 1e6, walls=args.walls, compile_s=compile_s,
                           compiler_options=opts)
                if backend not in meshes:  # the tokens on the host: device output + copy vs pinned-host output
                    row.update(host_walls(single, refine_fn, placed, outs[backend], args.walls, opts))
                if cert is not None:  # the call's certification stats (one more call)
                    st = jax.jit(functools.partial(refine_fn, stats=True))(*placed)[1]
                    row.update({k: float(v) for k, v in st._asdict().items()})
                if not args.wall_only:
                    m = chain_length(n, topc, backend) if not args.small else 3
                    t = time_device(chained(cfg, m, refine_fn=refine_fn, compiler_options=opts), placed, args.reps)
                    row.update(device_us=t / m * 1e6, loop_us=loop_us, net_us=t / m * 1e6 - loop_us, chain=m)
                first = next(iter(outs))  # the first backend run at this topc
                if backend != first:
                    ref = outs[first]
                    row["agree"] = float(np.mean(outs[backend] == ref))
                    row["disagree_tokens"] = int(np.sum(outs[backend] != ref))
                rows.append(row)
                emit("refine", row)
        if any(topcs) and not args.no_select and not args.wall_only:
            pallas = on_gpu or any(uses_kernels(b) for b in backends)
            for name, us in select_rows(cfg, n, args.reps, interpret=interpret, pallas=pallas).items():
                sel.append(dict(N=n, C=cfg.topc, impl=name, device_us=us))
                emit("select", sel[-1])
    stream.close()
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, select=sel), f, indent=1)
    md = to_markdown(meta, rows, backends)
    if sel:
        impls = list(dict.fromkeys(r["impl"] for r in sel))
        md += ("\nTop-C selection alone (device µs per call, C=%d):\n\n| N | " % cfg.topc + " | ".join(impls)
               + " |\n|---:|" + "---:|" * len(impls) + "\n")
        for n in ns:
            cells = [next((f"{r['device_us']:.1f}" for r in sel if r["N"] == n and r["impl"] == i), "-")
                     for i in impls]
            md += f"| {n} | " + " | ".join(cells) + " |\n"
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md)
    if not args.wall_only:
        plot(rows, os.path.join(args.out, "bench.png"), meta)
    print(md)


def to_markdown(meta, rows, backends):
    lines = [f"Device: {meta['device']}, JAX {meta['jax']}, {meta['date']}, K={meta['K']}, bf16, "
             f"V={meta['shape']['vocab_size']}"
             + (f" V_draft={meta['shape']['draft_vocab_size']}" if meta['shape'].get('draft_vocab_size') else "")
             + f" H={meta['shape']['hidden_size']} B={meta['shape']['block_size']} "
             f"r={meta['shape']['rank']} mlp={meta['shape']['mlp_hidden']}, weights std {meta.get('std', 0.02)}, "
             f"XLA compile options {meta.get('compiler_options', {}) or 'none'} ({meta.get('xla_options', 'off')}; "
             f"'{DEFAULT_XLA}' = XLA's defaults)", "",
             "device µs = chained device time per refine; net = minus the chain loop's own cost per iteration "
             "(an empty body); wall = one call, host clock (dispatch + block_until_ready), in brackets its "
             "enqueue (the call without the wait): wall - device is what one call costs beyond the GPU's work. "
             "to numpy = one call's wall to the tokens in a numpy array, output on the device (then copied) / in "
             "pinned host memory (RefineServer(output='host')).", "",
             "| mode | N | " + " | ".join(f"{b} device (net) µs | {b} wall (enqueue) µs | {b} to numpy: device / host "
                                         f"output µs" for b in backends) + " | agreement |",
             "|---|---:|" + "---:|---:|---:|" * len(backends) + "---:|"]
    keys = sorted({(r["topc"], r["N"]) for r in rows}, key=lambda k: (-k[0], k[1]))
    for topc, n in keys:
        cells = []
        agree = []
        for b in backends:
            r = next((r for r in rows if r["topc"] == topc and r["N"] == n and r["backend"] == b), None)
            if r and "device_us" in r:
                cells.append(f"{r['device_us']:.0f} ({r['net_us']:.0f}) | {r['wall_us']:.0f} ({r['enqueue_us']:.0f})")
            else:
                cells.append(f"- | {r['wall_us']:.0f} ({r['enqueue_us']:.0f})" if r else "- | -")
            cells[-1] += (f" | {r['wall_np_us']:.0f} / {r['wall_host_us']:.0f}" if r and "wall_host_us" in r
                          else " | -")
            if r and "agree" in r:
                agree.append(f"{b}: {r['agree']:.2%} ({r['disagree_tokens']} differ)")
            if r and "rows_certified" in r:  # a certified backend: its stats
                agree.append(f"{b}: rows certified {r['rows_certified']:.1%}, passes certified / row scan / full "
                             f"{r['passes_certified']:.2f} / {r['passes_row_scan']:.2f} / {r['passes_full_scan']:.2f}")
        mode = "full vocab" if topc == 0 else f"top-{topc}"
        lines.append(f"| {mode} | {n} | " + " | ".join(cells) + f" | {'; '.join(agree)} |")
    return "\n".join(lines) + "\n"


def plot(rows, path, meta):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (backend, topc) in sorted({(r["backend"], r["topc"]) for r in rows}):
        pts = sorted((r["N"], r["device_us"]) for r in rows if r["backend"] == backend and r["topc"] == topc)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{backend}, {'full vocab' if topc == 0 else f'top-{topc}'}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N (blocks per call)")
    ax.set_ylabel("device µs per refine (K=6)")
    ax.set_title(f"xpress-jax refine, {meta['device']}, JAX {meta['jax']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
