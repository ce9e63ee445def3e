"""Writing token shards: the pass behind `minillm tokenize` (minillm.data.prepare_data).

Offers `write_shards(cfg, retrain) -> summary` and `print_summary(summary)`; the format of the
files is described in minillm.data.

Steps: open the corpus (minillm.data.corpus); reuse the tokenizer, or train one on the train split
with a progress bar over the text it reads; then one pass over the documents that encodes each
split's pieces in ~1 MB batches (`encode_batch_fast`: the ids of `encode_batch`, no offsets,
multithreaded in Rust) on a worker thread while this thread reads ahead and writes the previous
batch. Ids go straight to a temporary file, so memory does not grow with the corpus.

Crash safety: tokenizer.json (when trained), train.bin, val.bin and meta.json are all written to
temporary names and fsynced (with chat data and the loss on the assistant, also train.mask and
val.mask: one byte per token, 1 = a training target); only when all are whole is meta.json removed,
the others renamed into place and the new meta.json renamed in last. Until then the previous files
are untouched; during the renames no meta.json exists, so no reader can pair old counts with new
files.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minillm.config import Config
from minillm.data.chat_shards import ChatEncoder, resolve_loss_on
from minillm.data.corpus import Corpus, Document, open_corpus
from minillm.data.meta import (
    MASK_SUFFIX,
    META_VERSION,
    SPLITS,
    TOKEN_DTYPES,
    data_record,
    shard_dtype,
)
from minillm.data.text import split_pieces
from minillm.data.tokenizer import (
    check_tokenizer,
    check_vocab_size,
    eot_id,
    load_tokenizer,
    tokenizer_sha256,
    train_tokenizer,
)
from minillm.errors import ConfigError, UserError
from minillm.runtime.files import StagedFile, ensure_writable_dir, fsync_dir, removing_new_dirs
from minillm.runtime.progress import Progress

if TYPE_CHECKING:
    from rich.console import Console
    from tokenizers import Encoding, Tokenizer

BATCH_CHARS = 1 << 20  # text per encode_batch call: enough pieces for every core, ~30 MB of ids


# ----------------------------------------------------------------------------- writing


class _ShardWriter(StagedFile):
    """Appends ids to a staged shard, counting and hashing what it writes."""

    def __init__(self, path: Path, dtype: str) -> None:
        super().__init__(path)
        self.dtype = TOKEN_DTYPES.get(dtype) or np.dtype(dtype)  # a mask file: "u1"
        self.sha = hashlib.sha256()
        self.tokens = 0
        self.file = open(self.tmp, "wb")  # closed by finish() or discard()

    def write(self, ids: np.ndarray) -> None:
        data = ids.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.tokens += len(ids)

    def finish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def discard(self) -> None:
        self.file.close()
        super().discard()


class _SplitEncoder:
    """Collects one split's pieces and encodes them in parallel batches into its shard.

    A batch is encoded on `pool`'s thread (Rust releases the GIL and fans out over every core)
    while this thread reads the next one and writes the previous one's ids, so reading and
    writing hide behind encoding. Progress advances when a batch is written, not when it is read.
    """

    def __init__(
        self,
        tok: Tokenizer,
        eot: int,
        writer: _ShardWriter,
        pool: Executor,
        progress: Progress,
        by_bytes: bool,
    ) -> None:
        self.tok, self.eot, self.writer, self.pool = tok, eot, writer, pool
        self.progress, self.by_bytes = progress, by_bytes
        self.pieces: list[str] = []
        self.ends: list[bool] = []  # whether a piece is the last of its document
        self.chars = 0
        self.units = self.nbytes = 0  # progress units and bytes of the batch being collected
        self.pending: tuple[Future[list[Encoding]], list[bool], int, int] | None = None
        self.seconds = 0.0  # spent encoding this split's batches

    def add_document(self, doc: Document) -> int:
        """Queue the document's pieces; returns its UTF-8 bytes."""
        nbytes, chars, prev = doc.nbytes, 0, None
        for piece in split_pieces(doc.blocks()):  # one piece behind, to know which is last
            if prev is not None:
                self._add(prev, False)
            chars += len(piece)
            prev = piece
        # Pieces were counted in characters; settle the document at its exact bytes.
        self.units += (nbytes - chars) if self.by_bytes else 1
        self.nbytes += nbytes - chars
        self._add(prev or "", True)
        return nbytes

    def _add(self, piece: str, end: bool) -> None:
        self.pieces.append(piece)
        self.ends.append(end)
        self.chars += len(piece)
        self.units += len(piece) if self.by_bytes else 0
        self.nbytes += len(piece)
        if self.chars >= BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        """Start encoding the collected pieces, then write the batch before them."""
        started = None
        if self.pieces:
            future = self.pool.submit(self._encode_batch, self.pieces)
            started = (future, self.ends, self.units, self.nbytes)
            self.pieces, self.ends, self.chars, self.units, self.nbytes = [], [], 0, 0, 0
        self._write_pending()
        self.pending = started

    def finish(self) -> None:
        self.flush()
        self._write_pending()

    def _encode_batch(self, pieces: list[str]) -> list[Encoding]:
        start = time.perf_counter()
        encodings = self.tok.encode_batch_fast(pieces, add_special_tokens=False)
        self.seconds += time.perf_counter() - start  # only the pool's one thread adds here
        return encodings

    def _write_pending(self) -> None:
        if self.pending is None:
            return
        future, ends, units, nbytes = self.pending
        self.pending = None
        eot = (self.eot,)
        ids = itertools.chain.from_iterable(
            itertools.chain(enc.ids, eot) if end else enc.ids
            for enc, end in zip(future.result(), ends)
        )
        self.writer.write(np.fromiter(ids, dtype=self.writer.dtype))  # no list of all ids
        self.progress.update(self.progress.done + units, self.progress.nbytes + nbytes)


