"""What every training objective is to the Trainer, and what the objectives share.

Offers `Objective` (the one contract: the Trainer writes the optimizer step once around it),
`Setup` (what an objective is built from: the config, where it runs, the tokenizer read once),
`MicroLoss` (one micro-batch's loss and totals),
`StepResult` (what one optimizer step did), `Reference` (the frozen train.init_from model the
post-training objectives compare against), `step_indices` (which rows a step reads: a pure
function of seed and step, so a resume reads the same ones) and `step_rows` (this rank's share of
them, in micro-batches), `token_logps` (per-token
log-probabilities of chosen targets, at a sampling temperature), `pad_rows` and `MeanMeter`
(scalars averaged over the steps since the last log line).

An objective never sees the Trainer: it gets the model and the step's numbers, and returns
tensors. What the Trainer does with them, in this order, for every objective (lm, dpo, grpo):
set the learning rate; `prepare` the step's batch (GRPO samples its rollouts); all-reduce the
`normalisers`; for each micro-batch under `no_sync` and autocast, `loss` (normalised by the
global counts), plus the MoE load-balancing loss, `scaler.scale(loss).backward()`; all-reduce the
micro-batches' totals; `step_loss` (the global loss, logged); unscale, clip, the finite check,
the optimizer step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from minillm.config import Config
from minillm.errors import UserError
from minillm.families import model_conventions
from minillm.model import Transformer
from minillm.model.lora import adapters_off
from minillm.tokenizer.bpe import load_tokenizer, tokenizer_sha256
from minillm.tokenizer.conventions import Conventions
from minillm.train.distributed import DistInfo

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass(frozen=True)
class Setup:
    """What an objective is built from: the run's final config and where it runs. Built by
    `prepare_run` before anything is written, so bad data stops a run that has written nothing
    (and a `--force` start that has not yet cleared the old checkpoints)."""

    cfg: Config
    dist: DistInfo
    device: torch.device
    verbose: bool  # rank 0 and asked to talk
    config_dir: Path | None = None  # the config file's folder (train.grpo.reward's python:)

    @property
    def tokenizer_file(self) -> Path:
        """data.tokenizer (init_from's when the config left it empty); a UserError if absent."""
        path = Path(self.cfg.data.tokenizer_path)
        if not path.is_file():
            raise UserError(f"{path}: tokenizer not found; run `minillm tokenize` first")
        return path

    @functools.cached_property
    def tokenizer_sha(self) -> str:
        return tokenizer_sha256(self.tokenizer_file)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer, read once (the objectives, LoRA's token rows)."""
        return load_tokenizer(self.tokenizer_file)

    @functools.cached_property
    def conventions(self) -> Conventions:
        """How the tokenizer is used: minillm's own chat template or a published model's."""
        return model_conventions(self.tokenizer, self.tokenizer_file.parent, self.cfg.model)


@dataclass(frozen=True)
class MicroLoss:
    """One micro-batch's share of the step: `loss` (what backward runs on: its sum over the
    micro-batch divided by the global normalisers, so the micro-batches and ranks add up to the
    step's loss), `totals` (detached float64 sums the Trainer adds over micro-batches and ranks,
    for `step_loss`) and `inputs` (its input tokens: throughput, and its share of the MoE loss)."""

    loss: torch.Tensor
    totals: torch.Tensor
    inputs: int


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did. loss and grad_norm stay 0-d device tensors: reading them
    waits for the device, so the loop does it on logging steps only."""

    loss: torch.Tensor  # the objective's loss over the global batch (lm: mean cross-entropy)
    grad_norm: torch.Tensor  # before clipping
    lr: float
    tokens: int  # input tokens of the global batch (throughput, MFU, tokens_seen)
    targets: float  # the global batch's first normaliser (lm: target tokens; dpo: pairs)
    finite: bool  # loss (and, without a grad scaler, gradient) finite: the step was taken


class Objective(Protocol):
    """A training objective (train.objective), as the Trainer calls it. Batches and micro-batches
    are the objective's own types; the Trainer only passes them back."""

    dropout: bool  # whether the model's dropout stays on in `loss` (off: dropout_off)
    chat: bool  # trains on conversations (a LoRA run then checks the base knows the chat tokens)
    needs_start_weights: bool  # whether it reads train.init_from's weights on a resume too
    # Its scalars shown on the progress line beside the loss: {tag: label} (a GRPO loss is ~0,
    # so its reward and share of correct replies are what a user watches).
    console: dict[str, str]
    # Labels of its `evaluate` keys on the console's val line where they differ from the
    # train line's (a DPO run's val loss has no sft term: "dpo loss").
    val_labels: dict[str, str]

    def loss_parts(self, own: dict[str, float]) -> dict[str, float]:
        """The parts the step's loss sums, by label, from its `scalars()` ({} for one part):
        shown after the loss, `loss 0.3036 (dpo 0.2900 + sft 0.0136)`."""

    def attach(self, model: Transformer) -> None:
        """The model it trains, holding its starting weights (before a resume loads its own)."""

    def batches(self, step: int) -> list[Any]:
        """This rank's micro-batches of optimizer step `step`: a pure function of seed, step,
        rank and world size (what a bitwise resume relies on)."""

    def prepare(self, model: Transformer, step: int, batch: list[Any]) -> list[Any]:
        """What the step learns from, made from its batch before the learning rate is set
        (GRPO: the rollouts, sampled from `model`); the batch itself for most."""

    def normalisers(self, batch: list[Any]) -> torch.Tensor:
        """This rank's counts that divide the step's summed loss (float64, 1-d), summed over
        the ranks by the Trainer; the first is StepResult.targets."""

    def loss(self, model: torch.nn.Module, micro: Any, norms: torch.Tensor) -> MicroLoss:
        """The loss of one micro-batch under `model` (the wrapped policy), normalised by the
        global `norms` (the normalisers summed over ranks, each at least 1). The policy's
        forward is the last forward of the model here (the MoE router statistics are read
        after it).
        """

    def step_loss(self, totals: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """The step's loss (0-d) from the global totals; also records the step's scalars."""

    def scalars(self) -> dict[str, float]:
        """Its own TensorBoard scalars since the last call ({} for none)."""

    def evaluate(self, model: Transformer, autocast: Any) -> dict[str, float]:
        """Its held-out measure of `model` ({} for none): `loss` is what BEST ranks."""

    def probe_input(self) -> torch.Tensor | None:
        """One row of input ids (1, T) for the per-layer activation charts (None: none)."""


class Reference:
    """The frozen train.init_from model: log-probabilities the policy is compared against.

    With LoRA it is the policy's own base with the adapters switched off (model.lora.adapters_off),
    so no second copy of the weights is held; else a frozen copy of the starting weights, taken
    before a resume loads the run's own, and sharded by `shard` as the policy is (FSDP: each
    rank then keeps its shard of the reference, not the whole model).
    """

    def __init__(
        self, model: Transformer, lora: bool, shard: Callable[[Transformer], None] | None = None
    ) -> None:
        self.policy = model
        self.copy: Transformer | None = None
        if not lora:
            self.copy = copy.deepcopy(model).requires_grad_(False).eval()
            if shard is not None:
                shard(self.copy)

    @contextlib.contextmanager
    def model(self) -> Iterator[Transformer]:
        """The reference model, in eval mode (no dropout), for the duration of the block."""
        if self.copy is not None:
            yield self.copy
            return
        training = self.policy.training
        try:
            with adapters_off(self.policy):
                self.policy.eval()
                yield self.policy
        finally:
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


def step_rows(n: int, cfg: Config, dist: DistInfo, step: int) -> list[list[int]]:
    """This rank's micro-batches of row indices (of n rows) for optimizer step `step`: the
    step's world x grad_accum x batch_size rows of `step_indices`, this rank's share cut into
    micro-batches of batch_size."""
    tc = cfg.train
    per_rank = tc.batch_size * tc.grad_accum
    rows = step_indices(n, tc.seed, step, per_rank * dist.world_size)
    mine = rows[dist.rank * per_rank : (dist.rank + 1) * per_rank]
    return [mine[i : i + tc.batch_size] for i in range(0, per_rank, tc.batch_size)]


def token_logps(
    model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(targets[b, t] | idx[b, :t+1]) for every position, 0 where targets is -100. (B, T)

    At a temperature T != 1, p is softmax(logits / T) in float32: the distribution the decoding
    core samples from at T (minillm.infer.sampling.apply_temperature), as TRL's GRPO computes it.
    """
    if temperature == 1.0:
        _, loss = model(idx, targets, reduction="none")
        return -loss.view(targets.shape)
    logits, _ = model(idx)
    scaled = logits.float() / temperature
    nll = F.cross_entropy(scaled.flatten(0, 1), targets.reshape(-1), reduction="none")
    return -nll.view(targets.shape)


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
