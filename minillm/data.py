"""Token shards: text -> ids -> `train.bin`, `val.bin`, `meta.json`; and the batches training reads.

Offers `prepare_data(cfg, retrain)` (what `minillm tokenize` runs; the work is in minillm.shards),
`print_summary`, `load_meta`, `open_split`, `train_batch`, `eval_batches`, `shard_dtype`,
`META_VERSION`, `SPLITS` and `DTYPES`.

A shard is the split's documents' token ids, each document followed by the EOT id, as raw
little-endian uint16 (uint32 when the vocabulary exceeds 65,536). `meta.json` holds:

    {"version", "dtype", "vocab_size", "eot_id",
     "train": {"tokens", "bytes", "documents", "sha256"}, "val": {...},
     "tokenizer_sha256", "source_fingerprint",
     "data": {"source", "format", "text_field", "val_fraction", "seed"}}

`bytes` counts the UTF-8 bytes of a split's document texts (not the separators), for
bits-per-byte. Everything a run writes (tokenizer.json when it trains one, both shards, meta.json)
goes to temporary names first and is fsynced; only when all of it is whole are the names swapped
in, meta.json last. A failed or interrupted run therefore leaves the previous shards and tokenizer
as they were, and `open_split` refuses a shard whose size disagrees with meta.json.

Batches are pure functions of their arguments (see `train_batch`), so a resumed run sees the same
data and the global batch does not depend on how it is spread over ranks and micro-batches.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minillm.config import Config, ConfigError, DataConfig

if TYPE_CHECKING:  # torch is imported where batches are made: `minillm tokenize` doesn't need it
    import torch

META_VERSION = 1
SPLITS = ("train", "val")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_RERUN = "run `minillm tokenize CONFIG` again"


def prepare_data(cfg: Config, retrain: bool = False) -> dict[str, Any]:
    """Train the tokenizer if needed, write both shards and meta.json; return the summary.

    An existing tokenizer is reused unless `retrain`; one that disagrees with the config is a
    UserError. Nothing is replaced unless the whole run succeeds.
    """
    from minillm.shards import write_shards

    return write_shards(cfg, retrain)


def print_summary(summary: dict[str, Any]) -> None:
    """Print what `prepare_data` returned: documents, bytes, tokens, bytes/token, MB/s."""
    from minillm.shards import print_summary as print_table

    print_table(summary)


def shard_dtype(vocab_size: int) -> str:
    """The shard dtype: uint16 while every id fits (vocab_size <= 65536), else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# ----------------------------------------------------------------------------- reading


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
        and meta.get("dtype") in DTYPES
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
    dtype, tokens = DTYPES[meta["dtype"]], meta[split]["tokens"]
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


# ----------------------------------------------------------------------------- batches


def train_batch(
    tokens: np.ndarray,
    *,
    seed: int,
    step: int,
    rank: int,
    world_size: int,
    batch_size: int,
    grad_accum: int,
    seq_len: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's `grad_accum` micro-batches (x, y) of step `step`, each (B, T) int64.

    A pure function of (seed, step, rank, world_size): the step draws G = B * grad_accum *
    world_size window offsets uniformly in [0, len - T - 1] from `default_rng([seed, step])`, and
    rank r's micro-batch m takes offsets[(r * grad_accum + m) * B :][:B]. So the global batch of a
    step is the same set of windows however it is split over ranks and micro-batches.
    """
    import torch

    n = len(tokens)
    if n < seq_len + 1:
        raise ConfigError(
            "train.seq_len",
            f"{seq_len} needs at least {seq_len + 1} tokens, but the split has only {n}",
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    rng = np.random.default_rng([seed % 2**64, step])  # numpy seeds must be >= 0
    windows = batch_size * grad_accum * world_size  # G, the global batch of the step
    offsets = rng.integers(0, n - seq_len - 1, size=windows, endpoint=True)
    batches = []
    for m in range(grad_accum):
        first = (rank * grad_accum + m) * batch_size
        rows = [tokens[o : o + seq_len + 1] for o in offsets[first : first + batch_size]]
        window = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
        batches.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return batches


def eval_batches(
    tokens: np.ndarray, *, seq_len: int, batch_size: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches (x, y), each (<= B, T) int64, that predict every token after the first once.

    Windows start at 0, T, 2T, ...: x = ids[i : i+T], y = ids[i+1 : i+T+1]. The last window is
    shorter and padded to T with input 0 and target -100 (ignored by cross-entropy); the last
    batch may have fewer rows. Deterministic: always the same first `max_batches` batches.
    """
    import torch

    targets = len(tokens) - 1
    starts = range(0, max(targets, 0), seq_len)
    for b, first in enumerate(range(0, len(starts), batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        rows = starts[first : first + batch_size]
        x = torch.zeros((len(rows), seq_len), dtype=torch.int64)
        y = torch.full((len(rows), seq_len), -100, dtype=torch.int64)
        for r, i in enumerate(rows):
            length = min(seq_len, targets - i)
            ids = torch.from_numpy(np.asarray(tokens[i : i + length + 1]).astype(np.int64))
            x[r, :length], y[r, :length] = ids[:-1], ids[1:]
        yield x, y
