"""The README's main command, `xpress demo`, on a small head: report printed, checks pass."""

from __future__ import annotations

import subprocess
import sys


def test_xpress_demo_small_both_backends():
    for backend in ("xla", "pallas"):
        cmd = [sys.executable, "-m", "xpress_jax.cli", "demo", "--vocab", "999", "--hidden", "32", "--block", "6",
               "--rank", "32", "--mlp", "48", "--topc", "40", "--passes", "3", "--n", "2", "--reps", "1",
               "--backend", backend]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        text = out.stdout
        assert "full-vocab" in text and "top-40" in text
        assert "fixed point" in text and "identical" in text
        assert text.strip().endswith("OK")


def test_xpress_demo_rejects_bad_sizes():
    cmd = [sys.executable, "-m", "xpress_jax.cli", "demo", "--vocab", "10", "--topc", "20"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "topc" in out.stderr
