"""Fitting and feeding the device: activation checkpointing, batch_size: auto, the prefetcher, TF32.

GPU-only tests carry the `cuda` marker and skip without one (scripts/gpu_check.sh runs them).
"""

from __future__ import annotations

import re
import threading
import weakref
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.checkpoint import layout
from minillm.config import ModelConfig, config_from_dict, config_to_dict
from minillm.data.batches import MicroBatch
from minillm.errors import ConfigError, UserError
from minillm.info import model_info
from minillm.model import Transformer
from minillm.runtime.device import enable_tf32
from minillm.train import batch_size as auto
from minillm.train.prefetch import Prefetcher
from tests.helpers import (
    load_script,
    make_trainer,
    run_config,
    run_trainer,
    tiny_config,
    weights,
)

cuda = pytest.mark.cuda


make_cfg = run_config


# ----------------------------------------------------------------------------- checkpointing


def test_activation_checkpointing_gives_bitwise_equal_weights(
    data_dir: Path, tmp_path: Path
) -> None:
    # Dropout included: the recompute must replay the very same masks.
    plain = run_trainer(make_cfg(data_dir, tmp_path / "a", model=dict(dropout=0.1), max_steps=5))
    cfg = make_cfg(
        data_dir,
        tmp_path / "b",
        model=dict(dropout=0.1),
        max_steps=5,
        activation_checkpointing=True,
    )
    ckpted = run_trainer(cfg)
    assert ckpted.model.activation_checkpointing
    a, b = weights(plain), weights(ckpted)
    assert all(torch.equal(a[k], b[k]) for k in a)


def saved_bytes(model: Transformer, idx: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward pass of one forward (what checkpointing saves)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return total


def test_activation_checkpointing_keeps_fewer_activations(tiny_model_cfg: ModelConfig) -> None:
    torch.manual_seed(0)
    model = Transformer(tiny_model_cfg)
    idx = torch.randint(0, tiny_model_cfg.vocab_size, (4, 64))
    full = saved_bytes(model, idx)
    model.activation_checkpointing = True
    kept = saved_bytes(model, idx)
    assert kept < full / 2
    model.eval()  # no recompute outside training: nothing to save memory for
    with torch.no_grad():
        logits, _ = model(idx)
    assert logits.shape == (4, 64, tiny_model_cfg.vocab_size)


def test_info_estimates_both(data_dir: Path) -> None:
    cfg = tiny_config(data_dir, train=dict(batch_size=4, activation_checkpointing=True))
    info = model_info(cfg)
    act = info["activation_bytes"]
    assert act["checkpointed"] < act["full"]
    assert info["memory_bytes"]["activations"] == act["checkpointed"]


# ----------------------------------------------------------------------------- batch_size: auto


class FakeAllocator:
    """Raises CUDA's out-of-memory for micro-batches above a limit, as the real allocator would."""

    def __init__(self, limit: int) -> None:
        self.limit, self.tried, self.freed = limit, [], 0

    def step(self, b: int) -> None:
        self.tried.append(b)
        held = torch.empty(b)  # a tensor the failed attempt holds until `free`
        if b > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory ({held.numel()})")

    def free(self) -> None:
        self.freed += 1


def test_search_halves_until_a_step_fits() -> None:
    alloc = FakeAllocator(limit=20)
    assert auto.search_micro_batch(alloc.step, 64, free=alloc.free) == 16
    assert alloc.tried == [64, 32, 16] and alloc.freed == 2
    alloc = FakeAllocator(limit=64)
    assert auto.search_micro_batch(alloc.step, 64, free=alloc.free) == 64 and alloc.freed == 0
    # A backend that reports out of memory as a plain RuntimeError is caught too.

    def mps_like(b: int) -> None:
        if b > 3:
            raise RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)")

    assert auto.search_micro_batch(mps_like, 8) == 2


def test_search_reraises_other_errors_and_refuses_when_nothing_fits() -> None:
    def broken(b: int) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        auto.search_micro_batch(broken, 8)
    with pytest.raises(UserError, match="train.batch_size: auto: not even one sequence"):
        auto.search_micro_batch(FakeAllocator(limit=0).step, 8)


def test_search_with_real_steps_under_a_fake_limit(tiny_model_cfg: ModelConfig) -> None:
    # The real forward + backward + AdamW step, under an allocator that refuses > 5 sequences.
    model = Transformer(tiny_model_cfg)
    opt = torch.optim.AdamW(model.parameters())

    def step(b: int) -> None:
        if b > 5:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        x = torch.randint(0, tiny_model_cfg.vocab_size, (b, 16))
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    assert auto.search_micro_batch(step, 32) == 4


