"""How the model is wrapped for the run: DDP or FSDP2 under torchrun, torch.compile if asked.

Offers `wrap_model`, `no_sync`, `release_groups`, `full_state`, `load_full_state` and their
model-only forms `full_model_state`, `load_full_model_state`. Checkpoints always hold full,
unsharded tensors keyed by parameter name (torch.distributed.checkpoint's "full state dict"),
whatever the wrapping, so single-device, DDP and FSDP runs read each other's checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from minillm.config import Config
from minillm.runtime.device import PRECISION_DTYPES, resolve_precision
from minillm.train.distributed import DistInfo


def wrap_model(
    model: torch.nn.Module, cfg: Config, device: torch.device, precision: str, dist: DistInfo
) -> torch.nn.Module:
    """The module the training step calls. `model` itself keeps the plain parameter names."""
    wrapped = model
    if dist.enabled and cfg.train.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif dist.enabled and cfg.train.parallel == "fsdp":
        shard_model(model, precision)
    if cfg.train.compile:
        wrapped = torch.compile(wrapped)
    return wrapped


def no_sync(
    wrapped: torch.nn.Module, model: torch.nn.Module, sync: bool
) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on accumulation micro-steps (`sync` False); DDP or FSDP2."""
    if sync:
        return contextlib.nullcontext()
    inner = getattr(wrapped, "_orig_mod", wrapped)  # under torch.compile
    if hasattr(inner, "no_sync"):  # DDP
        return inner.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: torch.nn.Module) -> Any:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def shard_model(model: torch.nn.Module, precision: str) -> None:
    """FSDP2: shard each block, then the rest (embedding, final norm, head), in place.

    Under bf16/fp16 the policy gathers parameters in that dtype and reduces gradients in fp32,
    which replaces autocast for the sharded weights.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if precision in ("bf16", "fp16"):
        policy = MixedPrecisionPolicy(
            param_dtype=PRECISION_DTYPES[precision], reduce_dtype=torch.float32
        )
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def reference_sharder(
    cfg: Config, device: torch.device, dist: DistInfo
) -> Callable[[torch.nn.Module], None] | None:
    """How a frozen reference model (DPO's) is sharded like the policy: FSDP2's `shard_model`
    at the run's precision under parallel: fsdp, else None (it stays whole)."""
    if not (dist.enabled and cfg.train.parallel == "fsdp"):
        return None
    precision = resolve_precision(cfg.train.precision, device)
    return lambda model: shard_model(model, precision)


def release_groups(model: torch.nn.Module) -> None:
    """After the process group is destroyed: make FSDP2's device mesh let go of its groups.

    DTensor's caches keep the mesh alive for the life of the process, and the mesh its groups,
    so gloo's worker threads would run on into the interpreter's shutdown and abort the process
    there when they free a tensor. Without those references the group's destructor joins them
    at the next collection. Nothing to do for a plain or DDP model.
    """
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            # A private field; where a torch lacks it, this is a no-op.
            getattr(p.device_mesh, "_pg_registry", {}).clear()


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Full (unsharded, CPU) model and optimizer state; a collective under FSDP."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=options)


def load_full_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_sd: dict[str, torch.Tensor],
    optim_sd: dict[str, Any],
) -> None:
    """Load full state saved by `full_state` into a plain, DDP-wrapped or sharded model."""
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=StateDictOptions(full_state_dict=True),
    )


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded, CPU) model state, copied: later changes to the weights leave it be."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}


def load_full_model_state(model: torch.nn.Module, model_sd: dict[str, torch.Tensor]) -> None:
    """Load a full model state into a plain, DDP-wrapped or sharded model."""
    set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True))
