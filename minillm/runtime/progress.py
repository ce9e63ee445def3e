"""The one progress display of long passes: a live bar on a terminal, plain lines otherwise.

Offers `Progress`, used by tokenizing (bytes, with MB/s), evaluation (batches) and training
(steps, with the loss and throughput of the last log).
"""

from __future__ import annotations

import math
import sys
import time

from rich.console import Console

PLAIN_EVERY_S = 10.0  # seconds between progress lines when the output is not a terminal


class Progress:
    """A rich bar with an info column and an ETA on a terminal; otherwise a plain line every
    PLAIN_EVERY_S seconds (or when `update(..., line=True)` asks for one).

    `done` counts the units of `total` (bytes, documents, batches, steps); `nbytes`, when given,
    the bytes behind them, so that the rate is MB/s whatever the bar counts. `total=None`: unknown
    (a stream): the count and the rate, with no percentage or ETA. `stderr=True` keeps stdout
    clean (for `--json`).
    """

    def __init__(
        self,
        description: str,
        total: int | None,
        console: Console | None = None,
        *,
        start: int = 0,
        enabled: bool = True,
        stderr: bool = False,
    ) -> None:
        self.console = console or Console(stderr=stderr, highlight=False)
        self.description = description
        self.total = None if total is None else max(total, 1)
        self.done, self.start_done, self.nbytes, self.info = start, start, 0, ""
        self.enabled = enabled and (total is None or total > 0)
        self.file = sys.stderr if stderr else sys.stdout
        self.start = self.last_line = time.perf_counter()
        self.bar = None
        if self.enabled and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            known = self.total is not None  # else a pulsing bar, the count and the time so far
            # Descriptions and info are text (task names, losses), not markup: `[ab]` stays.
            self.bar = RichProgress(
                TextColumn("{task.description}", markup=False),
                BarColumn(),
                TaskProgressColumn() if known else MofNCompleteColumn(),
                TextColumn("{task.fields[info]}", markup=False),
                TimeRemainingColumn() if known else TimeElapsedColumn(),
                console=self.console,
            )
            self.task = self.bar.add_task(description, total=self.total, info="", completed=start)
            self.bar.start()

    def rate(self) -> float:
        """MB/s so far (MB = 10^6 bytes)."""
        return self.nbytes / 1e6 / max(time.perf_counter() - self.start, 1e-9)

    def eta(self) -> float:
        """Seconds left at the pace so far."""
        done = self.done - self.start_done
        if self.total is None:
            return float("inf")
        elapsed = time.perf_counter() - self.start
        return elapsed / done * (self.total - self.done) if done > 0 else float("inf")

    def update(
        self, done: int, nbytes: int | None = None, info: str | None = None, line: bool = False
    ) -> None:
        self.done = done
        if nbytes is not None:
            self.nbytes = nbytes
            info = f"{self.rate():.1f} MB/s" if info is None else info
        if info is not None:
            self.info = info
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=done, info=self.info)
            return
        now = time.perf_counter()
        if line or now - self.last_line >= PLAIN_EVERY_S:
            self.last_line = now
            size = f"  {self.nbytes / 1e6:.1f} MB" if self.nbytes else ""
            info = f"  {self.info}" if self.info else ""
            if self.total is None:
                count = f"{done}"
                eta = f"  {format_duration(time.perf_counter() - self.start)} so far"
            else:
                count = f"{done}/{self.total} ({100 * done / self.total:.0f}%)"
                eta = f"  eta {format_duration(self.eta())}"
            print(f"{self.description}: {count}{size}{info}{eta}", file=self.file, flush=True)

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def describe(self, description: str) -> None:
        """Change the text shown on the bar (its `description` stays what it was made with)."""
        if self.bar is not None:
            self.bar.update(self.task, description=description)

    def print(self, message: str) -> None:
        """A line above the bar (or a plain line), as text: a sample's `[b]` is not markup."""
        if self.bar is not None:
            self.bar.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def format_duration(seconds: float) -> str:
    """1h02m or 3m05s; '?' when unknown."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
