"""The learning-rate schedule: a pure function of the step and the config.

Offers `lr_at(step, ...)` (warmup, then cosine, warmup-stable-decay or constant) and
`schedule_lr(step, cfg, peak)`, the same for a config and one optimizer's peak learning rate.
"""

from __future__ import annotations

import math

from minillm.config import TrainConfig


def decay_start(max_steps: int, decay_fraction: float) -> int:
    """First step of the decay of `wsd`: the last decay_fraction of max_steps (at least 1 step)."""
    return max_steps - max(1, round(decay_fraction * max_steps))


def lr_at(
    step: int,
    *,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    max_steps: int,
    schedule: str = "cosine",
    decay_fraction: float = 0.2,
) -> float:
    """Learning rate of optimizer step `step` (0-based).

    All schedules rise linearly to lr over steps 0..warmup-1 ((step+1)/warmup, so step 0 already
    learns). Then:
    - cosine: a half cosine from lr at step `warmup` to min_lr at step `max_steps`;
    - wsd: lr until the last `decay_fraction` of max_steps, then 1-sqrt down to min_lr at step
      `max_steps` (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed
      Training Durations": 1-sqrt beats linear at equal length, by spending longer near lr and
      falling fast at the end). Steps before the decay do not depend on max_steps, which is
      why a run can be extended from a checkpoint taken before it;
    - constant: lr.
    min_lr from `max_steps` on (cosine, wsd).
    """
    warm = (step + 1) / warmup_steps if step < warmup_steps else 1.0
    if schedule == "constant":
        return lr * warm
    if schedule == "wsd":
        if step >= max_steps:
            return min_lr
        start = decay_start(max_steps, decay_fraction)
        if step < start:
            return lr * warm
        decayed = min_lr + (lr - min_lr) * (1.0 - math.sqrt((step - start) / (max_steps - start)))
        # A decay that begins inside the warmup: the lower of the two, so lr never jumps up.
        return min(lr * warm, decayed)
    if step < warmup_steps:
        return lr * warm
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def schedule_lr(step: int, cfg: TrainConfig, peak: float | None = None) -> float:
    """`lr_at` for the config; `peak` replaces train.lr (min_lr scales with it), e.g. Muon's."""
    peak = cfg.lr if peak is None else peak
    return lr_at(
        step,
        lr=peak,
        min_lr=cfg.min_lr * peak / cfg.lr,
        warmup_steps=cfg.warmup_steps,
        max_steps=cfg.max_steps,
        schedule=cfg.schedule,
        decay_fraction=cfg.decay_fraction,
    )
