"""The ``xpress`` command: ``xpress demo`` (`xpress_jax.demo`) and ``xpress bench`` (the jitted `refine` on a
synthetic or converted head: compile and call times, tokens changed, the fixed point). Progress goes to
stderr, the report to stdout. Exit codes: 0 ok; 1 a check failed; 2 bad usage (the message names the
option); 3 an unexpected error (a bug: a traceback is printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from .demo import RECIPE_NAMES, TINY, DemoOptions, run_demo

__all__ = ["main", "demo", "bench", "build_parser"]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3

#: The synthetic head's sizes when no --checkpoint is given: (option, HeadConfig field, default, meaning).
_SIZES = (
    ("--vocab", "vocab_size", 32000, "V, vocabulary size", 1),
    ("--hidden", "hidden_size", 1024, "H, the drafter's hidden size", 1),
    ("--block", "block_size", 16, "B, slots per block (slot 0 = anchor)", 2),
    ("--rank", "rank", 256, "r, latent rank", 1),
    ("--mlp", "mlp_hidden", 512, "M, SwiGLU hidden width", 1),
)
_DEFAULT_TOPC, _DEFAULT_PASSES, _DEFAULT_N, _DEFAULT_STD = 512, 6, 4, 0.05
_EPILOG = "Exit codes: 0 ok, 1 a check failed, 2 bad usage, 3 internal error."


#: ``xpress demo``'s options: (option, DemoOptions field, type, minimum, help). Defaults: `DemoOptions`.
_DEMO_INTS = (
    ("--steps", "steps", 1, "optimizer steps"),
    ("--batch", "batch_size", 1, "blocks per step"),
    ("--vocab", "vocab_size", 2, "V, the target's vocabulary (at most 256)"),
    ("--block", "block_size", 2, "B, slots per block (slot 0 = anchor)"),
    ("--hidden", "hidden_size", 1, "H, the drafter's hidden size"),
    ("--rank", "rank", 1, "r, the head's latent rank"),
    ("--mlp", "mlp_hidden", 1, "M, the head's SwiGLU width"),
    ("--eval-blocks", "eval_blocks", 1, "blocks the accepted length is measured on"),
    ("--checkpoint-every", "checkpoint_every", 0, "write the train state every N steps (0: only at the end)"),
    ("--seed", "seed", 0, "seed of the task, the head's init and the data"),
)


def _add_demo_parser(sub) -> None:
    defaults = DemoOptions()
    d = sub.add_parser("demo", epilog=_EPILOG, help="the main command: train a head on "
                       "the embedded task, export, convert, refine, and measure the accepted length", description=(
        "Train an XPress refiner head on the embedded task (a 2nd-order Markov target, a drafter that predicts "
        "every slot independently), export it (Orbax + a vLLM folder), convert the vLLM folder with "
        "xpress-convert --verify, and measure with refine on the converted head the mean accepted length per "
        "block of the drafter alone and refined with K = 1..B-1 passes, full vocabulary and top-C. Prints the "
        "table, writes OUT/accepted_length.png and OUT/results.json. Seeded. Exits 1 if a check fails."))
    d.add_argument("--out", metavar="DIR", default=defaults.out,
                   help=f"folder for the outputs (default: {defaults.out}): train_state/, head_orbax/, vllm_head/, "
                        "converted/, the PNG, results.json (replaced on a re-run; nothing else is touched)")
    for opt, field, minimum, what in _DEMO_INTS:
        d.add_argument(opt, type=int, metavar="N", dest=field,
                       help=f"{what}, >= {minimum} (default: {getattr(defaults, field)}; "
                            f"with --tiny: {TINY.get(field, getattr(defaults, field))})")
    d.add_argument("--lr", type=float, metavar="F", dest="learning_rate",
                   help=f"peak learning rate, > 0 (default: {defaults.learning_rate:g})")
    d.add_argument("--topc", metavar="C[,C...]", dest="topcs",
                   help="the top-C columns of the table, comma-separated, each in [1, V] (full vocabulary is always "
                        f"measured; default: {','.join(map(str, defaults.topcs))}; with --tiny: "
                        f"{','.join(map(str, TINY['topcs']))}); the first is the exported xpress_topc")
    d.add_argument("--dtype", choices=["float32", "bfloat16"], dest="param_dtype",
                   help="the params' dtype in training and export (default: float32)")
    d.add_argument("--temperature", type=float, metavar="T",
                   help="speculative sampling at temperature T > 0 instead of the greedy check: the target is "
                        "sampled at T (the drafter: its marginals at T), the head is trained on continuations "
                        "sampled from it at T, refine samples the draft at T (K = 0: the seed sample) and a "
                        "rejection sampler verifies it against the target at T (default: greedy)")
    d.add_argument("--recipe", choices=list(RECIPE_NAMES), default=defaults.recipe,
                   help="the training recipe (default: ce): ce = the cross-entropy against the target's "
                        "continuation; speculators = vLLM speculators' XPress recipe: 0.1 x cross-entropy against "
                        "the teacher's argmax + 0.9 x total variation from the teacher's distribution, slot k "
                        "weighted exp(-(k-1)/4), + 0.3 x the loss over 3 free-running refine rounds")
    d.add_argument("--compare-recipes", action="store_true",
                   help="also train a head with each recipe, on the greedy continuation and on samples at T=1, and "
                        "print their mean accepted lengths side by side (full vocabulary; greedy check and "
                        "speculative sampling at T=1): three more trainings (four with another --temperature), minutes at "
                        "the default size (default: off)")
    d.add_argument("--resume", action="store_true",
                   help="continue training from OUT/train_state (the same options, --steps included: it is the "
                        "schedule's length) instead of starting over; without a saved state it says so and trains "
                        "from scratch")
    d.add_argument("--tiny", action="store_true",
                   help="a smoke run (seconds; its numbers are no result): the sizes marked 'with --tiny'")
    d.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress bar or progress lines on stderr")
    d.set_defaults(_parser=d, _run=demo)


def _demo_options(args: argparse.Namespace, error):
    given = [f for _, f, _, _ in _DEMO_INTS] + ["learning_rate", "param_dtype"]
    values = (dict(TINY) if args.tiny else {}) | {k: getattr(args, k) for k in given if getattr(args, k) is not None}
    for opt, field, minimum, _ in _DEMO_INTS:
        if field in values and values[field] < minimum:
            error(f"{opt} must be >= {minimum}, got {values[field]}")
    if values.get("vocab_size", 0) > 256:
        error(f"--vocab must be <= 256 (the task's tables hold V^3 floats), got {values['vocab_size']}")
    if args.learning_rate is not None and not 0 < args.learning_rate < float("inf"):  # also refuses nan
        error(f"--lr must be a finite number > 0, got {args.learning_rate}")
    if args.temperature is not None and not 0 < args.temperature < float("inf"):  # also refuses nan
        error(f"--temperature must be a finite number > 0, got {args.temperature}")
    V = values.get("vocab_size", DemoOptions.vocab_size)
    values["topcs"] = tuple(c for c in values.get("topcs", DemoOptions.topcs) if c <= V)
    if args.topcs is not None:
        try:
            values["topcs"] = tuple(int(c) for c in args.topcs.split(",") if c.strip())
        except ValueError:
            error(f"--topc must be comma-separated ints, got {args.topcs!r}")
        if not values["topcs"] or any(not 1 <= c <= V for c in values["topcs"]):
            error(f"--topc values must be in [1, V={V}] (full vocabulary is always measured), got {args.topcs!r}")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        error(f"--out {args.out}: exists and is not a folder; name a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        error(f"--out {args.out}: cannot write there ({e.strerror or e})")
    return DemoOptions(out=args.out, resume=args.resume, plot=not args.no_plot, progress=not args.quiet,
                       smoke=args.tiny, temperature=args.temperature, recipe=args.recipe,
                       compare_recipes=args.compare_recipes, **values)


def demo(args: argparse.Namespace, error) -> int:
    """Run ``xpress demo`` (`xpress_jax.demo.run_demo`); ``error(msg)`` reports a usage error."""
    from .train import ResumeError  # optax and orbax: only for the demo

    opts = _demo_options(args, error)
    try:
        result = run_demo(opts, say=lambda line: print(line, flush=True), progress=_progress(opts.progress))
    except ResumeError as e:  # --resume with other options than the checkpoint's
        hint = ""
        if "train_config.steps" in e.differences:
            saved = e.differences["train_config.steps"][0]
            hint = (f". Here: for {opts.steps} steps run again without --resume (it starts over, replacing "
                    f"{opts.out}/train_state) or with another --out; --steps {saved} resumes this run")
        error(f"--resume: {e}{hint}")
    print("OK" if result["ok"] else "FAILED")
    return EXIT_OK if result["ok"] else EXIT_CHECK_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xpress", epilog=_EPILOG, description="XPress refiner head in JAX. Converting a drafter's checkpoint "
        "(the one vLLM loads, or the xPress runtime's) into one that refine runs is the separate command "
        "xpress-convert (xpress-convert --help; xpress-convert inspect PATH shows what a checkpoint holds).")
    version = f"xpress-jax {xj.__version__} (jax {jax.__version__}, python {platform.python_version()})"
    parser.add_argument("--version", action="version", version=version, help="print the versions of xpress-jax, "
                        "JAX and Python")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_demo_parser(sub)
    d = sub.add_parser("bench", epilog=_EPILOG, help="time the jitted refine on a "
                       "synthetic or converted head, and check its fixed point", description=(
        "Build a synthetic head (or load a converted one with --checkpoint) and synthetic drafter logits, run the "
        "jitted refine in full-vocabulary and top-C mode, report compile + first-call time, call latency and how "
        "many drafter tokens refinement changed, and check the fixed point (full vocab: K=B-1 passes == K=B "
        "passes; slots 1..K final after K passes). Exits 1 if a check fails."))
    d.add_argument("--checkpoint", metavar="PATH",
                   help="a converted head (xpress-convert output, or xpress_jax.save_params); its config gives the "
                        "sizes, C and K (default: a synthetic head)")
    for opt, field, default, what, minimum in _SIZES:
        d.add_argument(opt, type=int, metavar="N", dest=field,
                       help=f"{what}, >= {minimum} (default: {default}; with --checkpoint: the checkpoint's)")
    d.add_argument("--topc", type=int, metavar="C",
                   help=f"C, candidates per draft slot; 0 = run full vocabulary only (default: {_DEFAULT_TOPC}, "
                        "clamped to V as vLLM does; with --checkpoint: the checkpoint's). An explicit C > V is refused")
    d.add_argument("--passes", type=int, metavar="K",
                   help=f"K, Jacobi passes per call, >= 1 (default: {_DEFAULT_PASSES}; with --checkpoint: the "
                        "checkpoint's)")
    d.add_argument("--n", type=int, default=_DEFAULT_N, metavar="N",
                   help=f"blocks (requests) per call, >= 1, <= the checkpoint's max_num_reqs (default: {_DEFAULT_N})")
    d.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="params and logits dtype (default: float32; with --checkpoint: the stored dtype)")
    d.add_argument("--std", type=float,
                   help=f"weight std of the synthetic head, > 0 (default: {_DEFAULT_STD}: strong enough that "
                        "refinement changes many drafter tokens); not with --checkpoint")
    d.add_argument("--seed", type=int, default=0, help="random seed of the head and the inputs, >= 0 (default: 0)")
    d.add_argument("--reps", type=int, default=5, help="timed calls per mode (the median is reported), >= 1 "
                   "(default: 5)")
    d.add_argument("--backend", default="auto", choices=["auto", "xla", "pallas"],
                   help="auto = Pallas kernels on a supported GPU, else the XLA (jnp) path; pallas on a CPU runs "
                        "the kernels in (slow) interpret mode (default: auto)")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    d.set_defaults(_parser=d, _run=bench)
    return parser


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn().block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _progress(enabled: bool):
    """One line per step on stderr, with the time since the start (so a long step is visibly running)."""
    t0 = time.perf_counter()
    return lambda msg: enabled and print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def _resolve(args: argparse.Namespace, error) -> tuple:
    """(config, head or None, dtype name) from the options or the checkpoint; errors name the option."""
    ints = [(opt, getattr(args, field), minimum) for opt, field, _, _, minimum in _SIZES]
    for opt, v, minimum in ints + [("--topc", args.topc, 0), ("--passes", args.passes, 1), ("--n", args.n, 1),
                                   ("--reps", args.reps, 1), ("--seed", args.seed, 0)]:
        if v is not None and v < minimum:
            error(f"{opt} must be >= {minimum}, got {v}")
    if args.std is not None and not args.std > 0:  # also refuses nan
        error(f"--std must be > 0, got {args.std}")

    run = {k: v for k, v in (("num_passes", args.passes), ("topc", args.topc)) if v is not None}
    if args.checkpoint is not None:
        if args.std is not None:
            error("--std sets the synthetic head's weights; it cannot be used with --checkpoint")
        try:
            head = xj.load_params(args.checkpoint)
        except (OSError, ValueError, TypeError) as e:
            error(f"--checkpoint {args.checkpoint}: {e}")
        cfg = head.config
        clash = [f"{opt} {getattr(args, field)} (the checkpoint has {getattr(cfg, field)})"
                 for opt, field, *_ in _SIZES
                 if getattr(args, field) is not None and getattr(args, field) != getattr(cfg, field)]
        if clash:
            error("size options conflict with --checkpoint: " + ", ".join(clash) + "; leave them out")
        if args.n > cfg.max_num_reqs:
            error(f"--n {args.n} exceeds the checkpoint's max_num_reqs={cfg.max_num_reqs}")
        dtype = args.dtype or head.dtype.name
    else:
        head, dtype = None, args.dtype or "float32"
        sizes = {field: default if getattr(args, field) is None else getattr(args, field)
                 for _, field, default, _, _ in _SIZES}
        cfg = xj.HeadConfig(**sizes, max_num_reqs=args.n)  # valid: checked above
    if run.get("topc", 0) > cfg.vocab_size:
        error(f"--topc {run['topc']} exceeds the vocabulary (V={cfg.vocab_size}); leave it out to use "
              f"min({_DEFAULT_TOPC}, V), or pass 0 for full vocabulary only")
    if head is None:
        run = {"topc": min(_DEFAULT_TOPC, cfg.vocab_size), "num_passes": _DEFAULT_PASSES} | run
    return dataclasses.replace(cfg, **run), head, dtype


def bench(args: argparse.Namespace, error) -> int:
    """Run ``xpress bench``; ``error(msg)`` reports a usage error."""
    progress = _progress(not args.quiet)
    cfg, head, dtype_name = _resolve(args, error)
    dtype = jnp.dtype(dtype_name)
    kp, kl, kh, ka = jax.random.split(jax.random.key(args.seed), 4)
    if head is None:
        progress(f"building a synthetic head (V={cfg.vocab_size}, H={cfg.hidden_size}, std={args.std or _DEFAULT_STD})")
        # Weights strong enough that refinement changes many of the drafter's tokens.
        head = xj.init_head(cfg, kp, dtype=dtype, std=args.std or _DEFAULT_STD)
        source = "synthetic head"
    else:
        source = f"checkpoint {args.checkpoint}"
        head = xj.Head(cfg, head.params).astype(dtype)  # the run's C and K (--topc/--passes), the checkpoint's weights
    N, B, V = args.n, cfg.block_size, cfg.vocab_size
    logits = (jax.random.normal(kl, (N, B, V), jnp.float32) * 2).astype(dtype)
    h = jax.random.normal(kh, (N, B, cfg.hidden_size), jnp.float32).astype(dtype)
    anchors = jax.random.randint(ka, (N,), 0, V, jnp.int32)
    # XLA's options for refine on this platform (on a GPU its kernels overlap where they can; same tokens).
    refine = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES, compiler_options=xj.compiler_options())
    # Pallas kernels only compile for GPUs; on a CPU they run in (slow) interpret mode.
    interpret = args.backend.startswith("pallas") and jax.default_backend() != "gpu"
    drafter = np.asarray(jnp.argmax(logits[:, 1:], axis=-1))

    print(f"xpress bench: {source}: V={V} H={cfg.hidden_size} B={B} r={cfg.rank} M={cfg.mlp_hidden} "
          f"C={cfg.topc} K={cfg.num_passes} N={N} dtype={dtype.name} backend={args.backend}"
          f"{' (interpret mode)' if interpret else ''}")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind})\n")
    call_col = f"call ms (median of {args.reps})"
    print(f"{'mode':<12} {'K':>3} {'compile+1st s':>13} {call_col:>{max(len(call_col), 9)}} "
          f"{'tokens changed vs drafter':>27}")
    modes = [("full-vocab", 0)] + ([(f"top-{cfg.topc}", cfg.topc)] if cfg.topc else [])
    for mode, topc in modes:
        kw = dict(topc=topc, backend=args.backend, interpret=interpret)
        progress(f"{mode}: compile + first call")
        t0 = time.perf_counter()
        out = refine(head, logits, h, anchors, **kw).block_until_ready()
        compile_s = time.perf_counter() - t0
        progress(f"{mode}: {args.reps} timed call(s)")
        ms = _median_ms(lambda: refine(head, logits, h, anchors, **kw), args.reps)
        changed = float(np.mean(np.asarray(out) != drafter))
        print(f"{mode:<12} {cfg.num_passes:>3} {compile_s:>13.2f} {ms:>{max(len(call_col), 9)}.2f} {changed:>26.1%}")

    # Fixed point: with K >= B-1 full-vocab passes the block is the sequential greedy decode,
    # so one more pass changes nothing.
    progress(f"fixed-point check: full vocab with K={B - 1}, K={B} and K={cfg.num_passes} passes (3 compiles)")
    a, b, early = (np.asarray(refine(head, logits, h, anchors, num_passes=k, topc=0, backend=args.backend,
                                     interpret=interpret)) for k in (B - 1, B, cfg.num_passes))
    same = bool(np.array_equal(a, b))
    settled = bool(np.array_equal(early[:, : cfg.num_passes], a[:, : cfg.num_passes]))
    ok = same and settled
    print(f"\nfixed point: full vocab K=B-1={B - 1} vs K={B}: {'identical' if same else 'DIFFERENT'} "
          f"({int(np.sum(a != b))} of {a.size} tokens differ)")
    print(f"after K={cfg.num_passes} passes slots 1..{min(cfg.num_passes, B - 1)} are final: "
          f"{'yes' if settled else 'NO'}; slots still moving after K: {int(np.sum(early != a))} of {a.size}")
    progress("done")
    print("OK" if ok else "FAILED")
    return EXIT_OK if ok else EXIT_CHECK_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``xpress``; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args._run(args, error=args._parser.error)  # usage errors: the subcommand's usage, exit 2
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        print("xpress: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print("xpress: internal error (a bug: please report it with the traceback above)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
