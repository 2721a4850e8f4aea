"""`python -m benchmarks.bench_kernels --small` runs every step, both implementations, on a CPU."""

from __future__ import annotations

import json

import jax
import pytest


@pytest.mark.slow
def test_bench_kernels_small_runs_every_step(tmp_path):
    from benchmarks import bench_kernels

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU smoke path (interpret mode)")
    bench_kernels.main(["--small", "--n", "1", "--chain", "1", "--reps", "1", "--out", str(tmp_path)])
    lines = [json.loads(x) for x in (tmp_path / "kernels.jsonl").read_text().splitlines()]
    got = {(x["step"], x["impl"]) for x in lines if x["kind"] == "kernel"}
    assert got == {(s, i) for s in bench_kernels.STEPS for i in ("pallas", "xla")}
    assert "| topc | 1 |" in (tmp_path / "kernels.md").read_text()
