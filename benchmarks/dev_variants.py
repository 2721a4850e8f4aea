"""Refine-level A/B of implementation variants that are not backends (one GPU run, same problem).

    PYTHONPATH=$PWD python3 -m benchmarks.dev_variants --out $OUT     # on a GPU

Variants (each an ops class fed to `xpress_jax.refine._refine`, passes unrolled):

* ``xla``: the XLA backend as shipped (on GPUs the readout dot writes bf16 directly).
* ``xla-f32out``: the readout as ``dot(preferred_element_type=f32).astype(bf16)`` (before 11-30 evening).
* ``pallas``: the Pallas backend as shipped (top-C selection reads the logits in place).
* ``pallas-select-copy``: top-C selection on a copy of ``logits[:, 1:]`` (before 11-30 evening).
* ``pallas-latent-kernel``: the latent kernel at every N (shipped: XLA's latent for N <= 4).
* ``pallas-xlapick``: Pallas latent, XLA readout + argmax (full vocab).
* ``pallas-topc-1split-*``: the top-C pick as one program per row over all C candidates
  (no combine launch; shipped: C split over programs + a combine kernel).

Prints device µs per refine (chained, as bench_refine) and the tokens' agreement with ``xla``.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from benchmarks.bench_refine import SERVING, chained, make_problem
from benchmarks.timing import time_jitted
from xpress_jax.refine import _JnpOps, _refine, _round_sum


def _f32out_pick(base, lat, w2):
    bias = jnp.dot(lat, w2.T, preferred_element_type=jnp.float32).astype(base.dtype)
    return jnp.argmax(_round_sum(base, bias), axis=-1).astype(jnp.int32)


def variants():
    from pallas_kernels import api, latent

    P = api.ops()

    class XlaF32(_JnpOps):
        full_vocab_pick = staticmethod(_f32out_pick)

    class PallasCopy(P):
        @classmethod
        def select_candidates_logits(cls, logits, c):
            N, B, V = logits.shape
            return cls.select_candidates(logits[:, 1:].reshape(N * (B - 1), V), c)

    class PallasLatentKernel(P):
        latent_pass = staticmethod(lambda params, xh, blk, prev: latent.latent_pass(params, xh, blk, prev))

    class PallasXlaPick(P):
        full_vocab_pick = staticmethod(_JnpOps.full_vocab_pick)
        full_vocab_pick_logits = classmethod(_JnpOps.full_vocab_pick_logits.__func__)

    def one_split(c_tile, num_warps):
        class PallasTopCOneSplit(P):  # one program per row over all C candidates: no combine launch
            @staticmethod
            def topc_pick(base_c, cand, lat, prepared):
                from pallas_kernels import topc_pick

                c = base_c.shape[1]
                cfg = topc_pick.TopCConfig(c_tile=c_tile, c_steps=-(-c // c_tile), k_tile=64, num_warps=num_warps)
                return topc_pick.topc_pick(base_c, cand, lat, prepared, config=cfg)

        return PallasTopCOneSplit

    return {"xla": _JnpOps, "xla-f32out": XlaF32, "pallas": P, "pallas-select-copy": PallasCopy,
            "pallas-latent-kernel": PallasLatentKernel, "pallas-xlapick": PallasXlaPick,
            "pallas-topc-1split-c128w8": one_split(128, 8), "pallas-topc-1split-c64w4": one_split(64, 4)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1,16,64,256")
    ap.add_argument("--cases", default="512:pallas,pallas-select-copy,pallas-latent-kernel;0:xla,xla-f32out,pallas,pallas-latent-kernel,pallas-xlapick")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "variants_out"))
    args = ap.parse_args(argv)
    cfg = xj.HeadConfig(**SERVING)
    vs = variants()
    rows = []
    for n in [int(x) for x in args.n.split(",")]:
        problem = make_problem(cfg, n)
        for case in args.cases.split(";"):
            topc, names = case.split(":")
            topc = int(topc)
            ref = None
            for name in names.split(","):
                ops = vs[name]
                def fn(p, l, h, a, ops=ops):
                    return _refine(ops, p, l, h, a, a, cfg.num_passes, topc, True)

                tok = np.asarray(jax.jit(fn)(*problem))
                ref = tok if ref is None else ref
                m = {1: 100, 4: 100, 16: 50, 64: 20, 256: 8}.get(n, 8)
                _, t, _ = time_jitted(chained(cfg, m, refine_fn=fn), problem, args.reps)
                rows.append(dict(N=n, topc=topc, variant=name, device_us=t / m * 1e6,
                                 differ_from_first=int(np.sum(tok != ref))))
                print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "variants.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)
    print("\n| mode | N | variant | device µs / refine | tokens differ from first variant |")
    print("|---|---:|---|---:|---:|")
    for r in rows:
        mode = "full vocab" if r["topc"] == 0 else f"top-{r['topc']}"
        print(f"| {mode} | {r['N']} | {r['variant']} | {r['device_us']:.0f} | {r['differ_from_first']} |")


if __name__ == "__main__":
    main()
