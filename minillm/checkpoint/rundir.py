"""The run directory's lock: one trainer at a time.

Offers `RunLock`. Which checkpoint a run resumes from, and what a resume may change, is the train
stage's policy (minillm.train.resume); this stage only stores and loads.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

from minillm.checkpoint import layout
from minillm.errors import UserError

LOCK_FILE = layout.LOCK_FILE


class RunLock:
    """An exclusive `flock` on <run>/train.lock, so two trainers never write the same run.

    The kernel drops the lock when its process dies (even by SIGKILL), so a lock left by a dead
    process is simply taken over; the file keeps the holder's pid and host for the message.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise UserError(
                    f"{self.path.parent}: another `minillm train` is using this run ({holder}); "
                    "wait for it or stop it"
                ) from None
            # The holder before us unlinks the file on release: if it did so between our open
            # and our flock, we hold a file no longer at self.path; open the new one instead.
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Drop the lock and remove its file: a run at rest holds no train.lock."""
        if self.fd is not None:
            # Unlinked while still held, so a process that opened the old file notices (above).
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
