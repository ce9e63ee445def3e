"""`train.batch_size: auto`: the largest micro-batch this device runs, and the grad_accum that
keeps the global batch at `train.batch_tokens`.

Offers `resolve_batch_size(cfg, device, precision, world_size, ...)`, which returns the integer
(batch_size, grad_accum) of the run (its config.yaml and checkpoints then record them, so a resume
is exact), and its parts: `search_micro_batch` (halving, catching out-of-memory; the step is
injected, so tests give it a fake allocator limit), `cuda_trial_step`, `split_global_batch`,
`estimate_micro_batch`, `available_memory` and `batch_split_of` (a checkpoint's).

On CUDA the search runs real training steps (forward, backward, optimizer step) of a throw-away
model at seq_len, from a power of two above `minillm info`'s estimate down. Elsewhere out-of-memory
is not an exception one can catch (the OS kills the process), so the estimate decides alone.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from pathlib import Path

import torch

from minillm.checkpoint import layout
from minillm.config import Config
from minillm.errors import ConfigError, UserError
from minillm.info import activation_bytes, model_info, runs_half
from minillm.model import Transformer, use_cpu_kernels
from minillm.runtime.device import autocast_context
from minillm.train.optim import build_optimizer

# Share of the memory the estimate may plan for: it is good to ~20%, and the allocator fragments.
ESTIMATE_SHARE = 0.8


def is_oom(error: BaseException) -> bool:
    """Whether `error` is an out-of-memory of the device (CUDA's, or a backend's RuntimeError)."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def search_micro_batch(
    step: Callable[[int], None],
    upper: int,
    free: Callable[[], None] = lambda: None,
    log: Callable[[str], None] = lambda _: None,
) -> int:
    """The first of upper, upper // 2, ..., 1 for which `step(b)` runs without out-of-memory.

    Errors other than out-of-memory propagate. `free` runs after each failure, outside the
    except block, so that the failed attempt's tensors (held by the traceback) are gone first.
    """
    b = upper
    while b >= 1:
        failed = False
        try:
            step(b)
        except Exception as e:  # noqa: BLE001 - anything but an OOM is re-raised
            if not is_oom(e):
                raise
            failed = True
        if not failed:
            return b
        free()
        log(f"micro-batch {b}: out of memory")
        b //= 2
    raise UserError(
        "train.batch_size: auto: not even one sequence of train.seq_len fits on this device "
        "(try train.activation_checkpointing: true, a shorter seq_len or a smaller model)"
    )


def split_global_batch(micro: int, cfg: Config, world_size: int) -> tuple[int, int]:
    """(batch_size, grad_accum) with batch_size <= micro and batch_size x grad_accum x seq_len x
    world_size == train.batch_tokens: the largest divisor of the sequences per rank."""
    t = cfg.train
    per_step = t.seq_len * world_size
    if t.batch_tokens % per_step:
        raise ConfigError(
            "train.batch_tokens",
            f"{t.batch_tokens} is not a multiple of seq_len x world size = {per_step}",
        )
    seqs = t.batch_tokens // per_step  # sequences per rank per optimizer step
    b = max(d for d in range(1, min(micro, seqs) + 1) if seqs % d == 0)
    return b, seqs // b


