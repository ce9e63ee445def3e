"""Every CUDA-only branch, run on the CPU with its device call given or stood in.

The GPU path of a trainer is otherwise first run by a user (the prefetcher once crashed there at
step 1 of every chat run). Each test here takes the branch a CUDA device takes and checks its
logic; tests/test_fit_device.py has the pinning test and the real-GPU ones (marker `cuda`).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch

from minillm.data.batches import MicroBatch
from minillm.runtime import perf
from minillm.runtime.device import enable_tf32, rng_state, set_rng_state
from minillm.train import batch_size as auto
from minillm.train.distributed import DistInfo, init_distributed, local_device
from minillm.train.optim import build_optimizer
from tests.helpers import make_trainer, run_config, tiny_config, weights

CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------- copies


def test_micro_batch_moves_every_tensor_non_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    # The trainer's `m.to(device, non_blocking=True)`: asynchronous from pinned memory on CUDA.
    calls: list[bool] = []
    real_to = torch.Tensor.to

    def recording_to(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(kwargs.get("non_blocking", False))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    x = torch.arange(6).view(2, 3)
    moved = MicroBatch(x, x + 1, x * 0).to(torch.device("cpu"), non_blocking=True)
    assert calls == [True, True, True] and torch.equal(moved.doc_ids, x * 0)
    calls.clear()
    plain = MicroBatch(x, x + 1).to(torch.device("cpu"), non_blocking=True)
    assert calls == [True, True] and plain.doc_ids is None  # no doc_ids: nothing to move


# ----------------------------------------------------------------------------- grad scaler


def test_fp16_grad_scaler_steps_skips_inf_gradients_and_resumes(
    data_dir: Path, tmp_path: Path
) -> None:
    # fp16 is CUDA's loss-scaled path; torch's GradScaler runs the same logic on the CPU.
    cfg = run_config(data_dir, tmp_path / "run", precision="fp16", max_steps=4, ckpt_every=2)
    trainer = make_trainer(cfg, verbose=False)
    try:
        assert trainer.scaler is not None
        scale = trainer.scaler.get_scale()
        before = weights(trainer)
        out = trainer.train_step()
        trainer.count_step(out)
        assert out.finite and any(
            not torch.equal(before[k], v) for k, v in weights(trainer).items()
        )
        assert trainer.scaler.get_scale() == scale  # a good step keeps the scale
        # Inf gradients with a finite loss: the scaler (not the trainer) skips the step and
        # halves its scale; the weights stay as they were.
        param = next(trainer.model.parameters())
        hook = param.register_hook(lambda g: g * float("inf"))
        before = weights(trainer)
        out = trainer.train_step()
        hook.remove()
        trainer.count_step(out)
        assert out.finite  # the loss was finite: not counted as a bad step
        assert all(torch.equal(before[k], v) for k, v in weights(trainer).items())
        assert trainer.scaler.get_scale() == scale / 2
        trainer.save()
    finally:
        trainer.close()
    resumed = make_trainer(cfg, verbose=False)
    try:
        assert resumed.state.step == 2 and resumed.scaler.get_scale() == scale / 2  # restored
    finally:
        resumed.close()


# ----------------------------------------------------------------------------- batch_size: auto


def test_auto_on_cuda_searches_with_real_steps_and_frees_after_each_oom(data_dir: Path) -> None:
    cfg = tiny_config(data_dir, train=dict(batch_size="auto", batch_tokens=32 * 64))
    tried: list[int] = []
    freed: list[int] = []

    def trial_step(c, device, precision):
        assert device.type == "cuda" and c is cfg

        def step(b: int) -> None:
            tried.append(b)
            if b > 5:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

        return step

    logs: list[str] = []
    got = auto.resolve_batch_size(
        cfg, CUDA, "bf16", 1, log=logs.append,
        memory=lambda device: 10**12,  # the estimate allows far more than fits
        trial_step=trial_step, free=lambda: freed.append(len(tried)),
    )  # fmt: skip
    # From the power of two at or above the 64 sequences per step, halving: 64, 32, 16, 8, 4.
    assert tried == [64, 32, 16, 8, 4] and freed == [1, 2, 3, 4]
    assert got == (4, 16)
    assert "micro-batch 8: out of memory" in logs and "the largest that ran" in logs[-1]


def test_auto_on_cuda_propagates_other_errors(data_dir: Path) -> None:
    cfg = tiny_config(data_dir, train=dict(batch_size="auto", batch_tokens=32 * 8))

    def trial_step(c, device, precision):
        def step(b: int) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        return step

    with pytest.raises(RuntimeError, match="illegal memory access"):
        auto.resolve_batch_size(cfg, CUDA, "bf16", 1, memory=lambda d: 10**12,
                                trial_step=trial_step, free=lambda: None)  # fmt: skip


def test_available_memory_on_cuda_is_the_free_bytes() -> None:
    asked: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 3 * 2**30, 80 * 2**30

    assert auto.available_memory(CUDA, cuda_mem_get_info=mem_get_info) == 3 * 2**30
    assert asked == [CUDA]


# ----------------------------------------------------------------------------- TF32


@pytest.fixture
def matmul_precision() -> None:
    """Put torch's global fp32 matmul setting back after a test changes it."""
    has_new = hasattr(torch.backends.cuda.matmul, "fp32_precision")
    old = torch.backends.cuda.matmul.fp32_precision if has_new else None
    old_high = torch.get_float32_matmul_precision()
    yield
    if has_new:
        torch.backends.cuda.matmul.fp32_precision = old
    torch.set_float32_matmul_precision(old_high)


