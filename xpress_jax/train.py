"""Train an `XPressHead` with optax: teacher-forced cross-entropy, AdamW, Orbax train-state checkpoints.

**Loss.** Every draft slot is scored as at serving time, ``base + bias``, with its predecessors
teacher-forced to the target's tokens (the Jacobi fixed-point condition); slot 0's predecessor is the batch's
``prev_ids`` for a head whose ``HeadConfig.predecessor`` is "previous" (`xpress_jax.toy`'s heads), the anchor
for an "anchor" head. By default the loss is the mean cross-entropy against the target's tokens: the target's
greedy continuation (the head learns to predict it: refine's greedy mode), or with ``sample_temperature=T`` a
continuation sampled from the target at T, and the cross-entropy is that of softmax(scores / T): the head learns
the target's conditional distribution at T, what speculative sampling at T accepts (a head trained on the greedy
continuation is sharper than the target at T, and the rejection sampler rejects the excess). With
``kpass_weight > 0`` a second term scores them from the head's own tokens after ``kpass_passes - 1`` greedy
passes (no gradient through the picks). The optimizer is ``clip_by_global_norm`` then ``optax.adamw`` (params in
``param_dtype``, loss in float32).

**The speculators recipe** (``TrainConfig.from_recipe("speculators")``: vLLM's training library trains its
XPress heads so): ``loss={"ce": 0.1, "tv": 0.9}`` scores every slot against the teacher (the batch's
``teacher_logits``, the target's logits along the data): the cross-entropy against the teacher's argmax and the
total variation ``1 - sum_v min(p_v, q_v)`` between the teacher's distribution p and the head's q (1 - TV is the
acceptance rate of speculative sampling), both at T (1 without ``sample_temperature``); each term is
``sum(mask * w * loss) / (sum(mask) + 1e-5)`` over the draft slots, ``w = exp(-(k - 1) / gamma)`` for draft slot
k = 1..B-1 (``loss_decay_gamma=4``); plus ``consistency_weight=0.3`` times the mean of the same loss over
``consistency_passes=3`` free-running rounds (`loss_and_metrics`). `xpress_loss` is that objective on given
scores (tests/training/test_recipe.py checks it against speculators' ``compute_metrics``).

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

__all__ = ["TrainConfig", "TrainResult", "ResumeError", "RECIPES", "LOSS_TERMS", "make_optimizer", "slot_weights",
           "distribution_loss", "xpress_loss", "loss_and_metrics", "init_state", "saved_step", "train"]

#: `TrainConfig.loss`'s terms, per draft slot against the teacher (the batch's ``teacher_logits``): "ce" the
#: cross-entropy against the teacher's argmax, "tv" the total variation from the teacher's distribution.
LOSS_TERMS = ("ce", "tv")

#: Named recipes for `TrainConfig.from_recipe`: the fields each sets. "ce": the default (today's loss);
#: "speculators": vLLM's speculators library's XPress recipe (its ``--loss-fn '{"ce": 0.1, "tv": 0.9}'``,
#: ``--dflash-decay-gamma 4``, ``--consistency-weight 0.3``, ``--consistency-passes 3``) less its base-logits
#: anchor, which trains the drafter co-trained there (a constant for the frozen drafter here).
RECIPES: dict[str, dict[str, Any]] = {
    "ce": {},
    "speculators": {"loss": (("ce", 0.1), ("tv", 0.9)), "loss_decay_gamma": 4.0, "consistency_weight": 0.3,
                    "consistency_passes": 3},
}

#: speculators' ``_LOSS_REDUCTION_EPS``: each term is ``sum(mask * w * loss) / (sum(mask) + eps)``.
LOSS_EPS = 1e-5


class ResumeError(ValueError):
    """A checkpoint directory that this run cannot resume from (written with other settings). ``differences``:
    ``{"train_config.steps": (saved, now), ...}``, each setting that differs."""

    def __init__(self, message: str, differences: Mapping[str, tuple[Any, Any]] | None = None):
        super().__init__(message)
        self.differences = dict(differences or {})


def _normalize_loss(loss: Any) -> tuple[tuple[str, float], ...] | None:
    """`TrainConfig.loss` as ``((name, weight), ...)``: from a mapping, pairs, a JSON object or a term's name."""
    if loss is None:
        return None
    spec = loss
    if isinstance(loss, str):
        if loss in LOSS_TERMS:
            spec = {loss: 1.0}
        else:
            try:
                spec = json.loads(loss)
            except json.JSONDecodeError:
                raise ValueError(f"loss must be a mapping of {LOSS_TERMS} to weights, a JSON object of it or one "
                                 f"term's name, e.g. '{{\"ce\": 0.1, \"tv\": 0.9}}', got {loss!r}") from None
    try:
        items = list(spec.items()) if isinstance(spec, Mapping) else [tuple(p) for p in spec]
    except TypeError:
        items = None
    if not items or any(len(p) != 2 for p in items):
        raise ValueError(f"loss must be a non-empty mapping of {LOSS_TERMS} to weights, e.g. "
                         f"{{'ce': 0.1, 'tv': 0.9}}, got {loss!r}")
    names = [n for n, _ in items]
    if any(n not in LOSS_TERMS for n in names) or len(set(names)) != len(names):
        raise ValueError(f"loss terms must be distinct names from {LOSS_TERMS}, got {names}")
    for n, w in items:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"loss weight of {n!r} must be a finite float >= 0, got {w!r}")
    return tuple((str(n), float(w)) for n, w in items)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Training hyperparameters (a changed value is a different run). ``steps`` is the schedule's length;
    the learning rate warms up linearly to ``learning_rate`` over ``warmup_steps`` (None: ``min(100, steps //
    10)``), then decays (cosine) to ``learning_rate * final_lr_fraction``. ``kpass_weight`` weighs the loss on
    the head's own inputs after ``kpass_passes - 1`` passes (0: off). ``sample_temperature``: train on
    continuations sampled from the target at this T > 0, scored at T (None: on the greedy continuation; the
    sampler is called as ``sample(tables, key, n, temperature=T)``). ``seed`` sets the init and the data.
    ``checkpoint_every``: write the train state every this many steps (0: only at the end).

    ``loss`` (None: the cross-entropy against the batch's ``target``, the default) scores every draft slot
    against the teacher, the batch's ``teacher_logits``: a mapping of `LOSS_TERMS` to weights, e.g. ``{"ce": 0.1,
    "tv": 0.9}`` (also its JSON string, speculators' ``--loss-fn`` spelling), stored as ``(("ce", 0.1), ("tv",
    0.9))``. "ce": the cross-entropy of softmax(scores / T) against the teacher's argmax; "tv": the total
    variation between softmax(teacher_logits / T) and softmax(scores / T), 1 minus the acceptance rate of
    speculative sampling at T (T: ``sample_temperature``, else 1). Each term is ``sum(mask * w * loss) /
    (sum(mask) + 1e-5)`` over the batch's draft slots, ``w = exp(-(k - 1) / loss_decay_gamma)`` for slot k =
    1..B-1 (speculators' ``dflash_loss_decay``: slot 1 weighs 1; slot 0, the anchor, is not scored; None: w = 1).

    ``consistency_weight`` (0: off) adds that weight times the mean of the loss (``loss``'s terms, or the default
    cross-entropy) over ``consistency_passes`` free-running rounds: round 0 scores the slots fed the drafter's
    argmax, round j fed the argmax of round j-1's scores (so round j's inputs are refine's tokens after j full-
    vocabulary passes); no gradient flows through the fed tokens, only through each round's own forward. This
    generalises the K-pass term rather than replacing it: ``kpass_passes=p`` is round p-1 alone (at weight
    ``kpass_weight``), ``consistency_passes=P`` the mean of rounds 0..P-1 (P = 1: ``kpass_passes=1``'s term);
    the recipes leave ``kpass_weight`` at 0, and both may be on.

    `from_recipe` builds a named recipe (`RECIPES`): "speculators" is speculators' XPress recipe,
    ``loss={"ce": 0.1, "tv": 0.9}``, ``loss_decay_gamma=4``, ``consistency_weight=0.3``,
    ``consistency_passes=3``. Its base-anchor term (0.6 times the loss of the drafter's own logits) is left
    out: it trains the drafter backbone that speculators co-trains with the head; the drafter here is frozen,
    so that term would be a constant."""

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
    loss: Any = None
    loss_decay_gamma: float | None = 4.0
    consistency_weight: float = 0.0
    consistency_passes: int = 3

    @classmethod
    def from_recipe(cls, name: str, **overrides: Any) -> "TrainConfig":
        """The named recipe's config (`RECIPES`: "ce", "speculators"), ``overrides`` on top (e.g. ``steps=``)."""
        if name not in RECIPES:
            raise ValueError(f"unknown recipe {name!r}; the recipes: {sorted(RECIPES)}")
        return cls(**{**RECIPES[name], **overrides})

    def __post_init__(self) -> None:
        if self.warmup_steps is None and isinstance(self.steps, int):
            object.__setattr__(self, "warmup_steps", min(100, self.steps // 10))
        object.__setattr__(self, "loss", _normalize_loss(self.loss))
        for name, minimum in (("steps", 1), ("batch_size", 1), ("warmup_steps", 0), ("kpass_passes", 1),
                              ("seed", 0), ("checkpoint_every", 0), ("consistency_passes", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
        g = self.loss_decay_gamma
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g)
                              or g <= 0):
            raise ValueError(f"loss_decay_gamma must be None or a finite float > 0, got {g!r}")
        for name in ("learning_rate", "final_lr_fraction", "weight_decay", "clip_norm", "kpass_weight",
                     "consistency_weight"):
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


def slot_weights(num_slots: int, gamma: float | None) -> jax.Array:
    """The per-slot loss weights of draft slots k = 1..num_slots, float32 [num_slots]: ``exp(-(k - 1) / gamma)``
    (speculators' ``dflash_loss_decay``, whose slot 0, the anchor, weighs 0 and is not scored here); None: ones."""
    k = jnp.arange(num_slots, dtype=jnp.float32)  # k - 1
    return jnp.ones((num_slots,), jnp.float32) if gamma is None else jnp.exp(-k / jnp.float32(gamma))


def distribution_loss(scores: jax.Array, teacher_logits: jax.Array, mask: jax.Array | None = None, *,
                      terms: Any = (("ce", 0.1), ("tv", 0.9)), gamma: float | None = 4.0,
                      temperature: Any = None) -> tuple[jax.Array, dict]:
    """``sum_i weight_i * term_i`` and ``{name: term_i}`` (unweighted) for the draft slots' ``scores`` [N, S, V]
    against ``teacher_logits`` [N, S, V] (S = B-1 draft slots, slot 1 first), in float32. Per slot: "ce" the
    cross-entropy of softmax(scores / T) against argmax(teacher_logits), "tv" ``1 - sum_v min(p_v, q_v)`` with
    p = softmax(teacher_logits / T), q = softmax(scores / T) (T = ``temperature``, None: 1). Each term is
    ``sum(mask * w * loss) / (sum(mask) + 1e-5)``, ``w`` = `slot_weights` (S, ``gamma``), ``mask`` [N, S]
    (None: ones) — speculators' ``compound_loss`` with ``dflash_loss_decay`` on a block whose slot 0 is
    masked. ``terms``: `TrainConfig.loss`'s forms."""
    terms = _normalize_loss(terms)
    if terms is None:
        raise ValueError("terms must name at least one of LOSS_TERMS")
    scores = scores.astype(jnp.float32)
    teacher = teacher_logits.astype(jnp.float32)
    if temperature is not None:
        inv_t = 1.0 / jnp.asarray(temperature, jnp.float32)
        scores, teacher = scores * inv_t, teacher * inv_t
    mask = jnp.ones(scores.shape[:-1], jnp.float32) if mask is None else jnp.asarray(mask).astype(jnp.float32)
    w = mask * slot_weights(scores.shape[1], gamma)
    denom = jnp.sum(mask) + LOSS_EPS
    logq = jax.nn.log_softmax(scores, axis=-1)
    parts = {}
    for name, _ in terms:
        if name == "ce":
            elem = -jnp.take_along_axis(logq, jnp.argmax(teacher, axis=-1)[..., None], axis=-1)[..., 0]
        else:  # "tv"
            elem = 1.0 - jnp.sum(jnp.minimum(jnp.exp(logq), jax.nn.softmax(teacher, axis=-1)), axis=-1)
        parts[name] = jnp.sum(elem * w) / denom
    total = sum((jnp.float32(weight) * parts[name] for name, weight in terms), jnp.zeros((), jnp.float32))
    return total, parts


def xpress_loss(tf_scores: jax.Array, round_scores: Any, teacher_logits: jax.Array, mask: jax.Array | None = None,
                *, terms: Any = (("ce", 0.1), ("tv", 0.9)), gamma: float | None = 4.0,
                consistency_weight: float = 0.3, temperature: Any = None) -> tuple[jax.Array, dict]:
    """The recipe's objective on given scores: ``distribution_loss(tf_scores) + consistency_weight *
    mean_j distribution_loss(round_scores[j])`` (no rounds: the first term alone), all against the same
    ``teacher_logits`` and ``mask`` — speculators' XPress ``compute_metrics`` without its base-anchor term.
    Returns the loss and ``{"tf_loss", "tf_<term>" (unweighted), "consistency_loss", "consistency_round<j>"}``."""
    loss, parts = distribution_loss(tf_scores, teacher_logits, mask, terms=terms, gamma=gamma,
                                    temperature=temperature)
    metrics = {"tf_loss": loss, **{f"tf_{name}": v for name, v in parts.items()}}
    rounds = [distribution_loss(s, teacher_logits, mask, terms=terms, gamma=gamma, temperature=temperature)[0]
              for s in round_scores]
    if rounds:
        cons = jnp.mean(jnp.stack(rounds))
        metrics.update({"consistency_loss": cons, **{f"consistency_round{j}": r for j, r in enumerate(rounds)}})
        loss = loss + jnp.float32(consistency_weight) * cons
    return loss, metrics


def _check_rounds(consistency_weight: float, consistency_passes: int) -> None:
    if isinstance(consistency_passes, bool) or not isinstance(consistency_passes, int) or consistency_passes < 1:
        raise ValueError(f"consistency_passes must be an int >= 1, got {consistency_passes!r}")
    if not (isinstance(consistency_weight, (int, float)) and math.isfinite(consistency_weight)
            and consistency_weight >= 0):
        raise ValueError(f"consistency_weight must be a finite float >= 0, got {consistency_weight!r}")


def loss_and_metrics(model: XPressHead, batch: Batch, *, kpass_weight: float = 0.0, kpass_passes: int = 2,
                     temperature: float | None = None, loss: Any = None, loss_decay_gamma: float | None = 4.0,
                     consistency_weight: float = 0.0, consistency_passes: int = 3) -> tuple[jax.Array, dict]:
    """The training loss (module docstring; the options are `TrainConfig`'s) and its metrics: ``loss``, ``ce``
    (teacher-forced cross-entropy against ``batch.target``), ``slot_accuracy`` [B-1] (teacher-forced argmax ==
    target, per draft slot); with ``loss``: `xpress_loss`'s metrics and ``accept_rate`` (teacher-forced, the
    mean over slots of ``sum_v min(p_v, q_v)`` at T); with the rounds ``consistency_loss``; with the K-pass term
    ``kpass_ce`` (its loss). ``temperature`` T: scores as softmax(scores / T) (None: softmax(scores))."""
    terms = _normalize_loss(loss)
    _check_rounds(consistency_weight, consistency_passes)
    if terms is not None and batch.teacher_logits is None:
        raise ValueError("TrainConfig.loss scores against the teacher: the sampler's batches must carry "
                         "teacher_logits (xpress_jax.toy.ToyTask.sample's do)")
    inv_t = None if temperature is None else 1.0 / jnp.asarray(temperature, jnp.float32)
    # Slot 0's predecessor: the real token before the anchor for a "previous" head, the anchor for an "anchor" one.
    prev_ids = batch.prev_ids if model.config.predecessor == "previous" else batch.anchors
    blk = jnp.concatenate([batch.anchors[:, None], batch.target], axis=1)
    scores = model(batch.logits, batch.h, XPressHead.prev_tokens(blk, prev_ids))  # [N, B-1, V]

    def term(s):  # the loss of one set of scores: the default cross-entropy, or `loss`'s terms
        if terms is None:
            return jnp.mean(_ce(s if inv_t is None else s * inv_t, batch.target))
        return distribution_loss(s, batch.teacher_logits, terms=terms, gamma=loss_decay_gamma,
                                 temperature=temperature)[0]

    def own_scores(draft):  # the slots scored from tokens the head picked (no gradient through the picks)
        own_blk = jax.lax.stop_gradient(jnp.concatenate([batch.anchors[:, None], draft], axis=1))
        return model(batch.logits, batch.h, XPressHead.prev_tokens(own_blk, prev_ids))

    scores_t = scores if inv_t is None else scores * inv_t
    ce = jnp.mean(_ce(scores_t, batch.target))
    slot_acc = jnp.mean((jnp.argmax(scores_t, axis=-1) == batch.target).astype(jnp.float32), axis=0)
    metrics = {"ce": ce, "slot_accuracy": slot_acc, "loss": ce}
    rounds = []  # the consistency rounds' scores
    if consistency_weight:
        pred = jnp.argmax(batch.logits[:, 1:], axis=-1).astype(jnp.int32)  # round 0: the drafter's argmax
        for _ in range(consistency_passes):
            rounds.append(own_scores(pred))
            pred = jnp.argmax(rounds[-1], axis=-1).astype(jnp.int32)  # the next round's input
    if terms is not None:
        total, recipe = xpress_loss(scores, rounds, batch.teacher_logits, terms=terms, gamma=loss_decay_gamma,
                                    consistency_weight=consistency_weight, temperature=temperature)
        t_scale = 1.0 if inv_t is None else inv_t
        p = jax.nn.softmax(batch.teacher_logits.astype(jnp.float32) * t_scale, axis=-1)
        overlap = jnp.sum(jnp.minimum(jax.nn.softmax(scores_t, axis=-1), p), axis=-1)
        metrics.update(recipe, accept_rate=jnp.mean(overlap), loss=total)
    elif rounds:
        metrics["consistency_loss"] = jnp.mean(jnp.stack([term(s) for s in rounds]))
        metrics["loss"] = ce + consistency_weight * metrics["consistency_loss"]
    if kpass_weight:
        if kpass_passes > 1:
            draft = model.refine(batch.logits, batch.h, batch.anchors, prev_ids, num_passes=kpass_passes - 1)
        else:
            draft = jnp.argmax(batch.logits[:, 1:], axis=-1).astype(jnp.int32)
        metrics["kpass_ce"] = term(own_scores(draft))
        metrics["loss"] = metrics["loss"] + kpass_weight * metrics["kpass_ce"]
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
                                    kpass_passes=tc.kpass_passes, temperature=t, loss=tc.loss,
                                    loss_decay_gamma=tc.loss_decay_gamma, consistency_weight=tc.consistency_weight,
                                    consistency_passes=tc.consistency_passes)

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


_TC_DEFAULTS = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(TrainConfig)}))


