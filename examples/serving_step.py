"""A jitted draft step of a toy serving loop: drafter -> refine -> the target's greedy check.

    python examples/serving_step.py                                  # trains a head first (5-9 s)
    python examples/serving_step.py --head xpress-demo/head_orbax    # the head `xpress demo` trained
    python examples/serving_step.py --smoke                          # untrained head: a quick check

What it shows: `xpress_jax.refine` inside one speculative-decoding step. `draft_step` is one
``jax.jit``-ted function of the head, the task's tables and the serving state of R concurrent
requests (each request's last two verified tokens). In one XLA program it

1. runs the drafter: logits [R, B, V] and hidden states [R, B, H] for every request's context
   (the embedded task's block drafter, `xpress_jax.toy`: a table lookup by context);
2. refines the draft with ``xj.refine`` (K Jacobi passes, full vocabulary or top-C; K and C are
   static arguments of the jit);
3. verifies the block as a greedy target does, in one parallel pass: the target's token after
   every prefix of [anchor, draft]. The accepted length is the longest prefix of the draft that
   agrees (0..B-1); the target's own token after it comes free, so a verification step gains
   accepted + 1 tokens. The drafter's unrefined block is checked the same way on the same
   contexts, for comparison;
4. moves every request past its accepted tokens and the target's token. A request that has
   ``--request-tokens`` tokens finishes, and a new request (a context drawn from the target
   chain's stationary distribution) takes its slot.

The state is donated (``donate_argnames="state"``): the caller hands it over and gets the next
state back, and XLA may write the new state into the old one's buffers. On a CPU it does: the
compiled step aliases all five state arrays to its outputs, and JAX gives no "donated buffers
were not usable" warning (JAX 0.10.2 to 0.12.1; tests/serving/test_examples.py checks both). Step 1
traces and compiles `draft_step`; every later step runs under ``jax.no_tracing()``, which raises
if anything traces again, and `TRACES` counts the traces.

Printed per step: the mean accepted draft tokens per block with refine and with the drafter
alone, the tokens per verification step with refine, the requests that finished, and the step's
wall time from dispatch to the results on the host (step 1 includes the compile).

The task (`xpress_jax.toy`, as in ``xpress demo``): the target is a second-order Markov chain over
V=64 tokens; the drafter guesses each of the B-1=7 draft slots independently. Greedy decoding of
this target ends in one of its three greedy cycles (of 1, 8 and 10 tokens) after ~10 tokens on
average from a typical context, and this head is right on every token in those cycles. So
requests are short (default 16 tokens: about two steps) and replaced, and the per-step numbers
mix fresh contexts (those of ``xpress demo``'s table) with contexts inside the cycles.

The head is one of three:

- trained here for ``--train-steps`` steps of 64 blocks (`xpress_jax.train`; default 1000);
- loaded with ``--head PATH`` from an Orbax serving checkpoint: ``xpress demo`` writes
  ``xpress-demo/head_orbax`` and ``xpress-demo/converted``, `xpress_jax.export.export_serving`
  writes one. It must be sized for this task (V=64, B=8, H=32: ``xpress demo``'s default task);
- ``--smoke``: an untrained random head, 4 steps of 8 requests, to check that everything runs.
  Its accepted lengths mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from xpress_jax.toy import ToyConfig, ToyTask, accepted_length

#: Sizes of the head trained here (those of ``xpress demo``'s head).
RANK, MLP_HIDDEN = 32, 64

#: How many times `draft_step` has been traced (a Python counter: runs once per trace, never when
#: the compiled step runs).
TRACES = 0


class State(NamedTuple):
    """The serving state of R requests: donated to `draft_step`, which returns its successor."""

    prev: jax.Array  # [R] int32, the token before the anchor
    anchor: jax.Array  # [R] int32, the last verified token
    generated: jax.Array  # [R] int32, tokens this request has gained so far
    finished: jax.Array  # [R] int32, requests finished in this slot so far
    key: jax.Array  # [2] uint32, raw PRNG key data: the contexts of new requests


class StepOut(NamedTuple):
    """What one step reports (fresh arrays, not donated)."""

    draft: jax.Array  # [R, B-1] int32, the refined draft
    accepted: jax.Array  # [R] int32, accepted draft tokens of the refined draft (0..B-1)
    drafter_accepted: jax.Array  # [R] int32, the same for the drafter's own block
    finished: jax.Array  # [R] bool, the request in this slot finished at this step


def serving_tables(task: ToyTask) -> dict[str, jax.Array]:
    """The task's arrays that `draft_step` reads, on the device (arguments of the jit, not constants)."""
    t = task.tables
    return {
        "drafter_logits": jnp.asarray(t["drafter_logits"]),  # [V*V, B, V], row = prev * V + anchor
        "hidden": jnp.asarray(t["hidden"]),  # [V*V, B, H]
        "context_logp": jnp.asarray(t["context_logp"]),  # [V*V], the chain's stationary distribution
        "greedy_next": jnp.asarray(task.greedy_next),  # [V, V], the target's greedy token after (a, b)
    }


