"""int8 inference (`--quantize int8` of sample, chat, serve and eval): the linear layers' weights
held in 8 bits, applied to a loaded model in place at load time; the checkpoint is unchanged.

Offers `QUANTIZE_CHOICES`, `check_quantize(value)`, `int8_kernel_problem()`, `quantize_int8(model)`
(-> a reason it could not, or None), `Int8Linear` and `Int8MoE`.

The kernel is fbgemm's (qnnpack's on ARM) dynamic-quantized linear, `torch.ops.quantized.
linear_dynamic` on weights packed by `quantized.linear_prepack`: int8 weights, each output row
with its own scale, times activations quantized to 8 bits per call, int32 accumulation. Measured
on this project's CPU (docs/benchmarks.md) it is the one int8 path torch 2.13 offers that is
faster than fp32 on a CPU: `aten._weight_int8pack_mm` was 3-20x slower than `F.linear`, and
torchao 0.18's int8 configs in eager mode 1.2-6x slower (its wheel has no CPU kernels). Its
status: the op is kept, but the eager `torch.ao.quantization` API around it is deprecated
(torchao is its successor, GPU-first) and so is creating the quantized tensor that packing takes;
if a release drops them, `int8_kernel_problem` says so and the model runs in fp32 with one
warning.

fbgemm quantizes a call's activations with one scale for the whole tensor, so a row's result
would depend on the other rows of the batch (serve's requests, `sample`'s prompts). Here each
row (token) is first divided by its own max |x| and two columns +1 and -1, multiplied by zero
weights, pin every row's range to [-1, 1]: the quantization is per token, the same whatever else
is in the batch, and finer than per tensor. (Batched == alone bit for bit also needs the float
parts before each rounding to be batch-exact: the decoder attends rows of unequal lengths one at
a time in an int8 model, minillm.model.decode.)

What is quantized: every linear layer of the blocks (attention's wqkv and wo, the SwiGLU's, each
expert of a mixture of experts) and the output head. The router of an MoE stays fp32 (E rows:
nothing to gain, and a routing flip would change a token's experts), as do the norms. The token
embedding stays fp32: a lookup reads one row per token, no matmul to speed, so 8 bits would only
add error. A tied head gets its own int8 copy of the embedding for the head matmul (the largest
one at a 49k vocabulary), beside the fp32 table for the lookup. A LoRA run's model arrives
merged (`load_checkpoint`), so the merged weights are quantized. A quantized model is for
inference only: its int8 layers have no gradient and no `weight` to export.
"""

from __future__ import annotations

import platform
import threading
import warnings
from collections.abc import Callable
from functools import cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.errors import UserError
from minillm.model.mla import MLA
from minillm.model.moe import MoE
from minillm.model.transformer import SwiGLU, Transformer

QUANTIZE_CHOICES = ("none", "int8", "nf4")  # nf4: minillm.model.nf4 (bitsandbytes)


def check_quantize(value: str | None) -> str:
    """--quantize's value, `none` for None; another value, or nf4 without bitsandbytes, is a
    UserError naming the choices (the install)."""
    value = "none" if value is None else value
    if value not in QUANTIZE_CHOICES:
        raise UserError(f"--quantize: {value!r} is not one of {', '.join(QUANTIZE_CHOICES)}")
    if value == "nf4":
        from minillm.model.nf4 import nf4_problem

        problem = nf4_problem()
        if problem is not None:
            raise UserError(f"--quantize: nf4: {problem}")
    return value


@cache
def _reduce_range() -> bool:
    """fbgemm's 7-bit activations: needed on x86 without VNNI, whose u8 x s8 multiply-add
    saturates 16-bit sums; with VNNI (or on ARM) the full 8 bits are exact and halve the error."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return True
    return not {"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags)


def _pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fbgemm's packed form of weight (N, K) with two zero columns appended (the range pins,
    see the module docstring), int8 per output row (symmetric), and the (N,) scales."""
    w = weight.detach().float().cpu()
    w = torch.cat((w, w.new_zeros(w.shape[0], 2)), dim=1)  # (N, K + 2)
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # the quantized tensor packing takes is deprecated (above)
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qw, None), scale.float()


