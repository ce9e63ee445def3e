"""The pass behind `minillm tokenize`: a corpus into token shards (`write_shards`).

Offers `write_shards(cfg, retrain) -> summary` (minillm.data.summary prints it); the format of the
files is described in minillm.data.meta.

Steps (`_write_shards`): check everything a pass needs before anything is changed (`_Pass`);
reuse the tokenizer, or train one on the train split with a progress bar over the text it reads;
open one `ShardWriter` per split (minillm.data.shard_writer); then one pass over the documents
that cuts each split's text into pieces and queues them in ~1 MB batches
(minillm.data.encode_batches), encoded on a thread or in `data.num_proc` worker processes
(minillm.data.encode_pool) while this thread reads ahead, and written in order as they come back.
Ids go straight to the shard files, so memory does not grow with the corpus, and the shards are
the same for every `num_proc`.

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
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minillm.config import Config
from minillm.data import shard_staging as staging_mod
from minillm.data.corpus import Corpus, prefix_keys
from minillm.data.encode_batches import ChatBatches, TextBatches
from minillm.data.encode_pool import Encoded, EncodePool
from minillm.data.meta import MASK_SUFFIX, SPLITS, TOKEN_DTYPES, shard_dtype
from minillm.data.shard_staging import (
    Staging,
    commit,
    make_meta,
    pass_inputs,
    resume_writers,
    shard_inputs,
    up_to_date,
)
from minillm.data.shard_writer import ShardWriter
from minillm.data.sources import open_corpus
from minillm.data.summary import pass_splits
from minillm.data.tokenizer_train import train_on_corpus
from minillm.errors import ConfigError, UserError, warn
from minillm.runtime.cpus import default_num_proc
from minillm.runtime.disk_space import full_disk_error, is_disk_full
from minillm.runtime.files import atomic_write_text, ensure_writable_dir, removing_new_dirs
from minillm.runtime.progress import Progress
from minillm.runtime.signals import interrupting_on_signals
from minillm.tokenizer.bpe import (
    check_not_a_models_tokenizer,
    check_tokenizer,
    check_vocab_size,
    load_tokenizer,
    tokenizer_sha256,
)
from minillm.tokenizer.chat_template import resolve_loss_on
from minillm.tokenizer.conventions import Conventions

if TYPE_CHECKING:
    from rich.console import Console
    from tokenizers import Tokenizer


def write_shards(cfg: Config, retrain: bool = False, reuse: bool = False) -> dict[str, Any]:
    """What `minillm tokenize` does (see the module docstring).

    reuse: when the shards in place are what this pass would write again (same inputs and
    tokenizer: shard_staging.up_to_date), write nothing and return {"out_dir", "up_to_date":
    True}. A failure leaves no folder behind that it created (an empty data.out_dir), except the
    staging folder of an interrupted pass that a rerun resumes. SIGINT and SIGTERM interrupt it
    even when the process started with them ignored (`nohup`, `&`), as they stop `train`.
    """
    dirs = (cfg.data.out_dir, cfg.data.tokenizer_path.parent)
    with interrupting_on_signals(), removing_new_dirs(*dirs):
        return _write_shards(cfg, retrain, reuse)


def _write_shards(cfg: Config, retrain: bool, reuse: bool) -> dict[str, Any]:
    from rich.console import Console

    start = time.perf_counter()
    run = _Pass(cfg, retrain)  # every check that needs no pass over the data, nothing changed
    if reuse and run.up_to_date():
        return {"out_dir": str(run.out_dir), "up_to_date": True}
    console = Console(highlight=False)
    with run.cleaning_up():  # a failure: what a rerun cannot use is removed, in one line
        run.get_tokenizer(console)
        resume = run.open_writers()
        stats, pass_seconds = run.encode(console, resume)
        run.commit(stats)
    return run.summary(stats, pass_seconds, time.perf_counter() - start)


class TokenizerSource(Enum):
    """Where a pass's tokenizer comes from."""

    REUSE = "reuse"  # data.tokenizer, as it is
    TRAIN = "train"  # trained on the train split by this pass
    STAGED = "staged"  # trained by the interrupted pass this one resumes (in .partial/)


