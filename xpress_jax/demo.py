"""``xpress demo``: what the refiner is for, end to end on the embedded task (`xpress_jax.toy`).

1. Train an `XPressHead` on the task (`xpress_jax.train`; train-state checkpoints in ``OUT/train_state``).
2. Export it both ways (`xpress_jax.export`): ``OUT/head_orbax`` and ``OUT/vllm_head``.
3. Convert the vLLM folder with ``xpress-convert --verify`` into ``OUT/converted`` and check that its
   params are bitwise the Orbax export's.
4. Measure with the jitted `xpress_jax.refine` on the converted head the mean accepted length per block
   of the drafter alone (K = 0) and refined with K = 1..B-1 passes, full vocabulary and each top-C;
   print the table, write ``OUT/accepted_length.png`` and ``OUT/results.json``.

With a temperature T (``xpress demo --temperature T``) the demo is about speculative sampling at T: the task's
target is sampled at T (``ToyConfig(temperature=T)``: its contexts and drafter are those of the chain at T,
`xpress_jax.toy`), step 1 trains the head on continuations sampled from the target at T, scored at T
(``TrainConfig(sample_temperature=T)``), and step 4 measures speculative sampling at T (`evaluate_sampled`):
refine samples the draft (``temperature=T``, ``proposal="scores"``) and `xpress_jax.sampling.accept` verifies it
against the target chain's logits at the draft positions.

``--recipe speculators`` trains with vLLM speculators' XPress recipe instead of the cross-entropy
(`xpress_jax.train.TrainConfig.from_recipe`). ``--compare-recipes`` then trains one head per recipe, greedy and
at T = 1, and prints their mean accepted length (full vocabulary, K = 0..B-1) side by side (`compare_recipes`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from .export import export_serving, export_vllm
from .refine import STATIC, refine
from .sampling import accept
from .toy import ToyConfig, ToyTask, evaluate

__all__ = ["DemoOptions", "TINY", "RECIPE_NAMES", "run_demo", "format_table", "evaluate_sampled", "compare_recipes",
           "format_comparison"]

#: What ``xpress demo`` writes inside ``--out`` (and replaces on a re-run; nothing else is touched).
OUTPUTS = ("train_state", "head_orbax", "vllm_head", "converted", "accepted_length.png", "results.json")


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """The demo's settings (the CLI's options; defaults: the embedded task at its default size)."""

    out: str = "xpress-demo"
    vocab_size: int = 64
    block_size: int = 8
    hidden_size: int = 32
    rank: int = 32
    mlp_hidden: int = 64
    steps: int = 1500
    batch_size: int = 256
    learning_rate: float = 3e-3
    param_dtype: str = "float32"
    topcs: tuple[int, ...] = (16, 8, 4)
    eval_blocks: int = 4096
    checkpoint_every: int = 500
    seed: int = 0
    resume: bool = False
    plot: bool = True
    progress: bool = True
    smoke: bool = False  # --tiny: a smoke run (every step runs; the numbers are not a result)
    temperature: float | None = None  # sample the target, train and measure at this T > 0 (None: greedy)
    recipe: str = "ce"  # the training recipe (`xpress_jax.train.RECIPES`)
    compare_recipes: bool = False  # also train and measure every recipe, greedy and at T = 1


#: The recipes ``--recipe`` takes (`xpress_jax.train.RECIPES`), and what each trains on, for the report.
RECIPE_NAMES = ("ce", "speculators")
RECIPE_LINES = {
    "ce": "the cross-entropy against the target's continuation",
    "speculators": "vLLM speculators' XPress recipe: 0.1 x cross-entropy against the teacher's argmax + 0.9 x "
                   "total variation from its distribution (the target chain's, given the continuation), slot k "
                   "weighted exp(-(k-1)/4), + 0.3 x the mean of that loss over 3 free-running rounds",
}


#: ``--tiny``: the smoke-run size (a few seconds).
TINY = dict(vocab_size=16, block_size=4, hidden_size=8, rank=8, mlp_hidden=16, steps=40, batch_size=32,
            topcs=(4,), eval_blocks=64, checkpoint_every=20)


def format_table(result: dict) -> list[str]:
    """The accepted-length table: rows K = 0..B-1, columns full vocab and each top-C. A sampled result's row
    K = 0 is each mode's seed sample (top-C: the drafter's sample among its C best)."""
    modes = list(result["refined"])
    names = ["full vocab" if int(c) == 0 else f"top-{c}" for c in modes]
    width = max(10, *(len(n) for n in names))
    lines = ["  K  " + "".join(f"{n:>{width + 2}}" for n in names)]
    if "seed_block" in result:
        lines.append("  0  " + "".join(f"{result['seed_block'][c]:>{width + 2}.2f}" for c in modes)
                     + "   (drafter alone: the seed sample)")
    else:
        lines.append("  0  " + "".join(f"{result['drafter']:>{width + 2}.2f}" for _ in modes) + "   (drafter alone)")
    for k in range(len(result["refined"][modes[0]])):
        lines.append(f"{k + 1:>3}  " + "".join(f"{result['refined'][c][k]:>{width + 2}.2f}" for c in modes))
    return lines


def evaluate_sampled(task: ToyTask, head, *, temperature: float | None = None, n_blocks: int = 4096, seed: int = 1234,
                     topcs: tuple[int, ...] = (0,), max_passes: int | None = None, backend: str = "auto") -> dict:
    """Mean accepted length per block under speculative sampling at ``temperature`` T > 0 (None: the task's), K =
    0..B-1.

    Each block's draft is the jitted `xpress_jax.refine` with ``temperature=T``, a key and ``proposal="scores"``
    (K = 0: the seed sample; in full-vocabulary mode the drafter alone). `xpress_jax.sampling.accept` verifies it:
    the target's logits at draft position j are the chain's raw logits (``next_logits``) after the two tokens
    before it (the draft's own prefix: the block is scored as drafted), both sides at T. At the task's own
    temperature the target is the task's chain and the drafter's K = 0 sample its exact marginals; at another T
    the target is the chain's logits sampled at that T (the contexts and the drafter stay the task's). The
    accepted length is the number of draft tokens accepted (0..B-1; the token the target adds is not counted).
    The same keys for every K and mode. Returns ``{"n_blocks", "seed", "temperature", "drafter", "seed_block":
    {C: at K = 0}, "refined": {C: [at K = 1, 2, ...]}}`` (C = 0: full vocabulary; ``drafter`` = its K = 0)."""
    t = float(task.config.temperature if temperature is None else temperature)
    if not (np.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a finite float > 0 (speculative sampling), got {temperature!r}")
    K_max = task.config.block_size - 1 if max_passes is None else max_passes
    batch = ToyTask.sample(task.tables, jax.random.key(seed), n_blocks)
    x = (batch.logits.astype(head.dtype), batch.h.astype(head.dtype), batch.anchors, batch.prev_ids)
    next_logits = jnp.asarray(task.tables["next_logits"])  # [a, b, c], the raw logits
    draft_key, accept_key = jax.random.split(jax.random.key(seed + 1))
    run = jax.jit(refine, static_argnames=STATIC)

    @jax.jit
    def accepted(draft, proposal, prev_ids, anchors, t, key):
        seq = jnp.concatenate([prev_ids[:, None], anchors[:, None], draft], axis=1)  # x_{-1}, x_0, the draft
        target = next_logits[seq[:, :-2], seq[:, 1:-1]]  # [N, B-1, V]: position j after (x_{j-2}, x_{j-1})
        tokens, _ = accept(target, draft, proposal, t, key)
        n_acc = jnp.sum(jnp.cumprod(tokens == draft, axis=1), axis=1)  # a replacement never equals the draft
        return jnp.mean(n_acc.astype(jnp.float32))

    def mean_accepted(k, c):
        draft, proposal = run(head, *x, num_passes=k, topc=c, max_num_reqs=n_blocks, backend=backend,
                              temperature=jnp.float32(t), key=draft_key, proposal="scores")
        return float(accepted(draft, proposal, batch.prev_ids, batch.anchors, jnp.float32(t), accept_key))

    seed_block = {int(c): mean_accepted(0, c) for c in topcs}
    refined = {int(c): [mean_accepted(k, c) for k in range(1, K_max + 1)] for c in topcs}
    drafter = seed_block[0] if 0 in seed_block else mean_accepted(0, 0)
    return {"n_blocks": n_blocks, "seed": seed, "temperature": t, "drafter": drafter, "seed_block": seed_block,
            "refined": refined}


def _duration(seconds: float) -> str:
    """``12.3 s``, or below a second ``45.1 ms`` (a smoke run's steps take milliseconds)."""
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _train_config(opts: DemoOptions, recipe: str, temperature: float | None, checkpoint_every: int = 0):
    from .train import TrainConfig

    return TrainConfig.from_recipe(recipe, steps=opts.steps, batch_size=opts.batch_size,
                                   learning_rate=opts.learning_rate, param_dtype=opts.param_dtype, seed=opts.seed,
                                   checkpoint_every=checkpoint_every, sample_temperature=temperature)


#: `compare_recipes`' modes: the column name and the temperature (None: the greedy check).
COMPARE_MODES = (("greedy", None), ("T=1", 1.0))


def compare_recipes(opts: DemoOptions, *, note: Callable[[str], None] = lambda _m: None,
                    trained: dict | None = None) -> dict:
    """Train a head with each recipe (`RECIPE_NAMES`) in each mode (`COMPARE_MODES`: trained on the greedy
    continuation and measured by the greedy check; trained on continuations sampled at T = 1 and measured by
    speculative sampling at T = 1) with ``opts``' sizes, steps and seed, on the task at T = 1, and measure the
    mean accepted length in full-vocabulary mode, K = 0..B-1 (`evaluate`, `evaluate_sampled`: the same blocks
    and keys for every head). ``trained``: ``{(recipe, mode): serving head}`` already trained so (not retrained).
    Returns ``{"n_blocks", "seed", "steps", "modes": {mode: {"drafter", "refined": {recipe: [K = 1, ...]}}}}``."""
    from .train import train

    task = ToyTask(ToyConfig(opts.vocab_size, opts.block_size, opts.hidden_size, seed=opts.seed))
    head_cfg = task.head_config(rank=opts.rank, mlp_hidden=opts.mlp_hidden, topc=0,
                                max_num_reqs=max(opts.eval_blocks, 1))
    modes = {}
    for mode, t in COMPARE_MODES:
        refined, drafter = {}, None
        for recipe in RECIPE_NAMES:
            head = (trained or {}).get((recipe, mode))
            if head is None:
                note(f"comparing recipes: training {recipe}, {mode} ({opts.steps} steps)")
                res = train(head_cfg, task.tables, ToyTask.sample, _train_config(opts, recipe, t),
                            progress=opts.progress)
                head = res.model.to_serving()
            note(f"comparing recipes: measuring {recipe}, {mode}")
            if t is None:
                ev = evaluate(task, head, n_blocks=opts.eval_blocks, seed=1000 + opts.seed, topcs=(0,))
            else:
                ev = evaluate_sampled(task, head, temperature=t, n_blocks=opts.eval_blocks, seed=1000 + opts.seed,
                                      topcs=(0,))
            refined[recipe], drafter = ev["refined"][0], ev["drafter"]
        modes[mode] = {"drafter": drafter, "refined": refined}
    return {"n_blocks": opts.eval_blocks, "seed": 1000 + opts.seed, "steps": opts.steps, "modes": modes}


def format_comparison(result: dict) -> list[str]:
    """`compare_recipes`' table: rows K = 0..B-1, a column per mode and recipe (full vocabulary)."""
    cols = [(mode, recipe) for mode, m in result["modes"].items() for recipe in m["refined"]]
    names = [f"{mode}: {recipe}" for mode, recipe in cols]
    widths = [max(10, len(n)) + 2 for n in names]
    lines = ["  K  " + "".join(f"{n:>{w}}" for n, w in zip(names, widths))]
    lines.append("  0  " + "".join(f"{result['modes'][mode]['drafter']:>{w}.2f}" for (mode, _), w in zip(cols, widths))
                 + "   (drafter alone)")
    first = result["modes"][cols[0][0]]["refined"][cols[0][1]]
    for k in range(len(first)):
        lines.append(f"{k + 1:>3}  " + "".join(f"{result['modes'][mode]['refined'][recipe][k]:>{w}.2f}"
                                               for (mode, recipe), w in zip(cols, widths)))
    return lines


def _plot(path: Path, result: dict, block_size: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    seed_block = result.get("seed_block", {})
    for c, row in result["refined"].items():
        ks = list(range(len(row) + 1))
        ax.plot(ks, [seed_block.get(c, result["drafter"]), *row], marker="o",
                label="full vocab" if int(c) == 0 else f"top-{c}")
    ax.axhline(result["drafter"], color="grey", linestyle="--", label="drafter alone")
    ax.set_xlabel("K (Jacobi passes of the refiner)")
    if "temperature" in result:
        ax.set_ylabel(f"mean draft tokens per block accepted (of {block_size - 1}),\nspeculative sampling at "
                      f"T={result['temperature']:g}", fontsize=9)
    else:
        ax.set_ylabel(f"mean accepted draft tokens per block (of {block_size - 1})")
    ax.set_ylim(0, block_size - 1)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(opts: DemoOptions, say: Callable[[str], None] = print,
             progress: Callable[[str], None] | None = None) -> dict:
    """Run the whole demo; ``say`` gets the report's lines, ``progress`` the stderr progress lines. Returns
    the results dict (also ``OUT/results.json``); ``results["ok"]`` is False when a check failed."""
    from .convert import VerificationError, convert_checkpoint  # the converter and optax/orbax: only here
    from .train import saved_step, train

    note = progress or (lambda _m: None)
    out = Path(opts.out).expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    for p in (out / name for name in OUTPUTS if not (name == "train_state" and opts.resume)):
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)

    t_all = time.perf_counter()
    note("building the task (target chain, drafter tables)")
    T = opts.temperature
    toy_cfg = ToyConfig(opts.vocab_size, opts.block_size, opts.hidden_size, seed=opts.seed,
                        temperature=1.0 if T is None else T)
    task = ToyTask(toy_cfg)
    head_cfg = task.head_config(rank=opts.rank, mlp_hidden=opts.mlp_hidden, topc=opts.topcs[0] if opts.topcs else 0,
                                max_num_reqs=max(opts.eval_blocks, 1))
    tc = _train_config(opts, opts.recipe, T, opts.checkpoint_every)
    V, B = toy_cfg.vocab_size, toy_cfg.block_size
    say("xpress demo: train an XPress refiner head on the embedded task, export it, convert it, refine")
    if opts.smoke:
        say("smoke run (--tiny): checks that every step runs, on a head too small and too briefly trained for its "
            "numbers to mean anything")
    say(f"task  : target = 2nd-order Markov chain over V={V} tokens; drafter = each of the B-1={B - 1} draft "
        f"slots predicted independently (its exact k-step marginal); seed {opts.seed}")
    if T is not None:
        say(f"        the target is sampled at T={T:g}: the chain is softmax(logits / T), and so are the contexts' "
            "distribution and the drafter's marginals")
    say(f"head  : H={toy_cfg.hidden_size} r={opts.rank} M={opts.mlp_hidden} B={B}, {opts.param_dtype} params; "
        f"AdamW (peak lr {opts.learning_rate:g}, warmup + cosine), {opts.steps} steps x {opts.batch_size} blocks")
    if T is not None:
        say(f"        trained on continuations sampled from the target at T={T:g} (cross-entropy of "
            "softmax(scores / T)), not on its greedy continuation")
    if opts.recipe != "ce":
        say(f"recipe: {opts.recipe}: {RECIPE_LINES[opts.recipe]}")
    if opts.resume and saved_step(out / "train_state") is None:
        say(f"resume: no saved train state in {out / 'train_state'}: training from scratch")

    note(f"training ({opts.steps} steps)")
    res = train(head_cfg, task.tables, ToyTask.sample, tc, checkpoint_dir=out / "train_state", resume=opts.resume,
                task_meta=dataclasses.asdict(toy_cfg), progress=opts.progress)
    last = res.history[-1] if res.history else None
    resumed = f", resumed from step {res.resumed_from}" if res.resumed_from is not None else ""
    say(f"train : {len(res.history)} steps in {_duration(res.seconds)} after compile ({res.tokens_per_s:,.0f} draft "
        f"tokens/s){resumed}; final loss {last['loss']:.4f}, teacher-forced slot accuracy {last['accuracy']:.3f}"
        if last else f"train : nothing to do{resumed} (the checkpoint is at the last step)")

    note("exporting (Orbax serving checkpoint, vLLM folder)")
    export_serving(out / "head_orbax", res.model)
    export_vllm(out / "vllm_head", res.model)
    say(f"export: {out / 'head_orbax'} (Orbax, serving form); {out / 'vllm_head'} (model.safetensors under "
        f"'xpress_head.', raw mix.L, + config.json)")

    note("converting the vLLM folder with xpress-convert --verify")
    try:
        report = convert_checkpoint(out / "vllm_head", out / "converted", verify=True, seed=opts.seed)
        say(f"convert: xpress-convert {out / 'vllm_head'} {out / 'converted'} --verify: "
            + "; ".join(report.verify.lines()))
    except VerificationError as e:  # exactness required (float32 in, float32 out) and not met
        say(f"convert: FAILED verification: {e}")
        return {"ok": False}
    head = xj.load_params(out / "converted")
    orbax_head = xj.load_params(out / "head_orbax")
    ok = all(np.array_equal(np.asarray(head.params[k]), np.asarray(orbax_head.params[k])) for k in xj.PARAM_NAMES)
    say(f"check : the converted checkpoint's params are {'bitwise identical to' if ok else 'DIFFERENT from'} "
        "the Orbax export's")

    at = "" if T is None else f" at T={T:g}"
    note(f"measuring: refine on the converted head{at}, K = {0 if T else 1}..{B - 1}, "
         f"modes {['full'] + list(opts.topcs)}")
    topcs = (0, *[c for c in opts.topcs if c])
    if T is None:
        result = evaluate(task, head, n_blocks=opts.eval_blocks, seed=1000 + opts.seed, topcs=topcs)
        say(f"\nMean accepted length per block: draft tokens (of B-1 = {B - 1}) that the target's greedy check "
            f"accepts, i.e. the longest prefix of the draft equal to the target's greedy continuation; "
            f"{opts.eval_blocks} blocks (contexts from the chain's stationary distribution, seed {result['seed']}); "
            "K = 0 is the drafter alone; refined = the jitted xpress_jax.refine on the converted checkpoint.\n")
    else:
        result = evaluate_sampled(task, head, temperature=T, n_blocks=opts.eval_blocks, seed=1000 + opts.seed,
                                  topcs=topcs)
        say(f"\nMean accepted length per block under speculative sampling at T={T:g}: draft tokens (of B-1 = "
            f"{B - 1}) that the rejection sampler accepts (min(1, p/q) per token, p = the target chain at T, q = "
            f"the draft's distribution at T, until the first rejection); {opts.eval_blocks} blocks (contexts from "
            f"the chain's stationary distribution, seed {result['seed']}); drafts = the jitted xpress_jax.refine "
            "with temperature=T on the converted checkpoint; K = 0 is its seed sample (full vocabulary: the drafter "
            "alone; top-C: the drafter's sample among its C best).\n")
    for line in format_table(result) + [""]:
        say(line)
    best = max(result["refined"][0])
    if opts.smoke:
        say("smoke run: every step ran. These numbers are no result: run `xpress demo` without --tiny to measure.")
    else:
        say(f"Full vocabulary{at}, K = {B - 1}: {best:.2f} accepted tokens per block vs {result['drafter']:.2f} for "
            f"the drafter alone ({best / max(result['drafter'], 1e-9):.2f}x); with the target's own next token, "
            f"{best + 1:.2f} vs {result['drafter'] + 1:.2f} tokens per verification step. Top-C cannot pick a "
            "token outside the drafter's C best, which caps it below full vocabulary.")
        if T is not None:
            say("The head is trained on continuations sampled from the target at T, so its refined distribution "
                "q = softmax(scores / T) approximates the target's conditional distribution given the draft's "
                "prefix; a drafted token is accepted with min(1, p/q). The drafter alone samples every slot from "
                "its exact marginal, right at slot 1 and ever less so further on.")
    if opts.plot:
        try:
            _plot(out / "accepted_length.png", result, B,
                  f"XPress refiner on the embedded task (V={V}, B={B}, r={opts.rank}, {opts.steps} steps{at})")
            say(f"plot  : {out / 'accepted_length.png'}")
        except ImportError:
            say("plot  : skipped (matplotlib is not installed: pip install matplotlib)")
    comparison = None
    if opts.compare_recipes:
        mode = {None: "greedy", 1.0: "T=1"}.get(T)  # this run's head is one of the comparison's
        comparison = compare_recipes(opts, note=note, trained={(opts.recipe, mode): head} if mode else None)
        say(f"\nRecipes compared: mean accepted length per block (of B-1 = {B - 1}), full vocabulary; a head "
            f"trained with each recipe ({opts.steps} steps x {opts.batch_size} blocks, seed {opts.seed}) on the "
            f"target's greedy continuation, measured by the greedy check (greedy), or on continuations sampled at "
            f"T=1, measured by speculative sampling at T=1 (T=1); {opts.eval_blocks} blocks, seed "
            f"{comparison['seed']}. Recipes: " + "; ".join(f"{r} = {RECIPE_LINES[r]}" for r in RECIPE_NAMES)
            + ".\n")
        for line in format_comparison(comparison) + [""]:
            say(line)
    result = {"ok": bool(ok), "options": json.loads(json.dumps(dataclasses.asdict(opts))),
              "task": dataclasses.asdict(toy_cfg), "head_config": dataclasses.asdict(head_cfg),
              "train": {"recipe": opts.recipe, "steps_run": len(res.history), "seconds": res.seconds,
                        "tokens_per_s": res.tokens_per_s, "final": last, "resumed_from": res.resumed_from},
              "accepted_length": {**result, "refined": {str(k): v for k, v in result["refined"].items()}},
              "jax": jax.__version__, "seconds_total": time.perf_counter() - t_all}
    if comparison is not None:
        result["recipes"] = comparison
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    say(f"results: {out / 'results.json'}; total {result['seconds_total']:.1f} s")
    return result
