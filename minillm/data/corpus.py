"""Documents from `data.source`, streamed as text and tagged with their split.

Offers `Corpus`, `TextCorpus`, `TableCorpus`, `Document` and `val_mask`; minillm.data.sources
opens one from `data.source` (`open_corpus`).

Documents. A plain-text file is one document (a book stays whole; `datasets`' "text" builder would
make every line a document). It is read in ~1 MB blocks of strict UTF-8, so memory does not grow
with the file. json/jsonl, parquet and csv are loaded with `datasets.load_dataset(...,
split="train")`, which converts them once to memory-mapped arrow, and read in batches of rows;
with `data.streaming` they (and hub datasets) are read as an `IterableDataset` instead, nothing
converted, the same rows in the same order. Each row's `data.text_field` is one document and empty
rows are skipped. A column of chat messages (`[{"role": ..., "content": ...}, ...]`) makes every
row one conversation (`Document.messages`, checked by minillm.data.chat, which also holds the
template).

Prefix. `data.max_documents` keeps the first rows (files) as read, empty ones included;
`data.max_bytes` stops before the first document that starts once the text kept totals that much
(the last one is taken whole; a text file is cut at a safe cut just after the limit).

Split. `data.val_fraction` of the documents (at least one, at most all but one) go to validation,
chosen by `data.seed`; with `data.val_documents` (needed by a stream, whose length is unknown) the
first that many go instead, counted like max_documents. A corpus of a single document (one .txt
file) is split at its tail instead, like nanoGPT's Shakespeare: validation is the last
`val_fraction` of its bytes, starting at the first safe cut (minillm.data.text.is_cut, preferring
a line start) from there.

Long documents are cut into pieces for encoding only at safe cuts: see minillm.data.text.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minillm.config import DataConfig
from minillm.data.chat import check_messages, content_bytes
from minillm.data.text import read_text_blocks, split_pieces
from minillm.errors import ConfigError

ROWS_PER_BATCH = 512  # rows fetched from arrow at a time


def _fail(file: str | Path | None, key: str, message: str) -> ConfigError:
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
    conversation (a row of chat messages, checked)."""

    split: str
    text: str | None = None
    path: Path | None = None
    start: int = 0
    end: int = 0
    messages: list[dict[str, str]] | None = None

    @property
    def nbytes(self) -> int:
        """UTF-8 bytes of the text (a file's bytes are exactly that, since it is strict UTF-8);
        of a conversation, its contents' bytes."""
        if self.messages is not None:
            return content_bytes(self.messages)
        if self.text is not None:
            return len(self.text.encode("utf-8"))
        return self.end - self.start

    def blocks(self) -> Iterator[str]:
        if self.text is not None:
            return iter((self.text,) if self.text else ())
        assert self.path is not None
        return read_text_blocks(self.path, self.start, self.end)


