"""The refine modes: the greedy and sampled passes, each an object of one protocol that one loop drives.

`xpress_jax.refine.run_passes` runs every mode (`Greedy`, `Sampled`, and the certified mode,
`xpress_jax.exact.CertifiedMode`) the same way:

- ``start()`` -> ``carry = (blk [N, B] int32, state)``: the seed block (slot 0 the anchors) and the mode's state;
- ``pass_(carry, q)`` -> ``carry``: one Jacobi pass. ``q`` is the 0-based pass number where the loop numbers the
  passes (`Loop.numbered`; then ``q < B-1``: from pass B-1 on every draft slot is final and the loop runs no
  pass), else None. A greedy or sampled pass is the latent step, then one pick step of the call's
  `xpress_jax.ops.Ops`, whose tokens of draft slots ``s..B-2`` `write_slots` writes (the slots before ``s`` are
  final: ``s <= q``); a certified pass also bounds the candidates and scans the rows it cannot certify;
- ``finish(carry, passes)`` -> refine's result: the draft [N, B-1] int32 (`INVALID_TOKEN` in invalid rows), and
  what the call asked for beside it.

A mode is built inside the trace, once per call: its constructor does the once-per-call work (the candidates,
the prepared ``w2``, a sampled seed block). `Call` holds what every mode reads, `Loop` how the loop runs it.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from .ops import Ops
from .params import to_verifier_ids
from .sampling import Proposal, Sampler

__all__ = ["INVALID_TOKEN", "Call", "Loop", "Mode", "Greedy", "Sampled", "write_slots"]

#: Token written to every draft slot of a row whose anchor or prev id lies outside [0, V)
#: (only reachable under ``jit``; concrete calls raise instead).
INVALID_TOKEN = -1


class Call(NamedTuple):
    """One refine call's steps and arrays, which every mode reads (`xpress_jax.refine.prepare` builds it)."""

    ops: Ops
    params: Mapping[str, jax.Array]
    logits: jax.Array  # [N, B, V] (a reduced head: its draft vocabulary)
    xh: jax.Array  # [N, B, r]: the hidden input, once per call
    anchors: jax.Array  # [N] int32, 0 in invalid rows
    prev_ids: jax.Array  # [N] int32, 0 in invalid rows
    valid: jax.Array  # [N] bool
    d2t: jax.Array | None  # a reduced head's draft -> verifier id map (None: the full vocabulary)


class Loop(NamedTuple):
    """How `xpress_jax.refine.run_passes` runs a mode: ``passes`` passes; ``unroll`` (Python or
    ``fori_loop(unroll=True)``); ``numbered`` (a Python loop telling each pass its number); ``checks`` (early exit:
    the pass numbers after which an unrolled loop checks for its fixed point, or None)."""

    passes: int
    unroll: bool
    numbered: bool
    checks: tuple[int, ...] | None = None


def write_slots(blk: jax.Array, tok: jax.Array, s: int, d2t: jax.Array | None) -> jax.Array:
    """``blk`` [N, B] with the draft slots s.. set to the picks ``tok`` ([N*(B-1-s)] draft ids, mapped to verifier
    ids with ``d2t`` where the head is reduced; the slots before s are final)."""
    n, b = blk.shape
    return blk.at[:, 1 + s:].set(to_verifier_ids(tok.reshape(n, b - 1 - s), d2t)) if s < b - 1 else blk


class Mode:
    """The protocol (module doc) and what every mode shares: the seed block, the latent, the tokens.

    ``first``: the seed block's draft slots, [N*(B-1)] draft ids; ``state``: the mode's initial state;
    ``with_passes``: `finish` also returns the passes run (an int32 scalar; benchmarks)."""

    topc: int = 0  # C, where a mode scores candidates (0: the full vocabulary)

    def __init__(self, call: Call, first: jax.Array, loop: Loop, state: Any = (), with_passes: bool = False):
        self.call, self.first, self.loop, self.state, self.with_passes = call, first, loop, state, with_passes
        self.n, self.b = call.logits.shape[:2]
        self.slots = self.b - 1  # draft slots per block

    def start(self):
        c = self.call
        blk = jnp.concatenate([c.anchors[:, None], to_verifier_ids(self.first.reshape(self.n, self.slots), c.d2t)],
                              axis=1)
        return blk, self.state

    def pass_(self, carry, q: int | None):
        raise NotImplementedError

    def finish(self, carry, passes: jax.Array):
        out = self.tokens(carry[0])
        return (out, passes) if self.with_passes else out

    def tokens(self, blk: jax.Array) -> jax.Array:
        """The draft [N, B-1] of ``blk``, `INVALID_TOKEN` in invalid rows."""
        return jnp.where(self.call.valid[:, None], blk[:, 1:], INVALID_TOKEN)

    def latent(self, blk: jax.Array):
        """The pass's latent of every draft row, [N*(B-1), r]; in the top-C passes of `Ops` with ``latent_terms``
        possibly its residual's two terms (`xpress_jax.reference.LatentSum`), which the pick adds."""
        c = self.call
        lat = c.ops.latent(c.params, c.xh, blk, c.prev_ids, terms=True) if self.topc and c.ops.latent_terms else \
            c.ops.latent(c.params, c.xh, blk, c.prev_ids)
        return lat.reshape(self.n * self.slots, c.params["w1"].shape[1])


