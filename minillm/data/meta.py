"""Token shards on disk: the format, `meta.json`, and opening a split for reading.

Offers `load_meta`, `open_split`, `open_mask`, `shard_dtype`, `data_record`, `stale_data_keys`,
`META_VERSION`, `MASK_SUFFIX`, `SPLITS` and `TOKEN_DTYPES`. The writer is `minillm.data.shards`.

A shard is the split's documents' token ids, each document followed by the EOT id, as raw
little-endian uint16 (uint32 when the vocabulary exceeds 65,536). `meta.json` holds:

    {"version", "dtype", "vocab_size", "eot_id",
     "train": {"tokens", "bytes", "documents", "sha256", "targets", "target_bytes"}, "val": {...},
     "chat", "loss_on", "tokenizer_sha256", "source_fingerprint",
     "data": {"source", "format", "text_field", "val_fraction", "seed", "loss_on"}}

`bytes` counts the UTF-8 bytes of a split's document texts (not the separators; of a conversation,
its contents), for bits-per-byte. With chat data (`"chat": true`) and `"loss_on": "assistant"`,
`<split>.mask` holds one byte per token, 1 where the token is a training target (an assistant
content's token or its `<|end|>`), and `targets` / `target_bytes` count those tokens and the
assistant bytes. Shards without a mask (older ones too, which lack these keys) make every token a
target. Everything a run writes (tokenizer.json when it trains one, both shards, meta.json) goes to
temporary names first and is fsynced; only when all of it is whole are the names swapped in,
meta.json last. A failed or interrupted run therefore leaves the previous shards and tokenizer as
they were, and `open_split` refuses a shard whose size disagrees with meta.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from minillm.config import DataConfig
from minillm.errors import ConfigError

META_VERSION = 1  # the chat keys are optional additions: older readers ignore them
MASK_SUFFIX = ".mask"
SPLITS = ("train", "val")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_RERUN = "run `minillm tokenize CONFIG` again"


def shard_dtype(vocab_size: int) -> str:
    """The shard dtype: uint16 while every id fits (vocab_size <= 65536), else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def data_record(data: DataConfig) -> dict[str, Any]:
    """The data settings shards are made from, as meta.json keeps them under "data": a run whose
    config says otherwise is warned that its shards are not what its config describes."""
    source = os.path.abspath(data.source) if os.path.exists(data.source) else data.source
    return {
        "source": source,
        "format": data.format,
        "text_field": data.text_field,
        "val_fraction": data.val_fraction,
        "seed": data.seed,
        "loss_on": data.loss_on,
    }


def stale_data_keys(meta: dict[str, Any], data: DataConfig) -> list[str]:
    """The data.* keys whose values differ from those the shards were made with (meta.json's
    "data"; none for shards from before it was recorded)."""
    made = meta.get("data")
    if not isinstance(made, dict):
        return []
    now = data_record(data)
    return [f"data.{k}" for k in now if k in made and made[k] != now[k]]


def load_meta(out_dir: str | Path) -> dict[str, Any]:
    """Read and check `<out_dir>/meta.json`; a missing or invalid one is a UserError."""
    path = Path(out_dir) / "meta.json"
    if not path.is_file():
        raise ConfigError(
            "data.out_dir", "no token shards here; run `minillm tokenize CONFIG` first", str(path)
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError("data.out_dir", f"unreadable ({e}); {_RERUN}", str(path)) from None

    def nat(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    ok = (
        isinstance(meta, dict)
        and meta.get("version") == META_VERSION
        and meta.get("dtype") in TOKEN_DTYPES
        and nat(meta.get("vocab_size"))
        and nat(meta.get("eot_id"))
        and all(
            isinstance(meta.get(s), dict)
            and all(nat(meta[s].get(k)) for k in ("tokens", "bytes", "documents"))
            for s in SPLITS
        )
    )
    if not ok:
        raise ConfigError(
            "data.out_dir", f"not a meta.json of version {META_VERSION}; {_RERUN}", str(path)
        )
    return meta


def open_split(out_dir: str | Path, split: str) -> np.ndarray:
    """The token ids of "train" or "val" as a read-only memmap, checked against meta.json."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    meta = load_meta(out_dir)
    dtype, tokens = TOKEN_DTYPES[meta["dtype"]], meta[split]["tokens"]
    path = Path(out_dir) / f"{split}.bin"
    try:
        size = path.stat().st_size
    except OSError:
        raise ConfigError("data.out_dir", f"missing; {_RERUN}", str(path)) from None
    if size != tokens * dtype.itemsize:
        raise ConfigError(
            "data.out_dir",
            f"{size} bytes, but meta.json says {tokens} tokens of {dtype.itemsize} bytes "
            f"(an interrupted run?); {_RERUN}",
            str(path),
        )
    if tokens == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(tokens,))


def open_mask(out_dir: str | Path, split: str, meta: dict[str, Any]) -> np.ndarray | None:
    """The split's target mask (bool per token) as a memmap, or None: every token a target."""
    if meta.get("loss_on") != "assistant":
        return None
    path = Path(out_dir) / f"{split}{MASK_SUFFIX}"
    tokens = meta[split]["tokens"]
    try:
        size = path.stat().st_size
    except OSError:
        raise ConfigError("data.out_dir", f"missing; {_RERUN}", str(path)) from None
    if size != tokens:
        raise ConfigError(
            "data.out_dir",
            f"{size} bytes, but meta.json says {tokens} tokens (an interrupted run?); {_RERUN}",
            str(path),
        )
    if tokens == 0:
        return np.zeros(0, dtype=bool)
    return np.memmap(path, dtype=np.bool_, mode="r", shape=(tokens,))