def available_memory(
    device: torch.device,
    cuda_mem_get_info: Callable[[torch.device], tuple[int, int]] = torch.cuda.mem_get_info,
) -> int:
    """Bytes this process may still allocate on `device` (CUDA: free, by `cuda_mem_get_info`;
    MPS: the recommended working set; CPU: the kernel's MemAvailable)."""
    if device.type == "cuda":
        return cuda_mem_get_info(device)[0]
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory())
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def estimate_micro_batch(cfg: Config, available: int, half: bool) -> int:
    """Sequences per micro-batch that `minillm info`'s estimate puts within `available` bytes."""
    memory = model_info(cfg)["memory_bytes"]  # weights, grads, optimizer state, activations
    static = sum(v for k, v in memory.items() if k not in ("activations", "total"))
    per_seq = activation_bytes(cfg, half, cfg.train.activation_checkpointing)
    return max(int((ESTIMATE_SHARE * available - static) // per_seq), 0)


def cuda_trial_step(cfg: Config, device: torch.device, precision: str) -> Callable[[int], None]:
    """One real training step at micro-batch b, on a throw-away model (the run's is built
    after, from the seed, so the search leaves no trace in its weights)."""

    def step(b: int) -> None:
        model = use_cpu_kernels(Transformer(cfg.model)).to(device)  # as the trainer builds it
        model.activation_checkpointing = cfg.train.activation_checkpointing
        optimizer = build_optimizer(model, cfg.train, device)
        x = torch.randint(0, cfg.model.vocab_size, (b, cfg.train.seq_len), device=device)
        with autocast_context(device, precision):
            _, loss = model(x, x, reduction="sum")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)

    return step


def free_cuda_memory() -> None:
    """Drop a failed attempt's cached blocks, so the next (smaller) one starts from a clean pool."""
    gc.collect()
    torch.cuda.empty_cache()


def batch_split_of(checkpoint: Path) -> tuple[int, int] | None:
    """The batch_size and grad_accum a checkpoint was trained with, if it records them."""
    train = layout.read_state(checkpoint)["config"].get("train", {})
    b, a = train.get("batch_size"), train.get("grad_accum")
    return (b, a) if isinstance(b, int) and isinstance(a, int) else None


def resolve_batch_size(
    cfg: Config,
    device: torch.device,
    precision: str,
    world_size: int,
    previous: tuple[int, int] | None = None,
    agree: Callable[[int], int] = lambda b: b,
    log: Callable[[str], None] = print,
    memory: Callable[[torch.device], int] | None = None,
    trial_step: Callable[[Config, torch.device, str], Callable[[int], None]] = cuda_trial_step,
    free: Callable[[], None] = free_cuda_memory,
) -> tuple[int, int]:
    """The run's integer (batch_size, grad_accum).

    An integer batch_size is kept (batch_tokens, if given, must agree with it). `auto` takes, in
    order: `previous` (the split of the run's latest checkpoint, when resuming: the same batches
    as before), the search on CUDA (`trial_step(cfg, device, precision)(b)` runs one step at
    micro-batch b, `free` cleans up after an out-of-memory), or elsewhere the estimate against
    `memory(device)` (default `available_memory`). `agree` makes the ranks agree on one
    micro-batch (the smallest).
    """
    t = cfg.train
    if t.batch_size != "auto":
        tokens = t.batch_size * t.grad_accum * t.seq_len * world_size
        if t.batch_tokens and tokens != t.batch_tokens:
            raise ConfigError(
                "train.batch_tokens",
                f"{t.batch_tokens} differs from batch_size x grad_accum x seq_len x world size "
                f"= {tokens} (set one, or batch_size: auto)",
            )
        return t.batch_size, t.grad_accum
    if previous is not None:
        b, accum = previous
        log(f"batch_size auto: {b} x grad_accum {accum}, as in the run's latest checkpoint")
    else:
        seqs = max(t.batch_tokens // (t.seq_len * world_size), 1)
        available = (memory or available_memory)(device)
        estimate = estimate_micro_batch(cfg, available, runs_half(cfg))
        if device.type == "cuda":
            # From the power of two above the estimate: halving then visits powers of two,
            # which divide the usual power-of-two batch_tokens.
            upper = 1 << max(estimate, 1).bit_length()
            micro = search_micro_batch(
                trial_step(cfg, device, precision), min(upper, _pow2_at_least(seqs)),
                free=free, log=log,
            )  # fmt: skip
            how = "the largest that ran a training step"
        else:
            micro = max(estimate, 1)
            how = "by the memory estimate"
        b, accum = split_global_batch(agree(micro), cfg, world_size)
        log(f"batch_size auto: micro-batch {b} x grad_accum {accum} x {world_size} rank(s) x "
            f"{t.seq_len} = {t.batch_tokens:,} tokens/step ({how}: {micro})")  # fmt: skip
    return b, accum


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
