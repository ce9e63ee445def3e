"""The optimizer and the learning-rate schedule.

Offers `lr_at(step, ...)` (a pure function: linear warmup, then cosine to min_lr) and
`build_optimizer(model, cfg, device)` (AdamW, weight decay on matrices only, fused or foreach).
"""

from __future__ import annotations

import math

import torch

from minillm.config import TrainConfig


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based).

    Steps 0..warmup-1 rise linearly to lr ((step+1)/warmup, so step 0 already learns); then a
    half cosine falls from lr at step `warmup` to min_lr at step `max_steps`; min_lr after that.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def schedule_lr(step: int, cfg: TrainConfig) -> float:
    return lr_at(
        step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps
    )


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights); not norm gains or other vectors."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW with the fused kernel on CUDA and the multi-tensor (foreach) one elsewhere."""
    kwargs = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.adam_eps,
        **kwargs,
    )