def _tokenizer_source(
    staging: Staging, state: dict[str, Any] | None, tok_path: Path, retrain: bool
) -> TokenizerSource:
    staged = staging.path / "tokenizer.json"
    if state is not None and state.get("tokenizer") == "trained" and staged.is_file():
        return TokenizerSource.STAGED
    if tok_path.exists() and not retrain:
        return TokenizerSource.REUSE
    return TokenizerSource.TRAIN


class _Pass:
    """One pass: its inputs, checked in `__init__` before anything is changed, and the steps that
    `_write_shards` runs in order, each using what the ones before it made."""

    def __init__(self, cfg: Config, retrain: bool) -> None:
        self.data = data = cfg.data
        self.out_dir, self.tok_path = Path(data.out_dir), data.tokenizer_path
        self.staging = Staging(self.out_dir)
        self.state = None if retrain else self.staging.load()
        self.source = _tokenizer_source(self.staging, self.state, self.tok_path, retrain)
        training = self.source is TokenizerSource.TRAIN
        if training:
            if self.tok_path.exists():
                check_not_a_models_tokenizer(self.tok_path)  # --retrain would replace it
            check_vocab_size(data.vocab_size)  # before any pass over the data
        self.corpus = open_corpus(data)
        ensure_writable_dir(self.out_dir, "data.out_dir")
        if training:
            ensure_writable_dir(self.tok_path.parent, "data.tokenizer")
        self.tok, self.tok_sha, self.tok_seconds = self._existing_tokenizer(), "", 0.0
        tok_input = f"{self.tok_path} (trained by this run)"
        if self.tok is not None:
            self.tok_sha = tokenizer_sha256(self._tokenizer_file())
            if self.source is TokenizerSource.REUSE:
                tok_input = f"{self.tok_path} {self.tok_sha[:12]}"
        self.inputs = pass_inputs(data, self.corpus.fingerprint, tok_input)
        if self.state is not None:
            self.staging.check_inputs(self.state, self.inputs, self.corpus.label)  # refused: kept
        self.writers: dict[str, ShardWriter] = {}
        self.masks: dict[str, ShardWriter] | None = None  # with the loss on the assistant
        self.saved = False  # a checkpoint exists that a rerun resumes from
        self.resumed_documents = self.resumed_bytes = 0

    def up_to_date(self) -> bool:
        """Whether the shards in place are what this pass would write: no interrupted pass to
        resume, the tokenizer reused, and meta.json records these inputs and this tokenizer."""
        if self.state is not None or self.source is not TokenizerSource.REUSE:
            return False
        assert self.tok is not None
        eot = Conventions.of(self.tok, self.tok_path.parent).doc_end
        return up_to_date(self.out_dir, self.inputs, self.tok_sha, eot)

    @property
    def trained(self) -> bool:
        """Whether the tokenizer is new: trained by this pass or by the one it resumes."""
        return self.source is not TokenizerSource.REUSE

    def _tokenizer_file(self) -> Path:
        staged = self.source is TokenizerSource.STAGED
        return self.staging.path / "tokenizer.json" if staged else self.tok_path

    def _existing_tokenizer(self) -> Tokenizer | None:
        """The tokenizer to reuse or the interrupted pass's, checked; None: one is trained."""
        if self.source is TokenizerSource.TRAIN:
            return None
        tok = load_tokenizer(self._tokenizer_file())
        check_tokenizer(tok, self.data.vocab_size, self.tok_path)
        return tok

    def _every(self) -> dict[str, ShardWriter]:
        """Every writer by the name state.json keeps it under: the splits, then their masks."""
        masks = {f"{s}{MASK_SUFFIX}": m for s, m in (self.masks or {}).items()}
        return {**self.writers, **masks}

    def get_tokenizer(self, console: Console) -> None:
        """Train the tokenizer when there is none, into a new staging folder; else start one,
        unless this pass resumes the one there."""
        if self.source is TokenizerSource.TRAIN:
            start = time.perf_counter()
            self.tok = train_on_corpus(self.corpus, self.data, console)
            self.tok_seconds = time.perf_counter() - start
            self.staging.start()
            tok_json = self.tok.to_str()
            atomic_write_text(self.staging.path / "tokenizer.json", tok_json)
            self.tok_sha = hashlib.sha256(tok_json.encode("utf-8")).hexdigest()
        elif self.state is None:
            self.staging.start()

    def open_writers(self) -> dict[str, Any] | None:
        """The shard writers, at the checkpoint a resumed pass continues from; returns that
        checkpoint's state (None: from the start, recorded as the first checkpoint)."""
        assert self.tok is not None
        self.vocab = self.tok.get_vocab_size()
        self.dtype = shard_dtype(self.vocab)
        self.chat = bool(getattr(self.corpus, "chat", False))
        self.loss_on = resolve_loss_on(self.data, self.chat, self.corpus.label)
        folder, size = self.staging.path, self.data.shard_tokens
        self.writers = {s: ShardWriter(folder, s, ".bin", self.dtype, size) for s in SPLITS}
        if self.loss_on == "assistant":
            self.masks = {s: ShardWriter(folder, s, MASK_SUFFIX, "u1", size) for s in SPLITS}
        resume = resume_writers(self.state, self._every(), self.staging)
        if resume is None:
            self.checkpoint({"documents": 0, "stats": None, "done": 0})
        else:
            self.saved = True
            self.resumed_documents = resume["documents"]
            self.resumed_bytes = sum(st["bytes"] for st in resume["stats"].values())
        return resume

    def checkpoint(self, progress: dict[str, Any]) -> None:
        """Record how far the pass got (`progress`) with every writer's shards, fsynced first."""
        writers = {name: w.checkpoint() for name, w in self._every().items()}
        tokenizer = "trained" if self.trained else "reused"
        state = {"inputs": self.inputs, "tokenizer": tokenizer, **progress, "writers": writers}
        self.staging.save(state)
        self.saved = True

    def encode(
        self, console: Console, resume: dict[str, Any] | None
    ) -> tuple[dict[str, dict[str, Any]], float]:
        """The pass over the documents into the shards; its counts per split and seconds."""
        assert self.tok is not None
        start = time.perf_counter()
        num_proc = _num_proc(self.data.num_proc)
        args = (self.writers, self.masks, num_proc, console, resume, self.checkpoint)
        conv = Conventions.of(self.tok, self._tokenizer_file().parent)
        self.doc_end = conv.doc_end
        stats = _encode(self.corpus, conv, *args)
        for w in self._every().values():
            w.finish()
        seconds = time.perf_counter() - start
        _check_splits(stats, self.corpus, self.data)
        return stats, seconds

    def commit(self, stats: dict[str, dict[str, Any]]) -> None:
        """meta.json made, and the shards (and a new tokenizer) moved into place."""
        assert self.tok is not None
        ids = (self.vocab, self.doc_end, self.dtype)
        meta = make_meta(self.data, self.corpus.fingerprint, ids, stats, self.writers, self.masks)
        meta.update(chat=self.chat, loss_on=self.loss_on, tokenizer_sha256=self.tok_sha)
        meta["inputs"] = shard_inputs(self.inputs)  # a rerun with the same has nothing to do
        commit(self.staging, self.out_dir, self.tok_path if self.trained else None, meta)

    @contextmanager
    def cleaning_up(self) -> Iterator[None]:
        """On any failure of the steps inside: the open shards closed, the staging folder removed
        unless a rerun can resume from it, and a full disk or a dead worker made one line."""
        try:
            yield
        except BaseException as e:
            for w in self._every().values():
                w.discard()
            if isinstance(e, UserError) or not self.saved:
                self.staging.remove()  # bad data (a rerun must change it anyway), or nothing saved
            elif not isinstance(e, (OSError, BrokenProcessPool)):
                warn(
                    f"{self.out_dir}: tokenize interrupted; run it again to resume from its "
                    "checkpoint"
                )
            error = _as_user_error(e, self.out_dir, self._bytes_needed)
            if error is None:
                raise
            raise error from None

    def _bytes_needed(self) -> int | None:
        """What the shards will take, about: ~4 bytes of text a token (a trained BPE's usual),
        each token `dtype` bytes and, with a mask, one more; None before the dtype is known."""
        dtype = getattr(self, "dtype", None)
        if dtype is None:
            return None
        text = sum(f.stat().st_size for f in self.corpus.files if f.is_file())
        per_token = TOKEN_DTYPES[dtype].itemsize + (1 if self.masks else 0)
        return text // 4 * per_token

    def summary(
        self, stats: dict[str, dict[str, Any]], pass_seconds: float, seconds: float
    ) -> dict[str, Any]:
        """What `write_shards` returns (minillm.data.summary prints it)."""
        tokens = {s: self.writers[s].tokens for s in SPLITS}
        shards = {s: len(self.writers[s].shards) for s in SPLITS}
        return {
            "out_dir": str(self.out_dir),
            "dtype": self.dtype,
            "vocab_size": self.vocab,
            "tokenizer": {
                "path": str(self.tok_path),
                "trained": self.trained,
                "seconds": self.tok_seconds,
                "by_interrupted_run": self.source is TokenizerSource.STAGED,
            },
            "resumed_documents": self.resumed_documents,
            "splits": pass_splits(stats, tokens, shards, pass_seconds, self.resumed_bytes),
            "seconds": seconds,
        }