def _differences(saved: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{"section.field": (saved, now)}`` for each setting of ``meta`` (JSON form) that the checkpoint's differs
    in. A `TrainConfig` field the checkpoint predates counts as the same when it is at its default now."""
    out = {}
    for section, now in meta.items():
        was = saved.get(section)
        if isinstance(now, dict) and isinstance(was, dict):
            for name in [*now, *(k for k in was if k not in now)]:
                if name not in was and section == "train_config" and now[name] == _TC_DEFAULTS.get(name, now[name]):
                    continue  # a newer field, off: the run the checkpoint belongs to
                if was.get(name) != now.get(name):
                    out[f"{section}.{name}"] = (was.get(name), now.get(name))
        elif was != now:
            out[section] = (was, now)
    return out


def _restore(mngr, step: int, abstract: dict, meta: dict) -> dict:
    saved_meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    diff = _differences(saved_meta, json.loads(json.dumps(meta)))
    if diff:
        listed = "; ".join(f"{k}: {was!r} in the checkpoint, {now!r} now" for k, (was, now) in diff.items())
        why = ""
        if "train_config.steps" in diff:
            why = (" steps is the length of the learning-rate schedule (warmup, then cosine decay to its end), and "
                   "resume continues the checkpoint's run bit-identically: a run with another steps is another run "
                   "(to train longer, start one with the new steps).")
        raise ResumeError(f"cannot resume: the checkpoint at step {step} was written by a different run ({listed})."
                          f"{why} Resume with the checkpoint's settings, or start fresh in another directory", diff)
    return mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]


def saved_step(checkpoint_dir: str | os.PathLike) -> int | None:
    """The latest step saved in ``checkpoint_dir`` (what ``resume=True`` would continue from), None if none."""
    directory = Path(checkpoint_dir).expanduser().absolute()
    if not directory.is_dir():
        return None
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False)) as mngr:
        return mngr.latest_step()


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
    ``slot_accuracy``, ``grad_norm``, and ``kpass_ce`` with the K-pass loss, ``consistency_loss`` with the
    rounds, `xpress_loss`'s metrics and ``accept_rate`` with ``loss``: `loss_and_metrics`), ``resumed_from``
    (the checkpoint step, None for a fresh start), ``seconds`` (wall time of the steps after the first,
    checkpoint writes excluded) and ``tokens_per_s`` (draft-slot predictions trained per second over those
    steps)."""

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
