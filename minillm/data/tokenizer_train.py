"""Training the BPE on a corpus's train split, or on a deterministic sample of it.

Offers `train_on_corpus(corpus, data, console)`, what `minillm tokenize` runs before its encoding
pass when there is no tokenizer to reuse (minillm.data.tokenize_pass).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from minillm.config import DataConfig
from minillm.data.corpus import Corpus
from minillm.data.text import split_pieces
from minillm.errors import ConfigError
from minillm.runtime.progress import Progress
from minillm.tokenizer.bpe import train_tokenizer

if TYPE_CHECKING:
    from rich.console import Console
    from tokenizers import Tokenizer


def _sample_rate(corpus: Corpus, data: DataConfig, train_bytes: int | None) -> float:
    """The share of the train text the tokenizer trains on: data.tokenizer_sample_bytes over
    the train split's bytes (for rows, estimated from the files' sizes, at most data.max_bytes:
    the same estimate whether the rows are streamed or not), at most 1."""
    if data.tokenizer_sample_bytes <= 0 or not corpus.files:  # a hub dataset: its size unknown
        return 1.0
    if train_bytes is None:  # rows: their text is not counted before a pass; the files are
        size = sum(f.stat().st_size for f in corpus.files)
        size = min(size, data.max_bytes or size)
        train_bytes = int(size * (1 - data.val_fraction)) if not data.val_documents else size
    return min(1.0, data.tokenizer_sample_bytes / max(train_bytes, 1))


def train_on_corpus(corpus: Corpus, data: DataConfig, console: Console) -> Tokenizer:
    """Train the tokenizer on the train split, with a progress bar over the text it reads.

    With a sample rate r < 1 (data.tokenizer_sample_bytes) it trains on a share r of the text
    pieces, spread evenly over the whole split (a piece is taken whenever the credit of r per
    character read covers it): deterministic, and not biased to the corpus's first documents.
    A hub dataset's size is unknown before a pass, so it trains on the split's first
    data.tokenizer_sample_bytes instead (the documents that start before that much text).
    """
    by_bytes = corpus.unit == "bytes"
    docs = None
    if by_bytes:  # documents left out for invalid UTF-8 (data.decode_errors) are not read
        docs = [d for d in corpus.documents() if d.split == "train" and not d.skipped]
    total = sum(d.nbytes for d in docs) if docs is not None else corpus.train_total()
    rate = _sample_rate(corpus, data, total if by_bytes else None)
    prefix = data.tokenizer_sample_bytes if not corpus.files else 0  # 0: no limit
    progress = Progress("train tokenizer", total, console)
    seen, credit = 0, 0.0

    def texts() -> Iterator[str]:
        nonlocal seen, credit
        for doc in docs if docs is not None else corpus.documents():
            if doc.split != "train" or doc.skipped:
                continue
            if prefix and seen >= prefix:
                break
            nbytes, done = doc.nbytes, progress.done
            # A conversation's contents are trained on one by one, as they are encoded.
            chat = doc.messages is not None
            pieces = (m["content"] for m in doc.messages) if chat else split_pieces(doc.blocks())
            for piece in pieces:
                if by_bytes:  # in characters ~ bytes, settled at the document's end
                    progress.update(progress.done + len(piece), progress.nbytes + len(piece))
                credit += len(piece) * rate
                if credit >= len(piece):
                    credit -= len(piece)
                    yield piece
            seen += nbytes
            progress.update(done + (nbytes if by_bytes else 1), seen)
        progress.describe("train tokenizer: merging")  # the trainer's last step, after reading

    try:
        tok = train_tokenizer(texts(), data.vocab_size)
    except ConfigError as err:
        if not seen and err.key == "data.vocab_size":  # the tokenizer saw no text at all
            raise ConfigError(
                "data.source",
                "no text in the train split: the corpus is empty, or all of its text went to "
                "validation (data.val_fraction, data.val_documents)",
                corpus.label,
            ) from None
        raise  # the corpus's own error (say, a row too short to split), as it was
    finally:
        progress.close()
    return tok
