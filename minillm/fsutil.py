"""Crash-safe file writing: write to a temporary name in the same folder, fsync, rename.

Offers `atomic_write`, `atomic_write_text`, `atomic_write_json`, `fsync_dir`, `sha256_file` and
`ensure_writable_dir`.
A reader therefore sees the old file or the new one, never a half-written one, whatever instant a
crash or a full disk strikes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def fsync_dir(path: str | Path) -> None:
    """Make a rename or new entry in `path` durable (a no-op where folders can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary sibling of `path`; on success fsync it and rename it over `path`.

    On any exception the temporary file is removed and `path` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    encoding = None if "b" in mode else "utf-8"
    try:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def save_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, with the file readable as any other new file (umask applies):
    safetensors >= 0.5 creates it 0600, which stops another user loading a shared model."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def ensure_writable_dir(folder: str | Path, key: str) -> None:
    """Create `folder` and a file in it now, so that a bad out_dir fails before hours of work.

    Raises a ConfigError naming `key` (the config key that chose the folder).
    """
    from minillm.config import ConfigError

    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        blocker = next((p for p in (folder, *folder.parents) if p.exists()), None)
        why = f"{blocker} is a file" if blocker and not blocker.is_dir() else e.strerror or e
        raise ConfigError(key, f"not writable: {why}", str(folder)) from None
