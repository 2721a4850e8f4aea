"""pytest hooks and fixtures of the suite (markers, skips, crash reruns, the end-of-run skip line). The numeric
helpers (small heads and inputs, oracles, compile counting) are in helpers.py."""

from __future__ import annotations

import os
import warnings

# On a GPU, `pytest -n 2` runs two processes on one device: without this each would preallocate
# 75% of its memory and the second would run out. Read when the backend starts (lazily, later).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _cpu_only_jax() -> bool:
    import importlib.util

    return not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins"))


# On a CPU-only install, compile the tests' XLA programs without LLVM's optimisation passes: the
# suite's cost is mostly compiling interpret-mode kernels (one ~1 s compile per shape and config,
# each run on tiny inputs), and -O0 cuts that by about a quarter. Results are the same: XLA's CPU
# code is IEEE either way (no fast-math), only slower to run. XPRESS_TEST_XLA_OPT=1, or an
# optimisation level already in XLA_FLAGS, keeps XLA's default. Read when the backend starts.
if (_cpu_only_jax() and os.environ.get("XPRESS_TEST_XLA_OPT") != "1"
        and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax
import pytest

import xpress_jax as xj

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


# --- The `slow` marker: expensive sweeps (e.g. the 961-row side of a dispatch boundary) -------
# Skipped by default; run them with `-m slow` (only them) or XPRESS_SLOW=1 (everything).


#: Where the processes of one CPU run share their compiled programs (set by the first process, read by its xdist
#: workers).
_SHARED_CACHE = "XPRESS_TEST_COMPILATION_CACHE"


def _share_compiled_programs(config) -> None:
    """On a CPU-only install, the xdist workers of one run share XLA's compiled programs through JAX's persistent
    compilation cache in a temporary folder of that run: most of the suite's time is compiling, and both workers
    compile many of the same programs (a module's fixtures, the small heads). Off by XPRESS_TEST_SHARED_CACHE=0, and
    on a GPU machine (there the compiled kernels are what is tested)."""
    if not _cpu_only_jax() or os.environ.get("XPRESS_TEST_SHARED_CACHE") == "0":
        return
    if not hasattr(config, "workerinput"):  # the run's first process: its folder, which the workers inherit
        import tempfile

        os.environ[_SHARED_CACHE] = tempfile.mkdtemp(prefix="xpress-test-cache-")
    folder = os.environ.get(_SHARED_CACHE)
    if folder:
        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    _share_compiled_programs(config)
    config.addinivalue_line("markers", "slow: expensive sweep, skipped unless `-m slow` or XPRESS_SLOW=1")
    config.addinivalue_line("markers", "interpret: runs Pallas kernels in interpret mode (on the host CPU device)")
    config.addinivalue_line("markers", "interpret_refine: compares refine(backend='pallas', interpret=True) with "
                            "the XLA backend; CPU only (refine lowers for JAX's default backend)")


@pytest.fixture(autouse=True, scope="module")
def _compile_caches_per_module(request):
    """Drop JAX's compiled programs after each test module when the slow cases run: a worker that runs the whole
    slow suite would otherwise keep every executable, and their memory mappings, until the kernel's mapping limit
    (vm.max_map_count) stops XLA's CPU compiler ("Cannot allocate memory"). The default suite keeps them (each
    module then reuses the small programs the others compiled)."""
    yield
    if os.environ.get("XPRESS_SLOW") == "1" or "slow" in (request.config.getoption("markexpr", "") or ""):
        jax.clear_caches()


@pytest.fixture(autouse=True)
def _interpret_mode_on_the_cpu_device(request):
    """Interpret-mode tests run on the host's CPU device, also on a GPU machine.

    They stand in for the compiled kernels where there is no GPU. On a GPU, XLA would compile the
    interpreted kernel body for the GPU and drop its ``f32 -> bf16 -> f32`` roundings
    (``xla_allow_excess_precision``): the test would then check XLA's fusion choices, not the
    kernel. There the compiled twins (``Test*`` classes without ``Interpret``) test the kernels.
    Applies to classes with ``INTERPRET = True`` and tests marked ``interpret``. Tests marked
    ``interpret_refine`` skip off a CPU: `refine` picks GPU lowerings (the readout dot's output
    dtype, unrolled passes) from JAX's default backend, so on a GPU machine the XLA side of such a
    comparison is not the CPU oracle; there `test_kernel_shapes.py`'s compiled refine tests run.
    """
    if request.node.get_closest_marker("interpret_refine") and jax.default_backend() != "cpu":
        pytest.skip("CPU only: an interpret-mode refine comparison (the compiled refine is tested on the GPU)")
    cls = request.cls
    interp = bool(cls is not None and getattr(cls, "INTERPRET", False)) or request.node.get_closest_marker("interpret")
    if interp and jax.default_backend() != "cpu":
        with jax.default_device(jax.devices("cpu")[0]):
            yield
    else:
        yield


#: A test whose xdist worker crashes (a segfault) runs once more, on a fresh worker. Seen only inside XLA's
#: CPU compiler of jaxlib 0.10.2 (`backend_compile_and_load`), intermittently, in different tests each time
#: (test_token_table, test_train), about one run in three of the whole suite; the same test passed when run
#: again. A test that crashes twice fails; every rerun is listed at the end of the run and shows as "R".
CRASH_RERUNS = 1
_crash_reruns: dict[str, int] = {}


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """pytest-xdist (controller): reschedule a crashed test up to `CRASH_RERUNS` times."""
    if _crash_reruns.get(crashitem, 0) < CRASH_RERUNS:
        _crash_reruns[crashitem] = _crash_reruns.get(crashitem, 0) + 1
        sched.mark_test_pending(crashitem)
        report.outcome = "rerun"


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})


