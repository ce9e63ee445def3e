"""Throughput helpers shared by the trainer and the benchmarks.

Offers `measure_matmul_peak` (a square-matmul probe of what the device sustains), `known_peak_flops`
(datasheet dense bf16/fp16 tensor-core peaks of common GPUs), `peak_flops` (the peak the trainer
uses: configured, datasheet, or a probe cached per machine), `reprobe_peak` (for a cached probe
that a run beats), `mfu`, `synchronize` and `step_peak_bytes` (the peak memory of one training
step, for bench_train and bench_lora).

MFU, here and in the trainer, is model FLOP/s over peak FLOP/s, where model FLOP/s is
`model.flops_per_token(seq_len)` (6 per matmul weight, head included, plus 12 * L * C * T for
attention) times tokens per second. Work the model does not need (recomputation, padding) earns
nothing, and causal attention is counted in full.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from minillm.runtime.device import PRECISION_DTYPES
from minillm.runtime.files import atomic_write_json, cache_dir

# Dense (no sparsity) bf16/fp16 tensor-core peaks from NVIDIA's datasheets, in FLOP/s. Matched by
# substring of torch.cuda.get_device_name(), first match wins, so variants come before the family.
_GPU_PEAKS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM (HBM3)
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
)


def known_peak_flops(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16
) -> float | None:
    """Datasheet dense peak FLOP/s of a known CUDA GPU for bf16/fp16 matmuls, else None.

    None for CPUs, MPS, other dtypes (fp32 peaks depend on TF32 settings) and unknown GPUs: the
    caller then measures with `measure_matmul_peak` or takes a configured value.
    """
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in _GPU_PEAKS:
        if key in name:
            return flops
    return None


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels, so that a wall-clock time covers them (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def measure_matmul_peak(
    seconds: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    n: int | None = None,
) -> float:
    """FLOP/s of (n, n) @ (n, n) matmuls sustained over about `seconds`: the best of ~10 timings.

    The best rather than the median, because interference from other processes only ever slows a
    timing down; a higher peak also makes MFU conservative. n defaults to 2048 on CPU (as the
    issue's reference numbers) and 8192 on a GPU. Uses the current torch thread setting.
    """
    device = torch.device(device)
    if n is None:
        n = 2048 if device.type == "cpu" else 8192
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    flops = 2.0 * n**3

    def timed(reps: int) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        synchronize(device)
        return time.perf_counter() - t0

    timed(1)  # warm-up: thread pools, kernel selection, caches
    # Time groups of matmuls of about seconds/10 each, so that one timing is long enough to trust.
    one = max(timed(1), 1e-6)
    reps = max(1, round(seconds / 10 / one))
    rates = []
    deadline = time.perf_counter() + seconds
    while len(rates) < 3 or time.perf_counter() < deadline:
        rates.append(reps * flops / timed(reps))
    return max(rates)


def mfu(flops_per_token: float, tokens_per_sec: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over peak FLOP/s (0..1)."""
    return flops_per_token * tokens_per_sec / peak_flops


# A CPU's probe runs this long, once per machine (then cached): a one-second probe read 45% to
# 88% MFU for the same run on a busy machine, so a longer one, and the same peak for every run.
PROBE_SECONDS = 3.0


def peak_cache_file() -> Path:
    """Where probed peaks are kept: $MINILLM_CACHE_DIR, else $XDG_CACHE_HOME/minillm or
    ~/.cache/minillm, file peak_flops.json (delete it to probe again)."""
    return cache_dir() / "peak_flops.json"


def _machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a probed peak depends on: the device's model, dtype, threads and torch version."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        name = platform.processor() or platform.machine()
        with contextlib.suppress(OSError):
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                name = next(
                    (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name
                )
    else:
        name = device.type
    threads = torch.get_num_threads()
    return f"{device.type}: {name} | {dtype} | {threads} threads | torch {torch.__version__}"


def peak_flops(device: torch.device, precision: str, configured: float = 0.0) -> tuple[float, str]:
    """The peak FLOP/s that MFU divides by, and where it comes from: `configured`
    (train.peak_flops) if set, else a known GPU's datasheet peak, else a matmul probe of
    PROBE_SECONDS, made once per machine and then read from `peak_cache_file()`."""
    if configured:
        return configured, "train.peak_flops"
    dtype = _probe_dtype(device, precision)
    known = known_peak_flops(device, dtype)
    if known:
        return known, "datasheet"
    path, key = peak_cache_file(), _machine_key(device, dtype)
    cached = _read_cache(path).get(key)
    if isinstance(cached, (int, float)) and cached > 0:
        return float(cached), f"probed once, cached in {path}"
    return _probe_and_cache(device, dtype), f"probed {PROBE_SECONDS:g} s, cached in {path}"


def reprobe_peak(device: torch.device, precision: str) -> float:
    """Probe again and cache the higher of the two peaks; returns it.

    For a run whose model FLOP/s exceed the cached peak (MFU above 100%): that probe ran on a
    busy machine, and only ever read too low.
    """
    return _probe_and_cache(device, _probe_dtype(device, precision))


def _probe_dtype(device: torch.device, precision: str) -> torch.dtype:
    """On a CPU the probe runs in fp32 whatever the precision: bf16 there is emulated, and a
    2048^2 bf16 probe would take many seconds."""
    return PRECISION_DTYPES[precision] if device.type != "cpu" else torch.float32


def _read_cache(path: Path) -> dict[str, float]:
    with contextlib.suppress(OSError, ValueError):
        cache = json.loads(path.read_text())
        if isinstance(cache, dict):
            return cache
    return {}


def _probe_and_cache(device: torch.device, dtype: torch.dtype) -> float:
    path, key = peak_cache_file(), _machine_key(device, dtype)
    value = measure_matmul_peak(PROBE_SECONDS, dtype, device)
    cache = _read_cache(path)
    old = cache.get(key)
    value = max(value, float(old)) if isinstance(old, (int, float)) else value
    with contextlib.suppress(OSError):  # a read-only home: probe again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {**cache, key: value})
    return value


def step_peak_bytes(step: Callable[[], object], device: torch.device, held: int) -> int:
    """Peak bytes of one training step, `held` (what the model and optimizer keep between
    steps) included. CUDA: the caching allocator's own peak. CPU: `held` plus the profiler's
    running total of what the step allocates (frees of older blocks are not seen)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [
        e["args"]["Total Allocated"]
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    ]
    return held + max(totals, default=0)
