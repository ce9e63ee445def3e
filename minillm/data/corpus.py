"""Documents from `data.source`, streamed as text and tagged with their split.

Offers `open_corpus(data_cfg) -> Corpus`, `Corpus`, `TextCorpus`, `TableCorpus`, `Document` and
`val_mask`.

Sources. `data.source` is a file, a glob (`data/*.txt`, `**` recurses), a folder (searched
recursively, hidden files skipped) or a Hugging Face hub dataset name. A hub name is tried only
when the source does not look like a path: it does not exist, has no glob characters and no file
extension, is `name` or `owner/name` (no leading `/`, `.` or `~`, no deeper folders), and `owner`
is not a local folder. With `data.format: auto` the format comes from the extension: .txt, .text,
.md are text; .json, .jsonl are json; .parquet; .csv. A folder keeps only those files.

Documents. A plain-text file is one document (a book stays whole; `datasets`' "text" builder would
make every line a document). It is read in ~1 MB blocks of strict UTF-8, so memory does not grow
with the file. json/jsonl, parquet and csv are loaded with `datasets.load_dataset(...,
split="train")`, which converts them once to memory-mapped arrow, and read in batches of rows;
each row's `data.text_field` is one document and empty rows are skipped. A column of chat
messages (`[{"role": ..., "content": ...}, ...]`) makes every row one conversation
(`Document.messages`, checked by minillm.data.chat, which also holds the template).

Split. `data.val_fraction` of the documents (at least one, at most all but one) go to validation,
chosen by `data.seed`. A corpus of a single document (one .txt file) is split at its tail instead,
like nanoGPT's Shakespeare: validation is the last `val_fraction` of its bytes, starting at the
first safe cut (minillm.data.text.is_cut, preferring a line start) from there.

Long documents are cut into pieces for encoding only at safe cuts: see minillm.data.text.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
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
EXTENSIONS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _fail(file: str | Path | None, key: str, message: str) -> ConfigError:
    return ConfigError(key, message, str(file) if file is not None else None)


def _reason(e: BaseException) -> BaseException:
    """The parser's own error under a library's wrapper: the end of the `raise ... from` chain
    (or, with none, the error being handled when this one was raised)."""
    if e.__cause__ is None and e.__context__ is not None:
        e = e.__context__
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def _first_line(e: BaseException) -> str:
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


def _tail_cut(blocks: Iterable[str], nbytes: int, val_fraction: float) -> tuple[int, int] | None:
    """(byte, char) offset where a single document's validation tail starts, or None.

    The first safe cut at or after the last `val_fraction` of the bytes, else the last before it.
    """
    target = nbytes - max(1, round(nbytes * val_fraction))
    step = max(16, min(4096, nbytes // 1000))  # dense enough cuts, few of them in a small text
    byte = char = 0
    before = None
    for k, piece in enumerate(split_pieces(blocks, step)):
        if k:
            if byte >= target:
                return byte, char
            before = byte, char
        byte += len(piece.encode("utf-8"))
        char += len(piece)
    return before


class Corpus:
    """The documents of a source, each tagged with its split, and what identifies them."""

    label: str  # what error messages name: the source as given
    files: list[Path]
    format: str
    n_documents: int  # before the split and before skipping empty rows
    unit: str  # what `total` and `Document` progress count: "bytes" or "documents"
    total: int
    fingerprint: str
    mask: np.ndarray  # which documents go to validation

    def documents(self) -> Iterator[Document]:
        raise NotImplementedError

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
        self.label, self.files, self.format = data.source, files, "text"
        self.sizes = [f.stat().st_size for f in files]
        self.n_documents, self.total = len(files), sum(self.sizes)
        if self.total == 0:
            raise _fail(data.source, "data.source", "no text: the corpus is empty")
        self.fingerprint = self._fingerprint(data, {})
        self.cut: tuple[int, int] | None = None
        if len(files) == 1:
            self.cut = _tail_cut(read_text_blocks(files[0]), self.total, data.val_fraction)
            if self.cut is None:
                raise _fail(
                    files[0],
                    "data.val_fraction",
                    "a single document too short, or without a line break or space, to split "
                    "off a validation tail; add text or more documents",
                )
            self.mask = np.zeros(1, dtype=bool)
        else:
            self.mask = val_mask(len(files), data.val_fraction, data.seed)

    def documents(self) -> Iterator[Document]:
        if self.cut is not None:
            path, size, cut = self.files[0], self.sizes[0], self.cut[0]
            yield Document("train", path=path, start=0, end=cut)
            yield Document("val", path=path, start=cut, end=size)
            return
        for path, size, is_val in zip(self.files, self.sizes, self.mask):
            if size:  # like empty rows, an empty file is no document
                yield Document("val" if is_val else "train", path=path, start=0, end=size)


class TableCorpus(Corpus):
    """Rows of a `datasets.Dataset` (json, parquet, csv files or a hub dataset), one per row."""

    unit = "documents"

    def __init__(self, ds: Any, files: list[Path], fmt: str, data: DataConfig, label: str) -> None:
        import pyarrow as pa

        self.label, self.files, self.format = label, files, fmt
        field = data.text_field
        if field not in ds.column_names:
            found = ", ".join(ds.column_names) or "none"
            raise _fail(label, "data.text_field", f"no column {field!r} (columns found: {found})")
        kind = ds.data.schema.field(field).type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            self.chat = False
        elif (
            (pa.types.is_list(kind) or pa.types.is_large_list(kind))
            and pa.types.is_struct(kind.value_type)
            and {"role", "content"} <= {f.name for f in kind.value_type}
        ):
            self.chat = True
        else:
            raise _fail(
                label,
                "data.text_field",
                f"column {field!r} holds {kind}, not text or a list of {{role, content}} messages",
            )
        self.ds, self.field = ds.select_columns([field]), field
        self.n_documents = len(ds)
        self.total = self.n_documents if self.n_documents > 1 else 2  # one row: two halves
        if not self.n_documents:
            raise _fail(label, "data.source", "no rows: the corpus is empty")
        extra = {"hub": label, "dataset": getattr(ds, "_fingerprint", "")} if not files else {}
        self.fingerprint = self._fingerprint(data, extra)
        self.val_fraction = data.val_fraction
        self.mask = val_mask(self.n_documents, data.val_fraction, data.seed)

    def _columns(self) -> Iterator[list[Any]]:
        """The text column in batches of rows, read from the arrow cache files.

        datasets memory-maps those files, and every page touched stays in the process's RSS
        (as page cache) until the end, so RSS would grow with the corpus. Reading the same
        record batches through a plain file keeps it flat. A dataset that is not simply its
        cache files (in memory, or re-indexed) is iterated through datasets instead.
        """
        import pyarrow as pa

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
        if rows != self.n_documents:  # a datasets change we do not know: fail loudly, not wrong
            raise RuntimeError(f"read {rows} rows from {files}, expected {self.n_documents}")

    def texts(self) -> Iterator[str]:
        """Every row's text in order, chat rows rendered, before any split (`minillm eval`)."""
        return self._texts()

    def _texts(self) -> Iterator[str]:
        for column in self._columns():
            for value in column:
                yield value or ""

    def _conversations(self) -> Iterator[list[dict[str, str]]]:
        row = 0
        for column in self._columns():
            for value in column:
                row += 1
                yield check_messages(value, self.label, row, self.field)

    def documents(self) -> Iterator[Document]:
        if self.chat:
            if self.n_documents == 1:
                raise _fail(
                    self.label,
                    "data.val_fraction",
                    "one conversation cannot be split into train and validation; add rows",
                )
            for messages, is_val in zip(self._conversations(), self.mask):
                yield Document("val" if is_val else "train", messages=messages)
            return
        if self.n_documents == 1:
            text = next(self._texts())
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
        for text, is_val in zip(self._texts(), self.mask):
            if text:
                yield Document("val" if is_val else "train", text=text)


