"""An exponential moving average of the weights (`train.ema_decay`), kept beside the training.

Offers `WeightEMA`. After every optimizer step that was taken, each average moves towards its
parameter: avg = avg + (1 - d) * (w - avg), with d = min(ema_decay, (1 + t) / (2 + t)) after t
updates, so the average starts as a plain mean of the weights seen (at 0.995, until step 198)
and does not drag the random initial weights along. The trainer evaluates and saves the average
(`swapped()`): the checkpoint's model is the average, and the raw training weights go into the
trainer state, so a resume continues both bit for bit.

Under FSDP2 each rank averages its own shard of each parameter; under DDP every rank holds the
same weights, hence the same average.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: an FSDP2 parameter's shard, else the parameter itself."""
    return p.to_local() if hasattr(p, "to_local") else p


class WeightEMA:
    """An fp32 average of a model's parameters on the parameters' device."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.model, self.decay, self.updates = model, decay, 0
        self.average = [p.float().clone() for p in self.params]

    @property
    def params(self) -> list[torch.Tensor]:
        """The weights now (looked up each time: FSDP2 may move a shard to new storage); the
        trainable ones only: a LoRA run's frozen base needs no average."""
        return [_local(p.detach()) for p in self.model.parameters() if p.requires_grad]

    def current_decay(self) -> float:
        """The decay the next update uses."""
        return min(self.decay, (1 + self.updates) / (2 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the weights: one step of the average."""
        weight, params = 1.0 - self.current_decay(), self.params
        if all(p.dtype == torch.float32 for p in params):
            torch._foreach_lerp_(self.average, params, weight)
        else:  # half-precision parameters: average in fp32
            for avg, p in zip(self.average, params, strict=True):
                avg.lerp_(p.float(), weight)
        self.updates += 1

    @torch.no_grad()
    def reset(self, updates: int = 0) -> None:
        """Start the average again from the model's current weights, as if after `updates`."""
        for avg, p in zip(self.average, self.params, strict=True):
            avg.copy_(p)
        self.updates = updates

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside, the model holds the average; after, its own weights again, unchanged."""
        params = self.params
        with torch.no_grad():
            raw = [p.clone() for p in params]
            for avg, p in zip(self.average, params, strict=True):
                p.copy_(avg)
        try:
            yield
        finally:
            with torch.no_grad():
                for saved, p in zip(raw, params, strict=True):
                    p.copy_(saved)