def drafter(tables, prev, anchor, dtype):
    """The block drafter: logits [R, B, V] and hidden states [R, B, H] of each request's context."""
    V = tables["greedy_next"].shape[0]
    ctx = prev * V + anchor
    logits = jnp.take(tables["drafter_logits"], ctx, axis=0).astype(dtype)
    h = jnp.take(tables["hidden"], ctx, axis=0).astype(dtype)
    return logits, h


def verify(greedy_next, prev, anchor, draft):
    """The target's greedy check of a block, in one parallel pass (as a target LM scores a draft).

    Returns (accepted [R], last [R], bonus [R]): the accepted draft tokens, the last verified
    token of the block (the anchor when nothing is accepted) and the target's own token after it.
    """
    blk = jnp.concatenate([anchor[:, None], draft], axis=1)  # [R, B]
    before = jnp.concatenate([prev[:, None], blk[:, :-1]], axis=1)  # [R, B]
    target = greedy_next[before, blk]  # [R, B]: the target's token after blk[:, :k+1]
    acc = accepted_length(draft, target[:, :-1])  # [R], 0..B-1
    last = jnp.take_along_axis(blk, acc[:, None], axis=1)[:, 0]
    bonus = jnp.take_along_axis(target, acc[:, None], axis=1)[:, 0]
    return acc, last, bonus


def new_contexts(tables, key, n):
    """``n`` contexts (prev, anchor) from the target chain's stationary distribution."""
    V = tables["greedy_next"].shape[0]
    ctx = jax.random.categorical(key, tables["context_logp"], shape=(n,))
    return (ctx // V).astype(jnp.int32), (ctx % V).astype(jnp.int32)


def initial_state(tables, n: int, seed: int) -> State:
    """R requests, each starting from a fresh context."""
    k0, k1 = jax.random.split(jax.random.key(seed))
    prev, anchor = new_contexts(tables, k0, n)
    # Two arrays, not one used twice: a donated buffer can be donated only once per call.
    return State(prev, anchor, jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.int32), jax.random.key_data(k1))


def _draft_step(head, tables, state: State, *, num_passes: int, topc: int, request_tokens: int):
    global TRACES
    TRACES += 1
    R = state.anchor.shape[0]
    logits, h = drafter(tables, state.prev, state.anchor, head.dtype)
    # With the head's token table (computed once, in `serve`), each pass gathers w1 @ in_proj_token rows
    # instead of a gather + GEMM: the same tokens, fewer kernels on a GPU.
    draft = xj.refine(head, logits, h, state.anchor, state.prev, num_passes=num_passes, topc=topc,
                      token_table=tables.get("token_table"))  # [R, B-1]
    own = jnp.argmax(logits[:, 1:], axis=-1).astype(jnp.int32)  # the drafter alone: each slot's argmax
    acc, last, bonus = verify(tables["greedy_next"], state.prev, state.anchor, draft)
    own_acc, _, _ = verify(tables["greedy_next"], state.prev, state.anchor, own)

    generated = state.generated + acc + 1
    done = generated >= request_tokens
    key, sub = jax.random.split(jax.random.wrap_key_data(state.key))
    fresh_prev, fresh_anchor = new_contexts(tables, sub, R)
    new = State(
        prev=jnp.where(done, fresh_prev, last),
        anchor=jnp.where(done, fresh_anchor, bonus),
        generated=jnp.where(done, 0, generated),
        finished=state.finished + done,
        key=jax.random.key_data(key),
    )
    return new, StepOut(draft, acc, own_acc, done)


#: ``draft_step(head, tables, state, *, num_passes, topc, request_tokens) -> (State, StepOut)``.
#: The head and the tables are read, not donated (every step uses them); the state is consumed. refine's XLA
#: options go to this, the outer jit (`xj.compiler_options()`: {} off a GPU).
draft_step = jax.jit(_draft_step, static_argnames=("num_passes", "topc", "request_tokens"),
                     donate_argnames="state", compiler_options=xj.compiler_options())


# ----------------------------------------------------------------------------------- the loop
class Row(NamedTuple):
    step: int
    accepted: float  # mean accepted draft tokens per block, refined
    drafter_accepted: float  # the same, the drafter alone
    tokens: float  # mean tokens per verification step (accepted + 1), refined
    finished: int  # requests finished at this step
    wall_ms: float  # dispatch to results on the host (step 1: trace + compile too)