def _as_user_error(
    e: BaseException, out_dir: Path, needed: Callable[[], int | None]
) -> UserError | None:
    """The one line that a failure which is neither bad data nor a bug is (None: it is)."""
    if is_disk_full(e):
        after = "the previous shards are intact; free some space and run `minillm tokenize` again"
        return full_disk_error(out_dir, "token shards", needed(), after + " (it resumes)")
    if isinstance(e, OSError):  # a quota, an I/O error
        return UserError(
            f"{out_dir}: writing the tokenizer and shards failed ({e.strerror or e}); "
            "free some space and run `minillm tokenize` again (it resumes)"
        )
    if isinstance(e, BrokenProcessPool):  # the OOM killer, or a kill of one worker
        return UserError(
            f"{out_dir}: an encoding worker process died (killed, or out of memory?); run "
            "`minillm tokenize` again to resume (a lower data.num_proc needs less memory)"
        )
    return None


def _num_proc(configured: int) -> int:
    """data.num_proc resolved (0: one per CPU); more than the CPUs is warned about."""
    cpus = default_num_proc()
    num_proc = configured or cpus
    if num_proc > cpus:
        warn(
            f"data.num_proc: {num_proc} worker processes for the {cpus} CPUs this process may "
            f"use; more workers than CPUs only cost memory (~80 MB each)"
        )
    return num_proc


