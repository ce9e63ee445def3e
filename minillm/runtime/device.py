"""Where and how the math runs: device and precision choice, autocast, RNG state.

Offers `resolve_device`, `sum_dtype`, `one_row_threads`, `threads`, `resolve_precision`,
`cpu_bf16_faster`, `cpu_bf16_slowdown`, `cpu_bf16_slow`, `bf16_cpu_note`, `autocast_context`,
`make_grad_scaler`, `enable_tf32`, `rng_state`, `set_rng_state`, `seed_everything` and
`StopSignal`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from minillm.config import DEVICE_PATTERN
from minillm.errors import ConfigError

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# Devices with no float64 (Apple's MPS): a `.double()` of a tensor there raises.
NO_FLOAT64 = frozenset({"mps"})


def sum_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype of running sums of losses on `device`: float64 (exact enough over millions of
    tokens), float32 where the device has no float64 (MPS)."""
    return torch.float32 if torch.device(device).type in NO_FLOAT64 else torch.float64


# One-row steps of layers with at least this many weights run on torch's threads even under
# PASSIVE, unless their products are float32: there a large product outweighs waking the worker.
# torch's bf16 matrix-vector products are bound by arithmetic on a CPU without a bf16 dot (one
# AVX2 core streams ~9 GB/s of bf16 weights), as are int8's and NF4's; fp32's are bound by
# memory, which one core nearly fills on 2 cores. scripts/bench_step_threads.py, two threads'
# step against one's (2-core AMD EPYC): bf16 0.90x at 11M weights a layer, 0.68x at 44M
# (TinyLlama-1.1B), 0.58x at 101M (Llama-3.2-3B); int8 0.89x and NF4 0.64x at 44M; fp32
# 1.04-1.09x at each (docs/benchmarks.md, "On a busy machine").
ALL_THREADS_FROM = 8_000_000


def one_row_threads(device: torch.device, layer_weights: int, fp32: bool) -> int | None:
    """The threads a one-row decode step runs on: 1 on the CPU while OpenMP's threads sleep
    between parallel regions (OMP_WAIT_POLICY=PASSIVE, minillm's default: minillm/__init__.py),
    else None (torch's own). A one-row step of a small model is ~40 small ops a layer: each
    would wake the sleeping workers for microseconds of work, which cost a quiet machine more
    than a second core gives (issue 49: batch-1 steps 1.35x slower after PASSIVE became the
    default). Layers of `layer_weights` >= ALL_THREADS_FROM whose products are not `fp32` keep
    torch's threads (its note). OMP_WAIT_POLICY=ACTIVE (spinning workers) keeps them always."""
    passive = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
    if device.type != "cpu" or not passive:
        return None
    return None if layer_weights >= ALL_THREADS_FROM and not fp32 else 1


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to n inside (None: unchanged), restored after."""
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def resolve_device(name: str, key: str = "train.device") -> torch.device:
    """`auto` is cuda, then mps, then cpu; an unknown or unavailable device is a ConfigError
    naming `key` (the config key, or the CLI option that gave it)."""
    if not DEVICE_PATTERN.fullmatch(name):
        raise ConfigError(key, f"unknown device {name!r} (auto, cpu, cuda, cuda:N, mps)")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(key, f"{name!r} asked for, but CUDA is not available")
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise ConfigError(key, f"{name!r}: this machine has {torch.cuda.device_count()} GPUs")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(key, "'mps' asked for, but MPS is not available")
    return device


def _native_bf16() -> bool:
    """bf16 in hardware (Ampere and newer); V100/T4 only emulate it, slowly."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.5 has no such argument and does not count emulation
        return torch.cuda.is_bf16_supported()


