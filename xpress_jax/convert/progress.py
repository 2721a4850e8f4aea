"""A minimal stderr progress bar (no tqdm), drawn only on a terminal."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # unreachable


class Progress:
    """``with Progress(total, "reading") as bar: bar.update(n)``; a no-op when disabled.

    Enabled only when ``enabled`` is true and the stream is a TTY, so logs and
    pipes never see carriage returns. Thread-safe ``update``.
    """

    def __init__(self, total: int, desc: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(enabled) and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.total = max(int(total), 1)
        self.desc = desc
        self.done = 0
        self._last = 0.0
        self._start = time.perf_counter()
        self._lock = threading.Lock()

    def __enter__(self) -> "Progress":
        self._draw(force=True)
        return self

    def __exit__(self, *exc) -> None:
        self.close(ok=exc[0] is None)

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            self._draw()

    def set(self, done: int) -> None:
        with self._lock:
            self.done = done
            self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        frac = min(self.done / self.total, 1.0)
        width = 30
        fill = int(frac * width)
        rate = self.done / max(now - self._start, 1e-9)
        self.stream.write(
            f"\r{self.desc:<8} [{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}% "
            f"{human_bytes(min(self.done, self.total))}/{human_bytes(self.total)} {human_bytes(rate)}/s "
        )
        self.stream.flush()

    def close(self, ok: bool = True) -> None:
        if not self.enabled:
            return
        if ok:
            self.done = max(self.done, self.total)
        self._draw(force=True)
        self.stream.write("\n")
        self.stream.flush()
        self.enabled = False
