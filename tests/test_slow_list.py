"""tests/slow_list.txt names tests that exist, and each listed parametrized test keeps a fast case."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import slow_list

ROOT = Path(__file__).resolve().parent.parent


def _collected(*args: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                          "-p", "no:cacheprovider", *args, "tests"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def test_every_listed_test_exists_and_parametrized_ones_keep_a_fast_case():
    listed = slow_list()
    collected = _collected()
    missing = sorted(listed - collected)
    assert not missing, f"tests/slow_list.txt names tests that are not collected (renamed?): {missing}"
    # A parametrized test whose fast cases are all listed would leave its code path to the slow stage
    # only. `-m "not slow"` is the fast suite: the listed cases and those marked `slow` in the code are
    # out of it. The five single tests listed on purpose have no parameters.
    fast = {n.split("[")[0] for n in _collected("-m", "not slow")}
    thinned = {n.split("[")[0] for n in listed if "[" in n}
    lost = sorted(thinned - fast)
    assert not lost, f"no case of these parametrized tests is left in the fast suite: {lost}"