def test_split_global_batch_table(data_dir: Path) -> None:
    cfg = tiny_config(data_dir, train=dict(batch_size="auto", batch_tokens=32 * 24))
    # 24 sequences per step: the largest divisor of 24 at most the micro-batch that fits.
    got = {m: auto.split_global_batch(m, cfg, world_size=1) for m in (1, 5, 7, 8, 24, 100)}
    assert got == {1: (1, 24), 5: (4, 6), 7: (6, 4), 8: (8, 3), 24: (24, 1), 100: (24, 1)}
    assert auto.split_global_batch(8, cfg, world_size=2) == (6, 2)
    with pytest.raises(ConfigError, match="train.batch_tokens.*world size = 160"):
        auto.split_global_batch(8, cfg, world_size=5)


def test_auto_needs_batch_tokens_and_an_int_must_agree_with_it(data_dir: Path) -> None:
    with pytest.raises(ConfigError, match="train.batch_size: auto needs train.batch_tokens"):
        tiny_config(data_dir, train=dict(batch_size="auto"))
    with pytest.raises(ConfigError, match="train.batch_tokens: 100 is not a multiple of seq_len"):
        tiny_config(data_dir, train=dict(batch_tokens=100))
    with pytest.raises(ConfigError, match="expected an integer or one of 'auto'"):
        tiny_config(data_dir, train=dict(batch_size="big"))
    cfg = tiny_config(data_dir, train=dict(batch_size=4, grad_accum=2, batch_tokens=32 * 4))
    with pytest.raises(ConfigError, match="differs from batch_size x grad_accum"):
        auto.resolve_batch_size(cfg, torch.device("cpu"), "fp32", 1, log=lambda _: None)


