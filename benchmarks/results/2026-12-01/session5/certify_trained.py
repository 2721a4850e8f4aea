"""Issue 14 on a trained head: does the certified mode's bound certify the rows of a head trained by
`xpress_jax.train` on the embedded task (`xpress_jax.toy`), and with how many candidates?

Part 2 evaluates the study's tighter bounds (`xpress_jax.exact.certified_full_vocab_pick`: block
centroid + radius, then a per-id int8 or 4-bit copy of w2 with the id's own base logit) on the latents
of the last pass (the block after K-1 scan passes).

For each task size, a head is trained (optax, the demo's settings), and an untrained head of the same
shape (std 0.1, what `examples/serving_step.py --smoke` uses) is the contrast. On one batch of eval
blocks, K = B-1 passes, full vocabulary: the scan's tokens, then `full_vocab=Certified(candidates=C,
scan_blocks=N-1)` (failing rows are scanned, never a fallback) with its stats, for each C. Prints a table;
writes certify_trained.json. CPU (XLA backend), float32 and bfloat16 heads.

    PYTHONPATH=$PWD python benchmarks/results/2026-12-01/session5/certify_trained.py [V ...]
"""
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import xpress_jax as xj
from xpress_jax import reference
from xpress_jax.exact import Certified, certified_full_vocab_pick, prepare_exact
from xpress_jax.head import hidden_input
from xpress_jax.toy import ToyConfig, ToyTask, accepted_length
from xpress_jax.train import TrainConfig, train

OUT = os.environ.get("OUT", os.path.dirname(os.path.abspath(__file__)))
N = 512
res = []
for V in [int(a) for a in sys.argv[1:]] or [64, 256]:
    task = ToyTask(ToyConfig(vocab_size=V, block_size=8))
    cfg = task.head_config(rank=32, mlp_hidden=64, topc=0, max_num_reqs=N)
    t0 = time.time()
    tr = train(cfg, task.tables, ToyTask.sample, TrainConfig(steps=1500, batch_size=256, warmup_steps=150, seed=0),
               progress=False)
    train_s = time.time() - t0
    heads = {"trained": tr.model.to_serving(), "untrained std 0.1": xj.init_head(cfg, jax.random.key(1), std=0.1)}
    batch = ToyTask.sample(task.tables, jax.random.key(1234), N)
    drafter = float(jnp.mean(accepted_length(task.drafter_tokens(batch), batch.target)))
    for hname, head32 in heads.items():
        for dtype in (jnp.float32, jnp.bfloat16):
            head = head32.astype(dtype)
            logits, h = batch.logits.astype(dtype), batch.h.astype(dtype)
            run = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)
            scan = np.asarray(run(head, logits, h, batch.anchors, batch.prev_ids, topc=0, backend="xla"))
            acc = float(jnp.mean(accepted_length(scan, batch.target)))
            changed = float(np.mean(scan != np.asarray(task.drafter_tokens(batch))))
            # the last pass's latents: the block after K-1 scan passes
            K = cfg.num_passes
            prevk = np.asarray(run(head, logits, h, batch.anchors, batch.prev_ids, topc=0, backend="xla",
                                   num_passes=K - 1))
            blk = jnp.concatenate([batch.anchors[:, None], jnp.asarray(prevk)], axis=1)
            lat = reference.latent_pass(head.params, hidden_input(head.params, h), blk, batch.prev_ids)
            lat = lat.reshape(-1, lat.shape[-1])
            base = reference.draft_rows(logits)
            w2 = head.params["w2"]
            preps = {bits: prepare_exact(w2, block=max(8, V // 16), bits=bits) for bits in (8, 4)}
            for c in (1, 2, 4, 8, 16, 32, 64):
                if c >= V:
                    continue
                tight = {}
                for bits, prep in preps.items():
                    tok_e, est = jax.jit(certified_full_vocab_pick, static_argnames="candidates")(
                        base, lat, w2, prep, candidates=c)
                    want = reference.full_vocab_pick(base, lat, w2)
                    tight[f"int{bits}"] = dict(rows_certified=round(float(est.rows_certified), 4),
                                               blocks_excluded=round(float(est.blocks_excluded), 4),
                                               ids_exact_scanned=round(float(est.ids_exact_scanned), 5),
                                               violations=int(est.violations),
                                               differ=int(np.sum(np.asarray(tok_e) != np.asarray(want))))
                cert = Certified(candidates=c, scan_blocks=N - 1)
                tok, st = run(head, logits, h, batch.anchors, batch.prev_ids, topc=0, backend="xla",
                              full_vocab=cert, return_stats=True)
                r = dict(V=V, head=hname, dtype=jnp.dtype(dtype).name, C=c, accepted=round(acc, 3),
                         drafter=round(drafter, 3), changed=round(changed, 3),
                         differ=int(np.sum(np.asarray(tok) != scan)),
                         **{k: round(float(v), 4) for k, v in st._asdict().items()},
                         train_s=round(train_s, 1), final_loss=round(float(tr.history[-1]["loss"]), 4),
                         last_pass=tight)
                res.append(r)
                print(r, flush=True)
json.dump(res, open(os.path.join(OUT, "certify_trained.json"), "w"), indent=1)
print("\n| V | head | dtype | accepted (drafter) | tokens changed by refine | " + " | ".join(
    f"C={c}" for c in (1, 2, 4, 8, 16, 32, 64)) + " |")
keys = sorted({(r["V"], r["head"], r["dtype"]) for r in res}, key=lambda k: (k[0], k[1] != "trained", k[2]))
for k in keys:
    rows = {r["C"]: r for r in res if (r["V"], r["head"], r["dtype"]) == k}
    first = next(iter(rows.values()))
    cells = [f"{rows[c]['rows_certified']:.1%}" + (f" ({rows[c]['differ']} differ)" if rows[c]["differ"] else "")
             if c in rows else "-" for c in (1, 2, 4, 8, 16, 32, 64)]
    print(f"| {k[0]} | {k[1]} | {k[2]} | {first['accepted']} ({first['drafter']}) | {first['changed']:.0%} | "
          + " | ".join(cells) + " |")
print("\nLast pass, rows certified by block centroid + int8 per id / block centroid + 4-bit per id:")
print("| V | head | dtype | " + " | ".join(f"C={c}" for c in (1, 2, 4, 8, 16, 32, 64)) + " |")
for k in keys:
    rows = {r["C"]: r for r in res if (r["V"], r["head"], r["dtype"]) == k}
    cells = [f"{rows[c]['last_pass']['int8']['rows_certified']:.1%} / {rows[c]['last_pass']['int4']['rows_certified']:.1%}"
             if c in rows else "-" for c in (1, 2, 4, 8, 16, 32, 64)]
    print(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells) + " |")
print("violations:", sum(v["violations"] for r in res for v in r["last_pass"].values()),
      "; tokens differing from the oracle:", sum(v["differ"] for r in res for v in r["last_pass"].values()))
