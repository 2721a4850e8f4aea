"""Session 9: the pruned pick alone against the scan's pick (H200), realistic latents (a std-0.04 head's
pass-6 latents, the scan's own tokens as guesses), N = 1 / 16 / 256. Config variants of the pruned kernel.
Run: PYTHONPATH=$PWD python3 benchmarks/results/2026-12-02-s9/probe_pruned.py [std] > $OUT/x.jsonl"""
import dataclasses, json, sys, warnings
warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp
import xpress_jax as xj
from xpress_jax import dispatch, exact, reference as ref
from xpress_jax.kernels import full_vocab, pruned
from benchmarks.bench_refine import SERVING, make_problem
from benchmarks.bench_kernels import time_step

std = float(sys.argv[1]) if len(sys.argv) > 1 else 0.04
ns = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 16, 256]
cfg = xj.HeadConfig(**SERVING)
for n in ns:
    params, logits, h, anchors = make_problem(cfg, n, std=std)
    w2 = params["w2"]
    out = jax.jit(lambda p, l, hh, a: xj.refine(p, l, hh, a, config=cfg, topc=0))(params, logits, h, anchors)
    blk = jnp.concatenate([anchors[:, None], out], axis=1)
    xh = xj.hidden_input(params, h)
    lat = ref.latent_pass(params, xh, blk, anchors).reshape(-1, cfg.rank)
    guess = out.reshape(-1)
    rows = lat.shape[0]
    B, V = cfg.block_size, cfg.vocab_size
    base2 = logits.reshape(n * B, V)
    plan = dispatch.plan(n, B, V, cfg.rank, 0, jnp.bfloat16)
    pp = jax.jit(exact.prepare_pruned)(w2)
    m = 50 if n < 256 else 10

    def scan(lat):
        tok = full_vocab.full_vocab_pick(base2, lat, w2, config=plan.full_vocab, slot_stride=B)
        return lat.at[0, 0].add((tok[0] % 2).astype(lat.dtype) * 0), tok

    t_scan = time_step(lambda x: scan(x)[0], lat, m, 5)
    want = jax.jit(scan)(lat)[1]
    base_cfg = pruned.pruned_config(plan.full_vocab, cfg.rank, jnp.bfloat16)
    # (config, two_phase, swap); second run of this script (the two-phase kernel)
    variants = {"2phase": (base_cfg, True, False), "2phase swap": (base_cfg, True, True)}
    if n < 256:
        variants["1phase"] = (base_cfg, False, False)
        variants["2phase stages3"] = (dataclasses.replace(base_cfg, num_stages=3), True, False)
        variants["2phase swap stages3"] = (dataclasses.replace(base_cfg, num_stages=3), True, True)
        variants["2phase vsteps*2"] = (dataclasses.replace(base_cfg, v_steps=base_cfg.v_steps * 2), True, False)
    print(json.dumps(dict(N=n, std=std, impl="scan", us=t_scan, cfg=str(plan.full_vocab))), flush=True)
    for name, (c, tp, sw) in variants.items():
        for fallen in (False, True) if name == "2phase" else (False,):
            try:
                def f(lat, c=c, fallen=fallen, tp=tp, sw=sw):
                    tok, need, frac, _ = pruned.pruned_pick(base2, lat, w2, pp.q, pp.scale, pp.err, pp.max_norm, guess,
                                                            jnp.asarray(fallen), config=c, slot_stride=B, two_phase=tp,
                                                            swap=sw)
                    return lat.at[0, 0].add((tok[0] % 2).astype(lat.dtype) * 0), tok, need, frac

                t = time_step(lambda x: f(x)[0], lat, m, 5)
                _, tok, need, frac = jax.jit(f)(lat)
                print(json.dumps(dict(N=n, std=std, impl=f"pruned {name}" + (" fallen" if fallen else ""), us=t,
                                      ratio=t / t_scan, differ=int((tok != want).sum()), exact_frac=float(frac),
                                      rows_cert=float((need <= 1).mean()), cfg=str(c))), flush=True)
            except Exception as e:  # a config that does not build
                print(json.dumps(dict(N=n, impl=f"pruned {name}", error=str(e)[:300])), flush=True)
