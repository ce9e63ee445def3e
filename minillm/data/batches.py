"""The batches that training and evaluation read from a split: pure functions of their inputs.

Offers `train_batch` (the micro-batches of one step, a function of (seed, step, rank, world
size)) and `eval_batches` (windows that predict every token after the first once). So a resumed run
sees the same data, and the global batch does not depend on how it is spread over ranks and
micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from minillm.errors import ConfigError


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
