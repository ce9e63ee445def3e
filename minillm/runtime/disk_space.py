"""A full disk met while writing, made one line that names the folder and the space needed.

Offers `is_disk_full` (an OSError ENOSPC/EDQUOT, torch.save's RuntimeError on a short write,
safetensors' error for either, or a `DiskFullError`), `full_disk_error` (the `DiskFullError` to
raise), `raise_if_disk_full` (called in a writer's `except` after its cleanup: raises that error
for a full disk), `free_bytes` and `human_bytes`. minillm.runtime.files' atomic writes raise a
`DiskFullError` naming the file's folder themselves, so every writer that uses them (meta files,
the tokenizer, a run's config, the Modelfile) answers a full disk in one line; the writers of
several files (checkpoints, token shards, the HF, peft and GGUF exports) catch it, remove their
temporary files and say what is kept.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

from minillm.errors import UserError

# torch.save on a full disk: its zip writer reports the short write as an enforce failure,
# "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598", or, in other
# versions, "PytorchStreamWriter failed writing file ...: file write failed".
_TORCH_SHORT_WRITE = ("unexpected pos", "file write failed")


# safetensors (Rust) on a full disk: "Error while serializing: I/O error: No space left on device
# (os error 28)"; its SafetensorError is neither an OSError nor a RuntimeError.
_RUST_IO_ERRORS = (f"(os error {errno.ENOSPC})", f"(os error {errno.EDQUOT})")


class DiskFullError(UserError, OSError):
    """A full disk, already said in one line (a UserError: exit 2); still an OSError ENOSPC, so
    a caller that catches OSError (an optional cache) or rewords a full disk sees one."""

    def __init__(self, message: str) -> None:
        OSError.__init__(self, errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)


def is_disk_full(e: BaseException) -> bool:
    """Whether `e` is a write that failed for want of space (or of quota)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(e, RuntimeError):
        return any(s in str(e) for s in _TORCH_SHORT_WRITE)
    return type(e).__name__ == "SafetensorError" and any(s in str(e) for s in _RUST_IO_ERRORS)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KB'; decimal units, as `df -H` prints them."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def free_bytes(folder: str | Path) -> int | None:
    """Free space for this user on the disk holding `folder` (its nearest existing parent)."""
    p = Path(folder).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def full_disk_error(folder: str | Path, what: str, needed: int | None, after: str) -> DiskFullError:
    """`<folder>: no space left on the device writing <what>: needs about N, M free; <after>`."""
    free = free_bytes(folder)
    sizes = [f"needs about {human_bytes(needed)}" if needed else ""]
    sizes.append(f"{human_bytes(free)} free" if free is not None else "")
    room = ", ".join(s for s in sizes if s)
    return DiskFullError(
        f"{folder}: no space left on the device writing {what}"
        + (f" ({room})" if room else "")
        + f"; {after}"
    )


def raise_if_disk_full(
    e: BaseException, folder: str | Path, what: str, needed: Callable[[], int | None], after: str
) -> None:
    """In a writer's `except` (after its cleanup): raise `full_disk_error` if `e` is a full disk,
    else return (the writer re-raises `e`). `needed` is asked only then."""
    if is_disk_full(e):
        raise full_disk_error(folder, what, needed(), after) from None