def serve(head: xj.Head, task: ToyTask, *, steps: int, requests: int, num_passes: int, topc: int,
          request_tokens: int, seed: int = 0, on_row=None) -> dict:
    """Run ``steps`` draft steps over ``requests`` concurrent requests; returns the rows and totals.

    Step 1 traces and compiles `draft_step`; steps 2.. run under ``jax.no_tracing()``.
    """
    # Everything the step reads is placed (committed) on one device first. A jit's outputs are
    # committed when any input is (a loaded head's arrays are), so a state that went in uncommitted
    # would come back committed, and step 2 would miss jit's fast dispatch cache: jax.no_tracing()
    # raises on that, even though the traced program itself is found again (TRACES stays 1).
    device = jax.devices()[0]
    head, tables = jax.device_put((head, serving_tables(task)), device)
    tables["token_table"] = xj.token_table(head)  # once per set of weights (refine's token_table)
    state = jax.device_put(initial_state(tables, requests, seed), device)
    kw = dict(num_passes=num_passes, topc=topc, request_tokens=request_tokens)
    traces0, rows, old_state_deleted = TRACES, [], []
    for s in range(1, steps + 1):
        # The loop reads the step's outputs, never the state. On a CPU, a numpy view of a state array
        # (np.asarray) would keep its buffer in use, and JAX would then copy it instead of donating it,
        # without a warning (seen with JAX 0.10.2, 0.11.2 and 0.12.0.1): `old_state_deleted` would say so.
        old = state
        t0 = time.perf_counter()
        with jax.no_tracing() if s > 1 else contextlib.nullcontext():
            state, out = draft_step(head, tables, state, **kw)
        acc, own, done = jax.device_get((out.accepted, out.drafter_accepted, out.finished))
        wall = (time.perf_counter() - t0) * 1e3
        old_state_deleted.append(all(x.is_deleted() for x in old))
        row = Row(s, float(acc.mean()), float(own.mean()), float(acc.mean() + 1), int(done.sum()), wall)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    jax.block_until_ready(state)
    return {"rows": rows, "traces": TRACES - traces0, "old_state_deleted": old_state_deleted,
            "state": state, "requests_finished": int(np.asarray(state.finished).sum())}


# ----------------------------------------------------------------------------------- the head
@functools.lru_cache(maxsize=1)
def toy_task() -> ToyTask:
    """The task: `xpress demo`'s default (seed 0), so that its heads fit these tables. Built once."""
    return ToyTask(ToyConfig())


def trained_head(task: ToyTask, steps: int, seed: int, requests: int) -> tuple[xj.Head, str]:
    from xpress_jax.train import TrainConfig, train

    # topc=0 and K = B-1 in the config; the step passes --num-passes and --topc to refine explicitly.
    cfg = task.head_config(rank=RANK, mlp_hidden=MLP_HIDDEN, topc=0, max_num_reqs=requests)
    tc = TrainConfig(steps=steps, batch_size=64, seed=seed)  # warmup: min(100, steps // 10)
    res = train(cfg, task.tables, ToyTask.sample, tc, progress=sys.stderr.isatty())
    return res.model.to_serving(), (f"trained here: {steps} steps x 64 blocks (xpress_jax.train), "
                                    f"final loss {res.history[-1]['loss']:.3f}")


def random_head(task: ToyTask, seed: int, requests: int) -> tuple[xj.Head, str]:
    """Random weights (std 0.1: refine changes about a third of the drafter's tokens, mostly for the worse)."""
    cfg = task.head_config(rank=RANK, mlp_hidden=MLP_HIDDEN, topc=0, max_num_reqs=requests)
    return xj.init_head(cfg, jax.random.key(seed), std=0.1), "untrained (random weights; --smoke)"


# ----------------------------------------------------------------------------------- command line
def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python examples/serving_step.py",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=_int_at_least(1), default=None, help="draft steps to run (default 10; --smoke: 4)")
    p.add_argument("--requests", type=_int_at_least(1), default=None,
                   help="R, concurrent requests per step (default 64; --smoke: 8)")
    p.add_argument("--num-passes", type=_int_at_least(1), default=None,
                   help="K, refine's Jacobi passes (default B-1 = 7: exact in full-vocabulary mode)")
    p.add_argument("--topc", type=_int_at_least(0), default=0,
                   help="C: score each slot's C best drafter tokens; 0 = full vocabulary (default 0)")
    p.add_argument("--request-tokens", type=_int_at_least(1), default=16,
                   help="a request finishes once it has this many tokens, and a new one takes its slot (default 16)")
    p.add_argument("--head", type=Path, default=None, metavar="PATH",
                   help="load the head from this Orbax serving checkpoint (e.g. xpress-demo/head_orbax) "
                        "instead of training one")
    p.add_argument("--train-steps", type=_int_at_least(1), default=None,
                   help="steps of 64 blocks to train the head for when no --head is given (default 1000)")
    p.add_argument("--smoke", action="store_true",
                   help="an untrained random head, 4 steps of 8 requests: checks that it runs (seconds); "
                        "its accepted lengths mean nothing")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="the requests' contexts and the head's init (default 0)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if a.smoke and (a.head is not None or a.train_steps is not None):
        p.error("--smoke uses an untrained head: leave out " + ("--head" if a.head is not None else "--train-steps"))
    if a.head is not None and a.train_steps is not None:
        p.error("--train-steps trains a head, --head loads one: give one of them")
    if a.head is not None and not a.head.is_dir():
        p.error(f"--head {a.head}: no such checkpoint folder (xpress demo writes xpress-demo/head_orbax)")
    a.steps = a.steps if a.steps is not None else (4 if a.smoke else 10)
    a.requests = a.requests if a.requests is not None else (8 if a.smoke else 64)
    a.train_steps = a.train_steps if a.train_steps is not None else 1000
    B, V = ToyConfig().block_size, ToyConfig().vocab_size
    if a.topc > V:
        p.error(f"argument --topc: must be in [0, {V}] (the task's vocab_size), got {a.topc}")
    a.num_passes = a.num_passes if a.num_passes is not None else B - 1
    return a


