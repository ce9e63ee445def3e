"""bf16 products on a CPU whose bf16 gemm is slow: computed in fp32, returned in bf16.

Offers `linear(x, weight, bias)` (F.linear's function), `upcast_dtype(x, weight)` (whether and
in which dtype a product takes that path), `fp32_product` and `fp32_input_grad` (its two
products, a row block of the weight at a time), `no_autocast()` and `bf16_slow()` (the cached
probe that decides).

A CPU without avx512_bf16/AMX (AVX2) has no bf16 gemm kernel in torch: a bf16 product falls to a
generic loop (`cpublas_gemm_impl`), 5x fp32's time for x W^T and 100-500x for a layer's input
gradient g W (docs/benchmarks.md), so a bf16 LoRA step at TinyLlama-1.1B's shape did not finish
in 16 minutes. There, while training (grad enabled) or for 16 rows or more, a bf16 product
upcasts its operands, multiplies in fp32 and rounds the result to bf16: the function autocast
computes (bf16 operands, products accumulated in fp32, a bf16 result). The upcast copies live
for one row block of one product, in one reused per-thread buffer (`scratch`, which NF4's
dequantized weights use too): the backward upcasts again, so a frozen bf16 weight is held once.
A GPU, a CPU with a fast bf16 gemm, and torch.compile's traces take F.linear as before.
The trainer's plain nn.Linear layers come here through `use_cpu_kernels`
(minillm.model.kernels_cpu); the head, LoRA's adapters, NF4 layers and MoE experts call it, and
attention's SDPA upcasts on the same condition (minillm.model.attention).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from minillm.runtime.device import cpu_bf16_slow

MIN_ROWS = 16  # without a gradient: fewer rows multiply faster in bf16 than W's upcast costs


def bf16_slow() -> bool:
    """Whether bf16 products run in fp32 on this CPU (the probe `cpu_bf16_slow`, once a process);
    tests replace it to take either branch on any CPU."""
    return cpu_bf16_slow()


def upcast_dtype(x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.dtype | None:
    """The dtype a product of x (and `weight`) returns when it is to run in fp32 instead (bf16:
    autocast's, or the operands' own outside autocast), else None (F.linear as it is)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling() or not x.is_floating_point():
        return None
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
    else:
        dtype = x.dtype
        if weight is not None and weight.dtype != dtype:
            return None  # F.linear's own error for mixed dtypes
    if dtype != torch.bfloat16:
        return None
    if not torch.is_grad_enabled() and x.numel() < MIN_ROWS * x.shape[-1]:
        return None
    return dtype if bf16_slow() else None


def no_autocast() -> torch.autocast:
    """Autocast off: inside, an fp32 product stays fp32."""
    return torch.autocast("cpu", enabled=False)


# Weights upcast at a time: 8 MiB of fp32, which the allocator reuses from one block to the next.
# A whole layer's fp32 copy (a (V, C) head: 262 MB at TinyLlama's shape) is fresh pages on every
# call, and filling them cost 20x the upcast itself here; the blocks also bound the transient.
BLOCK = 1 << 21


_SCRATCH = threading.local()  # per thread: (device, dtype, slot) -> a flat buffer


def scratch(device: torch.device, dtype: torch.dtype, numel: int, slot: int) -> torch.Tensor:
    """This thread's flat buffer `slot` of `dtype` on `device`, its first `numel` elements; grown
    (the old one freed first) when a larger one is asked for: one per key, the largest asked.
    Per thread: two threads' products never share one. Slot 2 is the upcast's (_upcast), 0 and 1
    NF4's (minillm.model.nf4)."""
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    key = (device, dtype, slot)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buffers.pop(key, None)
        del buf
        with torch.inference_mode(False):  # a normal tensor: inference mode and no_grad may write
            buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def _upcast(w: torch.Tensor) -> torch.Tensor:
    """w in fp32, in this thread's reused upcast buffer (valid until the next _upcast): a fresh
    8 MiB block each product left the heap's size to glibc's rising mmap threshold (a bf16 LoRA
    run's peak varied 3.4-4.0 GB at TinyLlama's shape)."""
    if w.dtype == torch.float32:
        return w
    if torch.is_grad_enabled():  # a double backward (create_graph) keeps the upcast: its own
        return w.float()
    return scratch(w.device, torch.float32, w.numel(), 2).view(w.shape).copy_(w)


def _blocks(weight: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
    """Row blocks (out rows, in) of `weight` of about BLOCK weights, with their row slices."""
    rows = max(1, BLOCK // max(weight.shape[1], 1))
    return [
        (slice(r, r + rows), w) for r, w in zip(range(0, weight.shape[0], rows), weight.split(rows))
    ]


def fp32_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """F.linear(x, weight, bias) multiplied in fp32, a row block of weight at a time, in `dtype`."""
    x32 = x.float()
    y = x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=dtype)  # (..., out)
    with no_autocast():
        for rows, w in _blocks(weight):
            b = None if bias is None else bias[rows].float()
            y[..., rows] = F.linear(x32, _upcast(w), b)
    return y


def fp32_input_grad(grad: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad @ weight (the input's gradient of a linear layer) in fp32, a row block of weight at
    a time, in `dtype`."""
    g = grad.float().flatten(0, -2)  # (N, out)
    out = g.new_zeros(g.shape[0], weight.shape[1])  # (N, in)
    with no_autocast():
        for rows, w in _blocks(weight):
            out.addmm_(g[:, rows], _upcast(w))
    return out.to(dtype).view(*grad.shape[:-1], -1)


class _Fp32Linear(torch.autograd.Function):
    """F.linear(x, weight, bias) in fp32, the result in `dtype`; the gradients in fp32, each in
    its input's dtype. Saves the inputs as given (x only when the weight trains)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        return fp32_product(x, weight, bias, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = fp32_input_grad(grad, weight, ctx.x_dtype)
        g = grad.float().flatten(0, -2)  # (N, out)
        with no_autocast():
            if ctx.needs_input_grad[1]:  # a trained weight: an adapter's, small
                grad_w = (g.T @ x.flatten(0, -2).float()).to(weight.dtype)  # (out, in)
            if ctx.needs_input_grad[2]:
                grad_b = g.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); a bf16 product on a CPU whose bf16 gemm is slow in fp32."""
    dtype = upcast_dtype(x, weight)
    if dtype is None:
        return F.linear(x, weight, bias)
    return _Fp32Linear.apply(x, weight, bias, dtype)


__all__ = [
    "bf16_slow",
    "fp32_input_grad",
    "fp32_product",
    "linear",
    "no_autocast",
    "upcast_dtype",
]
