"""A minimal stderr progress bar, drawn only on a terminal (logs and pipes see nothing)."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class Progress:
    """``with Progress(total, "reading") as bar: bar.update(n)``; a no-op unless enabled and on a TTY."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.total, self.desc, self.done = max(int(total), 1), desc, 0
        self._start = self._last = time.perf_counter()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._draw(force=True)
            sys.stderr.write("\n")

    def update(self, n: int) -> None:
        self.done += n
        self._draw()

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._last < 0.1):
            return
        self._last = now
        frac = min(self.done / self.total, 1.0)
        rate = human_bytes(self.done / max(now - self._start, 1e-9))
        bar = "#" * int(frac * 30) + "." * (30 - int(frac * 30))
        done = f"{human_bytes(self.done)}/{human_bytes(self.total)}"
        sys.stderr.write(f"\r{self.desc:<8} [{bar}] {frac:6.1%} {done} {rate}/s ")
        sys.stderr.flush()
