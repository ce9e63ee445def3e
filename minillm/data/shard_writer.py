"""Writing token shards: the pass behind `minillm tokenize` (`write_shards`).

Offers `write_shards(cfg, retrain) -> summary` (minillm.data.summary prints it); the format of the
files is described in minillm.data.

Steps: open the corpus (minillm.data.sources); reuse the tokenizer, or train one on the train split
with a progress bar over the text it reads; then one pass over the documents that cuts each
split's text into pieces and queues them in ~1 MB batches, encoded on a thread or in
`data.num_proc` worker processes (minillm.data.encode_pool) while this thread reads ahead, and
written in order as they come back. Ids go straight to the shard files, so memory does not grow
with the corpus, and the shards are the same for every `num_proc`.

Shards, resume and crash safety: ids go to numbered shards of `data.shard_tokens` tokens (with
chat data and the loss on the assistant, a `.mask` twin each: one byte per token, 1 = a training
target) in the staging folder `<out_dir>/.partial/`, with a newly trained tokenizer.json; every
CHECKPOINT_BYTES of text a checkpoint records how far the pass got (minillm.data.shard_staging), so
Ctrl-C or kill -9 and a rerun continue from there, and a rerun whose inputs changed is refused.
Only when the pass is whole are meta.json removed, the old shards removed, the new ones renamed
into place and the new meta.json written last. Until then the previous files are untouched;
during the renames no meta.json exists, so no reader can pair old counts with new files.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minillm.config import Config
from minillm.data import shard_staging as staging_mod
from minillm.data.chat_encode import ChatBatches, resolve_loss_on
from minillm.data.corpus import Corpus, Document, prefix_keys
from minillm.data.encode_pool import Encoded, EncodePool, default_num_proc, encode_text
from minillm.data.meta import (
    MASK_SUFFIX,
    SPLITS,
    shard_dtype,
)
from minillm.data.shard_staging import (
    ShardWriter,
    Staging,
    commit,
    make_meta,
    pass_inputs,
    resume_writers,
)
from minillm.data.sources import open_corpus
from minillm.data.summary import split_summary
from minillm.data.text import split_pieces
from minillm.data.tokenizer import (
    check_tokenizer,
    check_vocab_size,
    eot_id,
    load_tokenizer,
    tokenizer_sha256,
)
from minillm.data.tokenizer_train import train_on_corpus
from minillm.errors import ConfigError, UserError, warn
from minillm.runtime.files import (
    atomic_write_text,
    ensure_writable_dir,
    removing_new_dirs,
)
from minillm.runtime.progress import Progress

if TYPE_CHECKING:
    from rich.console import Console
    from tokenizers import Tokenizer

BATCH_CHARS = 1 << 20  # text per encode_batch call: enough pieces for every core, ~30 MB of ids


# ----------------------------------------------------------------------------- writing


class _TextBatches:
    """Collects one split's text pieces into batches of ~BATCH_CHARS for `encode_text`, run by
    `pool` (on a thread or in workers: minillm.data.encode_pool).

    A batch's tag for the pool's writer is (split, progress units, bytes): bytes when the bar
    counts bytes (pieces counted in characters, settled at each document's exact bytes), else
    documents.
    """

    def __init__(self, split: str, pool: EncodePool, eot: int, dtype: str, by_bytes: bool):
        self.split, self.pool, self.eot, self.dtype = split, pool, eot, dtype
        self.by_bytes = by_bytes
        self.pieces: list[str] = []
        self.ends: list[bool] = []  # whether a piece is the last of its document
        self.chars = 0
        self.units = self.nbytes = 0  # progress units and bytes of the batch being collected

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

    def flush(self, last: bool = False) -> None:
        if self.pieces:
            tag = (self.split, self.units, self.nbytes)
            args = (self.pieces, self.ends, self.eot, self.dtype)
            self.pool.submit(encode_text, *args, tag=tag, last=last)
            self.pieces, self.ends, self.chars, self.units, self.nbytes = [], [], 0, 0, 0


def _encode(
    corpus: Corpus,
    tok: Tokenizer,
    writers: dict[str, ShardWriter],
    masks: dict[str, ShardWriter] | None,
    num_proc: int,
    console: Console,
    resume: dict[str, Any] | None,
    checkpoint: Callable[[dict[str, Any]], None],
) -> dict[str, dict[str, Any]]:
    """One pass over the corpus into both splits' shards; per split: documents, bytes, encoding
    seconds, and (chat data) target tokens and the bytes they spell. `masks`: loss on the
    assistant. `resume`: a checkpoint's state, whose documents are skipped; `checkpoint` is
    called every CHECKPOINT_BYTES of text, with every batch before it written."""
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a text is text, not a boundary
    eot, dtype = eot_id(tok), writers["train"].dtype.str
    stats = {s: {"documents": 0, "bytes": 0, "seconds": 0.0} for s in SPLITS}
    skip = start = 0
    if resume is not None:
        stats, skip = resume["stats"], resume["documents"]
        start = corpus.seek(resume.get("cursor"))  # a stream: not read again from its start
    chat = bool(getattr(corpus, "chat", False))
    if chat:
        for s in SPLITS:
            stats[s].setdefault("targets", 0)
            stats[s].setdefault("target_bytes", 0)
    progress = Progress("encode", corpus.total, console, start=resume["done"] if resume else 0)

    def write(encoded: Encoded, tag: tuple[str, int, int]) -> None:
        split, units, nbytes = tag
        writers[split].write(encoded.ids)
        st = stats[split]
        st["seconds"] += encoded.seconds
        if chat:
            if masks is not None and encoded.mask is not None:
                masks[split].write(encoded.mask)
                st["targets"] += int(encoded.mask.sum())
            else:
                st["targets"] += len(encoded.ids)
            st["target_bytes"] += encoded.target_bytes
        progress.update(progress.done + units, progress.nbytes + nbytes)

    pool = EncodePool(tok, num_proc, write)
    try:
        batches: dict[str, _TextBatches | ChatBatches] = {
            s: ChatBatches(tok, s, pool, eot, dtype, masks is not None)
            if chat
            else _TextBatches(s, pool, eot, dtype, corpus.unit == "bytes")
            for s in SPLITS
        }
        since = 0  # text since the last checkpoint
        for i, doc in enumerate(corpus.documents(), start=start):
            if i < skip:  # done before the interruption: read (cheap), not encoded
                continue
            nbytes = batches[doc.split].add_document(doc)
            stats[doc.split]["bytes"] += nbytes
            stats[doc.split]["documents"] += 1
            since += nbytes
            if since >= staging_mod.CHECKPOINT_BYTES:
                for b in batches.values():
                    b.flush()
                pool.drain()
                done = {"documents": i + 1, "stats": stats, "done": progress.done}
                checkpoint({**done, "cursor": corpus.cursor()})
                since = 0
        for b in batches.values():
            b.flush(last=True)
        pool.drain()
    finally:
        pool.close()  # on an error: cancels what is queued, waits for what runs (a second)
        progress.close()
    return stats


def _check_splits(stats: dict[str, dict[str, Any]], corpus: Corpus, data: Any) -> None:
    if not stats["train"]["bytes"] + stats["val"]["bytes"]:
        raise ConfigError("data.source", "no text: the corpus is empty", corpus.label)
    key = "data.val_documents" if corpus.val_documents else "data.val_fraction"
    kept = prefix_keys(data)
    n = sum(stats[s]["documents"] for s in SPLITS)
    which = f"; {kept} kept {n} documents with text" if kept else ""
    for s in SPLITS:
        if not stats[s]["documents"]:
            message = f"the {s} split has no text (empty documents are skipped{which})"
            raise ConfigError(key, message, corpus.label)


def check_not_a_models_tokenizer(tok_path: Path) -> None:
    """A UserError if `tok_path` is the tokenizer of a model: a Hugging Face folder with weights
    (config.json and *.safetensors beside it), a minillm checkpoint (state.json) or run
    (checkpoints/ or its train.lock). Retraining it would leave those weights with ids that no
    longer mean what they were trained on."""
    folder = tok_path.parent
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        owner = "the Hugging Face model"
    elif (folder / "state.json").is_file():
        owner = "the checkpoint"
    elif (folder / "checkpoints").is_dir() or (folder / "train.lock").exists():
        owner = "the run"
    else:
        return
    raise UserError(
        f"{tok_path}: data.tokenizer: belongs to {owner} in {folder}, whose weights need it; "
        "--retrain does not replace it: point data.tokenizer at a new file (or drop --retrain "
        "to use it)"
    )


def write_shards(cfg: Config, retrain: bool = False) -> dict[str, Any]:
    """What `minillm tokenize` does (see the module docstring).

    A failure leaves no folder behind that it created (an empty data.out_dir), except the
    staging folder of an interrupted pass that a rerun resumes.
    """
    with removing_new_dirs(cfg.data.out_dir, cfg.data.tokenizer_path.parent):
        return _write_shards(cfg, retrain)


def _write_shards(cfg: Config, retrain: bool) -> dict[str, Any]:
    from rich.console import Console

    data = cfg.data
    start = time.perf_counter()
    out_dir, tok_path = Path(data.out_dir), data.tokenizer_path
    staging = Staging(out_dir)
    state = None if retrain else staging.load()
    staged_tok = staging.path / "tokenizer.json"
    if state is not None and state.get("tokenizer") == "trained" and staged_tok.is_file():
        mode = "staged"  # trained by the interrupted pass
    elif tok_path.exists() and not retrain:
        mode = "reuse"
    else:
        mode = "train"
        if tok_path.exists():
            check_not_a_models_tokenizer(tok_path)  # --retrain would replace it
        check_vocab_size(data.vocab_size)  # before any pass over the data
    corpus = open_corpus(data)
    ensure_writable_dir(out_dir, "data.out_dir")
    if mode == "train":
        ensure_writable_dir(tok_path.parent, "data.tokenizer")
    tok_seconds = 0.0
    if mode == "train":
        tok_input = f"{tok_path} (trained by this run)"
    else:
        tok = load_tokenizer(staged_tok if mode == "staged" else tok_path)
        check_tokenizer(tok, data.vocab_size, tok_path)
        tok_sha = tokenizer_sha256(staged_tok if mode == "staged" else tok_path)
        tok_input = (
            f"{tok_path} (trained by this run)"
            if mode == "staged"
            else f"{tok_path} {tok_sha[:12]}"
        )
    inputs = pass_inputs(data, corpus.fingerprint, tok_input)
    if state is not None:
        staging.check_inputs(state, inputs, corpus.label)  # before anything is changed
    console = Console(highlight=False)
    vocab = writers = masks = None
    saved = False  # a checkpoint exists that a rerun resumes from
    try:
        if mode == "train":
            train_start = time.perf_counter()
            tok = train_on_corpus(corpus, data, console)
            tok_seconds = time.perf_counter() - train_start
            staging.start()
            tok_json = tok.to_str()
            atomic_write_text(staged_tok, tok_json)
            tok_sha = hashlib.sha256(tok_json.encode("utf-8")).hexdigest()
        elif state is None:
            staging.start()
        vocab, dtype = tok.get_vocab_size(), shard_dtype(tok.get_vocab_size())
        chat = bool(getattr(corpus, "chat", False))
        loss_on = resolve_loss_on(data, chat, corpus.label)
        folder, size = staging.path, data.shard_tokens
        writers = {s: ShardWriter(folder, s, ".bin", dtype, size) for s in SPLITS}
        if loss_on == "assistant":
            masks = {s: ShardWriter(folder, s, MASK_SUFFIX, "u1", size) for s in SPLITS}
        every = {**writers, **{f"{s}{MASK_SUFFIX}": m for s, m in (masks or {}).items()}}
        trained = mode != "reuse"
        resume = resume_writers(state, every, staging)

        def checkpoint(progress: dict[str, Any]) -> None:
            nonlocal saved
            ws = {name: w.checkpoint() for name, w in every.items()}  # fsynced before the state
            staging.save(
                {
                    "inputs": inputs,
                    "tokenizer": "trained" if trained else "reused",
                    **progress,
                    "writers": ws,
                }
            )
            saved = True

        if resume is None:
            checkpoint({"documents": 0, "stats": None, "done": 0})
        else:
            saved = True
        pass_start = time.perf_counter()
        cpus = default_num_proc()
        num_proc = data.num_proc or cpus
        if num_proc > cpus:
            warn(
                f"data.num_proc: {num_proc} worker processes for the {cpus} CPUs this process may "
                f"use; more workers than CPUs only cost memory (~80 MB each)"
            )
        before = sum(st["bytes"] for st in resume["stats"].values()) if resume else 0
        stats = _encode(corpus, tok, writers, masks, num_proc, console, resume, checkpoint)
        for w in every.values():
            w.finish()
        pass_seconds = time.perf_counter() - pass_start
        _check_splits(stats, corpus, data)
        meta = make_meta(
            data, corpus.fingerprint, (vocab, eot_id(tok), dtype), stats, writers, masks
        )
        meta.update(chat=chat, loss_on=loss_on, tokenizer_sha256=tok_sha)
        commit(staging, out_dir, tok_path if trained else None, meta)
    except BaseException as e:
        for w in [*(writers or {}).values(), *(masks or {}).values()]:
            w.discard()
        if isinstance(e, UserError) or not saved:
            staging.remove()  # bad data (a rerun must change it anyway), or nothing to resume
        elif not isinstance(e, (OSError, BrokenProcessPool)):
            warn(f"{out_dir}: tokenize interrupted; run it again to resume from its checkpoint")
        if isinstance(e, OSError):  # a full disk, a quota, an I/O error: say so in one line
            raise UserError(
                f"{out_dir}: writing the tokenizer and shards failed ({e.strerror or e}); "
                "free some space and run `minillm tokenize` again (it resumes)"
            ) from None
        if isinstance(e, BrokenProcessPool):  # the OOM killer, or a kill of one worker
            raise UserError(
                f"{out_dir}: an encoding worker process died (killed, or out of memory?); run "
                "`minillm tokenize` again to resume (a lower data.num_proc needs less memory)"
            ) from None
        raise
    splits = {
        s: split_summary(
            stats[s]["documents"], stats[s]["bytes"], writers[s].tokens, stats[s]["seconds"]
        )
        for s in SPLITS
    }
    for s in SPLITS:
        splits[s]["shards"] = len(writers[s].shards)
    splits["total"] = split_summary(
        *(sum(splits[s][k] for s in SPLITS) for k in ("documents", "bytes", "tokens")),
        pass_seconds,
    )
    splits["total"]["shards"] = sum(splits[s]["shards"] for s in SPLITS)
    # This pass's pace: the bytes it encoded, not those a resumed-from run did.
    encoded = splits["total"]["bytes"] - before
    splits["total"]["mb_per_s"] = encoded / 1e6 / max(pass_seconds, 1e-9)
    return {
        "out_dir": str(out_dir),
        "dtype": dtype,
        "vocab_size": vocab,
        "tokenizer": {
            "path": str(tok_path),
            "trained": trained,
            "seconds": tok_seconds,
            "by_interrupted_run": mode == "staged",
        },
        "resumed_documents": resume["documents"] if resume else 0,
        "splits": splits,
        "seconds": time.perf_counter() - start,
    }
