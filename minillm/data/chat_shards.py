"""The chat side of `minillm tokenize`: conversations into ids and target masks.

Offers `ChatEncoder` (one split's conversations, batched, through the chat template of
minillm.data.chat, into its shard and mask writers) and `resolve_loss_on` (`data.loss_on`, auto
resolved against the data). minillm.data.shards drives both.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from minillm.data.chat import assistant_bytes, chat_ids, content_bytes, encode_conversation
from minillm.data.corpus import Document
from minillm.errors import ConfigError
from minillm.runtime.progress import Progress

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BATCH_CHARS = 1 << 20  # conversation text per encode batch, as for plain text


class ChatEncoder:
    """Encodes one split's conversations with the chat template: ids, then the target mask.

    Conversations are encoded in batches (one `encode_batch_fast` over their contents), each
    followed by EOT (never a target). `mask` is None when every token is a target (loss_on all).
    """

    def __init__(
        self, tok: Tokenizer, eot: int, writer: Any, mask: Any | None, progress: Progress
    ) -> None:
        """writer, mask: minillm.data.shards' staged writers (`write(array)`) of ids and mask."""
        self.tok, self.eot, self.writer, self.mask, self.progress = tok, eot, writer, mask, progress
        self.ids = chat_ids(tok, "data.tokenizer")
        self.batch: list[list[dict[str, str]]] = []
        self.chars = 0
        self.seconds = 0.0
        self.targets = 0  # target tokens written
        self.target_bytes = 0  # bytes of the texts those targets spell

    def add_document(self, doc: Document) -> int:
        assert doc.messages is not None
        self.batch.append(doc.messages)
        self.chars += doc.nbytes
        if self.chars >= BATCH_CHARS:
            self.finish()
        return doc.nbytes

    def finish(self) -> None:
        start = time.perf_counter()
        ids: list[int] = []
        target: list[bool] = []
        for messages in self.batch:
            conv_ids, conv_target = encode_conversation(self.tok, messages, self.ids)
            ids += [*conv_ids, self.eot]
            target += [*conv_target, False]
            self.target_bytes += assistant_bytes(messages) if self.mask else content_bytes(messages)
        self.seconds += time.perf_counter() - start
        self.writer.write(np.asarray(ids, dtype=np.int64))
        if self.mask is not None:
            self.mask.write(np.asarray(target, dtype=np.uint8))
            self.targets += sum(target)
        else:
            self.targets += len(ids)
        self.progress.update(
            self.progress.done + len(self.batch), self.progress.nbytes + self.chars
        )
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
