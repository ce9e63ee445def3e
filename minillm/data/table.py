"""Rows of json/jsonl, parquet, csv files or a hub dataset as documents: `TableCorpus`.

Loaded through `datasets` (minillm.data.sources): a `Dataset` converted once to the arrow cache
and read from its files, or, with `data.streaming`, an `IterableDataset` read as a stream. Each
row's `data.text_field` is one document (empty rows are skipped), or with a column of chat
messages one conversation. What a corpus is, its prefix and split: minillm.data.corpus.

A stream cannot be indexed, so an interrupted `minillm tokenize` resumes it from a cursor: the
`datasets` state of the stream where a batch of rows starts (`IterableDataset.state_dict`), with
the rows, documents and bytes before it. A hub dataset is then not read again from its start.

A row whose text is not UTF-8 (arrow loads json and parquet without checking; reading the value
fails) is read again with its strings as bytes and handled as `data.decode_errors` says: one error
line naming the row, U+FFFD in place of the invalid bytes, or the row left out (counted). A stream
and a csv file are decoded by `datasets` itself, so there invalid UTF-8 is always an error.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from minillm.config import DataConfig
from minillm.data.arrow_text import Undecodable, decoded, pylist
from minillm.data.chat_formats import (
    ALPACA_FIELDS,
    is_sharegpt_value,
    pick_chat_format,
    to_messages,
)
from minillm.data.corpus import (
    Corpus,
    Document,
    check_val_documents,
    corpus_error,
    error_reason,
    first_line,
    tail_cut,
    val_mask,
)
from minillm.data.jsonl_check import is_chat_value, json_kind, jsonl_problem
from minillm.data.text import NOT_UTF8
from minillm.errors import ConfigError, warn
from minillm.tokenizer.chat_template import check_messages, content_bytes

ROWS_PER_BATCH = 512  # rows fetched from arrow at a time


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


def _is_sharegpt(kind: Any, value: Any) -> bool:
    """Whether a column (its arrow type, or a stream's first value) holds ShareGPT turns."""
    import pyarrow as pa

    if kind is None:
        return is_sharegpt_value(value)
    return (
        (pa.types.is_list(kind) or pa.types.is_large_list(kind))
        and pa.types.is_struct(kind.value_type)
        and {"from", "value"} <= {f.name for f in kind.value_type}
    )


def _datasets_version() -> str:
    import datasets

    return str(datasets.__version__)


class TableCorpus(Corpus):
    """Rows of a `datasets.Dataset` (json, parquet, csv files or a hub dataset), one per row, or
    of a `datasets.IterableDataset` (data.streaming): the same rows, read as a stream."""

    unit = "documents"

    def __init__(
        self, ds: Any, files: list[Path], fmt: str, data: DataConfig, label: str, revision: str = ""
    ) -> None:
        """revision: a hub dataset's commit sha ("" unknown), part of its fingerprint: a resume
        refuses a dataset changed upstream since the interruption."""
        import datasets

        self.label, self.files, self.format = label, files, fmt
        self._start = {"row": 0, "documents": 0, "nbytes": 0}  # where documents() begins
        self._pos = dict(self._start)  # rows, documents and bytes read by documents() so far
        self._mark: dict[str, Any] | None = None  # the stream's cursor where its batch began
        self._start_cursor: dict[str, Any] | None = None  # seek's: where the stream begins
        self.streaming = isinstance(ds, datasets.IterableDataset)
        self.decode_errors = data.decode_errors
        self.max_documents, self.max_bytes = data.max_documents, data.max_bytes
        self.val_documents, self.val_fraction = data.val_documents, data.val_fraction
        self.ds = ds
        columns, kind, value, first = ds.column_names, None, None, None
        if self.streaming and ds.features is None:  # json: the columns are known once read
            self.layout, self.field = "auto", data.text_field  # as _batches reads them
            first = next(self._batches(), None)
            columns = list(first) if first is not None else []
        # ShareGPT and Alpaca rows become messages as they are read (minillm.data.chat_formats)
        self.layout, field = pick_chat_format(data.chat_format, data.text_field, columns or [])
        self.field = field
        if self.streaming and ds.features is not None:
            kind = ds.features.arrow_schema.field(field).type if field in columns else None
        elif self.streaming:
            value = first[field][0] if first is not None and field in first else None
        else:
            kind = ds.data.schema.field(field).type if field in columns else None
        self.read = [field]  # the columns read: Alpaca's three, otherwise the one
        if self.layout == "alpaca":
            self.read = [c for c in ALPACA_FIELDS if c in (columns or [])]
            if "output" not in self.read and (columns or not self.streaming):
                found = ", ".join(columns or []) or "none"
                message = f"no column 'output' for data.chat_format alpaca (columns found: {found})"
                raise corpus_error(label, "data.chat_format", message)
        if field not in (columns or []) and (columns or not self.streaming):
            found = ", ".join(columns or []) or "none"
            message = f"no column {field!r} (columns found: {found})"
            raise corpus_error(label, "data.text_field", message)
        chat = _is_chat_type(kind) if kind is not None else is_chat_value(value)
        if kind is not None and chat is None and not self.streaming and len(ds):
            value = ds[0][field]  # a column arrow keeps as JSON (turns with differing keys)
        if self.layout in ("auto", "sharegpt") and not chat and _is_sharegpt(None, value):
            self.layout, chat = "sharegpt", True
        elif self.layout in ("auto", "sharegpt") and not chat and _is_sharegpt(kind, value):
            self.layout, chat = "sharegpt", True
        elif self.layout == "alpaca":
            chat = True
        elif self.layout == "sharegpt" and chat is not None:
            message = f"column {field!r} holds {kind or json_kind(value)}, not ShareGPT turns"
            raise corpus_error(label, "data.chat_format", message)
        if chat is None and (problem := jsonl_problem(files, field)) is not None:
            raise problem  # the line at fault, not only the column's type
        if chat is None:
            held = kind if kind is not None else type(value).__name__
            raise corpus_error(
                label,
                "data.text_field",
                f"column {field!r} holds {held}, not text or a list of {{role, content}} messages",
            )
        self.chat = chat
        self.ds = ds.select_columns(self.read) if columns else ds
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
                raise corpus_error(label, "data.source", "no rows: the corpus is empty")
            self.total = n if n > 1 else 2  # one row: two halves
            if self.val_documents and n > 1:
                check_val_documents(data, n, label)
            elif not self.val_documents:
                self.mask = val_mask(n, data.val_fraction, data.seed)
        # A hub dataset is known by its revision (the same streamed or loaded); without one, a
        # loaded copy by what `datasets` hashed of it.
        known = self.streaming or revision
        dataset = "" if known else getattr(ds, "_fingerprint", "")
        extra = {"hub": label, "revision": revision, "dataset": dataset} if not files else {}
        if data.chat_format != "auto":  # so a fingerprint taken before the key stays valid
            extra["chat_format"] = data.chat_format
        self.fingerprint = self._fingerprint(data, extra)

    def _batches(self) -> Iterator[dict[str, list[Any]]]:
        """A stream's rows in batches; a file that fails to parse is one error line."""
        batches = iter(self.ds.iter(batch_size=ROWS_PER_BATCH))
        # Before the first batch, the dataset's state is still that of its previous pass (the
        # tokenizer's): the cursor is where this pass began.
        self._mark = self._start_cursor
        first = True
        while True:
            if not first:
                self._mark = self._cursor_here()
            first = False
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as e:  # datasets/pyarrow raise many types for unparsable files
                if self.format == "hub" and isinstance(e, ConnectionError):
                    message = "a hub dataset, and the Hugging Face hub is unreachable to read it"
                elif isinstance(error_reason(e), UnicodeDecodeError):
                    message = (
                        f"not UTF-8 text ({first_line(error_reason(e))}); data.decode_errors "
                        "reads past it only without data.streaming"
                    )
                else:
                    what = "the hub dataset" if self.format == "hub" else f"as {self.format}"
                    message = f"cannot read {what}: {first_line(error_reason(e))}"
                raise corpus_error(self.label, "data.source", message) from None
            yield batch

    def _cursor_here(self) -> dict[str, Any] | None:
        """The stream's state before its next batch, with what was read before it; None when
        `datasets` has none or it is not JSON (state.json holds it)."""
        state = self.ds.state_dict()
        try:
            json.dumps(state)
        except (TypeError, ValueError):
            return None
        if state is None:
            return None
        return {**self._pos, "state": state, "datasets": _datasets_version()}

    def cursor(self) -> dict[str, Any] | None:
        return self._mark if self.streaming else None

    def seek(self, cursor: dict[str, Any] | None) -> int:
        """Resume a stream where a batch began (`IterableDataset.load_state_dict`): the rows
        before it are not read again, a hub dataset's not downloaded again."""
        if not self.streaming or not cursor:
            return 0
        if cursor.get("datasets") != _datasets_version():  # its state may mean other positions
            warn(
                f"{self.label}: the stream's position was saved by datasets "
                f"{cursor.get('datasets')}, this is {_datasets_version()}; reading it again "
                "from the start"
            )
            return 0
        try:
            self.ds.load_state_dict(cursor["state"])
            start = {k: int(cursor[k]) for k in ("row", "documents", "nbytes")}
        except Exception as e:  # another datasets version's state, say: read from the start
            warn(
                f"{self.label}: cannot resume the stream where it stopped ({first_line(e)}); "
                "reading it again from the start"
            )
            return 0
        self._start, self._start_cursor = start, {**start, "state": cursor["state"]}
        return start["documents"]

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
                    raise corpus_error(self.label, "data.text_field", message)
                yield self._values({c: batch.get(c) for c in self.read})
            return
        files = [f["filename"] for f in self.ds.cache_files]
        if not files or getattr(self.ds, "_indices", None) is not None:
            for table in self.ds.with_format("arrow").iter(batch_size=ROWS_PER_BATCH):
                yield self._values({c: pylist(table.column(c).combine_chunks()) for c in self.read})
            return
        rows = 0
        for name in files:
            with pa.OSFile(name) as f:
                for batch in pa.ipc.open_stream(f):
                    rows += batch.num_rows
                    yield self._values({c: pylist(batch.column(c)) for c in self.read})
        if rows != self.n_rows:  # a datasets change we do not know: fail loudly, not wrong
            raise RuntimeError(f"read {rows} rows from {files}, expected {self.n_rows}")

    def _values(self, columns: dict[str, list[Any] | None]) -> list[Any]:
        """A batch's values: the one column's, or for Alpaca one {column: value} dict a row."""
        if self.layout != "alpaca":
            return columns[self.field] or []
        n = max(len(v) for v in columns.values() if v is not None)
        lists = {c: v if v is not None else [None] * n for c, v in columns.items()}
        return [{c: lists[c][i] for c in lists} for i in range(n)]

    def texts(self) -> Iterator[str]:
        """Every row's text in order, before any split (`minillm eval`); a chat column is scored
        per conversation instead (minillm.infer.evaluate_chat), so here it is refused in one
        line."""
        if self.chat:
            raise corpus_error(
                self.label,
                "data.text_field",
                f"column {self.field!r} holds chat messages: eval scores conversations from a "
                ".jsonl or .json file",
            )
        rows = itertools.chain.from_iterable(self._columns())
        for i, value in enumerate(rows):
            value, mark = self._decode(value, i)
            if mark != "skipped":
                yield value or ""

    def _decode(self, value: Any, row: int) -> tuple[Any, str]:
        """A row's value and "", or for one not UTF-8 (data.decode_errors) its value with U+FFFD
        and "replaced", or None and "skipped"; strict: one error line naming the row."""
        if not isinstance(value, Undecodable):
            return value, ""
        if self.decode_errors == "skip_document":
            return None, "skipped"
        if self.decode_errors == "replace":
            return decoded(value.raw, "replace"), "replaced"
        message = f"row {row + 1}: {self.field}: not UTF-8 text; {NOT_UTF8}"
        raise corpus_error(self.label, "data.source", message)

    def _rows(self) -> Iterator[tuple[int, str | list[dict[str, str]] | None, str]]:
        """(index, text or checked conversation, "" or how data.decode_errors read it: replaced
        or skipped, the value then None) of the rows kept: the first max_documents, and those
        that start before the text totals max_bytes."""
        nbytes = self._start["nbytes"]
        with contextlib.closing(self._columns()) as columns:
            rows = itertools.chain.from_iterable(columns)
            for i, value in enumerate(rows, start=self._start["row"]):
                if self.max_documents and i >= self.max_documents:
                    return
                if self.max_bytes and nbytes >= self.max_bytes:
                    return
                value, mark = self._decode(value, i)
                if mark == "skipped":
                    self._pos["row"] = i + 1
                    yield i, None, mark
                    continue
                if self.chat:
                    value = to_messages(self.layout, value, self.label, i + 1, self.field)
                    try:
                        value = check_messages(value, self.label, i + 1, self.field)
                    except ConfigError as e:
                        if self.layout in ("sharegpt", "alpaca"):  # no jsonl messages to name
                            raise
                        # A jsonl file's rows are named by their lines (blank lines count)
                        raise (jsonl_problem(self.files, self.field) or e) from None
                    nbytes += content_bytes(value) if self.max_bytes else 0
                else:
                    value = value or ""
                    nbytes += len(value.encode("utf-8")) if self.max_bytes else 0
                self._pos["row"], self._pos["nbytes"] = i + 1, nbytes
                yield i, value, mark

    def documents(self) -> Iterator[Document]:
        if self.n_documents == 1 and self.mask is not None:
            if self.chat:
                raise corpus_error(
                    self.label,
                    "data.val_fraction",
                    "one conversation cannot be split into train and validation; add rows",
                )
            _, value, mark = next(self._rows())
            if mark == "skipped":
                message = "no text: its one row is not UTF-8, left out by data.decode_errors"
                raise corpus_error(self.label, "data.source", message)
            text, replaced = str(value), mark == "replaced"
            cut = tail_cut([text], len(text.encode("utf-8")), self.val_fraction)
            if cut is None:
                raise corpus_error(
                    self.label,
                    "data.val_fraction",
                    "one row, too short to split off a validation tail; add text or rows",
                )
            yield Document("train", text=text[: cut[1]], replaced=replaced)
            yield Document("val", text=text[cut[1] :], replaced=replaced)
            return
        self._pos = dict(self._start)
        for i, value, mark in self._rows():
            split = "val" if self._is_val(i) else "train"
            if isinstance(value, list) or value or mark == "skipped":
                self._pos["documents"] += 1  # before the yield: a cursor taken after it counts it
                if mark == "skipped":
                    yield Document(split, skipped=True)
                elif isinstance(value, list):
                    yield Document(split, messages=value, replaced=mark == "replaced")
                else:
                    yield Document(split, text=value, replaced=mark == "replaced")
