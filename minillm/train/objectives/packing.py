"""How a run reads its shards: the target mask, document masking, and chat windows.

Offers `Packing(cfg, meta, train_tokens, val_tokens)`: what `train_batch` needs besides the
tokens (`train_kwargs`), the validation batches for chat data (every conversation alone in its
row, `val_batches`), the bytes per target for bits per byte, and a one-time note on conversations
longer than a window.

`train.doc_mask` (null = on for chat data) keeps attention inside each document of a window;
for chat data the windows then also start at a conversation's start, so the model sees a
conversation from its first token, as `minillm chat` gives it one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from minillm.config import Config
from minillm.data.batches import conversation_batches, doc_starts
from minillm.data.meta import open_mask


class Packing:
    """The data settings of one run, resolved against its shards' meta.json."""

    def __init__(
        self, cfg: Config, meta: dict[str, Any], train_tokens: np.ndarray, val_tokens: np.ndarray
    ) -> None:
        out_dir, seq_len = cfg.data.out_dir, cfg.train.seq_len
        self.chat = bool(meta.get("chat", False))
        self.doc_mask = cfg.train.doc_mask if cfg.train.doc_mask is not None else self.chat
        self.eot = int(meta["eot_id"])
        self.train_mask = open_mask(out_dir, "train", meta)
        self.val_mask = open_mask(out_dir, "val", meta)
        self.val_tokens = val_tokens
        self.starts = doc_starts(train_tokens, self.eot) if self.doc_mask and self.chat else None
        self.note = ""
        if self.starts is not None:
            # A conversation's tokens with its EOT; a window holds T + 1 of them.
            lengths = np.diff(np.append(self.starts, len(train_tokens)))
            long = int((lengths > seq_len + 1).sum())
            if long:
                self.note = (
                    f"note: {long} of {len(lengths)} training conversations are longer than "
                    f"train.seq_len={seq_len} tokens and are cut to their first {seq_len}"
                )
        val = meta["val"]
        if self.chat:
            # Chat data is scored over its targets; bits per byte over the bytes they spell.
            self.val_bytes_per_target = val.get("target_bytes", val["bytes"]) / max(
                val.get("targets", val["tokens"]), 1
            )
        else:
            # The split's tokens - 1 are predicted, as `minillm eval` counts.
            self.val_bytes_per_target = val["bytes"] / max(val["tokens"] - 1, 1)

    def train_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `train_batch` beyond the tokens and the batch shape."""
        return {
            "mask": self.train_mask,
            "eot_id": self.eot if self.doc_mask else None,
            "starts": self.starts,
        }

    def val_batches(
        self, seq_len: int, batch_size: int, max_batches: int | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Chat data: every conversation scored on its own; None: the plain windows."""
        if not self.chat:
            return None
        return list(
            conversation_batches(
                self.val_tokens,
                self.val_mask,
                self.eot,
                seq_len=seq_len,
                batch_size=batch_size,
                max_batches=max_batches,
            )
        )
