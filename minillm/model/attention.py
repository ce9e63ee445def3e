"""Causal self-attention: the SDPA call with grouped-query heads, and the GQA `Attention`.

Offers `attention` (SDPA of grouped-query heads), `SelfAttention` (what every attention module
of a block shares: its call, the output projection and the padding rule) and `Attention` (the
grouped-query one, with the families' options); DeepSeek's latent attention is
`minillm.model.mla.MLA`, a `SelfAttention` too.

Shape legend: B batch, T new tokens, S keys (cached + new), H query heads, K key/value heads,
D head dim, C model dim.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.config import ModelConfig
from minillm.model.bf16_cpu import no_autocast, upcast_dtype
from minillm.model.inputs import AttentionMask
from minillm.model.kv_cache import CacheWrite
from minillm.model.norm import RMSNorm
from minillm.model.rope import Rope

# `enable_gqa` arrived in torch 2.5; on 2.4 key/value heads are repeated by hand.
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA of q (B, H, T, D) over k, v (B, K, S, D), K dividing H (grouped-query heads); the
    logits scaled by `scale` (None: 1/sqrt(D)). In training on a CPU whose bf16 gemm is slow
    (minillm.model.bf16_cpu) a bf16 SDPA runs in fp32: its bf16 backward took 3x fp32's at 128
    tokens and 5.5x at 512 there; the forward alone is as fast, so eval stays bf16."""
    upcast = upcast_dtype(q) if torch.is_grad_enabled() else None
    if upcast is not None:
        with no_autocast():
            y = attention(q.float(), k.float(), v.float(), attn_mask, is_causal, dropout_p, scale)
        return y.to(upcast)
    extra = {}
    if k.shape[1] != q.shape[1]:
        if _SDPA_HAS_GQA:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
    )


class SelfAttention(nn.Module):
    """An attention module of a block: `attend` gives each head's output (B, H, T, Dv); the
    heads are concatenated and projected back to C by `wo`, then the residual dropout.

    A subclass makes `wo`, `dropout` (SDPA's, which `dropout_off` zeroes) and `resid_drop`.
    """

    wo: nn.Linear
    dropout: float
    resid_drop: nn.Dropout

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: AttentionMask, cache: CacheWrite | None, layer: int
    ) -> torch.Tensor:
        y = self.attend(x, rope, mask, cache, layer)  # (B, H, T, Dv)
        if mask.empty_rows is not None:
            # A query that may see no key at all (a left pad) outputs zeros, not an average.
            y = y.masked_fill(mask.empty_rows, 0.0)
        B, H, T, Dv = y.shape
        return self.resid_drop(self.wo(y.transpose(1, 2).reshape(B, T, H * Dv)))

    def attend(
        self, x: torch.Tensor, rope: Rope, mask: AttentionMask, cache: CacheWrite | None, layer: int
    ) -> torch.Tensor:
        """Each head's attention output (B, H, T, Dv) for x (B, T, C); `cache` gets this call's
        keys and values at `layer`."""
        raise NotImplementedError


class Attention(SelfAttention):
    """Causal multi-head self-attention with grouped-query heads, through SDPA; optionally q/k/v
    biases, per-head RMSNorm of q and k (qk_norm) and a sliding window (in the mask)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # q, k and v in one matmul: one large GEMM is faster than three small ones.
        self.wqkv = nn.Linear(
            cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=cfg.attention_bias
        )
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        # model.qk_norm (Qwen3): each head's q and k normalised over D before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)
        # model.query_pre_attn_scalar (Gemma 3): logits / sqrt(it) instead of / sqrt(D)
        scalar = cfg.query_pre_attn_scalar
        self.scale = None if scalar is None else scalar**-0.5

    def attend(
        self, x: torch.Tensor, rope: Rope, mask: AttentionMask, cache: CacheWrite | None, layer: int
    ) -> torch.Tensor:
        """Grouped-query heads through SDPA: (B, H, T, D)."""
        B, T, C = x.shape
        H, K, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * K, D)
        # split, not slicing: the backward of a split is one cat, that of a slice a zero-filled copy
        qk, v = qkv.split((H + K, K), dim=2)
        if self.q_norm is not None:
            q, k = qk.split((H, K), dim=2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=2)
        q, k = rope(qk).split((H, K), dim=2)  # q and k rotated in one pass
        # SDPA takes these strided views as they are; its output is laid out (B, T, H, D) in
        # memory, so the transpose back below is free.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|K, T, D)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, K, S, D): the cached keys and these
        dropout = self.dropout if self.training else 0.0
        return attention(q, k, v, mask.bool_mask, mask.is_causal, dropout, self.scale)
