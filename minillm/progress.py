"""Progress of long passes over data: a live bar on a terminal, plain lines otherwise.

Offers `ByteProgress`, which shows a rate in MB/s and an ETA (used by minillm.shards).
"""

from __future__ import annotations

import time

from rich.console import Console

PLAIN_EVERY_S = 10.0  # seconds between progress lines when stdout is not a terminal


class ByteProgress:
    """A rich bar with MB/s and ETA on a terminal; otherwise a plain line every few seconds.

    `done` counts the units of `total` (bytes, documents, ...), `nbytes` the bytes behind them,
    so the rate is MB/s whatever the bar counts.
    """

    def __init__(self, console: Console, description: str, total: int) -> None:
        self.console, self.description, self.total = console, description, max(total, 1)
        self.done = self.nbytes = 0
        self.start = self.last_line = time.perf_counter()
        self.bar = None
        if console.is_terminal:
            from rich.progress import (
                BarColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                console=console,
            )
            self.task = self.bar.add_task(description, total=self.total, rate="")
            self.bar.start()

    def rate(self) -> float:
        """MB/s so far (MB = 10^6 bytes)."""
        return self.nbytes / 1e6 / max(time.perf_counter() - self.start, 1e-9)

    def update(self, done: int, nbytes: int) -> None:
        self.done, self.nbytes = done, nbytes
        if self.bar is not None:
            self.bar.update(self.task, completed=done, rate=f"{self.rate():.1f} MB/s")
            return
        now = time.perf_counter()
        if now - self.last_line >= PLAIN_EVERY_S:
            self.last_line = now
            eta = (now - self.start) / max(done, 1) * (self.total - done)
            print(
                f"{self.description}: {100 * done / self.total:.0f}%  {nbytes / 1e6:.1f} MB  "
                f"{self.rate():.1f} MB/s  eta {eta:.0f}s",
                flush=True,
            )

    def describe(self, description: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=description)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
