"""Token agreement of the Pallas backend with the XLA backend at serving shapes, with evidence.

    PYTHONPATH=$PWD python3 -m benchmarks.agreement --out $OUT          # on a GPU
    PYTHONPATH=$PWD python3 -m benchmarks.agreement vllm --out $OUT     # vs PyTorch spellings of vLLM

1. End to end: refine(backend="pallas") vs refine(backend="xla"), N in 1..256,
   both modes, K=6, bf16: disagreeing tokens counted (a flip in one slot
   cascades into the slots after it, so end-to-end counts overstate the cause).
2. Per pick, the cause: one pass's pick on identical inputs (same latent, same
   base logits) by the kernel and by the oracle. For every row where they differ,
   both tokens' scores are recomputed exactly (float64 dot of the bf16 operands):
   base + bias before rounding, the two bf16-rounded biases the two
   implementations could have produced, and the gap in bf16 ulps. A gap within
   one ulp of the bias is float reassociation (fp32 accumulation order), not a bug.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, make_problem
from xpress_jax import reference as R
from xpress_jax.ops import Ops


def _ulp_bf16(x: np.ndarray) -> np.ndarray:
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    x = np.abs(x.astype(np.float64))
    e = np.floor(np.log2(np.maximum(x, 2.0**-126)))
    return 2.0 ** (e - 7)


def _round_bf16(x):
    """Round-to-nearest-even float64 -> bf16 value (as float64)."""
    return np.asarray(jnp.asarray(np.asarray(x, np.float32)).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def _midpoint_dist(x):
    """Distance of x to the nearest bf16 rounding boundary (midpoint between bf16 neighbours)."""
    x = np.asarray(x, np.float64)
    ulp = _ulp_bf16(x)
    lo = np.floor(x / ulp) * ulp
    return np.abs(x - (lo + ulp / 2))


def pick_evidence(cfg, n, topc, seed=3):
    params, logits, h, anchors = make_problem(cfg, n, seed=seed)
    ops, xla = Ops.pallas(), Ops.xla(jax.default_backend())
    B, V, r = cfg.block_size, cfg.vocab_size, cfg.rank
    rows = n * (B - 1)
    xh = xj.hidden_input(params, h)
    base = logits[:, 1:].reshape(rows, V)
    blk = jnp.concatenate([anchors[:, None], jnp.argmax(base, -1).reshape(n, B - 1).astype(jnp.int32)], 1)
    lat = R.latent_pass(params, xh, blk, anchors).reshape(rows, r)
    if topc:
        cand, base_c, _ = R.select_candidates(base, topc)
        want = R.topc_pick(base_c, cand, lat, R.topc_gather(params["w2"], cand))
        got = ops.topc_pick(base_c, cand, lat, ops.topc_prepare(params["w2"], cand))[0]
    else:
        want = xla.full_vocab_pick(logits, lat, params["w2"])[0]
        got = ops.full_vocab_pick(logits, lat, params["w2"])[0]
    want, got = np.asarray(want), np.asarray(got)
    bad = np.nonzero(want != got)[0]
    lat64 = np.asarray(lat.astype(jnp.float32), np.float64)
    w2 = params["w2"]
    out = []
    for i in bad:
        ids = [int(want[i]), int(got[i])]
        w = np.asarray(w2[jnp.asarray(ids)].astype(jnp.float32), np.float64)
        bias = w @ lat64[i]  # exact in float64
        b = np.asarray(base[i, jnp.asarray(ids)].astype(jnp.float32), np.float64)
        exact = b + bias
        ulp = _ulp_bf16(bias)
        out.append(dict(row=int(i), xla_token=ids[0], pallas_token=ids[1], base=b.tolist(),
                        bias_exact=bias.tolist(), score_exact=exact.tolist(),
                        gap=float(abs(exact[0] - exact[1])), bias_ulp=ulp.tolist(),
                        gap_in_bias_ulps=float(abs(exact[0] - exact[1]) / max(ulp)),
                        gap_in_score_ulps=float(abs(exact[0] - exact[1]) / max(_ulp_bf16(exact)))))
    return dict(N=n, topc=topc, rows=rows, differ=len(bad), evidence=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1,4,16,64,256")
    ap.add_argument("--out", default=os.environ.get("OUT", "agreement_out"))
    args = ap.parse_args(argv)
    cfg = xj.HeadConfig(**SERVING)
    f = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)
    e2e, picks = [], []
    for n in [int(x) for x in args.n.split(",")]:
        problem = make_problem(cfg, n)
        for topc in (512, 0):
            a = np.asarray(f(*problem, config=cfg, topc=topc, backend="xla"))
            b = np.asarray(f(*problem, config=cfg, topc=topc, backend="pallas"))
            first = [int(np.argmax(a[i] != b[i])) + 1 for i in range(n) if np.any(a[i] != b[i])]
            e2e.append(dict(N=n, topc=topc, tokens=a.size, differ=int(np.sum(a != b)),
                            blocks_differ=len(first), first_slots=first))
            picks.append(pick_evidence(cfg, n, topc))
            print(json.dumps(e2e[-1]), flush=True)
            print(json.dumps({k: v for k, v in picks[-1].items() if k != "evidence"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "agreement.json"), "w") as fh:
        json.dump(dict(end_to_end=e2e, per_pick=picks), fh, indent=1)
    print("\n| mode | N | end-to-end tokens differ | blocks | one-pass picks differ | max gap (bias ulps) | max gap (score ulps) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for e, p in zip(e2e, picks):
        gap = max((x["gap_in_bias_ulps"] for x in p["evidence"]), default=0.0)
        sgap = max((x["gap_in_score_ulps"] for x in p["evidence"]), default=0.0)
        mode = "full vocab" if e["topc"] == 0 else f"top-{e['topc']}"
        print(f"| {mode} | {e['N']} | {e['differ']} / {e['tokens']} | {e['blocks_differ']} | "
              f"{p['differ']} / {p['rows']} | {gap:.2f} | {sgap:.2f} |")




def explain_flips(cfg, n, topc):
    """Step both backends pass by pass on the end-to-end problem; at each first divergence
    (same block state in, different token out) report how far apart the two latents are and
    the exact scores of the two tokens under each latent."""
    P, X = Ops.pallas(interpret=jax.default_backend() == "cpu"), Ops.xla(jax.default_backend())
    params, logits, h, anchors = make_problem(cfg, n)
    B, V, r = cfg.block_size, cfg.vocab_size, cfg.rank
    rows = n * (B - 1)
    xh = xj.hidden_input(params, h)
    base = logits[:, 1:].reshape(rows, V)
    w2 = params["w2"]
    start = jnp.argmax(base, -1).astype(jnp.int32)  # the block's start in both modes
    f = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)
    lat_x, lat_p = jax.jit(X.latent), jax.jit(P.latent)
    kw = dict(config=cfg, topc=topc)
    prev_x = prev_p = np.asarray(start).reshape(n, B - 1)
    if topc:
        cand, base_c, _ = jax.jit(R.select_candidates, static_argnums=1)(base, topc)
        pick_x = jax.jit(lambda lat: X.topc_pick(base_c, cand, lat, X.topc_prepare(w2, cand))[0])
        pick_p = jax.jit(lambda lat: P.topc_pick(base_c, cand, lat, P.topc_prepare(w2, cand))[0])

        def f32_pick(lat):  # XLA with float32 operands: exact products, float32 sums
            w2c = jnp.take(w2, cand, axis=0).astype(jnp.float32)
            bias = jnp.einsum("nr,ncr->nc", lat.astype(jnp.float32), w2c,
                              precision=jax.lax.Precision.HIGHEST).astype(base_c.dtype)
            s = (base_c.astype(jnp.float32) + bias.astype(jnp.float32)).astype(base_c.dtype)
            return R.topc_winner(s, base_c, cand)
    else:
        pick_x = jax.jit(lambda lat: X.full_vocab_pick(logits, lat, w2)[0])
        pick_p = jax.jit(lambda lat: P.full_vocab_pick(logits, lat, w2)[0])

        def f32_pick(lat):
            bias = jnp.matmul(lat.astype(jnp.float32), w2.astype(jnp.float32).T,
                              precision=jax.lax.Precision.HIGHEST).astype(base.dtype)
            return jnp.argmax((base.astype(jnp.float32) + bias.astype(jnp.float32)).astype(base.dtype), -1)
    pick_f = jax.jit(f32_pick)
    found = []
    for p in range(1, cfg.num_passes + 1):
        # The jitted refine itself, K = p: the passes' inputs are exactly the end-to-end run's.
        ox = np.asarray(f(params, logits, h, anchors, num_passes=p, backend="xla", **kw))
        op = np.asarray(f(params, logits, h, anchors, num_passes=p, backend="pallas",
                          interpret=jax.default_backend() == "cpu", **kw))
        same_in = np.all(prev_x == prev_p, axis=1)
        blk = jnp.concatenate([anchors[:, None], jnp.asarray(prev_x)], 1)
        lx = lat_x(params, xh, blk, anchors).reshape(rows, r)
        lp = lat_p(params, xh, blk, anchors).reshape(rows, r)
        # Each implementation's one-pass pick of every row from the same (standalone XLA) latent,
        # and the XLA backend compiled the other way (passes in a loop instead of unrolled).
        picks = {name: np.asarray(fn(lx)) for name, fn in (("xla", pick_x), ("pallas", pick_p), ("f32", pick_f))}
        ox_loop = np.asarray(f(params, logits, h, anchors, num_passes=p, backend="xla",
                               unroll=jax.default_backend() != "gpu", **kw)).reshape(-1)
        for i in np.nonzero(np.repeat(same_in, B - 1) & (ox.reshape(-1) != op.reshape(-1)))[0]:
            ids = jnp.asarray([int(ox.reshape(-1)[i]), int(op.reshape(-1)[i])])
            w = np.asarray(w2[ids].astype(jnp.float32), np.float64)
            b = np.asarray(base[i, ids].astype(jnp.float32), np.float64)
            la, lb = (np.asarray(l[i].astype(jnp.float32), np.float64) for l in (lx, lp))
            lat_ulps = float(np.max(np.abs(la - lb) / _ulp_bf16(np.maximum(np.abs(la), np.abs(lb)))))
            sx, sp = b + w @ la, b + w @ lb  # exact scores of both tokens under each latent
            # Can float32 reassociation change the rounding? Distance of each token's exact bias
            # to the nearest bf16 rounding midpoint vs the float32 summation error bound
            # (r - 1) * 2^-24 * sum_k |lat_k w_k|; and the same for the score base + bf16(bias).
            bias = w @ la
            bound = (r - 1) * 2.0**-24 * (np.abs(w) @ np.abs(la))
            mid_b = _midpoint_dist(bias)
            sc = b + _round_bf16(bias)
            mid_s = _midpoint_dist(sc)
            s0, s1 = (float(_round_bf16(x)) for x in sc)
            t0, t1 = int(ids[0]), int(ids[1])
            # Equal scores: full vocab, the lowest id; top-C, the larger base logit, then the lowest id.
            tie = (min(t0, t1) if not topc or b[0] == b[1] else (t0 if b[0] > b[1] else t1))
            exact_tok = t0 if s0 > s1 else t1 if s1 > s0 else tie
            found.append(dict(N=n, topc=topc, pass_=p, row=int(i), xla_token=int(ids[0]),
                              pallas_token=int(ids[1]), lat_elems_differ=int(np.sum(la != lb)),
                              lat_max_diff_ulps=lat_ulps, scores_xla_latent=sx.tolist(),
                              scores_pallas_latent=sp.tolist(),
                              gap_score_ulps=float(max(abs(sx[0] - sx[1]), abs(sp[0] - sp[1]))
                                                   / _ulp_bf16(np.max(np.abs(sx)))),
                              bias_exact=bias.tolist(), bias_err_bound=bound.tolist(),
                              bias_to_midpoint=mid_b.tolist(), score_bf16_of_exact=[float(_round_bf16(x)) for x in sc],
                              # The reference rule in exact arithmetic (float64 dot, then the two bf16
                              # roundings): larger rounded score, then refine's tie rule.
                              exact_token=exact_tok,
                              xla_pick_same_latent=int(picks["xla"][i]),
                              pallas_pick_same_latent=int(picks["pallas"][i]),
                              xla_other_compile_token=int(ox_loop[i]),
                              xla_f32_operands_pick_same_latent=int(picks["f32"][i]),
                              score_to_midpoint=mid_s.tolist(),
                              # base + bf16(bias) is exact in float32 and rounded the same way by both
                              # implementations: only a bias rounding can differ.
                              reassociation_can_flip=bool(np.any(mid_b <= bound))))
        prev_x, prev_p = ox, op
    return found


def explain_main(argv=None):
    ap = argparse.ArgumentParser(description="explain end-to-end flips (first divergences)")
    ap.add_argument("--n", default="64,256")
    ap.add_argument("--out", default=os.environ.get("OUT", "agreement_out"))
    args = ap.parse_args(argv)
    cfg = xj.HeadConfig(**SERVING)
    allf = []
    for n in [int(x) for x in args.n.split(",")]:
        for topc in (512, 0):
            f = explain_flips(cfg, n, topc)
            allf += f
            for x in f:
                print(json.dumps(x), flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "flips.json"), "w") as fh:  # after every case (timeouts)
                json.dump(allf, fh, indent=1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "flips.json"), "w") as fh:
        json.dump(allf, fh, indent=1)
    print("\n| mode | N | pass | xla tok | pallas tok | latent elems differ | max latent diff (ulps) | "
          "score gap (ulps) | exact scores -> bf16 | bias to midpoint / f32 error bound | reassociation can flip "
          "| exact pick | xla / pallas / xla-f32-operands pick, same latent | xla, other compile |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|---|---:|")
    for x in allf:
        mode = "full vocab" if x["topc"] == 0 else f"top-{x['topc']}"
        sc = " / ".join(f"{a:.5f}->{c:.4f}" for a, c in zip(x["scores_xla_latent"], x["score_bf16_of_exact"]))
        mb = " / ".join(f"{m:.2e}<={e:.2e}" if m <= e else f"{m:.2e}>{e:.2e}"
                        for m, e in zip(x["bias_to_midpoint"], x["bias_err_bound"]))
        print(f"| {mode} | {x['N']} | {x['pass_']} | {x['xla_token']} | {x['pallas_token']} | "
              f"{x['lat_elems_differ']} | {x['lat_max_diff_ulps']:.2f} | {x['gap_score_ulps']:.2f} | {sc} | {mb} | "
              f"{'yes' if x['reassociation_can_flip'] else 'NO'} | {x['exact_token']} | "
              f"{x['xla_pick_same_latent']} / {x['pallas_pick_same_latent']} / "
              f"{x['xla_f32_operands_pick_same_latent']} | {x['xla_other_compile_token']} |")


# ----------------------------------------------------------------------------- vLLM's spellings
def torch_refine(params, logits, h, anchors, *, num_passes, topc, spelling="fused", ties="sorted"):
    """vLLM's head spelled in PyTorch on the GPU, from our serving params (bf16).

    ``spelling="fused"``: the precision choices of vLLM's fused path (docs/semantics.md): bf16
    operands, float32 accumulation (exact products: float32 matmuls with TF32 off), the hidden
    cache, xh, the latent and the readout bias rounded to bf16, the latent's elementwise work in
    float32, ``s = bf16(float32(base) + float32(bias))``. ``spelling="eager"``: the plain bf16
    PyTorch spelling (every op rounds to bf16): vLLM's own eager path, whose agreement with the
    fused one is the reference's self-agreement.

    Top-C candidates: sorted as ``torch.topk(..., sorted=True)`` (largest base logit first; equal
    logits in vocab order, as docs/semantics.md states, by a stable sort); ``ties="sorted"``
    picks the first position holding the largest s (vLLM); ``ties="lowest_id"`` the lowest vocab id
    among equal s (the rule refine used before; for comparison). Returns [N, B-1] int64 numpy.
    """
    import torch

    from xpress_jax.convert.torch_reference import to_torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    P = {k: to_torch(np.asarray(v)).to(dev) for k, v in params.items()}
    base_full = to_torch(np.asarray(logits)).to(dev)
    hh = to_torch(np.asarray(h)).to(dev)
    anchors = torch.as_tensor(np.array(anchors), dtype=torch.long, device=dev)
    N, B, V = base_full.shape
    r = P["w1"].shape[1]
    rows = N * (B - 1)
    bf, f32 = torch.bfloat16, torch.float32
    fused = spelling == "fused"

    def mm(a, b):  # fused: float32 accumulation of exact bf16 products; eager: a bf16 matmul
        return a.to(f32) @ b.to(f32) if fused else a @ b

    def rnd(x):  # the reference's rounding points (fused); eager rounds after every op anyway
        return x.to(bf).to(f32) if fused else x.to(bf)

    with torch.no_grad():
        g = hh.to(f32).mean(dim=1) if fused else hh.mean(dim=1)
        hc = torch.cat([rnd(mm(hh, P["down_h"])),
                        rnd(mm(rnd(g), P["down_g"]))[:, None, :].expand(N, B, r)], dim=-1)
        xh = rnd(mm(rnd(hc), P["in_proj_hidden"]))
        slots = base_full[:, 1:, :].reshape(rows, V)
        slots = torch.where(torch.isnan(slots), torch.full_like(slots, float("-inf")), slots)
        blk = torch.empty(N, B, dtype=torch.long, device=dev)
        blk[:, 0] = anchors
        blk[:, 1:] = slots.argmax(dim=-1).view(N, B - 1)
        mix = P["mix"].to(f32) if fused else P["mix"]  # [B(k), B(j), r]
        if topc:
            # torch.topk(sorted=True) order, with equal logits in vocab order (docs/semantics.md: lowest id
            # first, and the C-th place's ties keep the lowest ids): a stable descending sort.
            cand = torch.sort(slots, dim=-1, descending=True, stable=True).indices[:, : min(topc, V)]
            base_c = torch.gather(slots, 1, cand)
            w2c = P["w2"][cand]  # [rows, C, r]
        for _ in range(num_passes):
            prev = torch.cat([anchors[:, None], blk[:, :-1]], dim=1)
            x = (xh.to(f32) + mm(P["w1"][prev], P["in_proj_token"])) if fused else xh + P["w1"][prev] @ P["in_proj_token"]
            u = torch.einsum("kjc,njc->nkc", mix, x)[:, 1:]
            uc = rnd(u)
            act = rnd(torch.nn.functional.silu(mm(uc, P["mlp_gate"])) * mm(uc, P["mlp_up"]))
            lat = rnd(u + mm(act, P["mlp_down"])).reshape(rows, r)
            if topc:
                bias = rnd(torch.einsum("ncr,nr->nc", w2c.to(f32), lat.to(f32))) if fused else torch.einsum(
                    "ncr,nr->nc", w2c, lat.to(bf))
                s = (base_c.to(f32) + bias.to(f32)).to(bf).to(f32)
                s = torch.where(torch.isnan(s), torch.full_like(s, float("-inf")), s)
                if ties == "sorted":
                    pick = torch.gather(cand, 1, s.argmax(dim=-1, keepdim=True))[:, 0]
                else:
                    big = torch.iinfo(torch.long).max
                    pick = torch.where(s == s.max(-1, keepdim=True).values, cand, big).min(-1).values
            else:
                bias = rnd(lat.to(f32) @ P["w2"].to(f32).T) if fused else lat.to(bf) @ P["w2"].T
                s = (slots.to(f32) + bias.to(f32)).to(bf).to(f32)
                s = torch.where(torch.isnan(s), torch.full_like(s, float("-inf")), s)
                pick = s.argmax(dim=-1)
            blk[:, 1:] = pick.view(N, B - 1)
    return blk[:, 1:].cpu().numpy()


def vllm_main(argv=None):
    """Top-C (and full-vocab) token agreement with PyTorch spellings of vLLM."""
    ap = argparse.ArgumentParser(description="agreement with a PyTorch spelling of vLLM's fused path")
    ap.add_argument("--n", default="1,4,16,64,256")
    ap.add_argument("--topc", default="512,0")
    ap.add_argument("--std", type=float, default=0.06, help="weight std (0.06: refinement changes many tokens)")
    ap.add_argument("--out", default=os.environ.get("OUT", "agreement_out"))
    args = ap.parse_args(argv)
    cfg = xj.HeadConfig(**SERVING)
    f = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)
    rows_out = []
    for n in [int(x) for x in args.n.split(",")]:
        params, logits, h, anchors = make_problem(cfg, n, std=args.std)
        drafter = np.asarray(jnp.argmax(logits[:, 1:], -1))
        for topc in [int(x) for x in args.topc.split(",")]:
            kw = dict(num_passes=cfg.num_passes, topc=topc)
            ref = torch_refine(params, logits, h, anchors, **kw)
            row = dict(N=n, topc=topc, tokens=int(ref.size), changed_vs_drafter=float(np.mean(ref != drafter)))
            for name, out in (
                ("pallas", lambda: f(params, logits, h, anchors, config=cfg, backend="pallas", **kw)),
                ("xla", lambda: f(params, logits, h, anchors, config=cfg, backend="xla", **kw)),
                ("torch_fused_lowest_id", lambda: torch_refine(params, logits, h, anchors, ties="lowest_id", **kw)),
                ("torch_eager", lambda: torch_refine(params, logits, h, anchors, spelling="eager", **kw)),
            ):
                if name == "torch_fused_lowest_id" and not topc:
                    continue
                got = np.asarray(out())
                row[name] = float(np.mean(got == ref))
            rows_out.append(row)
            print(json.dumps(row), flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "vllm_agreement.json"), "w") as fh:
                json.dump(dict(std=args.std, K=cfg.num_passes, rows=rows_out), fh, indent=1)
    print("\nAgreement with the PyTorch spelling of vLLM's fused path (sorted top-C candidates, first position):")
    print("| mode | N | tokens | changed vs drafter | Pallas | XLA | fused, lowest-id ties | vLLM eager (self-agreement) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows_out:
        mode = "full vocab" if r["topc"] == 0 else f"top-{r['topc']}"
        low = f"{r['torch_fused_lowest_id']:.2%}" if "torch_fused_lowest_id" in r else "-"
        print(f"| {mode} | {r['N']} | {r['tokens']} | {r['changed_vs_drafter']:.1%} | {r['pallas']:.2%} | "
              f"{r['xla']:.2%} | {low} | {r['torch_eager']:.2%} |")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["explain"]:
        explain_main(sys.argv[2:])
    elif sys.argv[1:2] == ["vllm"]:
        vllm_main(sys.argv[2:])
    else:
        main()
