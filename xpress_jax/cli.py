"""`xpress` console command: ``xpress demo`` runs a synthetic head end to end and reports."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

__all__ = ["main", "demo"]


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn().block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def demo(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import xpress_jax as xj

    dtype = jnp.dtype(args.dtype)
    cfg = xj.HeadConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, block_size=args.block, rank=args.rank,
        mlp_hidden=args.mlp, topc=args.topc, num_passes=args.passes, max_num_reqs=max(args.n, 1),
    )
    key = jax.random.key(args.seed)
    kp, kl, kh, ka = jax.random.split(key, 4)
    # Weights strong enough that refinement changes many of the drafter's tokens.
    params = xj.init_params(cfg, kp, dtype=dtype, std=args.std)
    N, B, V = args.n, cfg.block_size, cfg.vocab_size
    logits = (jax.random.normal(kl, (N, B, V), jnp.float32) * 2).astype(dtype)
    h = jax.random.normal(kh, (N, B, cfg.hidden_size), jnp.float32).astype(dtype)
    anchors = jax.random.randint(ka, (N,), 0, V, jnp.int32)
    refine = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)
    # Pallas kernels only compile for GPUs; on a CPU they run in (slow) interpret mode.
    interpret = args.backend.startswith("pallas") and jax.default_backend() == "cpu"
    drafter = np.asarray(jnp.argmax(logits[:, 1:], axis=-1))

    print(f"xpress demo: V={V} H={cfg.hidden_size} B={B} r={cfg.rank} M={cfg.mlp_hidden} "
          f"C={cfg.topc} K={cfg.num_passes} N={N} dtype={dtype.name} backend={args.backend}"
          f"{' (interpret mode)' if interpret else ''}")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind})")
    print()
    print(f"{'mode':<12} {'K':>3} {'compile s':>10} {'call ms':>9} {'tokens changed vs drafter':>27}")
    ok = True
    for mode, topc in (("full-vocab", 0), (f"top-{cfg.topc}", cfg.topc)):
        if mode.startswith("top") and topc == 0:
            continue
        kw = dict(num_passes=cfg.num_passes, topc=topc, config=cfg, backend=args.backend, interpret=interpret)
        t0 = time.perf_counter()
        out = refine(params, logits, h, anchors, **kw).block_until_ready()
        compile_s = time.perf_counter() - t0
        ms = _median_ms(lambda: refine(params, logits, h, anchors, **kw), args.reps)
        changed = float(np.mean(np.asarray(out) != drafter))
        print(f"{mode:<12} {cfg.num_passes:>3} {compile_s:>10.2f} {ms:>9.2f} {changed:>26.1%}")

    # Fixed point: with K >= B-1 full-vocab passes the block is the sequential greedy decode,
    # so one more pass changes nothing.
    kw = dict(topc=0, config=cfg, backend=args.backend, interpret=interpret)
    a = np.asarray(refine(params, logits, h, anchors, num_passes=B - 1, **kw))
    b = np.asarray(refine(params, logits, h, anchors, num_passes=B, **kw))
    same = bool(np.array_equal(a, b))
    ok &= same
    print()
    print(f"fixed point: full vocab K=B-1={B - 1} vs K={B}: {'identical' if same else 'DIFFERENT'} "
          f"({int(np.sum(a != b))} of {a.size} tokens differ)")
    early = np.asarray(refine(params, logits, h, anchors, num_passes=cfg.num_passes, **kw))
    settled = bool(np.array_equal(early[:, : cfg.num_passes], a[:, : cfg.num_passes]))
    ok &= settled
    print(f"after K={cfg.num_passes} passes slots 1..{cfg.num_passes} are final: {'yes' if settled else 'NO'}; "
          f"slots still moving after K: {int(np.sum(early != a))} of {a.size}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xpress", description="XPress refiner head in JAX.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="build a synthetic head and drafter logits, run the jitted refine, report")
    d.add_argument("--vocab", type=int, default=32000)
    d.add_argument("--hidden", type=int, default=1024)
    d.add_argument("--block", type=int, default=16)
    d.add_argument("--rank", type=int, default=256)
    d.add_argument("--mlp", type=int, default=512)
    d.add_argument("--topc", type=int, default=512)
    d.add_argument("--passes", type=int, default=6)
    d.add_argument("--n", type=int, default=4, help="blocks per call")
    d.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    d.add_argument("--std", type=float, default=0.05, help="weight std of the synthetic head")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--reps", type=int, default=5)
    d.add_argument("--backend", default="auto", choices=["auto", "xla", "pallas"])
    args = parser.parse_args(argv)
    try:
        return demo(args)
    except (ValueError, TypeError) as e:
        print(f"xpress demo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
