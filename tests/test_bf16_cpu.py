"""bf16 products on a CPU whose bf16 gemm is slow (minillm.model.bf16_cpu): there a bf16 LoRA or
QLoRA step multiplies in fp32 (no bf16 matmul left but attention's), the same function as
torch's bf16 path within bf16 rounding, gradients of the adapters included; elsewhere (a fast
bf16 CPU, fp32, a GPU) F.linear exactly. The decision (`bf16_slow`) is forced both ways, so
both branches run on any CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.config import LoRAConfig
from minillm.model import Transformer, bf16_cpu, use_cpu_kernels
from minillm.model.bf16_cpu import linear, upcast_dtype
from minillm.model.lora import add_lora
from minillm.runtime.device import SLOW_BF16, bf16_cpu_note, cpu_bf16_slow, cpu_bf16_slowdown
from tests.helpers import assert_same_function, tiny_model_config

BF16_REL = 2**-8  # one bf16 rounding of a value, relative to the largest
aten = torch.ops.aten
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.mv, aten.addmv, aten.matmul}


@pytest.fixture(params=[True, False], ids=["slow-bf16-cpu", "fast-bf16-cpu"])
def slow(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both answers of the probe, on whatever CPU runs the test."""
    monkeypatch.setattr(bf16_cpu, "bf16_slow", lambda: request.param)
    return request.param


class _Matmuls(TorchDispatchMode):
    """Records the operand dtypes of every matmul and attention op run inside (after autocast's
    casts), forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in MATMULS or "scaled_dot_product" in func.name():
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        return func(*args, **(kwargs or {}))


def matmul_dtypes(fn: Callable[[], Any]) -> set[torch.dtype]:
    with _Matmuls() as seen:
        fn()
    return seen.dtypes


def test_the_probe_measures_a_slowdown() -> None:
    factor = cpu_bf16_slowdown()
    assert factor > 0 and cpu_bf16_slow() == (factor > SLOW_BF16)
    if torch.backends.cpu.get_cpu_capability() == "AVX2":  # no bf16 gemm in torch: 100-500x
        assert cpu_bf16_slow()


def test_a_bf16_run_on_such_a_cpu_says_so() -> None:
    cpu, slow, fast = torch.device("cpu"), (lambda: 120.0), (lambda: 0.4)
    note = bf16_cpu_note(cpu, "bf16", slowdown=slow)
    assert note.startswith("train.precision: bf16") and "120x" in note and "fp32" in note
    assert "\n" not in note
    assert bf16_cpu_note(cpu, "bf16", slowdown=fast) is None  # AMX, avx512_bf16
    assert bf16_cpu_note(cpu, "fp32", slowdown=slow) is None
    assert bf16_cpu_note(torch.device("meta"), "bf16", slowdown=slow) is None  # not a CPU


def test_which_products_run_in_fp32(slow: bool) -> None:
    bf16, x = torch.bfloat16, torch.randn(4, 32, 8)
    w = torch.randn(16, 8)
    assert upcast_dtype(x, w) is None  # fp32: F.linear
    with torch.autocast("cpu", dtype=bf16):
        assert upcast_dtype(x, w) == (bf16 if slow else None)
        with torch.no_grad():  # no gradient: 16 rows or more
            assert upcast_dtype(x, w) == (bf16 if slow else None)
            assert upcast_dtype(x[:1, :15], w) is None
        assert upcast_dtype(x[:1, :1], w) == (bf16 if slow else None)  # a gradient: any rows
        assert upcast_dtype(x.long(), w) is None
        assert upcast_dtype(x.to("meta"), w.to("meta")) is None  # not a CPU (as a GPU)
    with torch.autocast("cpu", dtype=torch.float16):
        assert upcast_dtype(x, w) is None
    assert upcast_dtype(x.to(bf16), w.to(bf16)) == (bf16 if slow else None)  # bf16 weights
    assert upcast_dtype(x.to(bf16), w) is None  # mixed dtypes: F.linear's error


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "bf16-weights"])
def test_linear_is_f_linear_within_one_bf16_rounding(
    slow: bool, autocast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output and the gradients of x, the weight and the bias against float64's, each within one
    bf16 rounding, the weight upcast in row blocks (of 10 rows here, the last of 8); no bf16
    matmul runs on the slow branch."""
    monkeypatch.setattr(bf16_cpu, "BLOCK", 10 * 64)
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    x0, w0, b0 = torch.randn(3, 40, 64), torch.randn(48, 64) / 8, torch.randn(48)
    g = torch.randn(3, 40, 48)
    x, w, b = (t.to(dtype).clone().requires_grad_() for t in (x0, w0, b0))
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    F.linear(*ref).backward(g.double())
    out = {}

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out["y"] = linear(x, w, b)
        out["y"].backward(g.to(out["y"].dtype))

    assert matmul_dtypes(step) == ({torch.float32} if slow else {torch.bfloat16})
    assert out["y"].dtype == torch.bfloat16
    assert_same_function(out["y"], F.linear(*ref), rel=BF16_REL)
    for got, want in zip((x, w, b), ref, strict=True):
        assert got.grad.dtype == dtype
        assert_same_function(got.grad, want.grad, rel=2 * BF16_REL)