class Greedy(Mode):
    """The greedy top-C mode (``topc`` > 0: each draft slot scores its C largest base logits) or the full-vocab scan
    (``topc`` = 0). State: none."""

    def __init__(self, call: Call, topc: int, loop: Loop, with_passes: bool = False):
        ops, w2 = call.ops, call.params["w2"]
        self.topc = topc
        if topc:
            self.cand, self.base_c, first = ops.select(call.logits, topc)
            self.prepared = ops.topc_prepare(w2, self.cand)  # once per call
        else:
            first = ops.start(call.logits)
            self.prepared = ops.full_vocab_prepare(w2)  # once per call
        super().__init__(call, first, loop, with_passes=with_passes)

    def pass_(self, carry, q):
        blk, state = carry
        c = self.call
        if q is None and c.ops.numbered:  # in a loop the numbered picks run as pass 0: every slot, its read order
            q = 0
        if self.topc:
            lat = self.latent(blk)
            tok, s = c.ops.topc_pick(self.base_c, self.cand, lat, self.prepared, q=q, slots=self.slots)
        else:
            tok, s = c.ops.full_vocab_pick(c.logits, self.latent(blk), self.prepared, q=q)
        return write_slots(blk, tok, s, c.d2t), state


class Sampled(Mode):
    """The sampled top-C or full-vocab mode (`xpress_jax.sampling`): each draft slot takes ``argmax(s * (1/T) + g)``
    with the frozen noise of `Sampler`. The seed block is sampled from the base logits with the same noise. With
    ``sampler.proposal`` the loop runs K - 1 passes and `finish` the last one with the proposal's extras (K = 0: the
    seed block's); the result is then ``(tokens, Proposal)``. State: none."""

    def __init__(self, call: Call, topc: int, sampler: Sampler, loop: Loop, num_passes: int,
                 with_passes: bool = False):
        super().__init__(call, None, loop, with_passes=with_passes)
        ops, w2 = call.ops, call.params["w2"]
        self.topc, self.sampler, self.num_passes = topc, sampler, num_passes
        if topc:
            self.cand, self.base_c, _ = ops.select(call.logits, topc)
            self.prepared = ops.topc_prepare(w2, self.cand)  # once per call
        else:
            self.prepared = ops.full_vocab_prepare(w2)
        # The seed block: the base logits with the same noise (its extras are the proposal only when K = 0).
        self.first, self.seed_extras, _ = self._pick(None, None if num_passes else sampler.proposal)

    def _pick(self, lat, want=None, q=None):
        """(tokens of draft slots s.., the extras wanted (top-C: ending with the candidates' ids) or None, s); ``lat``
        None: the seed block."""
        c, (seeds, inv_t, _) = self.call, self.sampler
        if self.topc:
            tok, extras, s = c.ops.topc_sample(self.base_c, self.cand, lat, self.prepared, seeds, inv_t, want, q=q,
                                               slots=self.slots)
            return tok, extras if extras is None else (*extras, self.cand), s
        return c.ops.full_vocab_sample(c.logits, lat, self.prepared, seeds, inv_t, want, q=q)

    def pass_(self, carry, q):
        blk, state = carry
        tok, _, s = self._pick(self.latent(blk), q=q)
        return write_slots(blk, tok, s, self.call.d2t), state

    def finish(self, carry, passes):
        proposal = self.sampler.proposal
        if proposal is None:
            return super().finish(carry, passes)
        blk, extras = carry[0], self.seed_extras
        if self.num_passes:  # the last pass, with the proposal's extras
            lat = self.latent(blk)
            tok, extras, s = self._pick(lat, proposal)
            blk = write_slots(blk, tok, s, self.call.d2t)
        out = self.tokens(blk)
        token_score, lse, scores, *ids = extras  # [rows, ...] each: as [N, B-1, ...]
        shape = lambda x: None if x is None else x.reshape(self.n, self.slots, *x.shape[1:])  # noqa: E731
        ids = shape(ids[0]) if ids and scores is not None else None
        return out, Proposal(shape(token_score), shape(lse), shape(scores), ids)
