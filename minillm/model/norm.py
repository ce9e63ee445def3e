"""RMSNorm, the one normalisation of every block (attention, FFN, MLA's latents).

Offers `rms_norm` (the function, which the decoding fast path calls) and `RMSNorm` (the module).
Its own module so that both `minillm.model.transformer` and `minillm.model.mla` build on it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., C) with gain weight (C,), normalised in float32 whatever x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * y.to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in float32 like LLaMA."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