def test_the_upcast_blocks_reuse_one_buffer_and_give_the_fresh_upcasts_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 60: each row block of a bf16 weight is upcast into one reused per-thread buffer
    (a fresh 8 MiB block each product left a bf16 LoRA run's peak to glibc's heap: 3.4-4.0 GB at
    1.1B). The products and the input gradient are bitwise those of a fresh `.float()` of each
    block, whatever the blocks before left in the buffer."""
    monkeypatch.setattr(bf16_cpu, "BLOCK", 10 * 64)
    torch.manual_seed(0)
    x, g = torch.randn(7, 64), torch.randn(7, 48)
    w, bias = (torch.randn(48, 64) / 8).bfloat16(), torch.randn(48).bfloat16()
    want_y = torch.cat(
        [F.linear(x, b.float(), c.float()) for b, c in zip(w.split(10), bias.split(10))], -1
    )
    want_gx = torch.zeros(7, 64)
    for r in range(0, 48, 10):
        want_gx.addmm_(g[:, r : r + 10], w[r : r + 10].float())
    ptrs = set()
    upcast = bf16_cpu._upcast

    def seen(block: torch.Tensor) -> torch.Tensor:
        out = upcast(block)
        ptrs.add(out.data_ptr())
        return out

    monkeypatch.setattr(bf16_cpu, "_upcast", seen)
    for _ in range(2):
        with torch.no_grad():  # as inside _Fp32Linear (with a gradient: fresh upcasts)
            y = bf16_cpu.fp32_product(x, w, bias, torch.float32)
            gx = bf16_cpu.fp32_input_grad(g, w, torch.float32)
        assert torch.equal(y, want_y) and torch.equal(gx, want_gx)
    assert len(ptrs) == 1  # 10 blocks' upcasts, one buffer
    w32 = w.float()
    assert upcast(w32) is w32  # an fp32 block is multiplied as it is, no copy


def test_a_double_backward_through_the_upcast_blocks_is_f_linears(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With create_graph the input gradient's products keep their own upcast of each block (the
    reused buffer would be overwritten under the graph): the weight's gradient of a gradient is
    float64's within bf16 rounding."""
    monkeypatch.setattr(bf16_cpu, "BLOCK", 10 * 64)
    monkeypatch.setattr(bf16_cpu, "bf16_slow", lambda: True)
    torch.manual_seed(0)
    x0, w0 = torch.randn(5, 64), torch.randn(48, 64) / 8
    grads = []
    for dtype, fn in ((torch.bfloat16, linear), (torch.float64, F.linear)):
        x, w = x0.to(dtype).requires_grad_(), w0.to(dtype).requires_grad_()
        (gx,) = torch.autograd.grad(fn(x, w).square().sum(), x, create_graph=True)
        gx.square().sum().backward()
        grads.append(w.grad)
    assert_same_function(grads[0], grads[1], rel=8 * BF16_REL)