@functools.cache
def cpu_bf16_faster() -> bool:
    """Whether bf16 matmuls run clearly (1.3x) faster than fp32's on this CPU: a probe of
    (1024, 1024) products, best of 5 timings of each (~0.1 s), once a process. A CPU without
    AVX-512 (torch's capability AVX2 or less) has no bf16 instructions: no probe, False."""
    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in capability and "AMX" not in capability:
        return False

    def rate(dtype: torch.dtype) -> float:
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(1024, 1024, generator=gen).to(dtype) for _ in range(2))
        torch.mm(a, b)  # warm-up: kernel selection, thread pool
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        return 1.0 / best

    return rate(torch.bfloat16) > 1.3 * rate(torch.float32)


# bf16 products this many times slower than fp32's run in fp32 instead (minillm.model.bf16_cpu):
# an fp32 product of a bf16 weight costs its upcast (one pass over W) and fp32's gemm, at most
# ~2x fp32's gemm at 128 rows here, so a smaller slowdown is not worth the detour.
SLOW_BF16 = 2.0


@functools.cache
def cpu_bf16_slowdown() -> float:
    """How many times longer this CPU takes for a bf16 matmul than for fp32's: a layer's input
    gradient's product (64, 256) @ (256, 256), at one thread (a busy second core cannot skew
    it), best of 3 timings of each, once a process (~0.05 s where bf16 is slow). A CPU without
    avx512_bf16/AMX (AVX2) has no bf16 gemm kernel in torch: its generic fallback measured
    100-500x fp32's on this project's AMD EPYC (docs/benchmarks.md); AMX measures below 1."""
    gen = torch.Generator().manual_seed(0)
    g, w = torch.randn(64, 256, generator=gen), torch.randn(256, 256, generator=gen)

    def seconds(dtype: torch.dtype) -> float:
        a, b = g.to(dtype), w.to(dtype)
        torch.mm(a, b)  # warm-up: kernel selection
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        return best

    # Maybe called first inside a forward: autocast would make the fp32 product a bf16 one.
    with threads(1), torch.no_grad(), torch.autocast("cpu", enabled=False):
        return seconds(torch.bfloat16) / max(seconds(torch.float32), 1e-9)


def cpu_bf16_slow() -> bool:
    """Whether this CPU's bf16 matmuls are slow enough (`SLOW_BF16`) that bf16 products run in
    fp32 (minillm.model.bf16_cpu): a CPU without bf16 instructions. Never on AMX/avx512_bf16."""
    return cpu_bf16_slowdown() > SLOW_BF16


def bf16_cpu_note(
    device: torch.device, precision: str, slowdown: Callable[[], float] = cpu_bf16_slowdown
) -> str | None:
    """The line a bf16 run on a CPU without a fast bf16 matmul starts with (`slowdown()`: the
    probe's factor), else None."""
    if device.type != "cpu" or precision != "bf16" or not slowdown() > SLOW_BF16:
        return None
    return (
        f"train.precision: bf16 on a CPU without bf16 matmul instructions (torch's bf16 matmul "
        f"measured {slowdown():.0f}x fp32's here): minillm multiplies in fp32 (bf16 in and out), "
        "so bf16 saves memory here (a LoRA base held in bf16), not time (a step ~1-1.3x an fp32 "
        "one); train.precision: auto picks fp32 on this CPU"
    )


def resolve_precision(
    name: str, device: torch.device, bf16_faster: Callable[[], bool] = cpu_bf16_faster
) -> str:
    """`auto` is bf16 on a CUDA GPU that supports it, and on a CPU where `bf16_faster()` (a
    matmul probe: Intel's AMX and avx512_bf16 ran a 9.9M model's training 2.2x faster in bf16
    autocast, AVX2 CPUs 10x slower), else fp32."""
    if name == "auto":
        if device.type == "cuda" and _native_bf16():
            return "bf16"
        if device.type == "cpu" and bf16_faster():
            return "bf16"
        return "fp32"
    if name == "bf16" and device.type == "cuda" and not _native_bf16():
        raise ConfigError("train.precision", "bf16 is not supported by this GPU; use fp16")
    return name


def autocast_context(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision by autocast; weights and optimizer state stay fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=PRECISION_DTYPES[precision])