class Int8Linear(nn.Module):
    """x (..., K) -> x W^T + b with W in int8 (per output row scales), activations quantized per
    token: `linear`'s function to about 1% of its output (tests/test_quantize.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed, _ = _pack(weight)
        self.bias = None if bias is None else bias.detach().float().clone()
        self.reduce_range = _reduce_range()

    def _raw(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x / s) W^T and s, s (N, 1) each row's max |x|, for x (N, K) in float32."""
        s = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_min_(1e-30)
        xn = _pinned(*x.shape)  # (N, K + 2): x / s, then the pins; in [-1, 1]
        torch.div(x, s, out=xn[:, : x.shape[1]])
        return torch.ops.quantized.linear_dynamic(xn, self.packed, self.reduce_range), s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2 and x.dtype == torch.float32  # the decoder's (N, K): no reshapes
        y, s = self._raw(x if flat else x.reshape(-1, self.in_features).float())
        y = y.mul_(s) if self.bias is None else torch.addcmul(self.bias, y, s)
        return y if flat else y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + this(y) for x (N, out), y (N, in): a residual add in one op (the decoder's)."""
        raw, s = self._raw(y)
        out = torch.addcmul(x, raw, s)
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


_PINNED = threading.local()  # per thread: (N, K) -> the buffer below
_PINNED_ROWS = 64  # decode steps reuse theirs; larger inputs (prompts, eval) get their own


def _pinned(n: int, k: int) -> torch.Tensor:
    """A float32 (n, k + 2) buffer whose last two columns hold the range pins +1 and -1 (the
    module docstring), for an input to be written into its first k columns. A decode step
    would otherwise spend two ops a layer (an expand and a cat) making one; reused per thread
    for n <= 64, made as a normal tensor, which inference mode and no_grad may both write."""
    cache = getattr(_PINNED, "buffers", None)
    if cache is None:
        cache = _PINNED.buffers = {}
    buf = cache.get((n, k)) if n <= _PINNED_ROWS else None
    if buf is None:
        with torch.inference_mode(False):
            buf = torch.empty(n, k + 2)
            buf[:, k], buf[:, k + 1] = 1.0, -1.0
        if n <= _PINNED_ROWS:
            cache[(n, k)] = buf
    return buf


class Int8MoE(MoE):
    """An `MoE` whose experts are int8 (`Int8Linear` pairs); the router stays fp32 and the
    routing is MoE's own (`forward`), only the experts' function differs."""

    def __init__(self, moe: MoE) -> None:
        nn.Module.__init__(self)  # not MoE's: no fp32 expert stacks to allocate
        self.k, self.hidden, self.router, self.drop = moe.k, moe.hidden, moe.router, moe.drop
        self.normalize, self.shared = moe.normalize, moe.shared
        # model.moe_router sigmoid's routing, fp32 as the router (None: softmax)
        self.register_buffer("router_bias", moe.router_bias)
        self.groups, self.scale = moe.groups, moe.scale
        if self.shared is not None:  # its gate (one row, if any) stays fp32, as the router
            self.shared.w_gate_up = Int8Linear(self.shared.w_gate_up.weight)
            self.shared.w_down = Int8Linear(self.shared.w_down.weight)
        self.activation = moe.activation
        self.stats = None
        self.gate_up = nn.ModuleList(Int8Linear(w) for w in moe.w_gate_up.unbind(0))
        self.down = nn.ModuleList(Int8Linear(w) for w in moe.w_down.unbind(0))

    def expert_ffns(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        act = self.activation
        return [lambda x, a=a, b=b: b(act(a(x))) for a, b in zip(self.gate_up, self.down)]


@cache
def int8_kernel_problem() -> str | None:
    """Why this torch build or CPU cannot run the int8 kernel, or None when it can (checked by
    packing and running a small layer against fp32)."""
    if not hasattr(torch.ops.quantized, "linear_dynamic"):
        return "this torch build has no quantized.linear_dynamic (fbgemm/qnnpack) kernel"
    if torch.backends.quantized.engine == "none":
        return "this torch build has no quantized engine (fbgemm, x86 or qnnpack)"
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(16, 32, generator=gen), torch.randn(3, 32, generator=gen)
        got, want = Int8Linear(w)(x), F.linear(x, w)
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        return f"the int8 kernel does not run here ({str(e).splitlines()[0][:120]})"
    if not torch.allclose(got, want, rtol=0.1, atol=0.1 * want.abs().max().item()):
        return "the int8 kernel gives wrong results on this CPU"
    return None


def quantize_int8(model: Transformer) -> str | None:
    """Put int8 layers into `model` (a Transformer on the CPU, eval mode) in place; None when
    done, else the reason it could not (the model is then untouched, fp32)."""
    device = model.tok_emb.weight.device
    if device.type != "cpu":
        return f"the int8 kernel runs on the CPU and the model is on {device.type}"
    problem = int8_kernel_problem()
    if problem is not None:
        return problem
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            if isinstance(attn, MLA):
                _quantize_mla(attn)
            else:
                _quantize(attn, "wqkv", bias=True)
                _quantize(attn, "wo")
            if isinstance(block.ffn, SwiGLU):
                _quantize(block.ffn, "w_gate_up")
                _quantize(block.ffn, "w_down")
            elif isinstance(block.ffn, MoE) and not isinstance(block.ffn, Int8MoE):
                block.ffn = Int8MoE(block.ffn)
        # A tied head's int8 copy sits where an untied head would (see the module docstring).
        if not isinstance(model.lm_head, Int8Linear):
            model.lm_head = Int8Linear(model.head_weight)
    model.quantized = "int8"
    return None


def _quantize_mla(attn: MLA) -> None:
    """Int8 projections of latent attention, but for wkv_b: its decode absorbs its float weight
    into the query and the output (minillm.model.mla), so it stays as it is."""
    for name in ("wq", "wq_a", "wq_b", "wkv_a", "wo"):
        if getattr(attn, name) is not None:
            _quantize(attn, name)


def _quantize(owner: nn.Module, name: str, bias: bool = False) -> None:
    """owner.<name> made an Int8Linear (with its bias where `bias`), unless it already is one:
    a lazy load quantizes layers as it reads them (minillm.checkpoint.quantized_load)."""
    layer = getattr(owner, name)
    if not isinstance(layer, Int8Linear):
        setattr(owner, name, Int8Linear(layer.weight, layer.bias if bias else None))


__all__ = [
    "QUANTIZE_CHOICES",
    "Int8Linear",
    "Int8MoE",
    "check_quantize",
    "int8_kernel_problem",
    "quantize_int8",
]
