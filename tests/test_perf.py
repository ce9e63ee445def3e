"""The MFU helpers (the datasheet peaks, the matmul probe, mfu) and a smoke run of the training
benchmark."""

from __future__ import annotations

import math
import time

import pytest
import torch

from minillm.runtime import perf
from tests.helpers import load_script

# Dense BF16 tensor-core TFLOP/s from NVIDIA's datasheets, which print the figure "with sparsity"
# (marked *) next to it, twice the dense one. Keyed by the name torch.cuda.get_device_name gives.
DATASHEET_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.5,  # H100 datasheet, SXM: 1,979* (sparse)
    "NVIDIA H100 PCIe": 756.5,  # H100 datasheet, PCIe: 1,513*
    "NVIDIA H100 NVL": 835.5,  # H100 datasheet, NVL: 1,671*
    "NVIDIA H800": 989.5,  # H800 SXM: the H100 SXM's compute, 1,979*
    "NVIDIA H200": 989.5,  # H200 datasheet, SXM: 1,979*
    "NVIDIA GH200 480GB": 989.5,  # GH200 datasheet: FP16/BF16 1,979*
    "NVIDIA B200": 2250.0,  # HGX B200 datasheet: 36 PFLOPS* FP16/BF16 for 8 GPUs, 4.5* each
    "NVIDIA A100-SXM4-80GB": 312.0,  # A100 datasheet: BF16 312 | 624*
    "NVIDIA A100 80GB PCIe": 312.0,  # A100 datasheet, PCIe: the same 312
    "NVIDIA A800-SXM4-80GB": 312.0,  # A800 datasheet: BF16 312 | 624*
    "NVIDIA L40S": 362.05,  # L40S datasheet: BF16 362.05 | 733*
    "NVIDIA L4": 121.0,  # L4 datasheet: BF16 242* (sparse)
    "NVIDIA A10": 125.0,  # A10 datasheet: BF16 125 | 250*
}
# In the code's table without an NVIDIA datasheet to check it against.
NO_DATASHEET = {"A10G"}  # AWS's variant of the A10 (g5 instances)


def test_known_peak_flops_table(monkeypatch: pytest.MonkeyPatch) -> None:
    assert perf.known_peak_flops("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, tflops in DATASHEET_TFLOPS.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        got = perf.known_peak_flops("cuda")
        assert got == pytest.approx(tflops * 1e12, rel=0.01), name
        assert perf.known_peak_flops("cuda", torch.float32) is None
    # Every GPU the code knows is one of the datasheet rows above (or named as without one).
    for key, _ in perf._GPU_PEAKS:
        assert key in NO_DATASHEET or any(key in name for name in DATASHEET_TFLOPS), key
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some Future GPU")
    assert perf.known_peak_flops("cuda:0") is None


def best_matmul_rate(n: int, reps: int = 10, tries: int = 7) -> float:
    """FLOP/s of `reps` (n, n) @ (n, n) matmuls timed here, the best of `tries` timings."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    best = math.inf
    for _ in range(tries):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return reps * 2 * n**3 / best


def test_matmul_peak_probe_and_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a clock that advances 1 ms a matmul, the probe reads exactly 2 n^3 FLOP a millisecond.
    clock = [0.0]
    mm = torch.mm

    def timed_mm(*args, **kwargs) -> torch.Tensor:
        clock[0] += 1e-3
        return mm(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(perf.time, "perf_counter", lambda: clock[0])
        m.setattr(torch, "mm", timed_mm)
        assert perf.measure_matmul_peak(seconds=0.05, n=64) == pytest.approx(2 * 64**3 / 1e-3)
    # On the real clock, against what the test measures itself: other processes only slow a
    # timing down, and on a shared machine the probe's longer windows (30 ms against the test's
    # 2 ms) catch far more of them, so the probe may read 100x lower but never 3x higher.
    peak = perf.measure_matmul_peak(seconds=0.3, n=256)
    measured = best_matmul_rate(256)
    assert measured / 1000 < peak < measured * 3, (peak, measured)
    assert perf.mfu(flops_per_token=1e6, tokens_per_sec=500.0, peak_flops=1e9) == 0.5


@pytest.mark.slow
def test_bench_train_runs_on_a_tiny_shape(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_script("bench_train", monkeypatch)
    bench.main(["--shapes", "tiny", "--compile", "no", "--steps", "2", "--warmup", "1",
                "--peak-seconds", "0.05", "--threads", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert "HF Llama" in out and "minillm" in out and "MFU" in out