# ----------------------------------------------------------------------------- sources


def _looks_like_hub(source: str) -> bool:
    if not _HUB_NAME.match(source) or Path(source).suffix:
        return False
    owner = source.split("/")[0]
    return "/" not in source or not Path(owner).is_dir()


def _resolve_files(source: str, fmt: str) -> list[Path] | None:
    """The files a source names, sorted; None when it is a hub dataset name."""
    if any(c in source for c in "*?["):
        files = sorted(
            Path(m)
            for m in glob.glob(os.path.expanduser(source), recursive=True)
            if os.path.isfile(m)
        )
        if not files:
            raise _fail(source, "data.source", "no files match this pattern")
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            files = sorted(
                f
                for f in path.rglob("*")
                if f.is_file() and not any(p.startswith(".") for p in f.relative_to(path).parts)
            )
            if fmt == "auto":
                files = [f for f in files if f.suffix.lower() in EXTENSIONS]
            if not files:
                kinds = ", ".join(EXTENSIONS)
                raise _fail(source, "data.source", f"no data files in this folder ({kinds})")
        elif path.exists():
            files = [path]
        elif _looks_like_hub(source):
            return None
        else:
            raise _fail(source, "data.source", "no such file or folder")
    for f in files:
        try:
            open(f, "rb").close()
        except OSError as e:
            raise _fail(f, "data.source", f"cannot read: {e.strerror or e}") from None
    return files


