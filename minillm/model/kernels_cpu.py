"""Eager CPU kernels: hand-written autograd Functions for the model's elementwise work, and
`use_cpu_kernels(model)`, which makes a Transformer use them.

Offers `use_cpu_kernels`, `eager_cpu(x)` (whether these kernels apply), `rotate`, `RMSNormCPU`,
`RoPE`, `SwiGLUCPU`, `CrossEntropyCPU` and `FusedLinear` (nn.Linear through
minillm.model.bf16_cpu.linear: fp32 products where the CPU's bf16 gemm is slow).

Eager PyTorch makes one pass over memory per elementwise op, and autograd's generic backward of
small formulas makes several more. On CPU, where these passes cost as much as the matmuls around
them, the Functions below compute the same math in fewer passes and with fewer temporaries.
`minillm.model.transformer` holds the plain formulas; a caller that wants these kernels (the
trainer) asks for them with `use_cpu_kernels(model)`, which gives the RMSNorm, SwiGLU, MoE and
Transformer modules subclasses whose forwards call them. They serve eager training only: under
torch.compile the plain formulas are traced and fused by inductor, without autograd (eval,
decoding) the native ops are as fast and cost less, and on a GPU the native fused kernels
(F.rms_norm, F.cross_entropy) are used; the RoPE Function, device-independent, serves any eager
device.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.bf16_cpu import linear
from minillm.model.moe import MoE, SharedExpert
from minillm.model.rope import apply_rope
from minillm.model.transformer import (
    RMSNorm,
    SwiGLU,
    Transformer,
    cross_entropy,
    swiglu,
)


def compiling() -> bool:
    """True while torch.compile traces: the plain formulas are what inductor fuses best."""
    return torch.compiler.is_compiling()


def eager_cpu(x: torch.Tensor) -> bool:
    """Whether to use the hand-written CPU kernels below (see the module docstring): they pay off
    in training; without autograd (eval, decoding) the native ops are as fast and cost less."""
    return x.device.type == "cpu" and torch.is_grad_enabled() and not compiling()


class RMSNormCPU(torch.autograd.Function):
    """F.rms_norm(x, weight) in fp32; saves x_hat = x / rms(x) for a 7-pass backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))  # (..., 1)
        x_hat = x * rstd
        ctx.save_for_backward(x_hat, rstd, weight)
        return x_hat * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_hat, rstd, weight = ctx.saved_tensors
        grad_weight = (grad * x_hat).flatten(0, -2).sum(0)
        grad_x_hat = grad * weight
        # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat))
        dot = (grad_x_hat * x_hat).mean(-1, keepdim=True)
        grad_x = torch.addcmul(grad_x_hat, x_hat, dot, value=-1.0).mul_(rstd)
        return grad_x, grad_weight, None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[x1 cos - x2 sin, x2 cos + x1 sin] for half tables cos, sin, written half by half."""
    dtype = torch.result_type(x, cos)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    x1, x2 = x.chunk(2, dim=-1)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out.to(x.dtype)


class RoPE(torch.autograd.Function):
    """RoPE as a rotation: its backward is the inverse rotation (sin negated), and saves no x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, -sin), None, None


