"""The MFU helpers (the datasheet peaks, the matmul probe, mfu) and a smoke run of the training
benchmark."""

from __future__ import annotations

import math

import pytest
import torch

from minillm.runtime import perf
from tests.helpers import load_script


def test_known_peak_flops_table(monkeypatch: pytest.MonkeyPatch) -> None:
    assert perf.known_peak_flops("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, flops in (
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        assert perf.known_peak_flops("cuda") == flops, name
        assert perf.known_peak_flops("cuda", torch.float32) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some Future GPU")
    assert perf.known_peak_flops("cuda:0") is None


def test_matmul_peak_probe_and_mfu() -> None:
    peak = perf.measure_matmul_peak(seconds=0.05, n=64)
    assert math.isfinite(peak) and peak > 0
    assert perf.mfu(flops_per_token=1e6, tokens_per_sec=500.0, peak_flops=1e9) == 0.5


def test_bench_train_runs_on_a_tiny_shape(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_script("bench_train", monkeypatch)
    bench.main(["--shapes", "tiny", "--compile", "no", "--steps", "2", "--warmup", "1",
                "--peak-seconds", "0.05", "--threads", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert "HF Llama" in out and "minillm" in out and "MFU" in out
