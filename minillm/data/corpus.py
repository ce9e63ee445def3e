"""Documents from `data.source`, streamed as text and tagged with their split.

Offers `Corpus`, `TextCorpus`, `Document` and `val_mask` (and `TableCorpus` for rows lives in
minillm.data.table); minillm.data.sources opens one from `data.source` (`open_corpus`).

Documents. A plain-text file is one document (a book stays whole; `datasets`' "text" builder would
make every line a document). It is read in ~1 MB blocks of strict UTF-8, so memory does not grow
with the file. json/jsonl, parquet and csv are loaded with `datasets.load_dataset(...,
split="train")`, which converts them once to memory-mapped arrow, and read in batches of rows;
with `data.streaming` they (and hub datasets) are read as an `IterableDataset` instead, nothing
converted, the same rows in the same order. Each row's `data.text_field` is one document and empty
rows are skipped. A column of chat messages (`[{"role": ..., "content": ...}, ...]`) makes every
row one conversation (`Document.messages`, checked by minillm.tokenizer.chat_template, which also
holds the template).

Prefix. `data.max_documents` keeps the first rows (files) as read, empty ones included;
`data.max_bytes` stops before the first document that starts once the text kept totals that much
(the last one is taken whole; a text file is cut at a safe cut just after the limit).

Split. `data.val_fraction` of the documents (at least one, at most all but one) go to validation,
chosen by `data.seed`; with `data.val_documents` (needed by a stream, whose length is unknown) the
first that many go instead, counted like max_documents. A corpus of a single document (one .txt
file) is split at its tail instead, like nanoGPT's Shakespeare: validation is the last
`val_fraction` of its bytes, starting at the first safe cut (minillm.data.text.is_cut, preferring
a line start) from there.

Invalid UTF-8 (`data.decode_errors`). strict: one error line naming the file and byte (the row,
in minillm.data.table). replace: a document with invalid bytes is read with U+FFFD in their place
and marked `Document.replaced`; skip_document: it is yielded marked `Document.skipped`, so that
the pass counts it, and nothing reads its text. A text file's documents are checked with one read
before they are yielded (decoding is far faster than encoding), and keep their bytes on disk as
`nbytes`; safe cuts (the tail split, data.max_bytes) are found on the exact bytes.

Long documents are cut into pieces for encoding only at safe cuts: see minillm.data.text.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minillm.config import DataConfig
from minillm.data.text import first_invalid_byte, read_text_blocks, split_pieces
from minillm.errors import ConfigError
from minillm.tokenizer.chat_template import content_bytes


def corpus_error(file: str | Path | None, key: str, message: str) -> ConfigError:
    return ConfigError(key, message, str(file) if file is not None else None)


def error_reason(e: BaseException) -> BaseException:
    """The parser's own error under a library's wrapper: the end of the `raise ... from` chain
    (or, with none, the error being handled when this one was raised)."""
    if e.__cause__ is None and e.__context__ is not None:
        e = e.__context__
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ----------------------------------------------------------------------------- documents


def val_mask(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """A boolean mask of the `n` documents that go to validation: at least one, never all."""
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    rng = np.random.default_rng(seed % 2**64)  # numpy seeds must be >= 0
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(n, size=n_val, replace=False)] = True
    return mask


@dataclass
class Document:
    """One document of a split: a string (a table row), bytes [start, end) of a text file, or a
    conversation (a row of chat messages, checked). `replaced`: it held invalid UTF-8, now
    U+FFFD; `skipped`: it holds invalid UTF-8 and is left out (data.decode_errors)."""

    split: str
    text: str | None = None
    path: Path | None = None
    start: int = 0
    end: int = 0
    messages: list[dict[str, str]] | None = None
    replaced: bool = False
    skipped: bool = False

    @property
    def nbytes(self) -> int:
        """UTF-8 bytes of the text (a file's bytes are exactly that, since it is UTF-8, or with
        invalid bytes replaced, those on disk); of a conversation, its contents' bytes."""
        if self.messages is not None:
            return content_bytes(self.messages)
        if self.text is not None:
            return len(self.text.encode("utf-8"))
        return self.end - self.start

    def blocks(self) -> Iterator[str]:
        if self.text is not None:
            return iter((self.text,) if self.text else ())
        assert self.path is not None
        errors = "replace" if self.replaced else "strict"
        return read_text_blocks(self.path, self.start, self.end, errors=errors)