def _encode(
    corpus: Corpus,
    conv: Conventions,
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
    eot, dtype = conv.doc_end, writers["train"].dtype.str
    stats = {s: {"documents": 0, "bytes": 0, "seconds": 0.0} for s in SPLITS}
    skip = start = 0
    if resume is not None:
        stats, skip = resume["stats"], resume["documents"]
        start = corpus.seek(resume.get("cursor"))  # a stream: not read again from its start
    for s in SPLITS:  # documents with invalid UTF-8 (data.decode_errors); not in older states
        stats[s].setdefault("replaced", 0)
        stats[s].setdefault("skipped", 0)
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

    pool = EncodePool(conv, num_proc, write)
    try:
        batches: dict[str, TextBatches | ChatBatches] = {
            s: ChatBatches(conv, s, pool, eot, dtype, masks is not None)
            if chat
            else TextBatches(s, pool, eot, dtype, corpus.unit == "bytes", not conv.cuttable)
            for s in SPLITS
        }
        since = 0  # text since the last checkpoint
        for i, doc in enumerate(corpus.documents(), start=start):
            if i < skip:  # done before the interruption: read (cheap), not encoded
                continue
            if doc.skipped:  # invalid UTF-8, and data.decode_errors: skip_document
                stats[doc.split]["skipped"] += 1
                continue
            nbytes = batches[doc.split].add_document(doc)
            stats[doc.split]["bytes"] += nbytes
            stats[doc.split]["documents"] += 1
            stats[doc.split]["replaced"] += doc.replaced
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
    skipped = sum(stats[s]["skipped"] for s in SPLITS)
    left_out = f"; {skipped} not UTF-8 left out by data.decode_errors" if skipped else ""
    if not stats["train"]["bytes"] + stats["val"]["bytes"]:
        message = "no text: the corpus is empty"
        if skipped:
            message += f" once its {skipped} documents that are not UTF-8 are left out"
        raise ConfigError("data.source", message, corpus.label)
    key = "data.val_documents" if corpus.val_documents else "data.val_fraction"
    kept = prefix_keys(data)
    n = sum(stats[s]["documents"] for s in SPLITS)
    which = f"; {kept} kept {n} documents with text" if kept else ""
    for s in SPLITS:
        if not stats[s]["documents"]:
            message = f"the {s} split has no text (empty documents are skipped{which}{left_out})"
            raise ConfigError(key, message, corpus.label)
