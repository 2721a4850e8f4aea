"""`python -m benchmarks.bench_refine --small` (its help: "smoke test on CPU") runs on a CPU and streams results."""

from __future__ import annotations

import json

import jax


def test_bench_refine_small_runs_on_cpu_and_writes_as_it_goes(tmp_path, capsys):
    from benchmarks import bench_refine

    if jax.default_backend() != "cpu":
        import pytest

        pytest.skip("the CPU smoke path: on a GPU bench_refine runs the full sweep")
    bench_refine.main(["--small", "--n", "1", "--reps", "1", "--walls", "1", "--no-select", "--out", str(tmp_path)])
    lines = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    kinds = [x["kind"] for x in lines]
    assert kinds[0] == "meta" and kinds.count("refine") == 2  # top-64 and full vocab, XLA backend off a GPU
    rows = [x for x in lines if x["kind"] == "refine"]
    assert {r["backend"] for r in rows} == {"xla"} and all(r["device_us"] > 0 and r["wall_us"] > 0 for r in rows)
    assert (tmp_path / "bench.json").exists() and "| top-64 | 1 |" in (tmp_path / "bench.md").read_text()
    assert "results stream to" in capsys.readouterr().out