def _train(corpus: Corpus, vocab_size: int, console: Console) -> Tokenizer:
    """Train the tokenizer on the train split, with a progress bar over the text it reads."""
    by_bytes = corpus.unit == "bytes"
    docs = [d for d in corpus.documents() if d.split == "train"] if by_bytes else None
    total = sum(d.nbytes for d in docs) if docs is not None else int((~corpus.mask).sum())
    progress = Progress("train tokenizer", total, console)
    seen = 0

    def texts() -> Iterator[str]:
        nonlocal seen
        for doc in docs if docs is not None else corpus.documents():
            if doc.split != "train":
                continue
            nbytes, done = doc.nbytes, progress.done
            # A conversation's contents are trained on one by one, as they are encoded.
            chat = doc.messages is not None
            pieces = (m["content"] for m in doc.messages) if chat else split_pieces(doc.blocks())
            for piece in pieces:
                if by_bytes:  # in characters ~ bytes, settled at the document's end
                    progress.update(progress.done + len(piece), progress.nbytes + len(piece))
                yield piece
            seen += nbytes
            progress.update(done + (nbytes if by_bytes else 1), seen)
        progress.describe("train tokenizer: merging")  # the trainer's last step, after reading

    try:
        tok = train_tokenizer(texts(), vocab_size)
    except ConfigError as err:
        if not seen and err.key == "data.vocab_size":  # the tokenizer saw no text at all
            raise ConfigError(
                "data.source",
                "no text in the train split: the corpus is empty, or all of its text went to "
                "validation (data.val_fraction)",
                corpus.label,
            ) from None
        raise  # the corpus's own error (say, a row too short to split), as it was
    finally:
        progress.close()
    return tok