_SKIP_LINE = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter):
    for nodeid, n in sorted(_crash_reruns.items()):
        terminalreporter.write_line(f"worker crashed, test run again ({n}x): {nodeid}", yellow=True)
    reasons = [rep.longrepr[2] for rep in terminalreporter.stats.get("skipped", [])
               if isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3]
    if reasons:  # written after pytest's own final line (pytest_unconfigure)
        terminalreporter.config.stash[_SKIP_LINE] = skip_summary(reasons)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and os.environ.get(_SHARED_CACHE):
        import shutil

        shutil.rmtree(os.environ.pop(_SHARED_CACHE), ignore_errors=True)
    line = config.stash.get(_SKIP_LINE, None)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter is not None:
        reporter.write_line(line)


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection reads the markers
def pytest_collection_modifyitems(config, items):
    if os.environ.get("XPRESS_SLOW") == "1" or "slow" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="slow sweep: run with `-m slow` or XPRESS_SLOW=1")
    for item in items:
        if any(_slow_here(m, item) for m in item.iter_markers("slow")):
            item.add_marker(skip)


def _slow_here(mark, item) -> bool:
    """`slow(interpret_only=True)` on a kernel class's method slows only its interpret twin
    (``INTERPRET = True``): the compiled twin, run on a GPU, is cheap and stays in the fast suite."""
    return not mark.kwargs.get("interpret_only") or bool(getattr(item.cls, "INTERPRET", True))


#: The end-of-run summary's skip categories: (pattern in the reason, label), the first match wins. A
#: reason starts with its category: "slow sweep: ...", "newer JAX: ...", "GPU only: ...", "needs torch: ...",
#: "CPU only: ...".
SKIP_CATEGORIES = (("slow sweep", "slow sweeps (run with -m slow)"), ("newer JAX", "need a newer JAX"), ("GPU", "GPU only"),
                   ("CUDA", "GPU only"), ("compiled kernel", "GPU only"), ("torch", "need torch"), ("CPU", "CPU only"))


def skip_summary(reasons: list[str]) -> str:
    """One line: how many tests were skipped for what, grouped by category, largest first."""
    counts: dict[str, int] = {}
    for reason in reasons:
        reason = reason.removeprefix("Skipped: ")
        label = next((lab for pat, lab in SKIP_CATEGORIES if pat in reason), reason.split(":")[0].strip())
        counts[label] = counts.get(label, 0) + 1
    return "skipped: " + ", ".join(f"{n} {label}" for label, n in sorted(counts.items(), key=lambda kv: -kv[1]))


# The numeric helpers live in helpers.py; re-exported for test files that still import them from here.
from helpers import (  # noqa: E402,F401
    COMPILES, SMALL, TRITON_CALL, chi2, lower_triton, make_head, make_inputs, near_tie_rows, nonfinite_pick_inputs,
    pick_inputs, run_on_host_devices, sequential_greedy, serving, to_f64, triton_operand_counts, triton_operands,
    with_columns,
)


@pytest.fixture
def small_cfg():
    return xj.HeadConfig(**SMALL)
