"""tests/slow_list.txt names tests that exist, and each listed parametrized test keeps a fast case."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

from conftest import slow_list

ROOT = Path(__file__).resolve().parent.parent


def _collected() -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                          "-p", "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def test_every_listed_test_exists_and_parametrized_ones_keep_a_fast_case():
    listed = slow_list()
    collected = _collected()
    missing = sorted(listed - collected)
    assert not missing, f"tests/slow_list.txt names tests that are not collected (renamed?): {missing}"
    # A parametrized test whose every case is listed would leave its code path to the slow stage only;
    # the five single tests listed on purpose are not parametrized, or have one case.
    cases = collections.Counter(n.split("[")[0] for n in collected if "[" in n)
    listed_cases = collections.Counter(n.split("[")[0] for n in listed if "[" in n)
    whole = sorted(f for f, k in listed_cases.items() if k == cases[f] and k > 1)
    assert not whole, f"every case of these parametrized tests is in tests/slow_list.txt: {whole}"