def _encode(
    corpus: Corpus,
    tok: Tokenizer,
    writers: dict[str, _ShardWriter],
    masks: dict[str, _ShardWriter] | None,
    console: Console,
) -> dict[str, dict[str, Any]]:
    """One pass over the corpus into both shards; per split: documents, bytes, encoding seconds,
    and (chat data) target tokens and the bytes they spell. `masks`: loss on the assistant."""
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a text is text, not a boundary
    eot = eot_id(tok)
    stats = {s: {"documents": 0, "bytes": 0, "seconds": 0.0} for s in SPLITS}
    by_bytes = corpus.unit == "bytes"
    progress = Progress("encode", corpus.total, console)
    try:
        # On an error the pool waits for the batch in flight (a second or so), then is gone.
        with ThreadPoolExecutor(1, thread_name_prefix="encode") as pool:
            encoders: dict[str, _SplitEncoder | ChatEncoder] = {
                s: ChatEncoder(tok, eot, writers[s], masks[s] if masks else None, progress)
                if getattr(corpus, "chat", False)
                else _SplitEncoder(tok, eot, writers[s], pool, progress, by_bytes)
                for s in SPLITS
            }
            for doc in corpus.documents():
                stats[doc.split]["bytes"] += encoders[doc.split].add_document(doc)
                stats[doc.split]["documents"] += 1
            for s in SPLITS:
                enc = encoders[s]
                enc.finish()
                stats[s]["seconds"] = enc.seconds
                if isinstance(enc, ChatEncoder):
                    stats[s]["targets"], stats[s]["target_bytes"] = enc.targets, enc.target_bytes
    finally:
        progress.close()
    return stats


def _split_summary(documents: int, nbytes: int, tokens: int, seconds: float) -> dict[str, Any]:
    return {
        "documents": documents,
        "bytes": nbytes,
        "tokens": tokens,
        "bytes_per_token": nbytes / tokens if tokens else 0.0,
        "seconds": seconds,
        "mb_per_s": nbytes / 1e6 / seconds if seconds > 0 else 0.0,
    }


def _check_splits(stats: dict[str, dict[str, Any]], corpus: Corpus) -> None:
    if not stats["train"]["bytes"] + stats["val"]["bytes"]:
        raise ConfigError("data.source", "no text: the corpus is empty", corpus.label)
    for s in SPLITS:
        if not stats[s]["documents"]:
            raise ConfigError(
                "data.val_fraction", f"the {s} split has no text (empty documents are skipped)"
            )


def _commit(staged: list[StagedFile], meta_path: Path, remove: list[Path]) -> None:
    """Swap the staged files in, meta.json (the last of `staged`) last.

    From the unlink until the new meta.json lands no meta.json exists, so no reader can pair the
    old token counts with new shards. Only renames here: nothing that could fill a disk.
    """
    meta_path.unlink(missing_ok=True)
    for path in remove:
        path.unlink(missing_ok=True)
    for s in staged:
        s.commit()
    for folder in {s.path.parent for s in staged}:
        fsync_dir(folder)


def write_shards(cfg: Config, retrain: bool = False) -> dict[str, Any]:
    """What `minillm.data.prepare_data` does (see there and the module docstring).

    A failure leaves no folder behind that it created (an empty data.out_dir).
    """
    with removing_new_dirs(cfg.data.out_dir, cfg.data.tokenizer_path.parent):
        return _write_shards(cfg, retrain)


