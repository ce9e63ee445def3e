"""The batches that training and evaluation read from a split: pure functions of their inputs.

Offers `MicroBatch`, `train_batch` (the micro-batches of one step, a function of (seed, step,
rank, world size)), `eval_batches` (windows that predict every token after the first once), and
for packed documents `doc_starts`, `doc_ids` and `conversation_batches` (every conversation alone
in its row). So a resumed run sees the same data, and the global batch does not depend on how it is
spread over ranks and micro-batches.

A training micro-batch is a `MicroBatch` (tokens, targets, doc_ids): with document masking
doc_ids (B, T) numbers the documents of a window (a document's EOT belongs to it), for the model's
`doc_ids` argument; else it is None. Evaluation batches stay plain (x, y) pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from minillm.errors import ConfigError


class MicroBatch(NamedTuple):
    """One micro-batch of a training step: tokens (B, T) int64, targets (B, T) int64 (-100 where
    not a target), and doc_ids (B, T) under document masking, else None."""

    tokens: torch.Tensor
    targets: torch.Tensor
    doc_ids: torch.Tensor | None = None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        """`fn` applied to every tensor present (pinning, a copy to the device), None kept."""
        return MicroBatch(*(None if t is None else fn(t) for t in self))

    def to(self, device: torch.device, non_blocking: bool = False) -> MicroBatch:
        """On `device`; non_blocking from pinned memory is an asynchronous copy on CUDA."""
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))


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
    mask: np.ndarray | None = None,
    eot_id: int | None = None,
    starts: np.ndarray | None = None,
) -> list[MicroBatch]:
    """This rank's `grad_accum` micro-batches (tokens, targets, doc_ids) of step `step`, (B, T).

    A pure function of (seed, step, rank, world_size): the step draws G = B * grad_accum *
    world_size window offsets uniformly in [0, len - T - 1] from `default_rng([seed, step])`, and
    rank r's micro-batch m takes offsets[(r * grad_accum + m) * B :][:B]. So the global batch of a
    step is the same set of windows however it is split over ranks and micro-batches.
    mask: per token, whether it is a target (others get y = -100). eot_id: add doc_ids.
    starts: draw the offsets from these document starts instead (chat: a window starts at a
    conversation); a window running past the end is padded with EOT inputs and -100 targets.
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
    if starts is None:
        offsets = rng.integers(0, n - seq_len - 1, size=windows, endpoint=True)
    else:
        offsets = starts[rng.integers(0, len(starts), size=windows)]
    pad = 0 if eot_id is None else eot_id
    batches: list[MicroBatch] = []
    for m in range(grad_accum):
        first = (rank * grad_accum + m) * batch_size
        rows, targets = [], []
        for o in offsets[first : first + batch_size]:
            row = np.full(seq_len + 1, pad, dtype=np.int64)  # (T+1,)
            got = np.asarray(tokens[o : o + seq_len + 1])
            row[: len(got)] = got
            keep = np.zeros(seq_len + 1, dtype=bool)
            keep[: len(got)] = True if mask is None else mask[o : o + len(got)]
            rows.append(row)
            targets.append(keep)
        window = torch.from_numpy(np.stack(rows))  # (B, T+1)
        # clone, not contiguous(): at B = 1 both slices are already contiguous views of one
        # buffer, and masking y to -100 below would then write into x (an IndexError in the
        # embedding, issue 60).
        x, y = window[:, :-1].clone(), window[:, 1:].clone()
        y[~torch.from_numpy(np.stack(targets)[:, 1:])] = -100
        batches.append(MicroBatch(x, y, None if eot_id is None else doc_ids(x, eot_id)))
    return batches


def doc_ids(x: torch.Tensor, eot_id: int) -> torch.Tensor:
    """(B, T) document number of each input token: a document's EOT closes (belongs to) it."""
    is_eot = (x == eot_id).long()
    return is_eot.cumsum(dim=1) - is_eot


def doc_starts(tokens: np.ndarray, eot_id: int) -> np.ndarray:
    """Offsets where the documents of a split start: 0 and every position after an EOT."""
    after = np.flatnonzero(np.asarray(tokens) == eot_id) + 1
    return np.concatenate([[0], after[after < len(tokens)]]).astype(np.int64)


def conversation_batches(
    tokens: np.ndarray,
    mask: np.ndarray | None,
    eot_id: int,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches (x, y), each (<= B, T), with every document alone in its row from its start.

    A row is one document and its EOT (cut to T+1 tokens), padded with target -100; targets are
    the mask's (every token where mask is None). So each conversation is scored on its own, as
    a chat model sees it, and no other conversation is in its context.
    """
    import torch

    starts = doc_starts(tokens, eot_id)
    ends = np.append(starts[1:], len(tokens))  # a document's EOT is the last token before `end`
    for b, first in enumerate(range(0, len(starts), batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        rows = range(first, min(first + batch_size, len(starts)))
        x = torch.zeros((len(rows), seq_len), dtype=torch.int64)
        y = torch.full((len(rows), seq_len), -100, dtype=torch.int64)
        for r, d in enumerate(rows):
            lo, hi = int(starts[d]), min(int(ends[d]), int(starts[d]) + seq_len + 1)
            ids = torch.from_numpy(np.asarray(tokens[lo:hi]).astype(np.int64))
            x[r, : hi - lo - 1], y[r, : hi - lo - 1] = ids[:-1], ids[1:]
            if mask is not None:
                keep = torch.from_numpy(np.array(mask[lo + 1 : hi], dtype=bool))
                y[r, : hi - lo - 1][~keep] = -100
        yield x, y


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
