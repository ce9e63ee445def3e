"""What Transformer.forward is given is checked up front (a wrong mask fails by name), and what
SDPA does with a fully masked row on this torch is what docs/architecture.md says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minillm.config import ModelConfig
from minillm.model import Transformer
from tests.helpers import assert_same_function

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layer=1, n_head=4, n_kv_head=2, max_seq_len=32)
    return Transformer(cfg).eval()


IDX = torch.randint(0, 50, (2, 19))
ONES = torch.ones(2, 19, dtype=torch.long)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attention_mask=torch.ones(2, 20)), r"attention_mask has shape \(2, 20\).*\(2, 19\)"),
        (
            dict(attention_mask=torch.ones(19, dtype=torch.bool)),
            r"attention_mask has shape \(19,\)",
        ),
        (dict(attention_mask=torch.ones(3, 19, dtype=torch.bool)), r"attention_mask .*\(3, 19\)"),
        (dict(attention_mask=ONES.float()), r"attention_mask must be bool or integer.*float32"),
        (dict(doc_ids=torch.zeros(2, 18, dtype=torch.long)), r"doc_ids has shape \(2, 18\)"),
        (
            dict(doc_ids=torch.zeros(2, 19)),
            r"doc_ids must have an integer dtype, got torch.float32",
        ),
        (dict(position_ids=torch.arange(20)[None]), r"position_ids has shape \(1, 20\)"),
        (dict(position_ids=torch.arange(19.0)[None]), r"position_ids must have an integer dtype"),
        (dict(position_ids=torch.arange(19)[None] + 20), r"position_ids must lie in \[0, 32\)"),
    ],
)
def test_wrong_shapes_and_dtypes_name_the_argument(model, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model(IDX, **kwargs)


def test_right_inputs_still_pass(model) -> None:
    with torch.no_grad():
        plain, _ = model(IDX)
        masked, _ = model(IDX, attention_mask=ONES.bool())
        shared, _ = model(IDX, position_ids=torch.arange(19)[None])
        docs, _ = model(IDX, doc_ids=torch.zeros(2, 19, dtype=torch.int32))
    for other in (masked, shared, docs):
        assert_same_function(other, plain)
    with pytest.raises(ValueError, match=r"idx must be token ids of shape \(B, T\)"):
        model(IDX[0])


def _fully_masked_row(backend) -> tuple[torch.Tensor, bool]:
    """SDPA output of three queries that see no key, and whether the gradients are finite."""
    from torch.nn.attention import sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    mask = torch.tril(torch.ones(8, 8, dtype=torch.bool)).expand(2, 1, 8, 8).clone()
    mask[0, :, :, :3] = False  # row 0: three left pads, whose queries see no key at all
    with sdpa_kernel([backend]):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y.sum().backward()
    return y[0, :, :3].detach(), all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_sdpa_on_a_fully_masked_row_matches_the_docs() -> None:
    from torch.nn.attention import SDPBackend

    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    pitfall = " ".join(text[text.index("**The all-masked-row pitfall.**") :][:2000].split())
    assert "Up to torch 2.4 the math backend returns NaN" in pitfall
    assert "From torch 2.5 on, SDPA returns zeros" in pitfall
    y, finite_grad = _fully_masked_row(SDPBackend.MATH)
    if version >= (2, 5):
        assert torch.count_nonzero(y) == 0 and finite_grad
        flash, flash_finite = _fully_masked_row(SDPBackend.FLASH_ATTENTION)  # the CPU kernel
        assert torch.count_nonzero(flash) == 0 and flash_finite
    else:
        assert torch.isnan(y).all()
