"""Issue 16, session 12: fewer XLA kernels per pass in the small-N latent, by spelling (no Pallas).

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-03-s12/probe_latent.py OUT.jsonl

At N=1 a pass's latent is 8 XLA kernels (2026-12-02 trace): gather w1[prev], the GEMM e @ in_proj_token,
the add of xh, the mixer + rounding, the gate/up GEMM, silu*up + rounding, the down GEMM, the residual +
rounding; each ~1.1-2.0 µs, mostly launch. Variants (same sums, up to summation order):
  mixsum   the mixer spelled as a multiply + sum over j (a reduction XLA can fuse with its producers)
  T        a prepared table T = w1 @ in_proj_token ([V, r] float32, computed once): x = xh + T[prev]
           (the gather, the GEMM and the add in one fusion)
  T+mixsum both
  T+mixsum+cvt  also the roundings that only feed a dot or the pick (uc, act, lat) as plain astype: a
           real rounding (the consumer takes bf16), which XLA's Triton GEMM fusions may take as a
           prologue/epilogue (reduce_precision blocks that); checked: lat equal bit for bit to the reference's
Prediction: T+mixsum 5 latent kernels per pass instead of 8: -3 x 1.25 x 6 = ~-22 µs per refine at N=1.
Outcome of the first run (probe_latent.py, latent.jsonl): T -3 kernels per pass; N=1 -9..-12 µs, N=16 -32.
Second run (PROBE_V2=1): + T+mixsum+cvt, N = 64 and 256, and the latents compared bit for bit.
Third run (PROBE_V3=1): default, T, T+mixsum and T(+mixsum)+bar (u behind an optimization barrier) over N = 1..256 (top-512; full vocab at 4 and 16), to place
the mixer's spelling and the XLA latent against the Pallas latent kernel (the plan's above N=64).
Per case: device µs per refine (chained, min of 3 interleaved rounds), tokens differing from the
default, and (N=1) the GPU kernels of one call from a profiler trace.
"""
import dataclasses, json, os, sys

import jax, jax.numpy as jnp, numpy as np

import xpress_jax as xj
from xpress_jax.head import _dot, acc_dtype, precision_for, round_to
from xpress_jax.ops import Ops
from xpress_jax.refine import refine_with
from benchmarks.bench_refine import SERVING, chain_length, chained, make_problem, time_device

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "2026-12-02"))
SMALL = os.environ.get("PROBE_SMALL")
cfg = xj.HeadConfig(**(dict(SERVING, vocab_size=1001, hidden_size=64, rank=24, mlp_hidden=40, topc=17)
                       if SMALL else SERVING))
base_ops = Ops.xla() if SMALL else Ops.pallas()
out = open(sys.argv[1], "a")


def make_latent(mixsum, table, cvt=False, bar=False):
    rnd = (lambda x, dt: x.astype(dt)) if cvt else round_to
    def lat(params, xh, blk, prev_ids, T=None):
        prev = jnp.concatenate([prev_ids[:, None], blk[:, :-1]], axis=1)
        cd = params["w1"].dtype
        acc = acc_dtype(cd)
        if table:
            x = xh.astype(acc) + jnp.take(T, prev, axis=0, mode="clip")
        else:
            e = jnp.take(params["w1"], prev, axis=0, mode="clip")
            x = xh.astype(acc) + _dot(e, params["in_proj_token"], acc)
        mix = params["mix"].astype(acc)
        if mixsum:
            u = jnp.sum(mix[None, 1:] * x[:, None, :, :], axis=2)
        else:
            u = jnp.einsum("kjc,njc->nkc", mix, x, precision=precision_for(acc))[:, 1:]
        if bar:  # u materialised once (else XLA recomputes the mixer inside the residual's fusion)
            u = jax.lax.optimization_barrier(u)
        uc = rnd(u, cd)
        gate = _dot(uc, params["mlp_gate"], acc)
        up = _dot(uc, params["mlp_up"], acc)
        act = rnd(jax.nn.silu(gate) * up, cd)
        return rnd(u + _dot(act, params["mlp_down"], acc), cd)
    return lat


