"""A full disk met while writing, made one line that names the folder and the space needed.

Offers `is_disk_full` (an OSError ENOSPC/EDQUOT, or torch.save's RuntimeError on a short write),
`full_disk_error` (the UserError to raise), `raise_if_disk_full` (called in a writer's `except`
after its cleanup: raises that error for a full disk), `free_bytes` and `human_bytes`. Each writer
(checkpoints, token shards, the tokenizer, the HF, peft and GGUF exports) removes its temporary
files first, so the error can promise that nothing existing was lost.
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


def is_disk_full(e: BaseException) -> bool:
    """Whether `e` is a write that failed for want of space (or of quota)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(e, RuntimeError):
        return any(s in str(e) for s in _TORCH_SHORT_WRITE)
    return False


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


def full_disk_error(folder: str | Path, what: str, needed: int | None, after: str) -> UserError:
    """`<folder>: no space left on the device writing <what>: needs about N, M free; <after>`."""
    free = free_bytes(folder)
    sizes = [f"needs about {human_bytes(needed)}" if needed else ""]
    sizes.append(f"{human_bytes(free)} free" if free is not None else "")
    room = ", ".join(s for s in sizes if s)
    return UserError(
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
