"""The optimizers of a run: AdamW alone, or Muon for the block matrices plus AdamW for the rest.

Offers `Optimizers` (several torch optimizers stepped as one), `build_optimizer(model, cfg,
device)`, `set_lr(optimizer, step, cfg)` and `param_groups`. The schedule is in `schedule.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from minillm.config import TrainConfig
from minillm.errors import ConfigError
from minillm.model.param_groups import optimizer_split
from minillm.train.schedule import schedule_lr


class Optimizers:
    """Named torch optimizers that the Trainer, the GradScaler and the checkpoint see as one.

    `param_groups`, `step` and `zero_grad` are what the loop and `GradScaler.unscale_/step` use;
    iterating yields the parts, which is how torch.distributed.checkpoint's `get_state_dict` and
    `set_state_dict` take several optimizers (one state dict keyed by parameter name, so an AdamW
    checkpoint has the same layout as before).
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer]) -> None:
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.parts.values() for g in opt.param_groups]

    def step(self, closure: Callable | None = None) -> None:
        for opt in self.parts.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.parts.values())


def param_groups(named: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights); not norm gains or other vectors."""
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> Optimizers:
    """AdamW (fused on CUDA, foreach elsewhere) and, with `optimizer: muon`, torch.optim.Muon.

    Call it after the model is wrapped: under FSDP2 the parameters are then shards, which Muon
    cannot take (it orthogonalises a whole matrix; each rank holds only some of its rows).
    """
    split = optimizer_split(model, cfg.optimizer)
    if any(hasattr(p, "to_local") for _, p in split.get("muon", [])):
        raise ConfigError(
            "train.optimizer",
            "muon cannot run under train.parallel: fsdp (Muon orthogonalises whole matrices, "
            "FSDP2 gives each rank a shard of rows); use parallel: ddp or optimizer: adamw",
        )
    kwargs = {"fused": True} if device.type == "cuda" else {"foreach": True}
    parts: dict[str, torch.optim.Optimizer] = {}
    if split.get("muon"):
        # The orthogonalised update has singular values near 1; "original" (Keller Jordan's
        # Muon) scales it by sqrt(max(1, rows/cols)), so muon_lr is Muon's own scale, not
        # AdamW's. Weight decay is decoupled: weights shrink by muon_lr * muon_weight_decay.
        parts["muon"] = torch.optim.Muon(
            [p for _, p in split["muon"]],
            lr=cfg.muon_lr,
            weight_decay=cfg.muon_weight_decay,
            momentum=cfg.muon_momentum,
            nesterov=True,
            adjust_lr_fn="original",
        )
    parts["adamw"] = torch.optim.AdamW(
        param_groups(split["adamw"], cfg.weight_decay),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.adam_eps,
        **kwargs,
    )
    return Optimizers(parts)


def set_lr(optimizer: Optimizers, step: int, cfg: TrainConfig) -> float:
    """Set every group's learning rate for `step`; return AdamW's (the one logged as train/lr).

    Computed from the config each step (not stored in the groups), so a resume with a changed
    lr or schedule follows the new config.
    """
    peaks = {"adamw": cfg.lr, "muon": cfg.muon_lr}
    for name, opt in optimizer.parts.items():
        lr = schedule_lr(step, cfg, peaks[name])
        for group in opt.param_groups:
            group["lr"] = lr
    return schedule_lr(step, cfg)


def newton_schulz_flops(optimizer: Optimizers) -> float:
    """Matmul FLOPs of one step's Newton-Schulz iterations on one rank (0 without Muon).

    Per (m x n) matrix, m <= n after Muon's transpose, each of ns_steps iterations computes
    X X^T (2 m^2 n), the quintic's A A (2 m^3) and B X (2 m^2 n).
    """
    muon = optimizer.parts.get("muon")
    if muon is None:
        return 0.0
    total = 0.0
    for group in muon.param_groups:
        for p in group["params"]:
            m, n = sorted(p.shape)
            total += group["ns_steps"] * (4 * m * m * n + 2 * m**3)
    return total
