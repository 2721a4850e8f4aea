"""What session 21's probes share: the served Pallas steps `P`, `with_keep` (the full-vocab pass pick with the
kernel's L2 hints), `with_config` (one fixed flat config), `barrier_latent` (session 16's "barrier_u_uc")."""
import dataclasses, functools

from xpress_jax import ops as O
from xpress_jax import reference as ref
from xpress_jax.kernels import full_vocab as fvk

P = O.Ops.pallas()


def with_keep(keep, latent=None):
    pp = O.PassPick(P.full_vocab_pick, functools.partial(O._pallas_pass_pick, interpret=False, keep=keep))
    kw = dict(latent=latent) if latent else {}
    return dataclasses.replace(P, name=f"keep={keep}", full_vocab_pass_pick=pp, **kw)


def with_config(c, keep):
    fc = fvk.FullVocabConfig(row_tile=c[0], v_tile=c[1], v_steps=c[2], k_tile=c[3], num_warps=c[4], num_stages=c[5],
                             hold_lat=False, flat=True, prefetch_base=True, lazy=True)

    def run(logits, lat, w2, q):
        n, b, v = logits.shape
        return fvk.full_vocab_pick(logits.reshape(n * b, v), lat, w2, config=fc, slot_stride=b, reverse=q % 2 == 1,
                                   keep=keep), 0

    return dataclasses.replace(P, name=f"{c} keep={keep}", full_vocab_pass_pick=O.PassPick(P.full_vocab_pick, run))


def barrier_latent(params, xh, blk, prev_ids, split=False):
    """Session 16's "barrier_u_uc" (`probe_mixer.py`): XLA's latent with the mixer behind an optimization barrier.
    (`probe_keep.py` ran a copy of that function; it is now `head.latent(..., barrier=True)`, the same ops.)"""
    split = split and blk.shape[0] * (blk.shape[1] - 1) <= 60
    return ref.latent_pass(params, xh, blk, prev_ids, split=split, barrier=True)
