"""Train an `XPressHead` with optax: teacher-forced cross-entropy, AdamW, Orbax train-state checkpoints.

**Loss.** Every draft slot is scored as at serving time, ``base + bias``, with its predecessors
teacher-forced to the target's tokens (the Jacobi fixed-point condition); the loss is the mean
cross-entropy against the target's tokens. By default those are the target's greedy continuation (the head
learns to predict it: refine's greedy mode). With ``sample_temperature=T`` they are a continuation sampled from
the target at T and the cross-entropy is that of softmax(scores / T): the head learns the target's conditional
distribution at T, what speculative sampling at T accepts (a head trained on the greedy continuation is sharper
than the target at T, and the rejection sampler rejects the excess). With ``kpass_weight > 0`` a second term
scores them from the head's own tokens after ``kpass_passes - 1`` greedy passes (no gradient through the picks).
The optimizer is ``clip_by_global_norm`` then ``optax.adamw`` (params in ``param_dtype``, loss in float32).

**State and resume.** The train state is one pytree (params, optimizer state, step, PRNG key data); step
``s`` draws its batch with ``fold_in(key, s)``. Orbax writes it every ``checkpoint_every`` steps;
``resume=True`` continues with bit-identical losses (on GPUs with ``XLA_FLAGS=--xla_gpu_deterministic_ops=
true``: the ``w1`` gather's gradient is a scatter-add).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from .config import HeadConfig
from .head import XPressHead
from .toy import Batch

__all__ = ["TrainConfig", "TrainResult", "ResumeError", "make_optimizer", "loss_and_metrics", "init_state", "train"]


class ResumeError(ValueError):
    """A checkpoint directory that this run cannot resume from (written with other settings)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Training hyperparameters (a changed value is a different run). ``steps`` is the schedule's length;
    the learning rate warms up linearly to ``learning_rate`` over ``warmup_steps`` (None: ``min(100, steps //
    10)``), then decays (cosine) to ``learning_rate * final_lr_fraction``. ``kpass_weight`` weighs the loss on
    the head's own inputs after ``kpass_passes - 1`` passes (0: off). ``sample_temperature``: train on
    continuations sampled from the target at this T > 0, scored at T (None: on the greedy continuation; the
    sampler is called as ``sample(tables, key, n, temperature=T)``). ``seed`` sets the init and the data.
    ``checkpoint_every``: write the train state every this many steps (0: only at the end)."""

    steps: int = 1500
    batch_size: int = 256
    learning_rate: float = 3e-3
    warmup_steps: int | None = None
    final_lr_fraction: float = 0.05
    weight_decay: float = 1e-4
    clip_norm: float = 1.0
    param_dtype: str = "float32"
    kpass_weight: float = 0.0
    kpass_passes: int = 2
    sample_temperature: float | None = None
    seed: int = 0
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        if self.warmup_steps is None and isinstance(self.steps, int):
            object.__setattr__(self, "warmup_steps", min(100, self.steps // 10))
        for name, minimum in (("steps", 1), ("batch_size", 1), ("warmup_steps", 0), ("kpass_passes", 1),
                              ("seed", 0), ("checkpoint_every", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
        for name in ("learning_rate", "final_lr_fraction", "weight_decay", "clip_norm", "kpass_weight"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite float >= 0, got {v!r}")
        if not self.learning_rate > 0 or not self.clip_norm > 0:
            raise ValueError(f"learning_rate and clip_norm must be > 0, got {self.learning_rate}, {self.clip_norm}")
        t = self.sample_temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                              or t <= 0):
            raise ValueError(f"sample_temperature must be None or a finite float > 0, got {t!r}")
        if self.param_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"param_dtype must be 'float32' or 'bfloat16', got {self.param_dtype!r}")


def make_optimizer(tc: TrainConfig):
    """``clip_by_global_norm`` then AdamW on linear warmup + cosine decay (optax)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.learning_rate, warmup_steps=tc.warmup_steps,
        decay_steps=max(tc.steps, tc.warmup_steps + 1), end_value=tc.learning_rate * tc.final_lr_fraction,
    )
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                       optax.adamw(schedule, weight_decay=tc.weight_decay, mu_dtype=jnp.float32))


def _ce(scores: jax.Array, target: jax.Array) -> jax.Array:
    """Per-token cross-entropy: [N, S, V] float32 scores, [N, S] ids -> [N, S]."""
    logp = jax.nn.log_softmax(scores, axis=-1)
    return -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]


