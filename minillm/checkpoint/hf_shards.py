"""A Hugging Face folder's weights written tensor by tensor into shards of at most a given size.

Offers `DEFAULT_MAX_SHARD_SIZE`, `parse_size` (`--max-shard-size`: "5GB", "500MB", "2GiB",
bytes) and `write_weight_shards` (what `minillm export` writes its weights with). The layout and
names are transformers' `save_pretrained`'s: one `model.safetensors` where the weights fit in one
shard, else `model-00001-of-0000N.safetensors`, ... and `model.safetensors.index.json` (its
`weight_map` and `metadata.total_size`), which transformers, peft, vLLM and minillm's `--ckpt`
read.

Shards are filled in the order the tensors come and each is written as soon as the next tensor
would take it past the limit; a tensor larger than the limit is a shard of its own (as
huggingface_hub splits). So at most one shard's tensors are held beyond the model. N is known
only at the end: shards are written under provisional names and renamed once all are written
(inside the export's staging folder, so a failure leaves no shard anywhere).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from torch import Tensor

from minillm.checkpoint.layout import HF_WEIGHTS_FILE, HF_WEIGHTS_INDEX
from minillm.errors import UserError
from minillm.runtime.files import save_safetensors

# huggingface_hub's default and transformers 4's (transformers 5 raised its own to 50GB, the
# Hub's limit per file): published 7-8B folders come in ~5GB shards, which upload, download and
# resume in pieces.
DEFAULT_MAX_SHARD_SIZE = "5GB"

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, key: str = "--max-shard-size") -> int:
    """Bytes of a size written as transformers takes it: "5GB" (10**9), "2GiB" (2**30), "500MB",
    or a number of bytes; units in any case. Anything else, or not above 0, is a UserError naming
    `key`."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        m = _SIZE_RE.match(str(text))
        unit = m.group(2).upper() if m else ""
        if m is None or unit not in _UNITS:
            raise UserError(
                f"{key}: {text!r} is not a size (bytes, or a number with KB, MB, GB, TB or "
                "KiB, MiB, GiB, TiB: 5GB, 500MB, 2GiB)"
            )
        size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise UserError(f"{key}: {text!r} is not above 0 bytes")
    return size


def shard_name(i: int, n: int) -> str:
    """transformers' name of shard i (from 1) of n."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def write_weight_shards(
    named: Iterable[tuple[str, Tensor]], folder: Path, max_bytes: int, metadata: dict[str, str]
) -> list[str]:
    """Write the (HF name, tensor) pairs of `named` into `folder` as one model.safetensors or as
    shards of at most `max_bytes` and their index; the file names written. Each tensor is
    written as it comes (its dtype kept), at most one shard's held at a time; a full disk is the
    OSError the caller turns into one line."""
    parts: list[list[str]] = []  # the names in each shard written so far
    shard: dict[str, Tensor] = {}
    size = total = params = 0

    def flush() -> None:
        nonlocal shard, size
        save_safetensors(shard, folder / f".part-{len(parts):05d}", metadata)
        parts.append(list(shard))
        shard, size = {}, 0  # the shard's tensors are freed here, before the next one grows

    for name, tensor in named:
        t = tensor.detach().cpu().contiguous()  # a view of a parameter stays one: no copy
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_bytes:
            flush()
        shard[name] = t
        size, total, params = size + nbytes, total + nbytes, params + t.numel()
    if shard:
        flush()
    if len(parts) == 1:
        (folder / ".part-00000").rename(folder / HF_WEIGHTS_FILE)
        return [HF_WEIGHTS_FILE]
    names = [shard_name(i + 1, len(parts)) for i in range(len(parts))]
    for i, name in enumerate(names):
        (folder / f".part-{i:05d}").rename(folder / name)
    weight_map = {t: name for name, part in zip(names, parts) for t in part}
    index = {
        "metadata": {"total_parameters": params, "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (folder / HF_WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [*names, HF_WEIGHTS_INDEX]
