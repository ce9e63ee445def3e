"""torchrun detection, the process group, and rank helpers.

Offers `DistInfo`, `init_distributed`, `local_device`, `shutdown_distributed`, `all_reduce_sum`,
`all_gather_objects` and `barrier`.
`minillm train` alone is one process (world size 1, no process group); under `torchrun` the
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR) says who we are.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init_distributed(
    device: torch.device, init_process_group: Callable[..., None] = dist.init_process_group
) -> DistInfo:
    """Join the process group torchrun describes (nccl on CUDA, gloo on CPU); else world size 1.

    A rank that dies makes torchrun stop the others; the timeout bounds any collective that
    would otherwise wait for it (MINILLM_DIST_TIMEOUT seconds, default 1800).
    `init_process_group` is torch's (a parameter, so a CPU test sees the backend chosen for CUDA).
    """
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) <= 1:
        return DistInfo()
    info = DistInfo(
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get("MINILLM_DIST_TIMEOUT", 1800)))
        # NCCL for CUDA tensors, gloo for the few CPU ones (the step's target count, objects):
        # NCCL alone refuses a CPU tensor.
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        init_process_group(backend=backend, timeout=timeout, **kwargs)
    return info


def local_device(
    device: torch.device,
    info: DistInfo,
    set_device: Callable[[torch.device], None] = torch.cuda.set_device,
) -> torch.device:
    """One GPU per process: cuda means cuda:<LOCAL_RANK> under torchrun, cuda:0 in one process
    (made current by `set_device`, torch's, a parameter for CPU tests). torch's set_device
    refuses a bare "cuda" with no index, so the index is always given."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", info.local_rank)  # 0 without torchrun
    if device.type == "cuda":
        set_device(device)
    return device


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (a list of one without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