def load_head(path: Path, requests: int) -> tuple[xj.Head, str]:
    """A serving checkpoint's head, checked against the task; ValueError (naming --head) if it does not fit."""
    head = xj.load_params(path)
    c, t = head.config, ToyConfig()
    want = dict(vocab_size=t.vocab_size, block_size=t.block_size, hidden_size=t.hidden_size)
    have = {k: getattr(c, k) for k in want}
    if have != want:
        raise ValueError(f"--head {path}: a head for {have}, but this example's task needs {want} "
                         "(the default `xpress demo` task)")
    if requests > c.max_num_reqs:
        raise ValueError(f"--requests {requests} is more than the head's max_num_reqs={c.max_num_reqs} ({path})")
    return head, f"loaded from {path} ({head.dtype})"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_all = time.perf_counter()
    if args.head is not None:
        try:
            head, origin = load_head(args.head, args.requests)
        except ValueError as e:
            print(f"serving_step.py: error: {e}", file=sys.stderr)
            return 2
    task = toy_task()
    V, B = task.config.vocab_size, task.config.block_size
    if args.smoke:
        head, origin = random_head(task, args.seed, args.requests)
    elif args.head is None:
        t0 = time.perf_counter()
        head, origin = trained_head(task, args.train_steps, args.seed, args.requests)
        origin += f", {time.perf_counter() - t0:.1f} s"

    mode = "full vocabulary" if args.topc == 0 else f"top-{args.topc}"
    print(f"task : target = 2nd-order Markov chain over V={V} tokens; block drafter, B={B} (B-1={B - 1} draft slots)")
    print(f"head : {origin}")
    print(f"step : jax.jit(draft_step), state donated; {args.requests} requests, refine K={args.num_passes} "
          f"{mode}; a request finishes after {args.request_tokens} tokens; JAX {jax.__version__}, "
          f"{jax.default_backend()}")
    print()
    print(" step   accepted/block (refined)  (drafter alone)   tokens/verification  finished   wall ms")

    def show(r: Row) -> None:
        note = "   (trace + compile)" if r.step == 1 else ""
        print(f"{r.step:>5}   {r.accepted:>24.2f}  {r.drafter_accepted:>15.2f}   {r.tokens:>19.2f}  "
              f"{r.finished:>8}  {r.wall_ms:>8.1f}{note}")

    res = serve(head, task, steps=args.steps, requests=args.requests, num_passes=args.num_passes, topc=args.topc,
                request_tokens=args.request_tokens, seed=args.seed, on_row=show)
    rows = res["rows"]
    later = rows[1:] or rows
    mean = lambda f: statistics.fmean(f(r) for r in rows)  # noqa: E731
    print()
    print(f"over {len(rows)} steps: {mean(lambda r: r.accepted):.2f} accepted draft tokens per block refined vs "
          f"{mean(lambda r: r.drafter_accepted):.2f} for the drafter alone (of {B - 1}); "
          f"{mean(lambda r: r.tokens):.2f} tokens per verification step; {res['requests_finished']} requests "
          "finished")
    print(f"wall : median {statistics.median(r.wall_ms for r in later):.1f} ms per step after step 1 "
          f"(step 1: {rows[0].wall_ms:.0f} ms with the compile); total {time.perf_counter() - t_all:.1f} s")
    donated = all(res["old_state_deleted"])
    print(f"jit  : draft_step traced {res['traces']} time(s); steps 2..{len(rows)} ran under jax.no_tracing(); "
          + ("every step consumed the donated state (its arrays are deleted after the call)" if donated
             else "the donated state was NOT consumed (its arrays are still alive after the call)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