def _write_shards(cfg: Config, retrain: bool) -> dict[str, Any]:
    from rich.console import Console

    data = cfg.data
    start = time.perf_counter()
    out_dir, tok_path = Path(data.out_dir), data.tokenizer_path
    reuse = tok_path.exists() and not retrain
    if not reuse:
        check_vocab_size(data.vocab_size)  # before any pass over the data
    corpus = open_corpus(data)
    ensure_writable_dir(out_dir, "data.out_dir")
    if not reuse:
        ensure_writable_dir(tok_path.parent, "data.tokenizer")
    console = Console(highlight=False)
    staged: list[StagedFile] = []
    try:
        if reuse:
            tok = load_tokenizer(tok_path)
            check_tokenizer(tok, data.vocab_size, tok_path)
            tok_sha, tok_seconds = tokenizer_sha256(tok_path), 0.0
        else:
            train_start = time.perf_counter()
            tok = _train(corpus, data.vocab_size, console)
            tok_seconds = time.perf_counter() - train_start
            tok_json = tok.to_str()
            staged.append(StagedFile.text(tok_path, tok_json))
            tok_sha = hashlib.sha256(tok_json.encode("utf-8")).hexdigest()
        vocab, dtype = tok.get_vocab_size(), shard_dtype(tok.get_vocab_size())
        chat = bool(getattr(corpus, "chat", False))
        loss_on = resolve_loss_on(data, chat, corpus.label)
        writers = {s: _ShardWriter(out_dir / f"{s}.bin", dtype) for s in SPLITS}
        staged += writers.values()
        masks = None
        if loss_on == "assistant":
            masks = {s: _ShardWriter(out_dir / f"{s}{MASK_SUFFIX}", "u1") for s in SPLITS}
            staged += masks.values()
        pass_start = time.perf_counter()
        stats = _encode(corpus, tok, writers, masks, console)
        for w in [*writers.values(), *(masks or {}).values()]:
            w.finish()
        pass_seconds = time.perf_counter() - pass_start
        _check_splits(stats, corpus)
        meta: dict[str, Any] = {"version": META_VERSION, "dtype": dtype, "vocab_size": vocab}
        meta["eot_id"] = eot_id(tok)
        for s in SPLITS:
            meta[s] = {
                "tokens": writers[s].tokens,
                "bytes": stats[s]["bytes"],
                "documents": stats[s]["documents"],
                "sha256": writers[s].sha.hexdigest(),
                "targets": stats[s].get("targets", writers[s].tokens),
                "target_bytes": stats[s].get("target_bytes", stats[s]["bytes"]),
            }
            if masks:
                meta[s]["mask_sha256"] = masks[s].sha.hexdigest()
        meta["chat"], meta["loss_on"] = chat, loss_on
        meta["tokenizer_sha256"] = tok_sha
        meta["source_fingerprint"] = corpus.fingerprint
        meta["data"] = data_record(data)
        meta_path = out_dir / "meta.json"
        staged.append(StagedFile.text(meta_path, json.dumps(meta, indent=2) + "\n"))
        # Masks of an earlier tokenize must not pair with these new shards.
        stale = [] if masks else [out_dir / f"{s}{MASK_SUFFIX}" for s in SPLITS]
        _commit(staged, meta_path, stale)
    except BaseException as e:
        for s in staged:
            s.discard()
        if isinstance(e, OSError):  # a full disk, a quota, an I/O error: say so in one line
            raise UserError(
                f"{out_dir}: writing the tokenizer and shards failed ({e.strerror or e}); "
                "free some space and run `minillm tokenize` again"
            ) from None
        raise
    splits = {
        s: _split_summary(
            stats[s]["documents"], stats[s]["bytes"], writers[s].tokens, stats[s]["seconds"]
        )
        for s in SPLITS
    }
    splits["total"] = _split_summary(
        *(sum(splits[s][k] for s in SPLITS) for k in ("documents", "bytes", "tokens")),
        pass_seconds,
    )
    return {
        "out_dir": str(out_dir),
        "dtype": dtype,
        "vocab_size": vocab,
        "tokenizer": {"path": str(tok_path), "trained": not reuse, "seconds": tok_seconds},
        "splits": splits,
        "seconds": time.perf_counter() - start,
    }


def print_summary(summary: dict[str, Any]) -> None:
    """The table `minillm tokenize` prints: per split and in total, then what the numbers mean."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{summary['out_dir']} ({summary['dtype']}, vocab {summary['vocab_size']})")
    for name in ("split", "documents", "bytes", "tokens", "bytes/token", "MB/s"):
        table.add_column(name, justify="left" if name == "split" else "right")
    for name, s in summary["splits"].items():
        table.add_row(
            name,
            f"{s['documents']:,}",
            f"{s['bytes']:,}",
            f"{s['tokens']:,}",
            f"{s['bytes_per_token']:.2f}",
            f"{s['mb_per_s']:.1f}",
        )
    tok = summary["tokenizer"]
    how = f"trained in {tok['seconds']:.1f}s" if tok["trained"] else "reused"
    console = Console(highlight=False)
    console.print(table)
    console.print(
        f"MB/s: per split, encoding only; total, the whole pass (read, encode, write). "
        f"Tokenizer {tok['path']} {how}; {summary['seconds']:.1f}s in all."
    )
