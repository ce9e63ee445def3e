"""`minillm eval` on chat data: every conversation scored on its own, over its targets.

Offers `chat_eval_data(ckpt, data, seq_len, batch_size, max_tokens)`: for a chat run's
validation shard, or a `--data` jsonl/json file of `{"messages": [...]}` rows, the batches
(one conversation per row, nothing of another in its context; minillm.data.batches), the bytes
that bits per byte divide by (the assistant contents' bytes when the loss is on the assistant)
and a note naming the source; None when the data is not chat.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minillm.data.batches import conversation_batches
from minillm.data.chat import assistant_bytes, chat_ids, check_messages, encode_conversation
from minillm.errors import UserError

if TYPE_CHECKING:
    from minillm.checkpoint.store import LoadedCheckpoint

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _cap(batches: Batches, max_tokens: int | None) -> tuple[Batches, int]:
    """The first batches that predict at least max_tokens targets (all without a cap)."""
    kept, n = [], 0
    for x, y in batches:
        if max_tokens is not None and n >= max_tokens:
            break
        kept.append((x, y))
        n += int((y != -100).sum())
    return kept, n


def _read_rows(path: Path) -> list[Any] | None:
    """The rows of a .jsonl/.json file if they are chat rows (a "messages" key), else None."""
    if path.suffix.lower() not in (".jsonl", ".json"):
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # the plain-text path reports it
    try:
        if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError:
        return None
    if not rows or not all(isinstance(r, dict) for r in rows) or "messages" not in rows[0]:
        return None
    return rows


def chat_eval_data(
    ckpt: LoadedCheckpoint,
    data: str | Path | None,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None,
) -> tuple[Batches, float, str] | None:
    """(batches, bytes, source) for chat data; None for text (module docstring)."""
    from minillm.data.meta import load_meta, open_mask, open_split

    tok = ckpt.tokenizer
    if data is not None:
        path = Path(data)
        rows = _read_rows(path)
        if rows is None:
            return None
        ids = chat_ids(tok, f"{ckpt.path}: --ckpt")
        tokens: list[int] = []
        mask: list[bool] = []
        sizes = []
        eot = tok.token_to_id("<|endoftext|>")
        for r, row in enumerate(rows, 1):
            messages = check_messages(row.get("messages"), str(path), r)
            conv, target = encode_conversation(tok, messages, ids)
            tokens += [*conv, eot]
            mask += [*target, False]
            sizes.append(assistant_bytes(messages))
        batches, n = _cap(
            list(
                conversation_batches(
                    np.asarray(tokens), np.asarray(mask), eot, seq_len=seq_len,
                    batch_size=batch_size,
                )
            ),
            max_tokens,
        )  # fmt: skip
        rows_used = sum(len(x) for x, _ in batches)
        return batches, float(sum(sizes[:rows_used])), f"{path} ({rows_used} conversations)"
    out_dir = Path(ckpt.config.data.out_dir)
    if not (out_dir / "meta.json").is_file():
        return None
    meta = load_meta(out_dir)
    if not meta.get("chat"):
        return None
    tokens_np = open_split(out_dir, "val")
    batches, n = _cap(
        list(
            conversation_batches(
                tokens_np, open_mask(out_dir, "val", meta), int(meta["eot_id"]),
                seq_len=seq_len, batch_size=batch_size,
            )
        ),
        max_tokens,
    )  # fmt: skip
    val = meta["val"]
    # The assistant bytes are known per split: scaled by the share of its targets evaluated.
    n_bytes = val.get("target_bytes", val["bytes"]) * n / max(val.get("targets", n), 1)
    if not n:
        raise UserError(f"{out_dir}: the val shards have no target tokens to score")
    return batches, float(n_bytes), f"{out_dir} (val shards, each conversation on its own)"
