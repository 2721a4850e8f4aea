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
    assert all(r["wall_np_us"] > 0 and r["wall_host_us"] > 0 for r in rows)  # to numpy: device / pinned-host output
    assert (tmp_path / "bench.json").exists() and "| top-64 | 1 |" in (tmp_path / "bench.md").read_text()
    assert "results stream to" in capsys.readouterr().out


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
        pytest.skip("the CPU smoke path")
    bench_refine.main(["--small", "--n", "1", "--topc", "64,0", "--backends", "xla,xla@certified-c256", "--wall-only",
                       "--walls", "1", "--no-select", "--out", str(tmp_path)])
    rows = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    cert = [r for r in rows if r.get("backend") == "xla@certified-c256"]
    assert len(cert) == 1 and cert[0]["topc"] == 0 and cert[0]["agree"] == 1.0
    assert 0 <= cert[0]["rows_certified"] <= 1 and "passes_full_scan" in cert[0]
