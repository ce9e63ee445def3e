"""Token shards on disk: the format, `meta.json`, and opening a split for reading.

Offers `load_meta`, `open_split`, `open_mask`, `shard_dtype`, `shard_name`, `sibling_name`,
`data_record`, `stale_data_keys`, `META_VERSION`, `MASK_SUFFIX`, `SPLITS` and `TOKEN_DTYPES`. The
writer is `minillm.data.tokenize_pass` (`minillm tokenize`).

A split is the token ids of its documents, each document followed by the EOT id, as raw
little-endian uint16 (uint32 when the vocabulary exceeds 65,536), cut into numbered shards
`<split>_000000.bin`, `<split>_000001.bin`, ... of `data.shard_tokens` tokens (the last one
shorter; a document may span two shards). `meta.json` (version 2) holds:

    {"version", "dtype", "vocab_size", "eot_id", "shard_tokens",
     "train": {"tokens", "bytes", "documents", "targets", "target_bytes",
               "replaced_documents", "skipped_documents",
               "shards": [{"file", "tokens", "file_bytes", "sha256"[, "mask_sha256"]}, ...]},
     "val": {...}, "chat", "loss_on", "tokenizer_sha256", "source_fingerprint", "inputs",
     "data": {"source", "format", "text_field", "val_fraction", "seed", "loss_on",
              "max_documents", "max_bytes", "val_documents", "decode_errors"}}

`bytes` counts the UTF-8 bytes of a split's document texts (not the separators; of a conversation,
its contents; of a text file whose invalid bytes were replaced, its bytes on disk), for
bits-per-byte; `replaced_documents` and `skipped_documents` count the documents that held invalid
UTF-8 and were read with U+FFFD or left out (`data.decode_errors`; absent from older shards); a
shard's `file_bytes` is its size on disk; `inputs` (absent from older shards) is what
shard_staging.pass_inputs recorded but the tokenizer, for a rerun to find them up to date.
With chat data (`"chat": true`) and `"loss_on":
"assistant"`, each shard has a `.mask` twin (`train_000000.mask`) holding one byte per token,
1 where the token is a training target (an assistant content's token or its `<|end|>`), and
`targets` / `target_bytes` count those tokens and the assistant bytes. Shards without a mask make
every token a target. Opening a split checks every shard's size and
sha256 against meta.json: a missing or damaged shard is one error line. Version 1 (one
`<split>.bin` per split, from before shards were numbered) is still read.

`minillm tokenize` writes shards into `<out_dir>/.partial/` as it goes, checkpointing there, and
moves them into place only when the pass is complete; meta.json is written last. A failed or
interrupted run therefore leaves the previous shards and tokenizer as they were, and running it
again resumes from the checkpoint (minillm.data.shard_staging).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from minillm.config import DataConfig
from minillm.data.shard_reader import ShardedArray
from minillm.errors import ConfigError
from minillm.runtime.files import HashCache

META_VERSION = 2  # numbered shards with a sha256 each
OLD_VERSIONS = (1,)  # one <split>.bin per split: still read
MASK_SUFFIX = ".mask"
SPLITS = ("train", "val")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_RERUN = "run `minillm tokenize CONFIG` again"


def shard_dtype(vocab_size: int) -> str:
    """The shard dtype: uint16 while every id fits (vocab_size <= 65536), else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(split: str, index: int, suffix: str = ".bin") -> str:
    """The file name of shard `index` of a split: train_000000.bin, its mask train_000000.mask."""
    return f"{split}_{index:06d}{suffix}"


