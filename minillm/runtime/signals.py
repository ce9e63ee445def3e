"""Signals for commands that stop by unwinding: `interrupting_on_signals`.

`train` installs its own handlers (minillm.runtime.device's StopSignal: checkpoint, then stop);
`tokenize` needs only that SIGINT and SIGTERM raise KeyboardInterrupt, so that its staged pass is
cleaned up or kept for a resume. Python installs its SIGINT handler only when SIGINT is not
ignored at startup: a process started by `nohup` or with `&` in a non-interactive shell inherits
SIG_IGN, and `kill -INT` would do nothing. This installs the handler whatever was inherited.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupting_on_signals() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM raise KeyboardInterrupt (each previous handler is restored on
    exit); off the main thread, where no handler can be set, signals are left alone."""
    old: dict[int, Any] = {}
    with contextlib.suppress(ValueError):  # not the main thread
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, _interrupt)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
