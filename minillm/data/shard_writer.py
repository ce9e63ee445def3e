"""One split's token ids (or its target mask) written into numbered shard files.

Offers `ShardWriter`. `minillm tokenize` (minillm.data.tokenize_pass) keeps one per split, and one
per split's mask with the loss on the assistant; minillm.data.shard_staging checkpoints and resumes
them, and the file names and format are minillm.data.meta's.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from minillm.data.meta import TOKEN_DTYPES, shard_name


class ShardWriter:
    """Appends ids to `<split>_NNNNNN<suffix>` files of at most `shard_tokens` each, counting and
    hashing what it writes. A shard is fsynced and final once full; the next opens on demand, so
    there is never an empty trailing shard."""

    def __init__(self, folder: Path, split: str, suffix: str, dtype: str, shard_tokens: int):
        self.folder, self.split, self.suffix, self.shard_tokens = (
            folder,
            split,
            suffix,
            shard_tokens,
        )
        self.dtype = TOKEN_DTYPES.get(dtype) or np.dtype(dtype)  # a mask file: "u1"
        self.shards: list[dict[str, Any]] = []  # the complete ones
        self.file: Any = None
        self.sha = hashlib.sha256()
        self.current = 0  # tokens in the open shard

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self.current

    def _path(self, index: int) -> Path:
        return self.folder / shard_name(self.split, index, self.suffix)

    def write(self, ids: np.ndarray) -> None:
        data = ids.astype(self.dtype, copy=False)
        pos = 0
        while pos < len(data):
            if self.file is None:
                self.file = open(self._path(len(self.shards)), "wb")  # closed by _close_shard
                self.sha, self.current = hashlib.sha256(), 0
            chunk = data[pos : pos + self.shard_tokens - self.current].tobytes()
            self.file.write(chunk)
            self.sha.update(chunk)
            n = len(chunk) // self.dtype.itemsize
            self.current += n
            pos += n
            if self.current == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.file = None
        name = shard_name(self.split, len(self.shards), self.suffix)
        nbytes = self.current * self.dtype.itemsize
        self.shards.append(
            {
                "file": name,
                "tokens": self.current,
                "file_bytes": nbytes,
                "sha256": self.sha.hexdigest(),
            }
        )
        self.current = 0

    def checkpoint(self) -> dict[str, Any]:
        """Make what is written durable; the state to resume from."""
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
        return {"shards": list(self.shards), "current": self.current}

    def resume(self, state: dict[str, Any]) -> None:
        """Continue after a checkpoint: complete shards as recorded, the open one truncated to
        its recorded tokens (what was written after the checkpoint is written again)."""
        for sh in state["shards"]:
            path = self.folder / sh["file"]
            if not path.is_file() or path.stat().st_size != sh["file_bytes"]:
                raise FileNotFoundError(path)
        self.shards, self.current = list(state["shards"]), int(state["current"])
        if self.current:
            path = self._path(len(self.shards))
            self.file = open(path, "r+b")  # closed by _close_shard
            self.file.truncate(self.current * self.dtype.itemsize)
            self.sha = hashlib.sha256()
            while block := self.file.read(1 << 20):
                self.sha.update(block)
            if self.file.tell() != self.current * self.dtype.itemsize:
                raise FileNotFoundError(path)  # shorter than recorded: start over

    def finish(self) -> None:
        if self.file is not None:
            self._close_shard()

    def discard(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
