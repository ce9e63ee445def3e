"""Documents collected into batches for the encoder: plain text, or chat conversations.

Offers `TextBatches` (one split's text pieces), `ChatBatches` (one split's conversations, for the
chat template of minillm.tokenizer.chat_template) and `BATCH_CHARS`. minillm.data.tokenize_pass
keeps one of them per split and submits each full batch to minillm.data.encode_pool, which encodes
it on a thread or in worker processes and hands the ids back in order with the batch's tag.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minillm.data.corpus import Document
from minillm.data.encode_pool import EncodePool, encode_chats, encode_text
from minillm.data.text import split_pieces
from minillm.errors import warn

if TYPE_CHECKING:
    from minillm.tokenizer.conventions import Conventions

BATCH_CHARS = 1 << 20  # text per encode batch: enough pieces for every core, ~30 MB of ids


class TextBatches:
    """Collects one split's text pieces into batches of ~BATCH_CHARS for `encode_text`, run by
    `pool` (on a thread or in workers: minillm.data.encode_pool).

    A batch's tag for the pool's writer is (split, progress units, bytes): bytes when the bar
    counts bytes (pieces counted in characters, settled at each document's exact bytes), else
    documents. With `whole` (a published model's tokenizer, whose pre-tokenizer's safe cuts
    minillm does not know) every document is one piece.
    """

    def __init__(
        self, split: str, pool: EncodePool, eot: int, dtype: str, by_bytes: bool, whole: bool
    ) -> None:
        self.split, self.pool, self.eot, self.dtype = split, pool, eot, dtype
        self.by_bytes, self.whole = by_bytes, whole
        self.pieces: list[str] = []
        self.ends: list[bool] = []  # whether a piece is the last of its document
        self.chars = 0
        self.units = self.nbytes = 0  # progress units and bytes of the batch being collected

    def add_document(self, doc: Document) -> int:
        """Queue the document's pieces; returns its UTF-8 bytes."""
        nbytes, chars, prev = doc.nbytes, 0, None
        pieces = ["".join(doc.blocks())] if self.whole else split_pieces(doc.blocks())
        for piece in pieces:  # one piece behind, to know which is last
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


class ChatBatches:
    """Collects one split's conversations into batches for `encode_chats` (the chat template,
    each conversation followed by EOT; with `masked`, the target mask too), run by `pool`.

    A batch's tag for the pool's writer is (split, conversations, bytes): its progress units.
    """

    def __init__(
        self, conv: Conventions, split: str, pool: EncodePool, eot: int, dtype: str, masked: bool
    ) -> None:
        conv.check_chat("data.tokenizer")  # a tokenizer without a chat template: one error, now
        if conv.splits_turns and split == "train":
            token = conv.tok.id_to_token(eot)
            warn(
                f"data.tokenizer: {token} ends each reply in this model's chat template and "
                "ends each document in the shards too, so with train.doc_mask on (the default "
                "for chat data) a conversation's later turns do not see its earlier ones; for "
                "multi-turn data set train.doc_mask: false"
            )
        self.split, self.pool, self.eot, self.dtype, self.masked = split, pool, eot, dtype, masked
        self.batch: list[list[dict[str, str]]] = []
        self.chars = 0

    def add_document(self, doc: Document) -> int:
        """Queue the conversation; returns its contents' UTF-8 bytes."""
        assert doc.messages is not None
        self.batch.append(doc.messages)
        self.chars += doc.nbytes
        if self.chars >= BATCH_CHARS:
            self.flush()
        return doc.nbytes

    def flush(self, last: bool = False) -> None:
        if self.batch:
            tag = (self.split, len(self.batch), self.chars)
            args = (self.batch, self.eot, self.dtype, self.masked)
            self.pool.submit(encode_chats, *args, tag=tag, last=last)
            self.batch, self.chars = [], 0
