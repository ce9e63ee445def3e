"""4-bit NF4 weights: QLoRA's frozen base (`train.lora.quantize: nf4`) and `--quantize nf4`.

Offers `NF4Linear`, `quantize_nf4(model)` (every linear layer of the blocks, in place),
`nf4_as_loaded(parts)` (the same, one layer at a time while a lazy load fills the model:
minillm.checkpoint.lazy.fill_model's `on_filled`, so a QLoRA run never holds its base in full),
`nf4_round_trip(model)` (the same layers' weights replaced by what NF4 holds: the function a
QLoRA run trained, for its merged checkpoint) and `nf4_problem()` (why it cannot run here).

The codes are bitsandbytes' (`bitsandbytes.functional.quantize_4bit`, quant_type nf4, blocks of
64 weights, their absmax scales themselves quantized to 8 bits: QLoRA's double quantization),
what `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True)` gives transformers and peft. Chosen over torchao's NF4Tensor
by measurement on this project's 2-core CPU (docs/benchmarks.md): bitsandbytes dequantizes a
5632 x 2048 weight ~5x faster there (its CPU kernel; torchao's is torch ops), its layer's fp32
forward + backward was ~1.4x faster, it runs on CUDA with its own kernels, and it is what
peft's QLoRA uses, so a run compares with peft + bitsandbytes code for code.

A fused projection (wqkv, w_gate_up) is quantized per Hugging Face module (q, k, v; gate, up),
as bitsandbytes quantizes peft's q_proj, k_proj, v_proj one by one: the double quantization's
scale blocks and offset are per tensor, so fusing first would give other codes. A forward
dequantizes the weight to the input's dtype and multiplies (bitsandbytes' own path for more than
one row); the backward dequantizes it again instead of keeping it, so a step holds one layer's
full weight at a time, not the model's. On CPU those two dequantize into a scratch buffer per
thread and dtype (`scratch_weight`, grown to the largest layer and reused): a fresh 46 MB weight
a layer was a fresh mmap with its page faults on every product (a QLoRA run sets glibc's mmap
threshold to 1 MB, minillm.checkpoint.lazy.map_large_blocks). `dequantized()` still returns a
tensor of its own, for merges, exports and tests that keep it. The embedding, the head, the
norms and an MoE's experts and router stay in the model's dtype (bitsandbytes skips the head,
and transformers' experts are not linear layers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.errors import ConfigError
from minillm.model.bf16_cpu import fp32_input_grad, fp32_product, scratch, upcast_dtype
from minillm.model.transformer import Transformer

BLOCK = 64  # weights per absmax scale (bitsandbytes' and QLoRA's default)


@cache
def nf4_problem() -> str | None:
    """Why NF4 cannot run in this environment (bitsandbytes missing or too old), or None."""
    try:
        import bitsandbytes
        from bitsandbytes.functional import dequantize_4bit, quantize_4bit  # noqa: F401
    except ImportError as e:
        return f"NF4 needs bitsandbytes >= 0.45 ({e.msg}); install it: pip install 'minillm[qlora]'"
    major, minor = (int(p) for p in bitsandbytes.__version__.split(".")[:2])
    if (major, minor) < (0, 45):
        return (
            f"NF4 needs bitsandbytes >= 0.45 (its CPU kernels), this is {bitsandbytes.__version__}"
        )
    return None


class _DequantLinear(torch.autograd.Function):
    """x W^T with W dequantized for the product and again for the gradient of x, each into the
    scratch buffer (NF4Linear.scratch_weight): nothing of the size of W is kept between forward
    and backward, and each product finishes before the next layer's dequantization. W is frozen
    (no gradient). With `upcast` (bf16_cpu.upcast_dtype: a CPU whose bf16 gemm is slow) both
    products run in fp32, a row block of W at a time, the result in `upcast`."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, layer: NF4Linear, upcast: torch.dtype | None
    ) -> torch.Tensor:
        ctx.layer, ctx.upcast = layer, upcast
        if upcast is None:
            return F.linear(x, layer.scratch_weight(x.dtype))
        return fp32_product(x, layer.scratch_weight(), None, upcast)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        # a double backward (create_graph) keeps the weight for its own backward: a fresh one
        weight = ctx.layer.dequantized if torch.is_grad_enabled() else ctx.layer.scratch_weight
        if ctx.upcast is None:  # (..., out) @ (out, in)
            return grad @ weight(grad.dtype), None, None
        return fp32_input_grad(grad, weight(), grad.dtype), None, None


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight (out, in) is held in NF4, in row blocks `parts` (the
    Hugging Face modules fused in it) quantized each on its own; the bias as it was."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, parts: Sequence[int] = ()
    ) -> None:
        super().__init__()
        from bitsandbytes.functional import quantize_4bit

        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        parts = tuple(parts) or (self.out_features,)
        if sum(parts) != self.out_features:
            raise ValueError(f"parts {parts} do not add up to the {self.out_features} rows")
        self.states = []
        w = weight.detach()
        for i, rows in enumerate(w.split(parts, dim=0)):
            packed, state = quantize_4bit(
                rows.contiguous(), blocksize=BLOCK, quant_type="nf4", compress_statistics=True
            )
            self.register_buffer(f"packed{i}", packed, persistent=False)
            self.states.append(state)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def _apply(self, fn: Any, recurse: bool = True) -> NF4Linear:
        super()._apply(fn, recurse)
        device = self.packed0.device  # the packed codes moved (.to, .cuda): their scales too
        for state in self.states:
            state.to(device)
        return self

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight (out, in) as NF4 holds it, in `dtype` (default: the original's)."""
        from bitsandbytes.functional import dequantize_4bit

        parts = [
            dequantize_4bit(getattr(self, f"packed{i}"), state)
            for i, state in enumerate(self.states)
        ]
        w = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return w.to(dtype or self.dtype)

    def scratch_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """dequantized(dtype), bit for bit, in this thread's scratch buffer: valid until the next
        call of any NF4Linear on this thread, so only for a product that finishes before then
        (_DequantLinear's; it keeps nothing). Each part lands in its row block, no cat; a dtype
        other than the weight's is one copy into a second buffer. On CPU only (a fresh weight
        there is fresh pages; a GPU's caching allocator reuses its blocks) and not while
        torch.compile traces: elsewhere dequantized(dtype)."""
        dtype = dtype or self.dtype
        device = self.packed0.device
        if device.type != "cpu" or torch.compiler.is_compiling():
            return self.dequantized(dtype)
        w = scratch(device, self.dtype, self.buffer_weight_numel, 0)
        w = w.view(self.out_features, self.in_features)
        row = 0
        for i, state in enumerate(self.states):
            rows = state.shape[0]
            _dequantize_into(getattr(self, f"packed{i}"), state, w[row : row + rows])
            row += rows
        if dtype == self.dtype:
            return w
        cast = scratch(device, dtype, self.buffer_weight_numel, 1)
        return cast.view(self.out_features, self.in_features).copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _DequantLinear.apply(x, self, upcast_dtype(x))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + this(y): the decoder's residual add (minillm.model.decode)."""
        return x + self(y)

    @property
    def buffer_weight_numel(self) -> int:
        """The weight's numel, for the model's FLOPs (Transformer.flops_per_token counts the
        parameters, and this weight is held in buffers)."""
        return self.out_features * self.in_features

    def nbytes(self) -> int:
        """Bytes held: the packed codes and their (double-quantized) scales."""
        total = 0
        for i, state in enumerate(self.states):
            total += getattr(self, f"packed{i}").nbytes + state.absmax.nbytes
            if state.state2 is not None:
                total += state.state2.absmax.nbytes + state.state2.code.nbytes
        return total

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4"


# bitsandbytes (major, minor) releases whose native CPU NF4 kernel _dequantize_into calls.
KERNEL_CHECKED = {(0, 50)}


@cache
def _cpu_kernel(dtype: torch.dtype) -> Any:
    """bitsandbytes' native CPU NF4 dequantizer for `dtype` (what its CPU `dequantize_4bit`
    calls), or None. Only on the bitsandbytes releases whose C signature (codes, absmax, out,
    blocksize, rows, cols) was checked against their own CPU op (KERNEL_CHECKED): a ctypes call
    with another release's arguments would not fail cleanly, so any other takes the fallback."""
    try:
        import bitsandbytes
        from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib
    except ImportError:
        return None
    if tuple(int(p) for p in bitsandbytes.__version__.split(".")[:2]) not in KERNEL_CHECKED:
        return None
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if name is None or isinstance(lib, ErrorHandlerMockBNBNativeLibrary):
        return None  # no native library: its CPU op is torch ops, which the fallback calls
    return getattr(lib, f"cdequantize_blockwise_cpu_nf4_{name}", None)


def _dequantize_into(packed: torch.Tensor, state: Any, out: torch.Tensor) -> None:
    """bitsandbytes' dequantize_4bit(packed, state) of a CPU tensor written into `out` (its shape
    and dtype) by its native CPU kernel: the call its CPU op makes, with the same absmax (its
    `dequantize_4bit(out=...)` has no CPU kernel); where that op would not call it (no native
    library, an odd row length, its avx512 fallback for blocks of 2048), a fresh tensor copied."""
    import ctypes as ct

    from bitsandbytes.functional import dequantize_4bit, dequantize_blockwise, get_ptr

    kernel = _cpu_kernel(out.dtype)
    rows, cols = out.shape
    fast = packed.shape[0] > 1 and cols % 2 == 0 and out.is_contiguous() and state.blocksize < 2048
    fast = fast and state.quant_type == "nf4" and state.dtype == out.dtype
    if kernel is None or not fast:
        out.copy_(dequantize_4bit(packed, state))
        return
    absmax = state.absmax
    if state.nested:  # as dequantize_4bit: the double quantization's scales, then the offset
        absmax = dequantize_blockwise(state.absmax, state.state2)
        absmax += state.offset
    absmax = absmax.float().contiguous()
    codes = packed.view(torch.uint8).reshape(rows, cols // 2)
    blocks, m, n = ct.c_longlong(state.blocksize), ct.c_longlong(rows), ct.c_longlong(cols)
    kernel(get_ptr(codes), get_ptr(absmax), get_ptr(out), blocks, m, n)


def linear_slots(model: Transformer) -> list[tuple[nn.Module, str, nn.Linear, str]]:
    """(holder, attribute, the frozen nn.Linear, its layer's name) of every linear layer of the
    blocks: attention's projections and a dense FFN's, a LoRALinear's base where there is one;
    an MoE's router and experts are not nn.Linear children and stay as they are."""
    slots = []
    for block in model.blocks:
        for owner in (block.attn, block.ffn):
            for name, child in owner.named_children():
                base = getattr(child, "base", None)
                if isinstance(base, nn.Linear):  # a LoRALinear: quantize its frozen base
                    slots.append((child, "base", base, name))
                elif isinstance(child, nn.Linear) and name != "router":
                    slots.append((owner, name, child, name))
    return slots


@torch.no_grad()
def quantize_nf4(
    model: Transformer, parts: dict[str, tuple[int, ...]] | None = None, key: str = "--quantize"
) -> Transformer:
    """Replace every linear layer of the blocks (a LoRALinear's base) by an NF4Linear of its
    weight, in place; the layers must be frozen (QLoRA trains adapters only). `parts`: the row
    blocks of a fused layer quantized each on its own, one per Hugging Face module (the family's
    `fused_rows`; none: each layer whole). Without bitsandbytes: a ConfigError naming `key`."""
    problem = nf4_problem()
    if problem is not None:
        raise ConfigError(key, f"nf4: {problem}")
    parts = parts or {}
    for holder, attr, layer, name in linear_slots(model):
        nf4 = NF4Linear(layer.weight, layer.bias, parts.get(name, ()))
        setattr(holder, attr, nf4.to(layer.weight.device))
    model.quantized = "nf4"
    return model


def nf4_as_loaded(
    parts: dict[str, tuple[int, ...]] | None = None, key: str = "train.lora.quantize"
) -> Callable[[str, nn.Module], nn.Module | None]:
    """fill_model's `on_filled` that turns each linear layer of the blocks quantize_nf4 would
    quantize (`blocks.<i>.attn.<name>`, `blocks.<i>.ffn.<name>` but the router) into an NF4Linear
    as soon as its weight is read: a load's peak is then the NF4 model plus one layer in the load
    dtype, not the whole base. Without bitsandbytes: a ConfigError naming `key`, before any
    weight is read."""
    problem = nf4_problem()
    if problem is not None:
        raise ConfigError(key, f"nf4: {problem}")
    parts = parts or {}

    @torch.no_grad()
    def quantize(name: str, module: nn.Module) -> nn.Module | None:
        path = name.split(".")
        in_block = len(path) == 4 and path[0] == "blocks" and path[2] in ("attn", "ffn")
        if not in_block or not isinstance(module, nn.Linear) or path[3] == "router":
            return None
        return NF4Linear(module.weight, module.bias, parts.get(path[3], ())).to(
            module.weight.device
        )

    return quantize


@torch.no_grad()
def nf4_round_trip(
    model: Transformer, parts: dict[str, tuple[int, ...]] | None = None
) -> Transformer:
    """Each linear layer of the blocks keeps its float weight but as NF4 holds it (quantized and
    dequantized, in its dtype, `parts` as quantize_nf4's): what a QLoRA run's base computed, to
    merge its adapters into."""
    parts = parts or {}
    for _, _, layer, name in linear_slots(model):
        layer.weight.copy_(NF4Linear(layer.weight, None, parts.get(name, ())).dequantized())
    return model


__all__ = [
    "NF4Linear",
    "linear_slots",
    "nf4_as_loaded",
    "nf4_problem",
    "nf4_round_trip",
    "quantize_nf4",
]
