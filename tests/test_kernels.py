"""The eager CPU kernels must not change the math: against the plain formulas and HF's gradients,
RoPE as a rotation, the chunked cross entropy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from minillm.families import to_hf_state_dict
from minillm.model import Transformer, kernels_cpu, use_cpu_kernels
from minillm.model.rope import apply_rope, rope_tables
from minillm.model.transformer import RMSNorm
from tests.helpers import assert_same_function
from tests.test_model import make_pair


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _train_pass(model: Transformer, idx: torch.Tensor, targets: torch.Tensor, **kw):
    model.zero_grad(set_to_none=True)
    logits, loss = model(idx, targets, **kw)
    (loss * 1.7).backward()  # a non-unit upstream gradient exercises the scaling
    return logits.detach(), loss.detach(), _grads(model)


@pytest.mark.parametrize("case", ["mha-tied", "gqa-untied"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_eager_cpu_kernels_equal_the_plain_formulas(case: str, reduction: str) -> None:
    kw = {"mha-tied": dict(n_kv_head=4), "gqa-untied": dict(n_kv_head=2, tie_embeddings=False)}
    plain, _, cfg = make_pair(**kw[case])
    fused = use_cpu_kernels(copy.deepcopy(plain))
    assert isinstance(fused, Transformer) and type(fused) is not Transformer
    assert all(type(m) is not RMSNorm for m in fused.modules())  # every norm swapped
    plain.train(), fused.train()
    idx = torch.randint(0, cfg.vocab_size, (3, 40))
    targets = torch.randint(0, cfg.vocab_size, (3, 40))
    targets[0, :7] = -100
    fast = _train_pass(fused, idx, targets, reduction=reduction)
    ref = _train_pass(plain, idx, targets, reduction=reduction)  # what torch.compile traces
    assert_same_function(fast[0], ref[0])
    assert_same_function(fast[1], ref[1])
    for name in fast[2]:
        assert_same_function(fast[2][name], ref[2][name], msg=name)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    with torch.no_grad():  # eval: the plain forwards (and `rotate`), the same logits
        assert_same_function(fused(idx)[0], plain(idx)[0])


@pytest.mark.parametrize("kernels", [False, True])
def test_training_gradients_match_hf_llama(kernels: bool) -> None:
    ours, hf, cfg = make_pair(n_kv_head=2)
    if kernels:  # as the trainer trains it
        use_cpu_kernels(ours)
    ours.train(), hf.train()
    # HF's nn.Embedding(padding_idx=pad_token_id) gives the pad token's row no lookup gradient;
    # minillm has no padding row.
    hf.model.embed_tokens.padding_idx = None
    idx = torch.randint(0, cfg.vocab_size, (2, 48))
    targets = torch.randint(0, cfg.vocab_size, (2, 48))
    _, loss = ours(idx, targets)
    loss.backward()
    ref = hf(input_ids=idx, labels=targets, shift_labels=targets).loss
    ref.backward()
    assert_same_function(loss, ref)
    got = to_hf_state_dict(_grads(ours), cfg)
    for name, p in hf.named_parameters():
        assert_same_function(got[name], p.grad, msg=name)


@pytest.mark.slow
def test_rope_is_a_rotation_with_the_inverse_as_backward() -> None:
    cos, sin = rope_tables(16, 32, 10000.0)
    x = torch.randn(2, 32, 3, 16, dtype=torch.float64, requires_grad=True)
    c, s = cos.double()[:, None], sin.double()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    ref = x * c + torch.cat((-x2, x1), dim=-1) * s  # the "rotate half" formula of HF
    for rope in (apply_rope, kernels_cpu.fused_rope):  # the formula and the RoPE Function
        got = rope(x, c, s)
        torch.testing.assert_close(got, ref)
        assert got.is_contiguous()
        assert torch.autograd.gradcheck(lambda t, rope=rope: rope(t, c, s), (x,))
        # A rotation keeps the norm of each (i, i + D/2) pair.
        torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))


def test_cross_entropy_kernel_handles_chunks_and_all_ignored_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernels_cpu.CrossEntropyCPU, "CHUNK_BYTES", 3 * 4 * 50)  # 3 rows a chunk
    logits = torch.randn(10, 50, requires_grad=True)
    targets = torch.randint(0, 50, (10,))
    targets[[1, 6]] = -100
    for t in (targets, torch.full((10,), -100)):
        for sum_, reduction in ((False, "mean"), (True, "sum")):
            ref = F.cross_entropy(logits, t, reduction=reduction)
            (g_ref,) = torch.autograd.grad(ref, logits)
            got = kernels_cpu.CrossEntropyCPU.apply(logits, t, sum_)
            (g_got,) = torch.autograd.grad(got, logits)
            torch.testing.assert_close(got, ref, equal_nan=True)
            torch.testing.assert_close(g_got, g_ref)
