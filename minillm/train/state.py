"""A Trainer's state in and out of a checkpoint: what a resume needs to continue bit for bit.

Offers `save_checkpoint(trainer, is_best)` (weights, optimizer, grad scaler, every rank's RNG,
the counters; a collective under FSDP) and `restore_checkpoint(trainer, path)`. The files and
their layout are minillm.checkpoint.store's. Under train.ema_decay the model file holds the
average of the weights (what eval, sample and export read) and the trainer state holds the raw
weights and the average's update count beside the optimizer's moments.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Protocol

import torch

from minillm.checkpoint import store as ckpt
from minillm.config import Config, config_to_dict
from minillm.errors import warn
from minillm.runtime.device import rng_state, set_rng_state
from minillm.train.distributed import DistInfo, all_gather_objects, all_reduce_sum
from minillm.train.ema import WeightEMA
from minillm.train.optim import Optimizers
from minillm.train.parallel import (
    full_model_state,
    full_state,
    load_full_model_state,
    load_full_state,
)
from minillm.train.run import Run


class Checkpointed(Protocol):
    """What a checkpoint saves of a Trainer and restores into it (a Protocol: no import of it)."""

    run: Run
    cfg: Config
    model: torch.nn.Module
    optimizer: Optimizers
    ema: WeightEMA | None
    scaler: torch.amp.GradScaler | None
    dist: DistInfo
    device: torch.device
    precision: str
    run_dir: Path
    is_main: bool
    verbose: bool
    step: int
    tokens_seen: int
    best_val: float
    bad_in_a_row: int
    skipped_steps: int
    last_ckpt: Path | None


def save_checkpoint(trainer: Checkpointed, is_best: bool = False) -> Path | None:
    """Checkpoint the state after `trainer.step` completed steps (a collective under FSDP).

    Weights that have overflowed (a huge lr can make a step with finite gradients do that)
    are not written: the last checkpoint stays the last good one. Returns None then, and on
    ranks other than 0.
    """
    t = trainer
    if not weights_finite(t.model, t.device):
        if t.is_main:
            warn(f"step {t.step}: the weights are not finite; no checkpoint written "
                 f"(the last good one: {t.last_ckpt or 'none'})")  # fmt: skip
        return None
    model_sd, optim_sd = full_state(t.model, t.optimizer)
    raw_sd = None
    if t.ema is not None:
        raw_sd = model_sd
        with t.ema.swapped():
            model_sd = full_model_state(t.model)
    rngs = all_gather_objects(rng_state())  # index = rank
    if not t.is_main:
        return None
    trainer_state = {
        "optimizer": optim_sd,
        "scaler": t.scaler.state_dict() if t.scaler is not None else {},
        "rng": rngs,
        "step": t.step,
        "tokens_seen": t.tokens_seen,
        "best_val": t.best_val,
        "bad_in_a_row": t.bad_in_a_row,
        "skipped_steps": t.skipped_steps,
    }
    if t.ema is not None:
        trainer_state["ema"] = {"updates": t.ema.updates, "weights": raw_sd}
    state = {
        "tokens_seen": t.tokens_seen,
        "best_val_loss": t.best_val if math.isfinite(t.best_val) else None,
        "world_size": t.dist.world_size,
        "precision": t.precision,
        "tokenizer_sha256": t.run.tokenizer_sha,
        "config": config_to_dict(t.cfg),
    }
    t.last_ckpt = ckpt.save_checkpoint(
        t.run_dir,
        t.step,
        model_sd,
        trainer_state,
        state,
        tokenizer_file=t.run.tokenizer_file,
        keep_last=t.cfg.train.keep_last,
        is_best=is_best,
    )
    return t.last_ckpt


def weights_finite(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether every weight on every rank is finite (a collective under torchrun)."""
    bad = torch.zeros((), device=device)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 shard
            bad += (~torch.isfinite(local)).sum()
    return all_reduce_sum(bad).item() == 0


def restore_checkpoint(trainer: Checkpointed, path: Path) -> None:
    """Load weights, optimizer, scaler, this rank's RNG and the counters from `path`."""
    t = trainer
    state = ckpt.read_state(path)
    weights = ckpt.load_model_state(path)
    trainer_state = ckpt.load_trainer_state(path)
    saved_ema = trainer_state.get("ema")
    if saved_ema is not None and t.ema is not None:  # the model file holds the average
        load_full_model_state(t.model, weights)
        t.ema.reset(updates=int(saved_ema["updates"]))
    if saved_ema is not None:  # training goes on from the raw weights, with or without one
        weights = saved_ema["weights"]
    load_full_state(t.model, t.optimizer, weights, trainer_state["optimizer"])
    if saved_ema is None and t.ema is not None:  # an average begun at this resume
        t.ema.reset()
    if t.scaler is not None and trainer_state.get("scaler"):
        t.scaler.load_state_dict(trainer_state["scaler"])
    rngs = trainer_state.get("rng", [])
    if t.dist.rank < len(rngs):
        set_rng_state(rngs[t.dist.rank])
    t.step = int(trainer_state["step"])
    t.tokens_seen = int(trainer_state["tokens_seen"])
    t.best_val = float(trainer_state.get("best_val", math.inf))
    t.bad_in_a_row = int(trainer_state.get("bad_in_a_row", 0))
    t.skipped_steps = int(trainer_state.get("skipped_steps", 0))
    t.last_ckpt = path
    if t.verbose:
        saved = time.strftime("%Y-%m-%d %H:%M", time.localtime(state.get("saved_at", 0)))
        print(f"resuming from {path} (step {t.step}, saved {saved})")