def test_auto_on_cpu_uses_the_estimate(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config(data_dir, train=dict(batch_size="auto", batch_tokens=32 * 16))
    per_seq = auto.activation_bytes(cfg, False, False)
    static = 16 * model_info(cfg)["params"]
    # Room for 5.x sequences in the estimate's share: 4 x 4 is the split of 16 sequences.
    room = (static + 5.5 * per_seq) / auto.ESTIMATE_SHARE
    monkeypatch.setattr(auto, "available_memory", lambda device: int(room))
    logs: list[str] = []
    got = auto.resolve_batch_size(cfg, torch.device("cpu"), "fp32", 1, log=logs.append)
    assert got == (4, 4)
    assert "micro-batch 4 x grad_accum 4" in logs[0] and "memory estimate: 5" in logs[0]
    # With 8 layers, checkpointing leaves room for more sequences in the same memory.
    chosen = []
    for on in (False, True):
        deep = tiny_config(
            data_dir,
            model=dict(n_layer=8),
            train=dict(batch_size="auto", batch_tokens=32 * 16, activation_checkpointing=on),
        )
        batch_size, _ = auto.resolve_batch_size(
            deep, torch.device("cpu"), "fp32", 1, log=logs.append
        )
        chosen.append(batch_size)
    assert chosen[0] < chosen[1]


def test_auto_is_stored_in_the_run_and_resume_keeps_it(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    cfg = make_cfg(data_dir, run, batch_size="auto", batch_tokens=32 * 8, max_steps=6)
    per_seq = auto.activation_bytes(cfg, False, False)
    static = 16 * model_info(cfg)["params"]
    memory = {"bytes": int((static + 2 * per_seq) / auto.ESTIMATE_SHARE)}
    monkeypatch.setattr(auto, "available_memory", lambda device: memory["bytes"])
    first = run_trainer(cfg, stop_at=3)
    assert (first.cfg.train.batch_size, first.cfg.train.grad_accum) == (2, 4)
    written = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert (written["batch_size"], written["grad_accum"]) == (2, 4)
    state = layout.read_state(layout.find_latest(run))
    assert state["config"]["train"]["batch_size"] == 2
    # More memory now: a fresh search would pick 8 x 1, but the run resumes with its own split.
    memory["bytes"] *= 100
    second = run_trainer(cfg)
    assert second.state.step == 6
    assert (second.cfg.train.batch_size, second.cfg.train.grad_accum) == (2, 4)
    # ...and ends where a run started with 2 x 4 written out ends: resume is exact.
    raw = config_to_dict(cfg)
    raw["train"].update(out_dir=str(tmp_path / "fixed"), batch_size=2, grad_accum=4)
    fixed = run_trainer(config_from_dict(raw))
    a, b = weights(fixed), weights(second)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- prefetching


def test_prefetcher_makes_the_next_step_on_its_thread() -> None:
    made: list[tuple[int, str]] = []

    def batches(step: int) -> list[MicroBatch]:
        made.append((step, threading.current_thread().name))
        x = torch.full((2, 3), step)
        return [MicroBatch(x, x + 1)]

    prefetch = Prefetcher(batches, end=4)
    try:
        got = [int(prefetch(s)[0][0][0, 0]) for s in range(4)]
    finally:
        prefetch.close()
    assert got == [0, 1, 2, 3]  # each step its own batches, in order
    assert [s for s, _ in made] == [0, 1, 2, 3]  # nothing made twice, nothing past `end`
    assert made[0][1] == threading.current_thread().name  # the first is made on demand
    assert all(name.startswith("minillm-prefetch") for _, name in made[1:])


def test_prefetcher_reraises_the_workers_error_and_handles_jumps() -> None:
    def batches(step: int) -> list[MicroBatch]:
        if step == 2:
            raise ValueError("bad shard")
        return [MicroBatch(torch.tensor([step]), torch.tensor([step]))]

    prefetch = Prefetcher(batches, end=10)
    try:
        assert int(prefetch(1)[0][0]) == 1
        with pytest.raises(ValueError, match="bad shard"):
            prefetch(2)
        assert int(prefetch(7)[0][0]) == 7  # not the one in flight: made on demand
    finally:
        prefetch.close()


def test_prefetcher_pins_doc_masked_micro_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CUDA path on the CPU: pinning stood in by a copy that records what it pinned. A
    # doc-masked micro-batch (chat data's default) has a third tensor, doc_ids, which the
    # prefetcher once unpacked as `x, y` (ValueError at step 1 of every chat run on a GPU).
    import numpy as np

    from minillm.data.batches import train_batch

    pinned: list[torch.Tensor] = []

    def fake_pin(t: torch.Tensor) -> torch.Tensor:
        copy = t.clone()
        pinned.append(copy)
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    tokens = np.array([5, 6, 7, 0, 8, 9, 0, 10, 11, 12, 0, 13] * 8, dtype=np.uint16)

    def batches(step: int) -> list:
        return train_batch(tokens, seed=0, step=step, rank=0, world_size=1, batch_size=2,
                           grad_accum=2, seq_len=8, eot_id=0)  # fmt: skip

    prefetch = Prefetcher(batches, end=3, pin=True)
    try:
        for step in range(3):
            got = prefetch(step)
            want = batches(step)
            assert len(got) == 2 and all(len(m) == 3 for m in got)  # doc_ids kept
            for g, w in zip(got, want):
                for a, b in zip(g, w):
                    assert torch.equal(a, b)
                    assert any(a is p for p in pinned)  # every tensor went through pinning
    finally:
        prefetch.close()


class DeviceReads(TorchDispatchMode):
    """Records each read on the host (`.item()`, `bool()`, `float()`, `int()`: all
    aten._local_scalar_dense, a device sync on CUDA) of a tensor computed from the model's
    weights: the outputs of every op with such an input, starting from `weights`."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.computed: dict[int, weakref.ref] = {}  # by id: a WeakSet compares tensors with ==
        self.reads: list[torch.dtype] = []
        for w in weights:
            self.add(w)

    def add(self, t: torch.Tensor) -> None:
        self.computed[id(t)] = weakref.ref(t)

    def has(self, t: object) -> bool:
        ref = self.computed.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        inputs = pytree.tree_leaves((args, kwargs or {}))
        from_model = any(self.has(t) for t in inputs)
        if func is torch.ops.aten._local_scalar_dense.default and from_model:
            self.reads.append(args[0].dtype)
        out = func(*args, **(kwargs or {}))
        if from_model:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.add(t)
        return out


def test_train_step_returns_device_tensors_without_reading_them(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = make_trainer(make_cfg(data_dir, tmp_path / "run"), verbose=False)
    try:
        model = DeviceReads(list(trainer.model.parameters()))
        tolist = torch.Tensor.tolist  # a host read that is no aten op: counted here

        def counted_tolist(t: torch.Tensor):  # noqa: ANN202
            if model.has(t):
                model.reads.append(t.dtype)
            return tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
        with model:
            out = trainer.train_step()
    finally:
        trainer.close()
    # The one read is the step's decision whether it was finite; loss and norm stay unread.
    assert model.reads == [torch.bool]
    assert model.has(out.loss) and model.has(out.grad_norm)
    assert isinstance(out.loss, torch.Tensor) and isinstance(out.grad_norm, torch.Tensor)
    assert out.finite is True and 0 < float(out.loss) < 10


# ----------------------------------------------------------------------------- TF32 and CUDA


@cuda
def test_prefetcher_pins_on_cuda() -> None:
    def batches(s: int) -> list[MicroBatch]:
        return [MicroBatch(torch.full((2, 3), s), torch.full((2, 3), s), torch.zeros(2, 3))]

    prefetch = Prefetcher(batches, 3, pin=True)
    try:
        for step in range(3):
            ((x, y, docs),) = prefetch(step)
            assert x.is_pinned() and y.is_pinned() and docs.is_pinned() and int(x[0, 0]) == step
    finally:
        prefetch.close()


def test_tf32_is_a_cuda_setting() -> None:
    assert enable_tf32(torch.device("cpu")) is False


@cuda
def test_tf32_on_ampere() -> None:
    device = torch.device("cuda")
    assert enable_tf32(device) == (torch.cuda.get_device_capability(device)[0] >= 8)


@cuda
def test_checkpointing_lowers_cuda_peak_memory() -> None:
    cfg = ModelConfig(vocab_size=4096, d_model=512, n_layer=8, n_head=8, max_seq_len=1024)
    model = Transformer(cfg).cuda()
    idx = torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda")
    peaks = []
    for on in (False, True):
        model.activation_checkpointing = on
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, idx)[1]
        loss.backward()
        model.zero_grad(set_to_none=True)
        peaks.append(torch.cuda.max_memory_allocated())
    assert peaks[1] < 0.6 * peaks[0]


@cuda
def test_auto_search_under_a_real_memory_cap(data_dir: Path) -> None:
    # Cap this process's share of the GPU, then search: the chosen micro-batch must fit, twice
    # it must not (a real torch.cuda.OutOfMemoryError, caught), and grad_accum fills the batch.
    device = torch.device("cuda", 0)  # set_per_process_memory_fraction wants an index
    free, total = torch.cuda.mem_get_info(device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, 2 * 2**30 / total), device)
    try:
        model = dict(vocab_size=8192, d_model=512, n_layer=8, n_head=8, max_seq_len=1024)
        cfg = tiny_config(
            data_dir,
            model=model,
            train=dict(batch_size="auto", batch_tokens=1024 * 256, seq_len=1024, device="cuda"),
        )
        b, a = auto.resolve_batch_size(cfg, device, "bf16", 1, log=print)
        assert b * a == 256 and b >= 1
        # The search tried 2b before b (it started above the 2 GiB cap's reach).
        with pytest.raises(torch.cuda.OutOfMemoryError):
            auto.cuda_trial_step(cfg, device, "bf16")(2 * b)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- scripts


@pytest.mark.slow
def test_bench_train_rows_with_and_without_checkpointing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_script("bench_train", monkeypatch)
    bench.main(["--shapes", "tiny", "--compile", "no", "--steps", "1", "--warmup", "1",
                "--peak-seconds", "0.02", "--threads", "0", "--checkpointing", "both"])  # fmt: skip
    rows = {line.split("  ")[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("minillm")}  # fmt: skip
    assert set(rows) == {"minillm", "minillm +ckpt"}
    assert rows["minillm"][-1] == rows["minillm +ckpt"][-1]  # the same first loss


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    root = Path(__file__).parent.parent
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(root), GPU_CHECK_DIR=str(tmp_path))
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.split("gpu_check summary", 1)[1]
    for step in ("cuda tests", "bench_train", "tokenize", "train ckpt=false", "train ckpt=true"):
        assert re.search(rf"{step}\s+0\s+\d+", summary), step
    assert "minillm +ckpt" in summary
    trains = re.findall(r"checkpointing (false|true)\s+(\d+) x (\d+)\s+([\d,]+)", summary)
    assert [t[0] for t in trains] == ["false", "true"]
    # batch_size: auto chose a split of the 512 tokens/step (seq_len 64: 8 sequences).
    assert all(int(b) * int(a) == 8 for _, b, a, _ in trains)