def _format_of(files: list[Path], fmt: str, source: str) -> str:
    if fmt != "auto":
        return fmt
    kinds = set()
    for f in files:
        kind = EXTENSIONS.get(f.suffix.lower())
        if kind is None:
            what = f"'{f.suffix}' files" if f.suffix else "files without an extension"
            raise _fail(
                f,
                "data.format",
                f"cannot tell the format of {what}; set text, json, parquet or csv",
            )
        kinds.add(kind)
    if len(kinds) > 1:
        raise _fail(
            source, "data.format", f"mixed formats ({', '.join(sorted(kinds))}); use one kind"
        )
    return kinds.pop()


def _quiet_datasets() -> None:
    import datasets
    import huggingface_hub

    datasets.disable_progress_bars()
    # CRITICAL, not ERROR: the loaders log "Failed to load JSON from file ..." before raising,
    # and the error line below already carries their reason.
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    huggingface_hub.utils.logging.set_verbosity_error()  # no "Retrying in 1s" lines offline


def _load_files(fmt: str, files: list[Path], source: str) -> Any:
    import datasets

    _quiet_datasets()
    try:
        return datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # datasets/pyarrow raise many types for unparsable files
        where = files[0] if len(files) == 1 else source
        e = _reason(e)
        raise _fail(where, "data.source", f"cannot read as {fmt}: {_first_line(e)}") from None


def _load_hub(name: str) -> Any:
    import datasets

    _quiet_datasets()
    try:
        return datasets.load_dataset(name, split="train")
    except ConnectionError:
        raise _fail(
            name,
            "data.source",
            "not a local file or folder, and the Hugging Face hub is unreachable to look it up",
        ) from None
    except Exception as e:
        raise _fail(
            name, "data.source", f"not a local file or folder, nor a hub dataset: {_first_line(e)}"
        ) from None


def open_corpus(data: DataConfig) -> Corpus:
    """Resolve `data.source` and open it; every problem is a UserError naming the file and key."""
    files = _resolve_files(data.source, data.format)
    if files is None:
        return TableCorpus(_load_hub(data.source), [], "hub", data, data.source)
    fmt = _format_of(files, data.format, data.source)
    if fmt == "text":
        return TextCorpus(files, data)
    label = str(files[0]) if len(files) == 1 else data.source
    return TableCorpus(_load_files(fmt, files, data.source), files, fmt, data, label)
