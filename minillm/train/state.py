"""A Trainer's state in and out of a checkpoint: what a resume needs to continue bit for bit.

Offers `TrainState` (what the Trainer owns and a checkpoint holds: the model, optimizer, grad
scaler and weight average it trains, and the loop's counters), `save_train_state(run, state,
is_best)` (those, and every rank's RNG; a collective under FSDP) and `restore_train_state(run,
state, path)`: named apart from minillm.checkpoint.store's `save_checkpoint`, which writes the
files. The files and their layout are minillm.checkpoint.store's. Under train.ema_decay
the model file holds the average of the weights (what eval, sample and export read) and the
trainer state holds the raw weights and the average's update count beside the optimizer's
moments. A LoRA run (train.lora) saves only the adapters and their optimizer state, and the
identity of its base (`lora_base` in state.json).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from minillm.checkpoint import layout
from minillm.checkpoint import store as ckpt
from minillm.config import config_to_dict
from minillm.errors import warn
from minillm.model.lora import adapter_state, is_adapter
from minillm.runtime.device import rng_state, set_rng_state
from minillm.train.distributed import all_gather_objects, all_reduce_sum
from minillm.train.ema import WeightEMA
from minillm.train.optim import Optimizers
from minillm.train.parallel import (
    full_model_state,
    full_state,
    load_full_model_state,
    load_full_state,
)
from minillm.train.run import Run


@dataclass
class TrainState:
    """What a checkpoint saves of a run in training and a resume restores, owned by the Trainer.
    The RNG is the process's own (torch's generators): a checkpoint takes every rank's."""

    model: torch.nn.Module  # the plain module (DDP or FSDP2 wrap it, sharing its parameters)
    optimizer: Optimizers
    scaler: torch.amp.GradScaler | None  # fp16 only
    ema: WeightEMA | None  # train.ema_decay > 0 only
    step: int = 0  # optimizer steps completed, skipped ones included
    tokens_seen: int = 0
    best_val: float = math.inf  # the lowest validation loss so far
    bad_in_a_row: int = 0  # non-finite steps since the last finite one
    skipped_steps: int = 0  # non-finite steps of the whole run
    last_ckpt: Path | None = None  # the newest checkpoint written or resumed from


def save_train_state(run: Run, state: TrainState, is_best: bool = False) -> Path | None:
    """Checkpoint `state` after `state.step` completed steps (a collective under FSDP).

    Weights that have overflowed (a huge lr can make a step with finite gradients do that)
    are not written: the last checkpoint stays the last good one. Returns None then, and on
    ranks other than 0.
    """
    s = state
    if not weights_finite(s.model, run.device):
        if run.is_main:
            warn(f"step {s.step}: the weights are not finite; no checkpoint written "
                 f"(the last good one: {s.last_ckpt or 'none'})")  # fmt: skip
        return None
    model_sd, optim_sd = full_state(s.model, s.optimizer)
    lora = run.lora_base is not None  # the adapters only: the base is recorded, not copied
    if lora:
        model_sd = adapter_state(model_sd)
    raw_sd = None
    if s.ema is not None:
        raw_sd = model_sd
        with s.ema.swapped():
            model_sd = full_model_state(s.model)
        if lora:
            model_sd = adapter_state(model_sd)
    rngs = all_gather_objects(rng_state())  # index = rank
    if not run.is_main:
        return None
    # The keys of trainer_state.pt and state.json are the on-disk format: old runs resume.
    trainer_state = {
        "optimizer": optim_sd,
        "scaler": s.scaler.state_dict() if s.scaler is not None else {},
        "rng": rngs,
        "step": s.step,
        "tokens_seen": s.tokens_seen,
        "best_val": s.best_val,
        "bad_in_a_row": s.bad_in_a_row,
        "skipped_steps": s.skipped_steps,
    }
    if s.ema is not None:
        trainer_state["ema"] = {"updates": s.ema.updates, "weights": raw_sd}
    meta = {
        "tokens_seen": s.tokens_seen,
        "best_val_loss": s.best_val if math.isfinite(s.best_val) else None,
        "world_size": run.dist.world_size,
        "precision": run.precision,
        "tokenizer_sha256": run.tokenizer_sha,
        "config": config_to_dict(run.cfg),
    }
    if lora:
        meta["lora_base"] = run.lora_base
    s.last_ckpt = ckpt.save_checkpoint(
        run.run_dir,
        s.step,
        model_sd,
        trainer_state,
        meta,
        tokenizer_file=run.tokenizer_file,
        keep_last=run.cfg.train.keep_last,
        is_best=is_best,
    )
    return s.last_ckpt


_FINITE_SLICE = 1 << 20  # elements checked at a time by weights_finite


def weights_finite(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether every weight on every rank is finite (a collective under torchrun)."""
    bad = torch.zeros((), device=device)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 shard
            # In slices: isfinite makes a float copy (abs) and bool masks of what it is given,
            # 2-3x the bytes of what it is given at once (~500 MB of a TinyLlama QLoRA save).
            for part in local.detach().reshape(-1).split(_FINITE_SLICE):
                bad += (~torch.isfinite(part)).sum()
    return all_reduce_sum(bad).item() == 0


def restore_train_state(run: Run, state: TrainState, path: Path) -> None:
    """Load weights, optimizer, scaler, this rank's RNG and the counters from `path` into
    `state`."""
    s = state
    saved = layout.read_state(path)
    weights = ckpt.load_model_state(path)
    trainer_state = ckpt.load_trainer_state(path)
    saved_ema = trainer_state.get("ema")
    if saved_ema is not None and s.ema is not None:  # the model file holds the average
        load_full_model_state(s.model, _with_base(s.model, weights))
        s.ema.reset(updates=int(saved_ema["updates"]))
    if saved_ema is not None:  # training goes on from the raw weights, with or without one
        weights = saved_ema["weights"]
    if run.lora_base is not None:  # adapters only: the base the model holds stays
        weights = _with_base(s.model, weights)
    load_full_state(s.model, s.optimizer, weights, trainer_state["optimizer"])
    if saved_ema is None and s.ema is not None:  # an average begun at this resume
        s.ema.reset()
    if s.scaler is not None and trainer_state.get("scaler"):
        s.scaler.load_state_dict(trainer_state["scaler"])
    rngs = trainer_state.get("rng", [])
    if run.dist.rank < len(rngs):
        set_rng_state(rngs[run.dist.rank])
    s.step = int(trainer_state["step"])
    s.tokens_seen = int(trainer_state["tokens_seen"])
    s.best_val = float(trainer_state.get("best_val", math.inf))
    s.bad_in_a_row = int(trainer_state.get("bad_in_a_row", 0))
    s.skipped_steps = int(trainer_state.get("skipped_steps", 0))
    s.last_ckpt = path
    if run.verbose:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(saved.get("saved_at", 0)))
        print(f"resuming from {path} (step {s.step}, saved {when})")


def _with_base(model: torch.nn.Module, adapters: dict[str, Tensor]) -> dict[str, Tensor]:
    """A LoRA checkpoint's adapters completed with the frozen base the model already holds, for
    the strict loaders (a missing or foreign adapter is still an error)."""
    if not any(is_adapter(k) for k in adapters):
        return adapters  # a run that is not LoRA: resume_point refused it already
    base = {k: v for k, v in model.state_dict().items() if not is_adapter(k)}
    return {**base, **adapters}