def _cuts(blocks: Iterable[str], nbytes: int) -> Iterator[tuple[int, int]]:
    """(byte, char) offsets of safe cuts in a text of about `nbytes` bytes, in order, one every
    few KB at most (dense enough, few of them in a small text); neither 0 nor the end. A file's
    invalid bytes, read as lone surrogates, count as the bytes they were."""
    step = max(16, min(4096, nbytes // 1000))
    byte = char = 0
    for k, piece in enumerate(split_pieces(blocks, step)):
        if k:
            yield byte, char
        byte += len(piece.encode("utf-8", "surrogateescape"))
        char += len(piece)


def tail_cut(blocks: Iterable[str], nbytes: int, val_fraction: float) -> tuple[int, int] | None:
    """(byte, char) offset where a single document's validation tail starts, or None.

    The first safe cut at or after the last `val_fraction` of the bytes, else the last before it.
    """
    target = nbytes - max(1, round(nbytes * val_fraction))
    before = None
    for cut in _cuts(blocks, nbytes):
        if cut[0] >= target:
            return cut
        before = cut
    return before


def _file_blocks(path: Path, end: int | None, decode_errors: str) -> Iterator[str]:
    """A text file's blocks for finding safe cuts: strict, or with data.decode_errors reading
    past invalid bytes, each one a lone surrogate (`_cuts` counts it as one byte)."""
    errors = "strict" if decode_errors == "strict" else "surrogateescape"
    return read_text_blocks(path, 0, end, errors=errors)


def _cut_after(path: Path, limit: int, decode_errors: str) -> int | None:
    """The byte offset of a safe cut at or just after `limit` in a text file (data.max_bytes):
    the first of `_cuts`, so within a few KB of the first; None when there is none."""
    cuts = _cuts(_file_blocks(path, None, decode_errors), limit)
    return next((byte for byte, _ in cuts if byte >= limit), None)


def prefix_keys(data: DataConfig) -> str:
    """The prefix keys set (`data.max_documents and data.max_bytes`), for error lines; or ""."""
    return " and ".join(f"data.{k}" for k in ("max_documents", "max_bytes") if getattr(data, k))


def check_val_documents(data: DataConfig, n: int, label: str) -> None:
    """Refuse, before any pass, a data.val_documents that leaves no document to train on."""
    if data.val_documents >= n:
        kept = prefix_keys(data)
        which = f" kept by {kept}" if kept else ""
        raise corpus_error(
            label,
            "data.val_documents",
            f"{data.val_documents}, but the corpus has {n} documents{which}: none would be "
            "left to train on",
        )


class Corpus:
    """The documents of a source, each tagged with its split, and what identifies them.

    Documents are counted as read (rows, files; the empty ones included, though they become no
    document) for data.max_documents and data.val_documents; data.max_bytes stops before the
    first document that starts at or after that much text.
    """

    label: str  # what error messages name: the source as given
    files: list[Path]
    format: str
    n_documents: int  # before the split and before skipping empty rows; 0 in a stream: unknown
    unit: str  # what `total` and `Document` progress count: "bytes" or "documents"
    total: int | None  # None: unknown (a stream)
    fingerprint: str
    mask: np.ndarray | None  # which documents go to validation; None: the first val_documents
    val_documents: int

    def documents(self) -> Iterator[Document]:
        raise NotImplementedError

    def cursor(self) -> dict[str, Any] | None:
        """Where a pass resumed after this point may start reading (a stream's position, at or
        before the documents yielded so far), or None: from the beginning."""
        return None

    def seek(self, cursor: dict[str, Any] | None) -> int:
        """Make the next `documents()` start at `cursor` (an earlier pass's `cursor()`); returns
        the number of documents before it (0: from the beginning)."""
        return 0

    def train_total(self) -> int | None:
        """The documents of the train split, None when unknown (a stream)."""
        if self.mask is not None:
            return int((~self.mask).sum())
        n = self.n_documents or self.total
        return None if n is None else max(n - self.val_documents, 0)

    def _is_val(self, index: int) -> bool:
        if self.mask is None:
            return index < self.val_documents
        return bool(self.mask[index])

    def _fingerprint(self, data: DataConfig, extra: dict[str, Any]) -> str:
        files = []
        for f in self.files:
            st = f.stat()
            files.append([os.path.realpath(f), st.st_size, st.st_mtime_ns])
        key = {
            "files": files,
            "format": self.format,
            "text_field": data.text_field,
            "val_fraction": data.val_fraction,
            "seed": data.seed,
            **extra,
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


class TextCorpus(Corpus):
    """Plain-text files, one document each."""

    unit = "bytes"

    def __init__(self, files: list[Path], data: DataConfig) -> None:
        if data.max_documents:
            files = files[: data.max_documents]
        self.label, self.files, self.format = data.source, files, "text"
        self.decode_errors = data.decode_errors
        self.sizes = [f.stat().st_size for f in files]
        if data.max_bytes:
            self._take_bytes(data.max_bytes)
        self.n_documents, self.total = len(self.files), sum(self.sizes)
        if self.total == 0:
            raise corpus_error(data.source, "data.source", "no text: the corpus is empty")
        self.fingerprint = self._fingerprint(data, {})
        self.val_documents = data.val_documents
        self.cut: tuple[int, int] | None = None
        self.mask = None
        # Empty files are no documents: one file with text is split at its tail, and the random
        # validation pick is drawn among the files with text.
        texts = [k for k, size in enumerate(self.sizes) if size]
        if len(texts) == 1:
            self.single = texts[0]
            path, size = self.files[self.single], self.sizes[self.single]
            blocks = _file_blocks(path, size, self.decode_errors)
            self.cut = tail_cut(blocks, size, data.val_fraction)
            if self.cut is None:
                raise corpus_error(
                    path,
                    "data.val_fraction",
                    "a single document too short, or without a line break or space, to split "
                    "off a validation tail; add text or more documents",
                )
        elif data.val_documents:
            check_val_documents(data, len(self.files), self.label)
        else:
            self.mask = np.zeros(len(self.files), dtype=bool)
            self.mask[texts] = val_mask(len(texts), data.val_fraction, data.seed)

    def _take_bytes(self, limit: int) -> None:
        """Keep the files until their text totals `limit` bytes, the last one cut after it."""
        total = 0
        for k, (path, size) in enumerate(zip(self.files, self.sizes)):
            if total >= limit:
                self.files, self.sizes = self.files[:k], self.sizes[:k]
                return
            if total + size > limit:
                self.sizes[k] = _cut_after(path, limit - total, self.decode_errors) or size
            total += self.sizes[k]

    def train_total(self) -> int | None:
        return None  # counted in bytes (minillm.data.tokenizer_train adds them up)

    def documents(self) -> Iterator[Document]:
        if self.cut is not None:
            path, size, cut = self.files[self.single], self.sizes[self.single], self.cut[0]
            yield self._checked(Document("train", path=path, start=0, end=cut))
            yield self._checked(Document("val", path=path, start=cut, end=size))
            return
        for k, (path, size) in enumerate(zip(self.files, self.sizes)):
            if size:  # like empty rows, an empty file is no document
                split = "val" if self._is_val(k) else "train"
                yield self._checked(Document(split, path=path, start=0, end=size))

    def _checked(self, doc: Document) -> Document:
        """The document marked as data.decode_errors says when it holds invalid UTF-8 (strict:
        unmarked; reading it fails)."""
        if self.decode_errors != "strict":
            assert doc.path is not None
            if first_invalid_byte(doc.path, doc.start, doc.end) is not None:
                doc.replaced = self.decode_errors == "replace"
                doc.skipped = self.decode_errors == "skip_document"
        return doc