def _cuts(blocks: Iterable[str], nbytes: int) -> Iterator[tuple[int, int]]:
    """(byte, char) offsets of safe cuts in a text of about `nbytes` bytes, in order, one every
    few KB at most (dense enough, few of them in a small text); neither 0 nor the end."""
    step = max(16, min(4096, nbytes // 1000))
    byte = char = 0
    for k, piece in enumerate(split_pieces(blocks, step)):
        if k:
            yield byte, char
        byte += len(piece.encode("utf-8"))
        char += len(piece)


def _tail_cut(blocks: Iterable[str], nbytes: int, val_fraction: float) -> tuple[int, int] | None:
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


def _cut_after(path: Path, limit: int) -> int | None:
    """The byte offset of a safe cut at or just after `limit` in a text file (data.max_bytes):
    the first of `_cuts`, so within a few KB of the first; None when there is none."""
    return next((byte for byte, _ in _cuts(read_text_blocks(path), limit) if byte >= limit), None)


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
        self.sizes = [f.stat().st_size for f in files]
        if data.max_bytes:
            self._take_bytes(data.max_bytes)
        self.n_documents, self.total = len(self.files), sum(self.sizes)
        if self.total == 0:
            raise _fail(data.source, "data.source", "no text: the corpus is empty")
        self.fingerprint = self._fingerprint(data, {})
        self.val_documents = data.val_documents
        self.cut: tuple[int, int] | None = None
        self.mask = None
        if len(self.files) == 1:
            size = self.sizes[0]
            self.cut = _tail_cut(read_text_blocks(files[0], 0, size), size, data.val_fraction)
            if self.cut is None:
                raise _fail(
                    files[0],
                    "data.val_fraction",
                    "a single document too short, or without a line break or space, to split "
                    "off a validation tail; add text or more documents",
                )
        elif not data.val_documents:
            self.mask = val_mask(len(self.files), data.val_fraction, data.seed)

    def _take_bytes(self, limit: int) -> None:
        """Keep the files until their text totals `limit` bytes, the last one cut after it."""
        total = 0
        for k, (path, size) in enumerate(zip(self.files, self.sizes)):
            if total >= limit:
                self.files, self.sizes = self.files[:k], self.sizes[:k]
                return
            if total + size > limit:
                self.sizes[k] = _cut_after(path, limit - total) or size
            total += self.sizes[k]

    def train_total(self) -> int | None:
        return None  # counted in bytes (minillm.data.tokenizer_train adds them up)

    def documents(self) -> Iterator[Document]:
        if self.cut is not None:
            path, size, cut = self.files[0], self.sizes[0], self.cut[0]
            yield Document("train", path=path, start=0, end=cut)
            yield Document("val", path=path, start=cut, end=size)
            return
        for k, (path, size) in enumerate(zip(self.files, self.sizes)):
            if size:  # like empty rows, an empty file is no document
                split = "val" if self._is_val(k) else "train"
                yield Document(split, path=path, start=0, end=size)


def _is_chat_type(kind: Any) -> bool | None:
    """Whether an arrow type is a text column (False), a column of chat messages (True), or
    neither (None)."""
    import pyarrow as pa

    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return False
    if (
        (pa.types.is_list(kind) or pa.types.is_large_list(kind))
        and pa.types.is_struct(kind.value_type)
        and {"role", "content"} <= {f.name for f in kind.value_type}
    ):
        return True
    return None


def _is_chat_value(value: Any) -> bool | None:
    """_is_chat_type for a row's value (a stream whose column types are known only once read)."""
    if value is None or isinstance(value, str):
        return False
    if isinstance(value, list) and all(
        isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value
    ):
        return True
    return None


class TableCorpus(Corpus):
    """Rows of a `datasets.Dataset` (json, parquet, csv files or a hub dataset), one per row, or
    of a `datasets.IterableDataset` (data.streaming): the same rows, read as a stream."""

    unit = "documents"

    def __init__(self, ds: Any, files: list[Path], fmt: str, data: DataConfig, label: str) -> None:
        import datasets

        self.label, self.files, self.format = label, files, fmt
        self.streaming = isinstance(ds, datasets.IterableDataset)
        self.field = field = data.text_field
        self.max_documents, self.max_bytes = data.max_documents, data.max_bytes
        self.val_documents, self.val_fraction = data.val_documents, data.val_fraction
        self.ds = ds
        columns, kind, value = ds.column_names, None, None
        if self.streaming and ds.features is not None:
            kind = ds.features.arrow_schema.field(field).type if field in columns else None
        elif self.streaming:  # json: the columns are known once a row is read
            first = next(self._batches(), None)
            columns = list(first) if first is not None else []
            value = first[field][0] if first is not None and field in first else None
        else:
            kind = ds.data.schema.field(field).type if field in columns else None
        if field not in (columns or []) and (columns or not self.streaming):
            found = ", ".join(columns or []) or "none"
            raise _fail(label, "data.text_field", f"no column {field!r} (columns found: {found})")
        chat = _is_chat_type(kind) if kind is not None else _is_chat_value(value)
        if chat is None:
            held = kind if kind is not None else type(value).__name__
            raise _fail(
                label,
                "data.text_field",
                f"column {field!r} holds {held}, not text or a list of {{role, content}} messages",
            )
        self.chat = chat
        self.ds = ds.select_columns([field]) if columns else ds
        self.mask = None
        if self.streaming:
            self.n_rows = self.n_documents = 0  # unknown until read
            self.total = self.max_documents or None
        else:
            self.n_rows = len(ds)  # of the whole table
            n = min(self.n_rows, self.max_documents or self.n_rows)
            if n and self.max_bytes:  # where the text reaches max_bytes: a pass over the rows
                n = sum(1 for _ in self._rows())
            self.n_documents = n
            if not n:
                raise _fail(label, "data.source", "no rows: the corpus is empty")
            self.total = n if n > 1 else 2  # one row: two halves
            if not self.val_documents:
                self.mask = val_mask(n, data.val_fraction, data.seed)
        dataset = "" if self.streaming else getattr(ds, "_fingerprint", "")
        extra = {"hub": label, "dataset": dataset} if not files else {}
        self.fingerprint = self._fingerprint(data, extra)

    def _batches(self) -> Iterator[dict[str, list[Any]]]:
        """A stream's rows in batches; a file that fails to parse is one error line."""
        batches = iter(self.ds.iter(batch_size=ROWS_PER_BATCH))
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as e:  # datasets/pyarrow raise many types for unparsable files
                if self.format == "hub" and isinstance(e, ConnectionError):
                    message = "a hub dataset, and the Hugging Face hub is unreachable to read it"
                else:
                    what = "the hub dataset" if self.format == "hub" else f"as {self.format}"
                    message = f"cannot read {what}: {first_line(error_reason(e))}"
                raise _fail(self.label, "data.source", message) from None
            yield batch

    def _columns(self) -> Iterator[list[Any]]:
        """The text column in batches of rows, read from the arrow cache files.

        datasets memory-maps those files, and every page touched stays in the process's RSS
        (as page cache) until the end, so RSS would grow with the corpus. Reading the same
        record batches through a plain file keeps it flat. A dataset that is not simply its
        cache files (in memory, or re-indexed) is iterated through datasets instead, and so is
        a stream.
        """
        import pyarrow as pa

        if self.streaming:
            for batch in self._batches():
                if self.field not in batch:  # a later file without the column
                    found = ", ".join(batch) or "none"
                    message = f"no column {self.field!r} (columns found: {found})"
                    raise _fail(self.label, "data.text_field", message)
                yield batch[self.field]
            return
        files = [f["filename"] for f in self.ds.cache_files]
        if not files or getattr(self.ds, "_indices", None) is not None:
            for batch in self.ds.iter(batch_size=ROWS_PER_BATCH):
                yield batch[self.field]
            return
        rows = 0
        for name in files:
            with pa.OSFile(name) as f:
                for batch in pa.ipc.open_stream(f):
                    rows += batch.num_rows
                    yield batch.column(self.field).to_pylist()
        if rows != self.n_rows:  # a datasets change we do not know: fail loudly, not wrong
            raise RuntimeError(f"read {rows} rows from {files}, expected {self.n_rows}")

    def texts(self) -> Iterator[str]:
        """Every row's text in order, chat rows rendered, before any split (`minillm eval`)."""
        for column in self._columns():
            for value in column:
                yield value or ""

    def _rows(self) -> Iterator[tuple[int, str | list[dict[str, str]]]]:
        """(index, text or checked conversation) of the rows kept: the first max_documents, and
        those that start before the text totals max_bytes."""
        nbytes = 0
        with contextlib.closing(self._columns()) as columns:
            for i, value in enumerate(itertools.chain.from_iterable(columns)):
                if self.max_documents and i >= self.max_documents:
                    return
                if self.max_bytes and nbytes >= self.max_bytes:
                    return
                if self.chat:
                    value = check_messages(value, self.label, i + 1, self.field)
                    nbytes += content_bytes(value) if self.max_bytes else 0
                else:
                    value = value or ""
                    nbytes += len(value.encode("utf-8")) if self.max_bytes else 0
                yield i, value

    def documents(self) -> Iterator[Document]:
        if self.n_documents == 1 and self.mask is not None:
            if self.chat:
                raise _fail(
                    self.label,
                    "data.val_fraction",
                    "one conversation cannot be split into train and validation; add rows",
                )
            text = str(next(self._rows())[1])
            cut = _tail_cut([text], len(text.encode("utf-8")), self.val_fraction)
            if cut is None:
                raise _fail(
                    self.label,
                    "data.val_fraction",
                    "one row, too short to split off a validation tail; add text or rows",
                )
            yield Document("train", text=text[: cut[1]])
            yield Document("val", text=text[cut[1] :])
            return
        for i, value in self._rows():
            split = "val" if self._is_val(i) else "train"
            if isinstance(value, list):
                yield Document(split, messages=value)
            elif value:
                yield Document(split, text=value)
