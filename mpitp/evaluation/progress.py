"""Progress for batch logs: when stderr is not a terminal, a plain line every few seconds instead of a bar.

tqdm redraws its bar with carriage returns; in a scheduler's ``.err`` file that is hundreds of updates glued into one
line. :class:`LineProgress` has the same three calls as the bar (``add_total``, ``__call__``, ``close``) and writes
``mpitp: 120/158 requests (76%), 850 tok/s, 1m10s elapsed, ETA 0m22s`` at most every ``MPITP_PROGRESS_INTERVAL``
seconds (default 30), plus a last line when the evaluation ends.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO, TypeVar

_Bar = TypeVar("_Bar")

DEFAULT_INTERVAL = 30.0


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


class LineProgress:
    def __init__(self, interval: float | None = None, stream: TextIO | None = None):
        env = os.environ.get("MPITP_PROGRESS_INTERVAL")
        self.interval = interval if interval is not None else float(env) if env else DEFAULT_INTERVAL
        self.stream = stream or sys.stderr
        self.t0 = self.last = time.perf_counter()
        self.total = self.done = self.tokens = 0
        self.written = -1  # requests done at the last line written

    def add_total(self, n: int) -> None:
        self.total += n

    def __call__(self, n: int, tokens: int) -> None:
        self.done += n
        self.tokens += tokens
        if time.perf_counter() - self.last >= self.interval:
            self._write()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        eta = f", ETA {_clock((self.total - self.done) / rate)}" if rate > 0 and self.total > self.done else ""
        return (f"mpitp: {self.done}/{self.total} requests{pct}, {self.tokens / max(elapsed, 1e-9):.0f} tok/s, "
                f"{_clock(elapsed)} elapsed{eta}")

    def _write(self) -> None:
        self.last = time.perf_counter()
        self.written = self.done
        self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.done and self.written != self.done:
            self._write()


class TqdmProgress:
    """One tqdm bar on rank 0 across all DP groups."""

    def __init__(self):
        from tqdm import tqdm

        self.bar = tqdm(total=0, desc="mpitp", unit="req", dynamic_ncols=True, file=sys.stderr)
        self.t0 = time.perf_counter()
        self.tokens = 0

    def add_total(self, n: int) -> None:
        self.bar.total = (self.bar.total or 0) + n
        self.bar.refresh()

    def __call__(self, n: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.set_postfix_str(f"{self.tokens / max(1e-9, time.perf_counter() - self.t0):.0f} tok/s",
                                 refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()



def make_progress(bar_factory: Callable[[], _Bar]) -> _Bar | LineProgress:
    """The tqdm bar (``bar_factory()``) on a terminal, :class:`LineProgress` otherwise."""
    stream = sys.stderr
    return bar_factory() if getattr(stream, "isatty", lambda: False)() else LineProgress(stream=stream)