def test_without_bf16_it_is_f_linear_exactly(slow: bool) -> None:
    x, w = torch.randn(5, 64), torch.randn(32, 64)
    assert torch.equal(linear(x, w), F.linear(x, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if not slow:  # a CPU with a fast bf16 gemm: torch's own bf16 product
            assert torch.equal(linear(x, w), F.linear(x, w))


def lora_model(nf4: bool = False, **model: Any) -> Transformer:
    """A tiny model as a bf16 LoRA run's trainer builds it: the base in bf16 (`nf4`: its linear
    layers in NF4, QLoRA's), the CPU kernels, adapters on every projection (attention's alone in
    an MoE; B not zero, so they change the function)."""
    torch.manual_seed(0)
    net = use_cpu_kernels(Transformer(tiny_model_config(vocab_size=97, **model)))
    targets = ["wqkv", "wo"] if model.get("n_experts") else ["wqkv", "wo", "w_gate_up", "w_down"]
    add_lora(net.to(torch.bfloat16), LoRAConfig(rank=4, alpha=8.0, targets=targets))
    if nf4:
        pytest.importorskip("bitsandbytes")
        from minillm.model.nf4 import quantize_nf4

        quantize_nf4(net)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)
    return net.train()


def lora_step(net: Transformer, autocast: bool = True) -> tuple[torch.Tensor, dict]:
    """The loss and the trainable parameters' gradients of one step (bf16 autocast)."""
    idx = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, loss = net(idx[:, :-1], idx[:, 1:])
    loss.backward()
    grads = {n: p.grad for n, p in net.named_parameters() if p.requires_grad}
    net.zero_grad(set_to_none=True)
    return loss.detach(), grads


def worst_error(grads: dict, exact: dict) -> float:
    """The largest gradient error, relative to its tensor's largest exact value."""
    return max(
        ((g.double() - exact[n]).abs().max() / exact[n].abs().max()).item()
        for n, g in grads.items()
    )


@pytest.mark.parametrize(
    "model",
    [
        {},
        dict(tie_embeddings=False, attention_bias=True),
        dict(n_experts=4, n_experts_per_token=2),
        dict(nf4=True, attention_bias=True),
    ],
    ids=["dense-tied", "untied-bias", "moe", "qlora"],
)
def test_a_bf16_lora_step_is_torchs_within_bf16_rounding(
    monkeypatch: pytest.MonkeyPatch, model: dict
) -> None:
    """The slow-CPU branch runs every product of the step in fp32 (the frozen base, an NF4 base,
    the head, the adapters, the experts, attention) and computes torch's bf16 step: its loss
    within a bf16 rounding of the exact one (the same step in float64, from the same bf16
    weights), its adapters' gradients no farther from the exact ones than torch's bf16 step's
    (1-4% of their largest value at this size: the bf16 activations between layers), within 2x."""
    results, dtypes = {}, {}
    for slow in (False, True):
        monkeypatch.setattr(bf16_cpu, "bf16_slow", lambda slow=slow: slow)
        net = lora_model(**model)
        dtypes[slow] = matmul_dtypes(lambda n=net, s=slow: results.update({s: lora_step(n)}))
    assert dtypes[True] == {torch.float32}
    assert torch.bfloat16 in dtypes[False]
    exact_loss, exact = lora_step(lora_model(**model).double(), autocast=False)
    grads, (loss_fp32, grads_fp32) = results[False][1], results[True]
    assert grads.keys() == grads_fp32.keys() == exact.keys() and grads
    assert all(g.dtype == torch.float32 for g in [*grads.values(), *grads_fp32.values()])
    assert_same_function(loss_fp32, exact_loss, rel=BF16_REL)
    assert worst_error(grads_fp32, exact) <= 2 * worst_error(grads, exact)