class SwiGLUCPU(torch.autograd.Function):
    """silu(gate) * up from the fused (..., 2F) projection; the backward writes both halves of
    one gradient buffer in place of autograd's separate gradients and their concatenation."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(gate, up, act)
        return act * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        gate, up, act = ctx.saved_tensors
        out = grad.new_empty(*grad.shape[:-1], 2 * grad.shape[-1])
        grad_gate, grad_up = out.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        torch.mul(grad, act, out=grad_up)
        return out


class CrossEntropyCPU(torch.autograd.Function):
    """Cross-entropy of fp32 logits (N, V) with ignore_index -100, mean or sum.

    F.cross_entropy materialises log_softmax (N, V) and, in the backward, a zero-filled (N, V)
    gradient and a second (N, V) one. This keeps only the per-row logsumexp and builds the
    gradient softmax - onehot once, in cache-sized chunks of rows.
    """

    CHUNK_BYTES = 1 << 21  # 2 MiB of logits per chunk, about one core's L2

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, sum_: bool) -> torch.Tensor:
        N, V = logits.shape
        rows = max(1, CrossEntropyCPU.CHUNK_BYTES // (4 * V))
        lse = torch.empty(N, dtype=logits.dtype, device=logits.device)
        for i in range(0, N, rows):
            torch.logsumexp(logits[i : i + rows], dim=-1, out=lse[i : i + rows])
        valid = targets != -100
        safe = torch.where(valid, targets, 0)
        losses = (lse - logits.gather(1, safe[:, None]).squeeze(1)).masked_fill_(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(logits, safe, valid, lse, count)
        ctx.sum_ = sum_
        return losses.sum() if sum_ else losses.sum() / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, safe, valid, lse, count = ctx.saved_tensors
        N, V = logits.shape
        scale = grad if ctx.sum_ else grad / count
        row_scale = torch.where(valid, scale, 0.0)[:, None]  # ignored rows get no gradient
        out = torch.empty_like(logits)
        rows = max(1, CrossEntropyCPU.CHUNK_BYTES // (4 * V))
        for i in range(0, N, rows):
            chunk = out[i : i + rows]
            torch.sub(logits[i : i + rows], lse[i : i + rows, None], out=chunk).exp_()
            idx = safe[i : i + rows, None]
            chunk.scatter_(1, idx, chunk.gather(1, idx) - 1.0)  # softmax - onehot
            chunk.mul_(row_scale[i : i + rows])
        return out, None, None


# ----------------------------------------------------------------------------- the modules


class FusedRMSNorm(RMSNorm):
    """RMSNorm through RMSNormCPU where it applies (eager CPU training in float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32 and eager_cpu(x):
            return RMSNormCPU.apply(x, self.weight, self.eps)
        return super().forward(x)


def fused_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`swiglu` through SwiGLUCPU where it applies."""
    if gate_up.dtype == torch.float32 and eager_cpu(gate_up):
        return SwiGLUCPU.apply(gate_up)
    return swiglu(gate_up)


class FusedSwiGLU(SwiGLU):
    """SwiGLU whose activation is fused_swiglu."""

    activation = staticmethod(fused_swiglu)


class FusedMoE(MoE):
    """A mixture of experts whose experts' activation is fused_swiglu."""

    activation = staticmethod(fused_swiglu)


class FusedSharedExpert(SharedExpert):
    """A shared expert (Qwen2-MoE) whose activation is fused_swiglu."""

    activation = staticmethod(fused_swiglu)


def fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` through the RoPE Function in eager mode, `rotate` without autograd."""
    if compiling():  # the plain formula: inductor fuses it and its backward
        return apply_rope(x, cos, sin)
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    if not torch.is_grad_enabled():  # an eval: no autograd node to build
        return rotate(x, cos, sin)
    return RoPE.apply(x, cos, sin)


def fused_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, reduction: str
) -> torch.Tensor:
    """`cross_entropy` through CrossEntropyCPU where it applies."""
    if reduction in ("mean", "sum") and logits.dtype == torch.float32 and eager_cpu(logits):
        return CrossEntropyCPU.apply(logits, targets, reduction == "sum")
    return cross_entropy(logits, targets, reduction)


class FusedLinear(nn.Linear):
    """nn.Linear whose product is bf16_cpu.linear's: F.linear's but on a CPU whose bf16 gemm is
    slow, where a bf16 product runs in fp32 (100-500x faster there for the input gradient)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class FusedTransformer(Transformer):
    """Transformer with the fused RoPE and cross-entropy."""

    loss_function = staticmethod(fused_cross_entropy)
    rotate = staticmethod(fused_rope)


_FUSED = {
    nn.Linear: FusedLinear,
    RMSNorm: FusedRMSNorm,
    SwiGLU: FusedSwiGLU,
    MoE: FusedMoE,
    SharedExpert: FusedSharedExpert,
    Transformer: FusedTransformer,
}


def use_cpu_kernels(model: Transformer) -> Transformer:
    """Make model (in place) run the kernels above where they apply; returns it.

    Each nn.Linear, RMSNorm, SwiGLU, MoE and the Transformer itself becomes the Fused subclass
    above: the same parameters, state_dict and hooks, the math of the plain module
    (tests/test_kernels.py pins it), in fewer passes over memory (a linear layer: in fp32 where
    the CPU's bf16 gemm is slow, minillm.model.bf16_cpu). Elsewhere (GPU, torch.compile, no
    autograd) the subclasses run the plain forwards.
    """
    for module in model.modules():
        fused = _FUSED.get(type(module))
        if fused is not None:
            module.__class__ = fused
    return model
