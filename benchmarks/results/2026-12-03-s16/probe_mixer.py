"""Session 16 (issue 16): XLA computes a pass's mixer twice where the latent is not split.

`probe_hlo.py` (full vocab, N=1, token table): each pass runs the gather + mixer as one fusion feeding the gate/up
GEMM (`loop_convert_fusion.6..11`, ~3.4 µs each in the trace) and recomputes the same gather + mixer inside the
residual's fusion `round(u + d)` (`loop_convert_fusion.12..17`). In top-C passes up to 60 draft rows the latent is
split, u is an operand of the pick kernel, and XLA emits one multi-output fusion (u in f32, its rounding) instead.
Variants of XLA's latent (the served steps otherwise): "barrier_u" (`u` behind `lax.optimization_barrier`: one
fusion writes it, the GEMM and the residual read it) and "barrier_u_uc" (`u` and its rounding behind one barrier).
Same operations in the same order, so the same latent bit for bit wherever XLA emits the same reductions.
Prediction: the residual fusion no longer recomputes 16 gathers and the mixer per element: ~-1.5 to -2.5 µs per
pass, -9 to -15 µs per refine at full vocab N=1 and at N=16 in both modes (top-512 N=16 is not split either);
the barrier may also stop the mixer from fusing into the gate/up GEMM's operand, which would cost a launch back.
Chained device µs per refine with a token table, 3 interleaved rounds, tokens against served. JSON to argv[1]."""
import dataclasses, os, sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-s14"))
from harness import time_variants  # noqa: E402
from xpress_jax import head as H  # noqa: E402
from xpress_jax import reference as ref  # noqa: E402
from xpress_jax.ops import Ops  # noqa: E402

P = Ops.pallas()


def make_latent(mode):
    def latent(params, xh, blk, prev_ids, split=False):
        prev = jnp.concatenate([prev_ids[:, None], blk[:, :-1]], axis=1)
        cd = params["w1"].dtype
        acc = H.acc_dtype(cd)
        x = xh.astype(acc) + jnp.take(params[H.TOKEN_TABLE], prev, axis=0, mode="clip")
        u = jnp.einsum("kjc,njc->nkc", params["mix"].astype(acc), x, precision=H.precision_for(acc))[:, 1:]
        if mode == "barrier_u":
            u = lax.optimization_barrier(u)
            uc = H.round_to(u, cd)
        else:
            u, uc = lax.optimization_barrier((u, H.round_to(u, cd)))
        gate = H._dot(uc, params["mlp_gate"], acc)
        up = H._dot(uc, params["mlp_up"], acc)
        act = H.round_to(jax.nn.silu(gate) * up, cd)
        d = H._dot(act, params["mlp_down"], acc)
        if split and blk.shape[0] * (blk.shape[1] - 1) <= 60:
            return ref.LatentSum(u, d)
        return H.round_to(u + d, cd)
    return latent


V = {"served": P, **{m: dataclasses.replace(P, name=m, latent=make_latent(m)) for m in ("barrier_u", "barrier_u_uc")}}
out = open(sys.argv[1], "w")
for n, topc in ((1, 0), (16, 0), (16, 512), (4, 0)):
    time_variants(n, topc, V, 3, out)
