"""`python -m benchmarks.bench_refine --small` (its help: "smoke test on CPU") runs on a CPU and streams results."""

from __future__ import annotations

import json

import jax
import pytest


@pytest.mark.slow
def test_bench_refine_small_runs_on_cpu_and_writes_as_it_goes(tmp_path, capsys):
    from benchmarks import bench_refine

    if jax.default_backend() != "cpu":
        pytest.skip("CPU only: the smoke path (on a GPU bench_refine runs the full sweep)")
    bench_refine.main(["--small", "--n", "1", "--topc", "64", "--reps", "1", "--walls", "1", "--no-select",
                       "--draft-vocab-size", "1024", "--out", str(tmp_path)])
    lines = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    kinds = [x["kind"] for x in lines]
    assert kinds[0] == "meta" and kinds.count("refine") == 1  # top-64, XLA backend off a GPU
    assert lines[0]["shape"]["draft_vocab_size"] == 1024  # a reduced head: logits and w2 over 1024 draft ids
    rows = [x for x in lines if x["kind"] == "refine"]
    assert {r["backend"] for r in rows} == {"xla"} and all(r["device_us"] > 0 and r["wall_us"] > 0 for r in rows)
    assert all(r["wall_np_us"] > 0 and r["wall_host_us"] > 0 for r in rows)  # to numpy: device / pinned-host output
    md = (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.json").exists() and "| top-64 | 1 |" in md and "V_draft=1024" in md
    assert "results stream to" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_refine_certified_backends(tmp_path):
    """``@certified[-c<C>][-s<S>]`` backends time refine(full_vocab=Certified(...)) at topc=0 only, agree with the
    first backend, and carry the call's certification stats; a bad spelling exits naming it."""
    import pytest

    from benchmarks import bench_refine
    from xpress_jax.exact import Certified

    assert bench_refine.certified_flag("certified") == Certified()
    assert bench_refine.certified_flag("certified-c2048-s4") == Certified(candidates=2048, scan_blocks=4)
    assert bench_refine.certified_flag("loop") is None
    with pytest.raises(SystemExit, match="certified-x3"):
        bench_refine.certified_flag("certified-x3")
    if jax.default_backend() != "cpu":
        pytest.skip("CPU only: the smoke path")
    bench_refine.main(["--small", "--n", "1", "--topc", "64,0", "--backends", "xla,xla@certified-c256", "--wall-only",
                       "--walls", "1", "--no-select", "--out", str(tmp_path)])
    rows = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    cert = [r for r in rows if r.get("backend") == "xla@certified-c256"]
    assert len(cert) == 1 and cert[0]["topc"] == 0 and cert[0]["agree"] == 1.0
    assert 0 <= cert[0]["rows_certified"] <= 1 and "passes_full_scan" in cert[0]


@pytest.mark.slow
def test_bench_refine_table_backends(tmp_path):
    """``@table`` (and ``-table`` after another flag) times refine with a prepared token table: the same tokens
    as the first backend, in both modes."""
    from benchmarks import bench_refine

    if jax.default_backend() != "cpu":
        pytest.skip("CPU only: the smoke path")
    bench_refine.main(["--small", "--n", "1", "--topc", "64,0", "--backends", "xla,xla@table,xla@certified-table",
                       "--wall-only", "--walls", "1", "--no-select", "--out", str(tmp_path)])
    rows = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    table = [r for r in rows if r.get("backend") == "xla@table"]
    assert sorted(r["topc"] for r in table) == [0, 64] and all(r["agree"] == 1.0 for r in table)
    cert = [r for r in rows if r.get("backend") == "xla@certified-table"]
    assert len(cert) == 1 and cert[0]["topc"] == 0 and cert[0]["agree"] == 1.0 and "rows_certified" in cert[0]


@pytest.mark.parametrize("std, topc", [(1.0, 0), pytest.param(0.02, 0, marks=pytest.mark.slow),
                                       pytest.param(1.0, 4, marks=pytest.mark.slow),
                                       pytest.param(0.02, 4, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_fixed_point_study_matches_refine_early_exit(tmp_path, std, topc):
    """benchmarks.fixed_point: a block's first unchanged pass, as the study finds it, is where refine's own
    early exit (one check per pass: the loop form) stops on that block alone. std 0.02: converges at once;
    1.0: keeps changing."""
    import numpy as np

    import xpress_jax as xj
    from benchmarks import fixed_point
    from xpress_jax.ops import Ops
    from xpress_jax.refine import prepare, resolve_call, run_passes
    from xpress_jax.toy import ToyConfig, ToyTask

    task = ToyTask(ToyConfig(vocab_size=16, block_size=5, hidden_size=8))
    cfg = task.head_config(rank=8, mlp_hidden=8, topc=4, num_passes=4)
    batch = ToyTask.sample(task.tables, jax.random.key(0), 6)
    head = xj.init_head(cfg, jax.random.key(1), std=std)
    first = fixed_point.block_fixed_pass(head, batch, 4, topc)
    x = (batch.logits[:1], batch.h[:1], batch.anchors[:1], batch.prev_ids[:1])
    p, _, k, c, _ = resolve_call(head, *x, topc=topc, unroll=False)
    one = jax.jit(lambda p, *x: run_passes(prepare(Ops.xla(), p, *x, k, c, False, early_exit=True,
                                                   return_passes=True))[1])
    for i in range(6):
        passes = one(p, *(a[i:i + 1] for a in (batch.logits, batch.h, batch.anchors, batch.prev_ids)))
        assert int(passes) == min(first[i], 4), (std, topc, i)
    runs = fixed_point.passes_run(np.array([1, 2, 3, 5, 5]), 1, 4, 200, np.random.default_rng(0))
    assert set(runs.tolist()) <= {2, 4}  # checks after passes 2 (N < 16), none after the last


@pytest.mark.slow
def test_fixed_point_cli_writes_its_report(tmp_path):
    """``python -m benchmarks.fixed_point`` trains a head (a few steps here) and writes fixed_point.json."""
    from benchmarks import fixed_point

    fixed_point.main(["--block-size", "5", "--num-passes", "3", "--steps", "4", "--blocks", "32", "--out",
                      str(tmp_path)])
    rep = json.loads((tmp_path / "fixed_point.json").read_text())
    hist = rep["heads"]["trained"]["full vocab"]["block_first_fixed_pass"]
    assert abs(sum(hist.values()) - 1) < 1e-9 and set(hist) == {"1", "2", "3", "4"}


@pytest.mark.slow
def test_serving_loop_small_runs_on_cpu(tmp_path):
    """`python -m benchmarks.serving_loop --small`: every kind runs, gives the same tokens, and the marginals are
    the steps minus the drafter-only step."""
    from benchmarks import serving_loop

    if jax.default_backend() != "cpu":
        pytest.skip("CPU only: the smoke path")
    serving_loop.main(["--small", "--n", "1", "--topc", "512,0", "--steps", "2", "--rounds", "1", "--reps", "1",
                       "--out", str(tmp_path)])
    rows = [json.loads(x) for x in (tmp_path / "serving_loop.jsonl").read_text().splitlines()]
    assert [r["topc"] for r in rows] == [17, 0] and all(r["same_tokens"] and r["device_us"] > 0 for r in rows)
    for r in rows:
        base = min(r["steps_us"]["drafter"])
        for k in serving_loop.KINDS[1:]:  # from the unrounded medians: within the rounding of three numbers
            assert abs(r["marginal_us"][k] - (min(r["steps_us"][k]) - base)) <= 0.16, (k, r)
    assert "| top-17 | 1 |" in (tmp_path / "serving_loop.md").read_text()
    with pytest.raises(SystemExit, match="--n values must lie in"):
        serving_loop.main(["--small", "--n", "0", "--out", str(tmp_path)])