def loss_and_metrics(model: XPressHead, batch: Batch, *, kpass_weight: float = 0.0, kpass_passes: int = 2,
                     temperature: float | None = None) -> tuple[jax.Array, dict]:
    """The training loss (module docstring) and its metrics: ``loss``, ``ce`` (teacher-forced),
    ``slot_accuracy`` [B-1] (teacher-forced argmax == target, per draft slot). ``temperature`` T: the
    cross-entropy of softmax(scores / T) (None: of softmax(scores))."""
    inv_t = None if temperature is None else 1.0 / jnp.asarray(temperature, jnp.float32)
    blk = jnp.concatenate([batch.anchors[:, None], batch.target], axis=1)
    scores = model(batch.logits, batch.h, XPressHead.prev_tokens(blk, batch.prev_ids))  # [N, B-1, V]
    if inv_t is not None:
        scores = scores * inv_t
    ce = jnp.mean(_ce(scores, batch.target))
    slot_acc = jnp.mean((jnp.argmax(scores, axis=-1) == batch.target).astype(jnp.float32), axis=0)
    metrics = {"ce": ce, "slot_accuracy": slot_acc, "loss": ce}
    if kpass_weight:
        if kpass_passes > 1:
            draft = model.refine(batch.logits, batch.h, batch.anchors, batch.prev_ids, num_passes=kpass_passes - 1)
        else:
            draft = jnp.argmax(batch.logits[:, 1:], axis=-1).astype(jnp.int32)
        own_blk = jax.lax.stop_gradient(jnp.concatenate([batch.anchors[:, None], draft], axis=1))
        kscores = model(batch.logits, batch.h, XPressHead.prev_tokens(own_blk, batch.prev_ids))
        if inv_t is not None:
            kscores = kscores * inv_t
        metrics["kpass_ce"] = jnp.mean(_ce(kscores, batch.target))
        metrics["loss"] = ce + kpass_weight * metrics["kpass_ce"]
    return metrics["loss"], metrics


def init_state(head_config: HeadConfig, tc: TrainConfig) -> tuple[Any, dict]:
    """(graphdef, state): a fresh `XPressHead` (training init) and the train state of step 0."""
    model = XPressHead(head_config, rngs=nnx.Rngs(tc.seed), param_dtype=jnp.dtype(tc.param_dtype))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    return graphdef, {"params": params, "opt_state": make_optimizer(tc).init(params), "step": jnp.zeros((), jnp.int32),
                      "key": jax.random.key_data(jax.random.fold_in(jax.random.key(tc.seed), 1))}


def _make_step(graphdef, tc: TrainConfig, sample: Callable):
    tx = make_optimizer(tc)

    def step(state: dict, tables: Mapping[str, jax.Array]) -> tuple[dict, dict]:
        key = jax.random.fold_in(jax.random.wrap_key_data(state["key"]), state["step"])
        t = tc.sample_temperature
        batch = sample(tables, key, tc.batch_size) if t is None else sample(tables, key, tc.batch_size, temperature=t)

        def loss_fn(params):
            return loss_and_metrics(nnx.merge(graphdef, params), batch, kpass_weight=tc.kpass_weight,
                                    kpass_passes=tc.kpass_passes, temperature=t)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return jax.jit(step)


# ---------------------------------------------------------------------------- checkpoints
def _save(mngr, state: dict, meta: dict) -> None:
    if mngr.latest_step() != int(state["step"]):
        mngr.save(int(state["step"]), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                              meta=ocp.args.JsonSave(meta)))
        mngr.wait_until_finished()


def _restore(mngr, step: int, abstract: dict, meta: dict) -> dict:
    saved_meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if saved_meta != json.loads(json.dumps(meta)):
        diff = [k for k in meta if saved_meta.get(k) != json.loads(json.dumps(meta[k]))]
        raise ResumeError(f"cannot resume: the checkpoint at step {step} was written by a different run "
                          f"({', '.join(diff)} differ); resume with the same settings, or start fresh in another "
                          "directory")
    return mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]


