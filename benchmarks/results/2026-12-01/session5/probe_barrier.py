"""Issue 16 probe: can Pallas-Triton programs meet at a grid-wide barrier (atomic counter spin), and what
does one barrier cost on an H200? Correctness: each stage every program writes a vector, meets the
barrier, reads its neighbour's vector; a stale read shows as a wrong final value."""
import sys; sys.path.insert(0, ".")
import json, os, statistics, time
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from xpress_jax.kernels.common import compiler_params, lower_triton

W = 32
LIMIT = 200000

def make(G, S, arrive_sync=True):
    def kern(cnt_in, x_ref, cnt_ref, y_ref, o_ref):
        pid = pl.program_id(0)
        lane = lax.broadcasted_iota(jnp.int32, (W,), 0)
        val = x_ref[pid, :]
        def barrier(s):
            if arrive_sync:
                plt.debug_barrier()
            plt.atomic_add(cnt_ref, (jnp.int32(0),), jnp.int32(1))
            target = (s + 1) * G
            def cond(c):
                return (c[0] < target) & (c[1] < LIMIT)
            def body(c):
                return plt.atomic_add(cnt_ref, (jnp.int32(0),), jnp.int32(0)), c[1] + 1
            c = lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0)))
            plt.debug_barrier()
            return c[1] >= LIMIT
        def stage(s, carry):
            val, bad = carry
            sl = lax.rem(s, jnp.int32(2))
            y_ref[sl, pid, :] = val
            to = barrier(s)
            nb = jnp.where(pid + 1 == G, jnp.int32(0), pid + 1)
            return y_ref[sl, nb, :] + 1, bad + to.astype(jnp.int32)
        val, bad = lax.fori_loop(0, S, stage, (val, jnp.int32(0)))
        o_ref[pid, :] = jnp.where(lane == 0, bad, val)
    f = pl.pallas_call(
        kern, name="probe_barrier", grid=(G,),
        out_shape=[jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((2, G, W), jnp.int32),
                   jax.ShapeDtypeStruct((G, W), jnp.int32)],

        input_output_aliases={0: 0},
        compiler_params=compiler_params(4, 1))
    def run(x):
        return f(jnp.zeros((1,), jnp.int32), x)[2]
    return run

def expected(x, S):
    G = x.shape[0]
    v = np.array(x)
    for s in range(S):
        v = np.roll(v, -1, axis=0) + 1
    return v

if __name__ == "__main__":
    if jax.devices()[0].platform == "cpu":
        for G, S in ((16, 3), (132, 24)):
            t = lower_triton(make(G, S), jax.ShapeDtypeStruct((G, W), jnp.int32)).as_text()
            print("lowered", G, S, len(t))
        sys.exit(0)
    OUT = os.environ.get("OUT", "/tmp/out")
    res = []
    for G in (4, 16, 66, 132):
        for S in (1, 24, 96):
            run = make(G, S)
            x = jnp.asarray(np.random.default_rng(G * 1000 + S).integers(0, 1000, (G, W)), jnp.int32)
            bad = 0
            for t in range(20):
                y = np.asarray(jax.jit(run)(x))
                e = expected(x, S)
                bad += int((y[:, 1:] != e[:, 1:]).sum()) + int(y[:, 0].sum()) * 1000
            M = 50
            @jax.jit
            def chain(x):
                return lax.fori_loop(0, M, lambda i, x: run(x) - S, x)
            chain(x).block_until_ready()
            ts = []
            for _ in range(7):
                t0 = time.perf_counter(); chain(x).block_until_ready(); ts.append((time.perf_counter() - t0) / M * 1e6)
            r = dict(G=G, S=S, bad=bad, us=round(statistics.median(ts), 2))
            print(r, flush=True); res.append(r)
    json.dump(res, open(f"{OUT}/barrier.json", "w"))