def test_tf32_on_ampere_and_newer_only(matmul_precision: None) -> None:
    assert enable_tf32(CUDA, capability=lambda d: (7, 0)) is False  # V100: no TF32
    assert enable_tf32(torch.device("cpu"), capability=lambda d: (9, 0)) is False
    assert enable_tf32(CUDA, capability=lambda d: (8, 0)) is True
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    else:
        assert torch.get_float32_matmul_precision() == "high"


# ----------------------------------------------------------------------------- torchrun


def test_torchrun_on_cuda_pairs_nccl_with_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.distributed_c10d import BackendConfig

    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MINILLM_DIST_TIMEOUT", "60")
    calls: list[dict] = []

    def init_process_group(**kwargs) -> None:  # torch's, stood in: no GPU, no peers
        calls.append(kwargs)

    def backends(call: dict) -> dict[str, str]:
        """The backend each device type's tensors get, as torch itself reads the string."""
        return BackendConfig(call["backend"]).get_device_backend_map()

    info = init_distributed(CUDA, init_process_group=init_process_group)
    assert info == DistInfo(rank=1, local_rank=1, world_size=2)
    # NCCL for the CUDA tensors, gloo for the CPU ones (NCCL alone refuses them).
    ((call,),) = [calls]
    assert backends(call) == {"cuda": "nccl", "cpu": "gloo"}, call["backend"]
    assert call["device_id"] == CUDA and call["timeout"] == datetime.timedelta(seconds=60)
    calls.clear()
    init_distributed(torch.device("cpu"), init_process_group=init_process_group)
    ((call,),) = [calls]
    assert backends(call)["cpu"] == "gloo" and "device_id" not in call


def test_one_gpu_per_process_under_torchrun() -> None:
    current: list[torch.device] = []
    got = local_device(CUDA, DistInfo(rank=3, local_rank=1, world_size=4), current.append)
    assert got == torch.device("cuda", 1) and current == [got]
    current.clear()
    # One process: cuda:0, since torch's set_device refuses a "cuda" without an index (seen on
    # the H200: every single-GPU `minillm train` failed there).
    assert local_device(CUDA, DistInfo(), current.append) == torch.device("cuda", 0)
    assert current == [torch.device("cuda", 0)]
    current.clear()
    assert local_device(torch.device("cpu"), DistInfo(world_size=2), current.append).type == "cpu"
    assert current == []  # the CPU sets no CUDA device


# ----------------------------------------------------------------------------- optimizer, RNG


def test_adamw_is_fused_on_cuda(data_dir: Path) -> None:
    cfg = tiny_config(data_dir)
    model = torch.nn.Linear(4, 4)
    fused = build_optimizer(model, cfg.train, CUDA)
    plain = build_optimizer(model, cfg.train, torch.device("cpu"))
    assert all(g.get("fused") for opt in fused for g in opt.param_groups)
    assert all(g.get("foreach") and not g.get("fused") for opt in plain for g in opt.param_groups)


def test_cuda_rng_state_is_saved_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    states = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
    restored: list[list[torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    state = rng_state()
    assert state["cuda"] is states
    set_rng_state(state)
    assert restored == [states]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # another machine: left alone
    set_rng_state(state)
    assert restored == [states]


# ----------------------------------------------------------------------------- perf


def test_cuda_peak_flops_from_the_datasheet_and_synchronize(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    assert perf.peak_flops(CUDA, "bf16") == (989e12, "datasheet")
    assert perf.peak_flops(CUDA, "bf16", configured=5e14) == (5e14, "train.peak_flops")
    perf.synchronize("cuda")
    assert synced == [CUDA]
