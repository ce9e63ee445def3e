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
from minillm.errors import UserError
from minillm.tokenizer.chat_template import assistant_bytes, check_messages

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


def _all_dicts(values: list[Any]) -> bool:
    return all(isinstance(v, dict) for v in values)


def _read_rows(path: Path, field: str | None) -> list[tuple[int, Any]] | None:
    """(line, messages) of a .jsonl/.json file if its rows are chat rows, else None.

    Chat rows hold a list in `field` (--text-field; without it, the run's data.text_field or
    "messages"). Lines count from 1 (a .json array: its elements).
    """
    if path.suffix.lower() not in (".jsonl", ".json"):
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # the plain-text path reports it
    try:
        if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
            rows = list(enumerate(json.loads(text), 1))
        else:
            rows = [(n, json.loads(line)) for n, line in enumerate(text.splitlines(), 1)
                    if line.strip()]  # fmt: skip
    except ValueError:
        return None  # the table path names the line that is not JSON
    if not rows or not all(isinstance(r, dict) for _, r in rows):
        return None
    first = rows[0][1]
    names = [field] if field else ["messages"]
    name = next(
        (k for k in names if isinstance(v := first.get(k), list) and v and _all_dicts(v)), None
    )
    if name is None:
        return None
    return [(n, (name, r.get(name))) for n, r in rows]


def chat_eval_data(
    ckpt: LoadedCheckpoint,
    data: str | Path | None,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None,
    text_field: str | None = None,
) -> tuple[Batches, float, str] | None:
    """(batches, bytes, source) for chat data; None for text (module docstring). text_field:
    the column of messages (--text-field; default the run's data.text_field, else "messages")."""
    from minillm.data.meta import load_meta, open_mask, open_split

    if data is not None:
        path = Path(data)
        field = text_field
        if field is None and ckpt.config.data.text_field != "text":
            field = ckpt.config.data.text_field
        rows = _read_rows(path, field)
        if rows is None and field is not None and text_field is None:
            rows = _read_rows(path, None)  # a chat run's --data file with a messages column
        if rows is None:
            return None
        conventions = ckpt.conventions
        conventions.check_chat(f"{ckpt.path}: --ckpt")
        tokens: list[int] = []
        mask: list[bool] = []
        sizes = []
        eot = conventions.doc_end
        unit = "line" if path.suffix.lower() == ".jsonl" else "row"
        for n, (name, value) in rows:
            try:
                messages = check_messages(value, str(path), n, name, unit=unit)
            except UserError as e:  # the flag the user typed, not the run's config key
                flagged = str(e).replace(": data.text_field: ", ": --text-field: ", 1)
                raise UserError(flagged) from None
            conv, target = conventions.chat_targets(messages)
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