VARIANTS = {"default": None, "mixsum": (True, False), "T": (False, True), "T+mixsum": (True, True)}
V2 = os.environ.get("PROBE_V2")
if V2:
    VARIANTS = {"default": None, "T+mixsum": (True, True), "T+mixsum+cvt": (True, True, True)}


def make_fn(variant, topc):
    def fn(pt, l, h, a):
        p, T = pt
        ops = base_ops
        if VARIANTS[variant] is not None:
            f = make_latent(*VARIANTS[variant])
            ops = dataclasses.replace(base_ops, latent=lambda *xs: f(*xs, T=T))
        return refine_with(ops, p, l, h, a, config=cfg, topc=topc)
    return fn


CASES = ((1, 512), (1, 0), (4, 512), (16, 512), (16, 0))
if V2:
    CASES = ((1, 512), (1, 0), (16, 512), (16, 0), (64, 512), (64, 0), (256, 512))
V3 = os.environ.get("PROBE_V3")
if V3:
    V2 = True
    CASES = ((1, 512), (2, 512), (4, 512), (8, 512), (16, 512), (32, 512), (64, 512), (128, 512), (256, 512), (1, 0),
             (16, 0))
    VARIANTS = {"default": None, "T": (False, True), "T+mixsum": (True, True),
                "T+bar": (False, True, False, True), "T+mixsum+bar": (True, True, False, True)}


def lat_check(variant, params, T, n):
    """The variant's latents against `reference.latent_pass` on fresh inputs: (elements differing, max |diff|)."""
    from xpress_jax import reference as ref
    k1, k2, k3 = jax.random.split(jax.random.key(n + 7), 3)
    B, r = cfg.block_size, cfg.rank
    xh = (jax.random.normal(k1, (n, B, r), jnp.float32) * 0.5).astype(params["w1"].dtype)
    blk = jax.random.randint(k2, (n, B), 0, cfg.vocab_size, jnp.int32)
    pid = jax.random.randint(k3, (n,), 0, cfg.vocab_size, jnp.int32)
    want = jax.jit(ref.latent_pass)(params, xh, blk, pid).astype(jnp.float32)
    got = jax.jit(lambda *xs: make_latent(*VARIANTS[variant])(*xs, T=T))(params, xh, blk, pid).astype(jnp.float32)
    return int((want != got).sum()), float(jnp.abs(want - got).max()), int(want.size)
for n, topc in CASES[:int(os.environ.get("PROBE_CASES", len(CASES)))]:
    topc = topc and cfg.topc
    params, logits, h, anchors = make_problem(cfg, n, std=0.02)
    acc = acc_dtype(params["w1"].dtype)
    T = jax.jit(lambda w, p: _dot(w, p, acc))(params["w1"], params["in_proj_token"])
    args = ((params, T), logits, h, anchors)
    m = 2 if SMALL else chain_length(n, topc, "pallas")
    res = {}
    for v in VARIANTS:
        fn = make_fn(v, topc)
        res[v] = dict(tok=np.asarray(jax.jit(fn)(*args)), chain=chained(cfg, m, refine_fn=fn), dev=[], fn=fn)
    for _ in range(3):
        for v, r in res.items():
            r["dev"].append(time_device(r["chain"], args, 3 if SMALL else 5) / m * 1e6)
    for v, r in res.items():
        row = dict(N=n, topc=topc, variant=v, device_us=[round(x, 1) for x in r["dev"]],
                   differ=int((r["tok"] != res["default"]["tok"]).sum()))
        if V2 and VARIANTS[v] is not None:
            row["lat_check"] = lat_check(v, params, T, n)
        if n == 1 and not SMALL and not V3:
            import trace_util
            tr = trace_util.trace(r["fn"], args, f"lat_{v}_{topc}")
            row["trace"] = tr
        out.write(json.dumps(row) + "\n"); out.flush()
        ntr = row.get("trace", {}).get("n", "-") if isinstance(row.get("trace"), dict) else row.get("trace", "-")
        print(f"N={n:3d} topc={topc:3d} {v:9s} device {min(r['dev']):7.1f} differ {row['differ']} kernels {ntr} lat {row.get('lat_check')}",
              flush=True)