# ---------------------------------------------------------------------------- progress
class _Bar:
    """Training progress on stderr: a redrawn bar on a terminal, else a line every 10%. The ETA is
    timed from the end of the first step (which includes the compile)."""

    def __init__(self, total: int, enabled: bool, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled, self.total = enabled, total
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.first = None  # (step, time) at the end of the first step
        self._last, self._next_line = 0.0, 0

    def __call__(self, step: int, loss: float, acc: float, tok_s: float, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = (step, now)
        eta = " (the first step: with the compile)" if step == self.first[0] else \
            f" eta {(now - self.first[1]) / (step - self.first[0]) * (self.total - step):4.0f} s"
        text = (f"train {step:>6}/{self.total} [{'#' * int(step / self.total * 24):<24}] loss {loss:.4f} "
                f"acc {acc:.3f} {tok_s:,.0f} tok/s{eta}")
        if self.tty:
            if final or now - self._last > 0.1:
                self._last = now
                self.stream.write("\r" + text + ("\n" if final else "\x1b[K"))
                self.stream.flush()
        elif final or step >= self._next_line:
            self._next_line = step + max(self.total // 10, 1)
            print(text, file=self.stream, flush=True)


# ---------------------------------------------------------------------------- the loop
@dataclasses.dataclass
class TrainResult:
    """What `train` returns: the trained ``model``, the final train ``state``, ``history`` (one dict per step
    run by this call: ``step`` (1-based), ``loss``, ``ce``, ``accuracy`` (mean over draft slots),
    ``slot_accuracy``, ``grad_norm``, and ``kpass_ce`` with the K-pass loss), ``resumed_from`` (the checkpoint
    step, None for a fresh start), ``seconds`` (wall time of the steps after the first, checkpoint writes
    excluded) and ``tokens_per_s`` (draft-slot predictions trained per second over those steps)."""

    model: XPressHead
    state: dict
    history: list[dict]
    resumed_from: int | None
    seconds: float
    tokens_per_s: float


def train(head_config: HeadConfig, tables: Mapping[str, Any],
          sample: Callable[[Mapping[str, jax.Array], jax.Array, int], Batch], tc: TrainConfig = TrainConfig(), *,
          checkpoint_dir: str | os.PathLike | None = None, resume: bool = False,
          task_meta: Mapping[str, Any] | None = None, progress: bool = True,
          log: Callable[[dict], None] | None = None) -> TrainResult:
    """Train a head from scratch (or resume one) on batches from ``sample(tables, key, n)`` (with
    ``tc.sample_temperature``: ``sample(tables, key, n, temperature=T)``).

    ``tables`` (e.g. `xpress_jax.toy.ToyTask.tables`) enter the jitted step as arguments; ``sample`` is
    jit-able (e.g. ``ToyTask.sample``). ``checkpoint_dir``: where Orbax writes the train state; ``resume``
    continues from its latest step (without it, a directory holding checkpoints is refused).
    ``task_meta``: JSON-able description of the data, stored with the checkpoints (must match on resume).
    ``progress``: a progress bar on stderr; ``log``: called with each step's metrics.
    """
    if not isinstance(head_config, HeadConfig):
        raise TypeError(f"head_config must be a HeadConfig, got {type(head_config).__name__}")
    if not isinstance(tc, TrainConfig):
        raise TypeError(f"tc must be a TrainConfig, got {type(tc).__name__}")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir")
    end = tc.steps
    graphdef, state = init_state(head_config, tc)
    meta = {"head_config": dataclasses.asdict(head_config), "train_config": dataclasses.asdict(tc),
            "task": dict(task_meta or {})}
    tables = {k: jnp.asarray(v) for k, v in tables.items()}
    mngr = resumed_from = None
    if checkpoint_dir is not None:
        directory = Path(checkpoint_dir).expanduser().absolute()
        mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True, enable_async_checkpointing=False))
        latest = mngr.latest_step()
        if latest is not None:
            if not resume:
                mngr.close()
                raise FileExistsError(f"{directory} already holds train checkpoints (latest step {latest}); pass "
                                      "resume=True (--resume) to continue, or use another directory")
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
            state = _restore(mngr, latest, abstract, meta)
            resumed_from = latest
    step_fn = _make_step(graphdef, tc, sample)
    start = int(state["step"])
    bar = _Bar(tc.steps, progress)
    history: list[dict] = []
    tokens_per_step = tc.batch_size * (head_config.block_size - 1)
    t_first = None
    try:
        for s in range(start, end):
            state, metrics = step_fn(state, tables)
            m = jax.device_get(metrics)
            t_first = t_first or time.perf_counter()  # after the first (compiling) step
            slot_acc = [float(a) for a in m.pop("slot_accuracy")]
            rec = {"step": s + 1, **{k: float(v) for k, v in m.items()},
                   "accuracy": float(np.mean(slot_acc)), "slot_accuracy": slot_acc}
            history.append(rec)
            if log is not None:
                log(rec)
            tok_s = (s - start) * tokens_per_step / max(time.perf_counter() - t_first, 1e-9)
            bar(s + 1, rec["loss"], rec["accuracy"], tok_s, final=s + 1 == end)
            if mngr is not None and tc.checkpoint_every and (s + 1) % tc.checkpoint_every == 0:
                t_save = time.perf_counter()
                _save(mngr, state, meta)
                t_first += time.perf_counter() - t_save  # throughput counts training, not checkpoint writes
        if mngr is not None and end > start:
            _save(mngr, state, meta)
    finally:
        if mngr is not None:
            mngr.close()
    seconds = time.perf_counter() - t_first if t_first is not None else 0.0
    timed_steps = max(len(history) - 1, 0)
    model = nnx.merge(graphdef, state["params"])
    return TrainResult(model=model, state=state, history=history, resumed_from=resumed_from, seconds=seconds,
                       tokens_per_s=timed_steps * tokens_per_step / seconds if seconds > 0 else 0.0)
