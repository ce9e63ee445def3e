"""Training objectives past next-token prediction (`train.objective: dpo | grpo`), and what they
share.

Offers `StepResult` (what one optimizer step did, whatever its loss), `Objective` (what the
Trainer calls: `batches(step)`, `train_step(trainer, batch)`, `scalars()`, `evaluate(trainer)`;
the Trainer's `make_objective` builds one), `Reference`
(the frozen train.init_from model the objectives compare against), `step_indices` (which rows
a step reads: a pure function of seed and step, so a resume reads the same ones), `token_logps`
(per-token log-probabilities of chosen targets) and `MeanMeter` (scalars averaged over the steps
since the last log line).

The Trainer keeps its loop; an objective replaces only what a step reads and how its loss is
made, and what an evaluation measures (docs/training.md, "Preference tuning and RL").
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from minillm.model import Transformer
from minillm.model.lora import LoRALinear, TokenRows


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did. loss and grad_norm stay 0-d device tensors: reading them
    waits for the device, so the loop does it on logging steps only."""

    loss: torch.Tensor  # the objective's loss over the global batch (lm: mean cross-entropy)
    grad_norm: torch.Tensor  # before clipping
    lr: float
    tokens: int  # input tokens of the global batch (throughput, MFU, tokens_seen)
    targets: float  # target tokens of the global batch (fewer, with a target mask)
    finite: bool  # loss (and, without a grad scaler, gradient) finite: the step was taken


class Objective(Protocol):
    """What a Trainer calls in place of its own next-token step and evaluation. `trainer` is the
    minillm.train.trainer.Trainer (its optimizer, models, autocast, state, _clip_and_step);
    typed Any here, since the trainer imports this module."""

    def batches(self, step: int) -> Any: ...

    def train_step(self, trainer: Any, batch: Any) -> StepResult: ...

    def scalars(self) -> dict[str, float]: ...

    def evaluate(self, trainer: Any) -> dict[str, float]: ...


class Reference:
    """The frozen train.init_from model: log-probabilities the policy is compared against.

    With LoRA it is the policy's own base with the adapters switched off (scale 0 during the
    forward: W x + 0 * B A x is W x exactly; trained token rows back to the base's), so no
    second copy of the weights is held; else a frozen copy of the starting weights, taken
    before a resume loads the run's own.
    """

    def __init__(self, model: Transformer, lora: bool) -> None:
        self.policy = model
        self.copy: Transformer | None = None
        if not lora:
            self.copy = copy.deepcopy(model).requires_grad_(False).eval()

    @contextlib.contextmanager
    def model(self) -> Iterator[Transformer]:
        """The reference model, in eval mode (no dropout), for the duration of the block."""
        if self.copy is not None:
            yield self.copy
            return
        layers = [m for m in self.policy.modules() if isinstance(m, LoRALinear)]
        rows = [m for m in self.policy.modules() if isinstance(m, TokenRows)]
        scales = [m.scale for m in layers]
        training = self.policy.training
        try:
            for m in layers:
                m.scale = 0.0
            for m in rows:
                m.active = False
            self.policy.eval()
            yield self.policy
        finally:
            for m, s in zip(layers, scales, strict=True):
                m.scale = s
            for m in rows:
                m.active = True
            self.policy.train(training)


def step_indices(n: int, seed: int, step: int, count: int, offset: int = 0) -> list[int]:
    """Rows `count * step + offset ...` of an endless stream over n rows: each epoch a fresh
    permutation drawn from (seed, epoch). A pure function of its arguments, so a resumed run
    reads the rows an uninterrupted one would."""
    out = []
    for p in range(count * step + offset, count * step + offset + count):
        epoch, i = divmod(p, n)
        perm = np.random.default_rng([seed % 2**63, epoch]).permutation(n)
        out.append(int(perm[i]))
    return out


def token_logps(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[b, t] | idx[b, :t+1]) for every position, 0 where targets is -100. (B, T)"""
    _, loss = model(idx, targets, reduction="none")
    return -loss.view(targets.shape)


def pad_rows(rows: list[list[int]], masks: list[list[bool]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (B, T) and targets (B, T) of token rows whose next token is a target where the
    mask says so, right-padded (padding is after every real token: causal attention never sees
    it) with targets -100."""
    T = max(len(r) for r in rows) - 1
    idx = torch.zeros(len(rows), T, dtype=torch.long)
    tgt = torch.full((len(rows), T), -100, dtype=torch.long)
    for b, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids = torch.tensor(r, dtype=torch.long)
        idx[b, : len(r) - 1] = ids[:-1]
        keep = torch.tensor(m[1:], dtype=torch.bool)
        tgt[b, : len(r) - 1] = torch.where(keep, ids[1:], torch.full_like(ids[1:], -100))
    return idx, tgt


class MeanMeter:
    """Named values averaged over the steps since the last `scalars()` (a log line)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
            self.counts[k] = self.counts.get(k, 0) + 1

    def scalars(self) -> dict[str, float]:
        out = {k: self.sums[k] / self.counts[k] for k in self.sums}
        self.sums, self.counts = {}, {}
        return out
