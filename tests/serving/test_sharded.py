"""`refine_sharded` on a mesh of forced CPU host devices == single-device `refine`, token for token.

The pytest process has already initialised JAX with one CPU device, so the checks run in a child
process started with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (this file, run as a
script). Meshes 4x1 (data), 1x4 (vocab) and 2x2; N = 3 (no axis divides it) and V = 301 (no axis
divides it); both modes (top-C with C = 1, 7 and V; full vocabulary); both backends (XLA and the
Pallas kernels in interpret mode); inputs with ties across shards (equal logits and equal w2 rows
on ids held by different devices, so membership at the C-th place and the pick's tie breaks cross
shards) and with non-finite logits (NaN, +-inf, a row of all -inf, a row of all NaN).

Sampled (``temperature``, ``key``, ``proposal``): the same tokens as one device for the same key, on every mesh
and both modes; the proposal's candidate ids equal, its values up to float rounding (XLA may sum a shard's smaller
products in another order).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

V, N = 301, 3
MESHES = ((4, 1), (1, 4), (2, 2))

# (mesh, topc, backend, dtype, inputs): `test_sharded_equals_single_device` (slow but for one 2x2 case: a child
# process on 4 host devices) covers each mesh, mode, backend, dtype and input kind at least once; `sweep` (slow)
# every C x input kind on every mesh.
FAST = [
    ((2, 2), 7, "pallas", "bfloat16", "ties"),
    ((4, 1), 0, "xla", "float32", "random"),
    ((1, 4), 7, "xla", "bfloat16", "nonfinite"),
    ((1, 4), 0, "pallas", "bfloat16", "ties"),
    ((2, 2), V, "xla", "float32", "ties"),
    ((1, 4), 1, "xla", "float32", "nonfinite"),
    ((2, 2), 0, "xla", "bfloat16", "nonfinite"),
]
KINDS = ("random", "ties", "nonfinite")


def sweep(mesh):
    """Every C x input kind on ``mesh`` once, backend and dtype alternating (12 cases; the full
    product of backends and dtypes too would be 48 per mesh, minutes of interpret-mode compiles)."""
    return [(mesh, c, ("xla", "pallas")[(i + k) % 2], ("float32", "bfloat16")[(i // 2 + k) % 2], kind)
            for i, c in enumerate((1, 7, V, 0)) for k, kind in enumerate(KINDS)]


def _run_child(cases):
    from helpers import run_on_host_devices

    out = run_on_host_devices([os.path.abspath(__file__), json.dumps(cases)])
    return json.loads(out.strip().splitlines()[-1])


# Variants (a sixth element): "make_mesh" builds the mesh with jax.make_mesh (Explicit axes: refine_sharded reshards
# its inputs), "reduced" runs a head with a reduced draft vocabulary (V_DRAFT of V, a d2t map: w1 and w2 split over
# different row counts, picks mapped to verifier ids).
V_DRAFT = 173
VARIANTS = [((2, 2), 7, "xla", "float32", "random", "make_mesh+reduced"),
            ((1, 4), 0, "pallas", "bfloat16", "ties", "reduced"),
            ((4, 1), 0, "xla", "bfloat16", "nonfinite", "make_mesh")]


@pytest.mark.interpret
@pytest.mark.parametrize("cases", [pytest.param(VARIANTS[:1], id="2x2-make_mesh-reduced"),
                                   pytest.param(FAST + VARIANTS[1:], id="every-kind", marks=pytest.mark.slow)])
def test_sharded_equals_single_device(cases):
    results = _run_child(cases)
    bad = [r for r in results if r["differ"]]
    assert not bad, bad
    assert all(r["changed"] > 0.2 for r in results if r["kind"] != "nonfinite"), "refinement changes too few tokens"


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_sharded_equals_single_device_sweep(mesh):
    results = _run_child(sweep(mesh))
    bad = [r for r in results if r["differ"]]
    assert not bad, bad


# (mesh, topc, backend, dtype, inputs, temperature, proposal): every mesh and mode at T > 0 and T = 0, N = 3 and
# V = 301 that no axis divides; a noise that lands on the wrong row or id changes most tokens.
SAMPLED = [
    ((2, 2), 0, "xla", "float32", "random", 1.0, "scores"),
    ((1, 4), 7, "xla", "bfloat16", "ties", 3.0, "scores"),
    ((4, 1), 7, "xla", "float32", "random", 1.3, "logprob"),
    ((1, 4), 0, "xla", "bfloat16", "nonfinite", 0.0, "logprob"),
    ((2, 2), V, "pallas", "float32", "ties", 2.0, None),
    ((1, 4), 0, "pallas", "bfloat16", "random", 0.5, "scores"),
    ((2, 2), 0, "xla", "float32", "random", 1.0, "scores", "make_mesh+reduced"),
    ((2, 2), 7, "xla", "float32", "ties", 0.7, "scores", "reduced"),
]


@pytest.mark.interpret
@pytest.mark.slow
@pytest.mark.parametrize("cases", [pytest.param(SAMPLED[:2], id="2x2-1x4"), pytest.param(SAMPLED[2:], id="more")])
def test_sharded_sampling_equals_single_device(cases):
    results = _run_child([["sample", *c] for c in cases])
    bad = [r for r in results if r["differ"] or r["proposal_differ"]]
    assert not bad, bad
    # The sampled tokens are not the greedy ones (T > 0), so the noise is in play.
    assert all(r["not_greedy"] > 0.2 for r in results if r["case"][5] > 0), results


@pytest.mark.interpret
@pytest.mark.slow
def test_kernels_run_per_shard():
    """Every pallas_call inside the sharded refine sees shard-sized operands: no [V, r] weight and no
    [N, B, V] logits reach a kernel (the kernels run per shard, never on gathered inputs)."""
    results = _run_child([["kernel-shapes"]])
    assert results["kernels"] >= 4, results  # selection, top-C pick, latent, full-vocab pick
    assert not results["whole"], results


# ----------------------------------------------------------------------------- the child process


def _inputs(cfg, kind, dtype, seed=0):
    import jax.numpy as jnp
    import numpy as np

    import xpress_jax as xj
    from helpers import make_head, make_inputs

    params = make_head(cfg, seed=seed)
    logits, h, anchors, prev = make_inputs(cfg, N, seed=seed + 1)
    lg = np.asarray(logits, np.float64)[..., :cfg.draft_vocab_size]
    if kind == "ties":
        # Integer logits: many equal values, also at the C-th place, on ids of every shard; w2 rows
        # repeat with period 7, so equal scores recur on ids held by different devices.
        lg = np.round(lg * 1.5)
        w2 = np.asarray(params["w2"])
        params["w2"] = jnp.asarray(w2[np.arange(w2.shape[0]) % 7])
    elif kind == "nonfinite":
        rng = np.random.default_rng(seed)
        mask = rng.random(lg.shape)
        lg[mask < 0.05] = np.nan
        lg[(mask > 0.05) & (mask < 0.08)] = -np.inf
        lg[mask > 0.995] = np.inf
        lg[0, 2] = -np.inf  # a row of all -inf
        lg[1, 3] = np.nan  # a row of all NaN
    logits = jnp.asarray(lg, dtype)
    params = {k: v if k == "d2t" else v.astype(dtype) for k, v in params.items()}
    return xj.Head(cfg, params), logits, h.astype(dtype), anchors, prev


def _mesh(shape, variant):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    if "make_mesh" in variant:  # Explicit axes by default
        return jax.make_mesh(shape, ("data", "model"))
    return Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))


def _check(case):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import xpress_jax as xj
    from xpress_jax.sharded import refine_sharded

    mesh_shape, topc, backend, dtype, kind, *variant = case
    variant = variant[0] if variant else ""
    cfg = xj.HeadConfig(vocab_size=V, hidden_size=16, block_size=5, rank=24, mlp_hidden=32, topc=topc or 1,
                        num_passes=3, draft_vocab_size=V_DRAFT if "reduced" in variant else None)
    head, logits, h, anchors, prev = _inputs(cfg, kind, jnp.dtype(dtype))
    interpret = backend == "pallas"
    want = np.asarray(xj.refine(head, logits, h, anchors, prev, topc=topc, backend=backend, interpret=interpret))
    mesh = _mesh(mesh_shape, variant)
    f = jax.jit(lambda *a: refine_sharded(*a, mesh=mesh, topc=topc, backend=backend, interpret=interpret))
    got = np.asarray(f(head, logits, h, anchors, prev))
    start = np.asarray(jnp.argmax(jnp.where(jnp.isnan(logits[:, 1:]), -jnp.inf, logits[:, 1:]), -1))
    if cfg.reduced:
        start = start + np.asarray(head.params["d2t"])[start]
    return dict(case=case, kind=kind, differ=int((got != want).sum()), changed=float((want != start).mean()))


def _check_sampled(case):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import xpress_jax as xj
    from xpress_jax.sharded import refine_sharded

    mesh_shape, topc, backend, dtype, kind, temp, proposal, *variant = case
    variant = variant[0] if variant else ""
    cfg = xj.HeadConfig(vocab_size=V, hidden_size=16, block_size=5, rank=24, mlp_hidden=32, topc=topc or 1,
                        num_passes=3, draft_vocab_size=V_DRAFT if "reduced" in variant else None)
    head, logits, h, anchors, prev = _inputs(cfg, kind, jnp.dtype(dtype))
    interpret = backend == "pallas"
    key = jax.random.key(11)
    kw = dict(topc=topc, backend=backend, interpret=interpret, proposal=proposal)
    want = xj.refine(head, logits, h, anchors, prev, temperature=temp, key=key, **kw)
    greedy = np.asarray(xj.refine(head, logits, h, anchors, prev, topc=topc, backend=backend, interpret=interpret))
    mesh = _mesh(mesh_shape, variant)
    # The temperature traced: one executable serves every T.
    f = jax.jit(lambda t, k, *a: refine_sharded(*a, mesh=mesh, temperature=t, key=k, **kw))
    got = f(jnp.float32(temp), key, head, logits, h, anchors, prev)
    want_tok, got_tok = (np.asarray(x[0] if proposal else x) for x in (want, got))
    proposal_differ = []
    if proposal:
        w, g = want[1], got[1]
        for name in ("token_score", "lse", "scores", "ids"):
            a, b = getattr(w, name), getattr(g, name)
            if a is None or b is None:
                if (a is None) != (b is None):
                    proposal_differ.append(name)
                continue
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)  # -inf and +inf must match exactly
            same = np.array_equal(a, b) if name == "ids" else np.allclose(a, b, rtol=1e-5, atol=1e-4)
            if a.shape != b.shape or not same:
                proposal_differ.append(name)
    return dict(case=case, differ=int((got_tok != want_tok).sum()), proposal_differ=proposal_differ,
                not_greedy=float((want_tok != greedy).mean()))


def _kernel_shapes():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import xpress_jax as xj
    from xpress_jax.sharded import refine_sharded

    out = {"kernels": 0, "whole": []}
    for topc in (7, 0):
        cfg = xj.HeadConfig(vocab_size=V, hidden_size=16, block_size=5, rank=24, mlp_hidden=32, topc=topc or 1)
        head, logits, h, anchors, prev = _inputs(cfg, "random", jnp.bfloat16)
        mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
        jaxpr = jax.make_jaxpr(lambda *a: refine_sharded(*a, mesh=mesh, topc=topc, backend="pallas", interpret=True))(
            head, logits, h, anchors, prev)

        def walk(jp):
            for eqn in jp.eqns:
                if eqn.primitive.name == "pallas_call":
                    out["kernels"] += 1
                    for v in eqn.invars:
                        shape = tuple(getattr(v.aval, "shape", ()))
                        # whole vocabulary (V, or V padded to 2 shards), or all blocks' rows (N*B, padded
                        # N*B, N*(B-1), padded N*(B-1)) instead of one device's 2 blocks
                        if {V, V + 1} & set(shape) or (shape and shape[0] in (15, 20, 12, 16)):
                            out["whole"].append(shape)
                for p in eqn.params.values():
                    for j in (p if isinstance(p, (list, tuple)) else [p]):
                        if hasattr(j, "eqns"):
                            walk(j)
                        elif hasattr(getattr(j, "jaxpr", None), "eqns"):
                            walk(j.jaxpr)

        walk(jaxpr.jaxpr)
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    cases = json.loads(sys.argv[1])
    if cases == [["kernel-shapes"]]:
        print(json.dumps(_kernel_shapes()))
    elif cases and cases[0][0] == "sample":
        print(json.dumps([_check_sampled(c[1:]) for c in cases]))
    else:
        print(json.dumps([_check(c) for c in cases]))
