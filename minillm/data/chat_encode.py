"""The chat side of `minillm tokenize`: conversations into ids and target masks.

Offers `ChatBatches` (one split's conversations, batched for the chat template of
minillm.data.chat, which minillm.data.encode_pool runs) and `resolve_loss_on` (`data.loss_on`, auto
resolved against the data). minillm.data.shard_writer drives both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minillm.data.chat import chat_ids
from minillm.data.corpus import Document
from minillm.data.encode_pool import EncodePool, encode_chats
from minillm.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BATCH_CHARS = 1 << 20  # conversation text per encode batch, as for plain text


class ChatBatches:
    """Collects one split's conversations into batches for `encode_chats` (the chat template,
    each conversation followed by EOT; with `masked`, the target mask too), run by `pool`.

    A batch's tag for the pool's writer is (split, conversations, bytes): its progress units.
    """

    def __init__(
        self, tok: Tokenizer, split: str, pool: EncodePool, eot: int, dtype: str, masked: bool
    ) -> None:
        chat_ids(tok, "data.tokenizer")  # a tokenizer without the chat tokens: one error, now
        self.split, self.pool, self.eot, self.dtype, self.masked = split, pool, eot, dtype, masked
        self.batch: list[list[dict[str, str]]] = []
        self.chars = 0

    def add_document(self, doc: Document) -> int:
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


def resolve_loss_on(data: Any, chat: bool, label: str) -> str:
    """data.loss_on resolved: auto = assistant for chat data, all otherwise."""
    if data.loss_on == "assistant" and not chat:
        raise ConfigError(
            "data.loss_on",
            f"assistant needs chat data (a column of {{role, content}} messages); "
            f"data.text_field {data.text_field!r} holds plain text",
            label,
        )
    return data.loss_on if data.loss_on != "auto" else ("assistant" if chat else "all")
