"""Crash-safe file writing: write to a temporary name in the same folder, fsync, rename.

Offers `atomic_write`, `atomic_write_text`, `atomic_write_json`, `atomic_copy` (one file;
`copy_if_changed`: unless it is already there),
`StagedFile` (files that commit together), `commit_dir` (a staged folder renamed into place),
`fsync_dir`, `fsync_file`, `sha256_file`, `save_safetensors`, `ensure_writable_dir`,
`removing_new_dirs`; and reading a user's files: `read_user_text`, `user_jsonl`.
A reader therefore sees the old file or the new one, never a half-written one, whatever instant a
crash or a full disk strikes; a full disk is a `DiskFullError` (one line, exit 2) naming the
folder and the space the file needs.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from minillm.errors import ConfigError, UserError
from minillm.runtime.disk_space import full_disk_error, is_disk_full


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


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def temp_name(path: Path) -> Path:
    """The hidden temporary sibling that `path` is written under until it is renamed in place."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


class StagedFile:
    """A file written under its temporary name until `commit` renames it in place.

    Several staged files are written and fsynced first, then committed together (token shards,
    meta.json, the tokenizer), so a failure before the commits changes nothing.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tmp = temp_name(self.path)

    @classmethod
    def text(cls, path: str | Path, text: str) -> StagedFile:
        staged = cls(path)
        try:
            with open(staged.tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as e:
            staged.discard()
            _raise_if_disk_full(e, staged.path, len(text.encode("utf-8")))
            raise
        return staged

    def commit(self) -> None:
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.tmp.unlink()


def _raise_if_disk_full(e: BaseException, path: Path, size: int | None) -> None:
    """A full disk met writing `path` (its temporary file already removed) as one line."""
    if is_disk_full(e) and not isinstance(e, UserError):
        kept = f"{path.name} is as it was" if path.exists() else f"{path.name} was not written"
        raise full_disk_error(path.parent, path.name, size, kept) from None


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb", size: int | None = None) -> Iterator[IO[Any]]:
    """Open a temporary sibling of `path`; on success fsync it and rename it over `path`.

    On any exception the temporary file is removed and `path` is left as it was; a full disk is
    a DiskFullError naming the folder and `size` (the bytes to write, where the caller knows).
    """
    staged = StagedFile(path)
    encoding = None if "b" in mode else "utf-8"
    try:
        with open(staged.tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        staged.commit()
    except BaseException as e:
        staged.discard()
        _raise_if_disk_full(e, staged.path, size)
        raise
    fsync_dir(staged.path.parent)


def atomic_copy(src: str | Path, dst: str | Path) -> None:
    """Copy `src` to `dst` through a temporary file, fsynced, then renamed."""
    with atomic_write(dst, size=os.path.getsize(src)) as out, open(src, "rb") as f:
        shutil.copyfileobj(f, out)


def copy_if_changed(src: Path, dst: Path) -> None:
    """`atomic_copy` of src to dst unless dst already holds src's bytes (a finished run started
    again rewrites none of its files)."""
    if not dst.is_file() or dst.read_bytes() != src.read_bytes():
        atomic_copy(src, dst)


def commit_dir(tmp: Path, final: Path) -> None:
    """Make the staged folder `tmp` the folder `final`: every file and the folder fsynced, an
    existing `final` moved aside, the rename, the parent fsynced, then the old one deleted.

    A crash at any instant leaves `final` whole: the old one, or the new one (or, between the
    two renames, neither, with the old one intact under a hidden name).
    """
    for p in tmp.iterdir():
        if p.is_file():
            fsync_file(p)
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, with the file readable as any other new file (umask applies):
    safetensors >= 0.5 creates it 0600, which stops another user loading a shared model."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as e:
        # safetensors' own error type for a full disk: made the OSError every writer checks for
        if is_disk_full(e) and not isinstance(e, OSError):
            raise OSError(errno.ENOSPC, f"{path}: {e}") from None
        raise
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def atomic_write_text(path: str | Path, text: str) -> None:
    data = text.encode("utf-8")
    with atomic_write(path, "wb", size=len(data)) as f:
        f.write(data)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cache_dir() -> Path:
    """minillm's per-user cache: $MINILLM_CACHE_DIR, else $XDG_CACHE_HOME/minillm or
    ~/.cache/minillm."""
    root = os.environ.get("MINILLM_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minillm"
    return Path(root)


class HashCache:
    """sha256 of files, each computed once per version of the file.

    A digest is kept in `cache_dir()/file_hashes.json` under the file's real path with its size,
    device, inode, modification and change times, and reused while those are unchanged: a 20 GB
    corpus whose shards every DDP rank checks on every start is read once, not at every start.
    Any write to a file, and any setting of its times (`touch -r`, `rsync -t`), moves its change
    time, which nothing a user runs can set back; damage that no write made (a failing disk)
    is caught only the first time. Only files last changed at least SETTLED_S ago are
    remembered: the clock that stamps writes ticks in steps (milliseconds, or seconds on some
    file systems), and a write within the same step would keep the times. A cache that cannot
    be found, read or written is ignored. Use as a context manager; the cache is saved on exit.
    """

    SETTLED_S = 2.0
    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        try:
            self.path: Path | None = cache_dir() / "file_hashes.json"
        except (RuntimeError, KeyError):  # no $HOME and no passwd entry: no cache
            self.path = None
        self.entries: dict[str, list[Any]] = {}
        self.changed = False

    def __enter__(self) -> HashCache:
        try:
            assert self.path is not None
            entries = json.loads(self.path.read_text(encoding="utf-8"))
            self.entries = entries if isinstance(entries, dict) else {}
        except (OSError, ValueError, AssertionError):
            pass
        return self

    def sha256(self, path: str | Path) -> str:
        st = os.stat(path)
        stamp = [st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
        key = os.path.realpath(path)
        hit = self.entries.get(key)
        if isinstance(hit, list) and hit[:-1] == stamp:
            return str(hit[-1])
        digest = sha256_file(path)
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) >= self.SETTLED_S * 1e9:
            self.entries.pop(key, None)
            self.entries[key] = [*stamp, digest]  # newest last: trimmed from the front
            self.changed = True
        return digest

    def __exit__(self, *exc: object) -> None:
        if not self.changed or self.path is None:
            return
        keep = dict(list(self.entries.items())[-self.MAX_ENTRIES :])
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, keep)


@contextlib.contextmanager
def removing_new_dirs(*folders: str | Path) -> Iterator[None]:
    """On an error inside, remove those of `folders` (and their parents) that did not exist
    before and are empty now: a command that fails before doing work leaves the disk as it was.
    """
    new: list[Path] = []
    for folder in folders:
        for p in (Path(folder), *Path(folder).parents):
            if p.exists():
                break
            new.append(p)
    try:
        yield
    except BaseException:
        for p in sorted(set(new), key=lambda p: len(p.parts), reverse=True):  # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()  # only if empty
        raise


def ensure_writable_dir(folder: str | Path, key: str) -> None:
    """Create `folder` and a file in it now, so that a bad out_dir fails before hours of work.

    Raises a ConfigError naming `key` (the config key that chose the folder).
    """

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


def read_user_text(path: str | Path, what: str = "file") -> str:
    """A user's UTF-8 text file; a missing, unreadable or non-UTF-8 one is one UserError line."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such {what}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def user_jsonl(path: str | Path, what: str = "file") -> Iterator[tuple[int, str, Any]]:
    """(N, "<path>: line N", the value) of each non-blank line N of a user's jsonl file; a line
    that is not JSON is one UserError line naming the file, line and column."""
    for n, raw in enumerate(read_user_text(path, what).splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path}: line {n}"
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        yield n, where, value


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file ({} where there is none: a folder's optional config files);
    unreadable, or not an object, is one CheckpointError naming it."""
    from minillm.errors import CheckpointError

    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return value