def sibling_name(shard_file: str, suffix: str = MASK_SUFFIX) -> str:
    """The file beside a shard of meta.json's "shards" (train_000000.bin) with `suffix`: its
    target mask train_000000.mask by default."""
    return shard_file.removesuffix(".bin") + suffix


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
        # Not data.streaming: how the rows are read does not change the shards.
        "max_documents": data.max_documents,
        "max_bytes": data.max_bytes,
        "val_documents": data.val_documents,
        "decode_errors": data.decode_errors,
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

    def shards_ok(entry: dict[str, Any]) -> bool:
        shards = entry.get("shards")
        return isinstance(shards, list) and all(
            isinstance(sh, dict)
            and isinstance(sh.get("file"), str)
            and "/" not in sh["file"]
            and nat(sh.get("tokens"))
            and isinstance(sh.get("sha256"), str)
            for sh in shards
        )

    ok = (
        isinstance(meta, dict)
        and meta.get("version") in (META_VERSION, *OLD_VERSIONS)
        and meta.get("dtype") in TOKEN_DTYPES
        and nat(meta.get("vocab_size"))
        and nat(meta.get("eot_id"))
        and all(
            isinstance(meta.get(s), dict)
            and all(nat(meta[s].get(k)) for k in ("tokens", "bytes", "documents"))
            and (meta.get("version") != META_VERSION or shards_ok(meta[s]))
            for s in SPLITS
        )
    )
    if not ok:
        raise ConfigError(
            "data.out_dir", f"not a meta.json of version {META_VERSION}; {_RERUN}", str(path)
        )
    return meta


def _shard_files(meta: dict[str, Any], split: str, suffix: str) -> list[tuple[str, int, str]]:
    """(file name, tokens, sha256 or "" when not recorded) of each shard (or mask) of a split."""
    if meta["version"] == 1:
        return [(f"{split}{suffix}", meta[split]["tokens"], "")]
    key = "sha256" if suffix == ".bin" else "mask_sha256"
    return [
        (sibling_name(sh["file"], suffix), sh["tokens"], sh.get(key, ""))
        for sh in meta[split]["shards"]
    ]


def _open_files(
    out_dir: Path, files: list[tuple[str, int, str]], dtype: np.dtype, total: int
) -> np.ndarray | ShardedArray:
    """Memmap each file after checking its size and sha256; one file is returned as it is.

    A shard's sha256 is computed once per version of the file (minillm.runtime.files.HashCache),
    so opening a corpus of many GB again, as every DDP rank does at every start, costs a stat
    per shard rather than a read of every byte.
    """
    if sum(tokens for _, tokens, _ in files) != total:
        raise ConfigError(
            "data.out_dir",
            f"the shards do not add up to the split's tokens; {_RERUN}",
            str(out_dir / "meta.json"),
        )
    parts = []
    with HashCache() as hashes:
        for name, tokens, sha in files:
            parts.append(_open_file(out_dir / name, tokens, sha, dtype, hashes))
    if len(parts) == 1:
        return parts[0]  # a small corpus: the plain memmap, as before shards were numbered
    return ShardedArray(parts) if parts else np.zeros(0, dtype=dtype)


def _open_file(path: Path, tokens: int, sha: str, dtype: np.dtype, hashes: HashCache) -> np.ndarray:
    """One shard, memmapped after its size and (when recorded) sha256 are checked."""
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
    if sha and hashes.sha256(path) != sha:
        raise ConfigError(
            "data.out_dir",
            f"sha256 differs from meta.json's (the file was changed or damaged); {_RERUN}",
            str(path),
        )
    if not tokens:  # numpy cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(tokens,))


def open_split(out_dir: str | Path, split: str) -> np.ndarray | ShardedArray:
    """The token ids of "train" or "val" (a read-only memmap, or a ShardedArray over several
    shards), every shard checked against meta.json's size and sha256."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    meta = load_meta(out_dir)
    dtype = TOKEN_DTYPES[meta["dtype"]]
    files = _shard_files(meta, split, ".bin")
    return _open_files(Path(out_dir), files, dtype, meta[split]["tokens"])


def open_mask(
    out_dir: str | Path, split: str, meta: dict[str, Any]
) -> np.ndarray | ShardedArray | None:
    """The split's target mask (bool per token), beside its shards, or None: every token a
    target."""
    if meta.get("loss_on") != "assistant":
        return None
    files = _shard_files(meta, split, MASK_SUFFIX)
    return _open_files(Path(out_dir), files, np.dtype(np.bool_), meta[split]["tokens"])