def enable_tf32(
    device: torch.device,
    capability: Callable[[torch.device], tuple[int, int]] = torch.cuda.get_device_capability,
) -> bool:
    """Let fp32 matmuls use TF32 tensor cores on an Ampere-or-newer GPU; True if now on.

    fp32 matmuls (fp32 runs, and the fp32 ops that autocast leaves) otherwise run on the slow
    IEEE path; TF32 keeps fp32's range with a 10-bit mantissa, the trade every LLM trainer makes.
    `capability(device)` is the GPU's compute capability (a parameter, so a CPU test can give one).
    """
    if device.type != "cuda" or capability(device)[0] < 8:
        return False
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    else:
        torch.set_float32_matmul_precision("high")
    return True


def make_grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 and fp32 need none."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every RNG a step can draw from (dropout uses torch's), as tensors and plain values."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["python"] = list(_encode_python_state(random.getstate()))
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = [torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), gauss]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    if "python" in state:
        random.setstate(_decode_python_state(state["python"]))
    if "numpy" in state:
        keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def _encode_python_state(st: tuple) -> tuple:
    # (version, tuple of 625 ints, gauss) -> only ints and None, which weights_only can load.
    version, internal, gauss = st
    return version, list(internal), gauss


def _decode_python_state(st: list) -> tuple:
    version, internal, gauss = st
    return version, tuple(internal), gauss


class StopSignal:
    """Turns SIGINT/SIGTERM into a request to checkpoint and stop after the current step.

    The first signal is acknowledged at once with `notice` (on stderr). Signals within
    SAME_REQUEST_S of the first are that same request: `timeout`, `make` and a terminal signal
    a whole process group, so one Ctrl-C or one `kill` of the group can arrive two or three
    times. A later second one stops at once (KeyboardInterrupt), except inside
    `finishing(what)`, a checkpoint being written: there it says that `what` finishes first, and
    only a third stops at once. The atomic checkpoint writes keep the previous checkpoint whole
    either way.
    """

    SAME_REQUEST_S = 2.0

    def __init__(self, notice: str = "") -> None:
        self.requested = False
        self.signame = ""
        self.notice = notice
        self._count = 0
        self._first_at = 0.0  # time.monotonic() of the first signal
        self._finishing = ""  # what a second signal lets finish, while inside finishing()
        self._old: dict[int, Any] = {}

    @staticmethod
    def _say(text: str) -> None:
        # os.write, not print: a handler may run while the main code is inside a print to stderr.
        if text:
            with contextlib.suppress(OSError):
                os.write(2, f"{text}\n".encode())

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.requested:
            self.requested, self._count = True, 1
            self._first_at = time.monotonic()
            self.signame = signal.Signals(signum).name
            self._say(self.notice)
            return
        if time.monotonic() - self._first_at < self.SAME_REQUEST_S:
            return  # the first request again, delivered to the process group twice
        self._count += 1
        if self._finishing and self._count == 2:
            self._say(f"{self._finishing}: finishing it first (interrupt once more to abandon it)")
            return
        self._restore()
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def finishing(self, what: str) -> Iterator[None]:
        """Inside, a second signal lets the work (`what`, e.g. "writing checkpoint ...") end."""
        self._finishing = what
        try:
            yield
        finally:
            self._finishing = ""

    def _restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def __enter__(self) -> StopSignal:
        with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.requested or not self._old:
            self._restore()
            return
        # Stopped by a signal: its copies may still be on their way (a process group signalled
        # at once), and the run exits 130 in a moment. Until the window closes they are the
        # same request; a later signal gets the handler that was there before.
        old, self._old = self._old, {}
        for s in old:
            signal.signal(s, functools.partial(self._after_exit, old))

    def _after_exit(self, old: dict[int, Any], signum: int, frame: Any) -> None:
        if time.monotonic() - self._first_at < self.SAME_REQUEST_S:
            return
        for s, handler in old.items():
            signal.signal(s, handler)
        os.kill(os.getpid(), signum)
