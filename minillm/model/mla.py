"""Multi-head latent attention (`model.attention: mla`), DeepSeek-V2/V3's, with a latent KV cache.

Offers `MLA`, the same function as transformers' `DeepseekV3Attention` given the same weights
(`minillm.families.deepseek_v3` maps the names). Each token's keys and values come from one
compressed latent c = RMSNorm(x W_dkv) (R numbers) through one up-projection W_ukv, plus one
RoPE key k_pe (P numbers) that every head shares; the queries go through their own bottleneck
(q_lora_rank, RMSNorm between) or one plain projection. Each head's query and key are the
concatenation [nope (N), rope (P)]; the logits are scaled by (N + P)^-0.5, times yarn's
mscale(factor, mscale_all_dim)^2 (`ModelConfig.mla_softmax_scale`).

Without a cache the keys and values are decompressed per head, as transformers does (training,
evaluation). With one (`minillm.model.kv_cache`, which then holds R + P numbers per token and
layer, not per-head keys and values) the up-projection is absorbed: head h's logit
q_nope_h . (W_uk_h c) + q_pe_h . k_pe equals (W_uk_h^T q_nope_h) . c + q_pe_h . k_pe, so the
query moves into the latent space, attends over the cached [c, k_pe] as keys and over c as
values, and W_uv_h maps the attended latent to the head's value width before the output
projection (docs/architecture.md derives it).

RoPE is held in the "rotate half" layout of the rest of minillm: DeepSeek's interleaved pairs
(transformers' rope_interleave) are a fixed permutation of the rotated rows of the q and kv
down-projections, which `minillm.families.deepseek_v3` applies on import and undoes on export.

Shape legend: B batch, T new tokens, S keys (cached + new), H heads, N qk_nope_head_dim,
P qk_rope_head_dim, V v_head_dim, R kv_lora_rank, Q q_lora_rank, C model dim.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.config import ModelConfig
from minillm.model.attention import SelfAttention
from minillm.model.inputs import AttentionMask
from minillm.model.kv_cache import CacheWrite
from minillm.model.norm import RMSNorm
from minillm.model.rope import Rope


class MLA(SelfAttention):
    """Causal multi-head latent attention through SDPA (the module docstring derives it)."""

    # train.lora.targets: the layers each target names in this module (minillm.model.lora):
    # wqkv, the attention's input projections, and wo its output projection.
    lora_layers = {"wqkv": ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"), "wo": ("wo",)}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, N, P = cfg.n_head, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        V, R, C = cfg.v_head_dim, cfg.kv_lora_rank, cfg.d_model
        self.dims = (H, N, P, V, R)
        # The query: one projection, or (q_lora_rank) down, RMSNorm, up.
        self.wq = nn.Linear(C, H * (N + P), bias=False) if cfg.q_lora_rank is None else None
        Q = cfg.q_lora_rank or 0
        self.wq_a = nn.Linear(C, Q, bias=False) if Q else None
        # The latent norms at model.norm_eps, as llama.cpp, vLLM and SGLang apply rms_norm_eps
        # to them (transformers builds them at its default 1e-6: every published DeepSeek's).
        self.q_norm = RMSNorm(Q, cfg.norm_eps) if Q else None
        self.wq_b = nn.Linear(Q, H * (N + P), bias=False) if Q else None
        self.wkv_a = nn.Linear(C, R + P, bias=False)  # [latent, shared RoPE key]
        self.kv_norm = RMSNorm(R, cfg.norm_eps)
        self.wkv_b = nn.Linear(R, H * (N + V), bias=False)  # per head [W_uk; W_uv]
        self.wo = nn.Linear(H * V, C, bias=False)
        self.scale = cfg.mla_softmax_scale
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def attend(
        self, x: torch.Tensor, rope: Rope, mask: AttentionMask, cache: CacheWrite | None, layer: int
    ) -> torch.Tensor:
        """Latent attention, decompressed or (with a cache) absorbed: (B, H, T, V)."""
        B, T, _ = x.shape
        H, N, P, V, R = self.dims
        if self.wq is not None:
            q = self.wq(x)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_pe = q.view(B, T, H, N + P).split((N, P), dim=-1)
        c, k_pe = self.wkv_a(x).split((R, P), dim=-1)  # (B, T, R), (B, T, P)
        c = self.kv_norm(c)
        pe = rope(torch.cat((q_pe, k_pe[:, :, None]), dim=2))  # (B, T, H + 1, P): one pass
        q_pe, k_pe = pe.split((H, 1), dim=2)
        if cache is None:
            return self._decompressed(q_nope, q_pe, c, k_pe, mask)
        return self._absorbed(q_nope, q_pe, c, k_pe, mask, cache, layer)

    def _decompressed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        mask: AttentionMask,
    ) -> torch.Tensor:
        """Per-head keys and values from the latent, as transformers: (B, H, T, V)."""
        B, T, H, _ = q_nope.shape
        _, N, P, V, _ = self.dims
        k_nope, v = self.wkv_b(c).view(B, T, H, N + V).split((N, V), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)  # (B, H, T, N + P)
        k = torch.cat((k_nope, k_pe.expand(B, T, H, P)), dim=-1).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), mask.bool_mask, dropout, mask.is_causal, scale=self.scale
        )

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        mask: AttentionMask,
        cache: CacheWrite,
        layer: int,
    ) -> torch.Tensor:
        """Attention over the cached latents with W_uk in the query and W_uv after: (B, H, T, V)."""
        H, N, _, V, R = self.dims
        B, T = c.shape[:2]
        latent = torch.cat((c, k_pe[:, :, 0]), dim=-1)[:, None]  # (B, 1, T, R + P)
        # The cache's "keys" are [c, k_pe] (R + P wide), its "values" nothing (0 wide): c is read
        # from the keys, so each token is stored once.
        keys, _ = cache.update(layer, latent, latent[..., :0])  # (B, 1, S, R + P)
        w_uk, w_uv = self.wkv_b.weight.view(H, N + V, R).split((N, V), dim=1)  # (H, N|V, R)
        # Per head, batched over the heads (bmm: a broadcast matmul is ~10x slower on a CPU).
        q_latent = torch.bmm(q_nope.reshape(B * T, H, N).transpose(0, 1), w_uk)  # (H, BT, R)
        q = torch.cat((q_latent.transpose(0, 1).view(B, T, H, R), q_pe), dim=-1)  # (B, T, H, R+P)
        if T == 1 and not mask.is_causal:
            # A decode step: the H queries of one token are H rows against the one latent
            # "head", so the cached latents are read once, not once per head. By hand: SDPA
            # with the latent as a strided view of the keys takes a path 50x slower on a CPU.
            scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale  # (B, 1, H, S)
            if mask.bool_mask is not None:
                scores = scores.masked_fill(~mask.bool_mask, float("-inf"))
            probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(probs, keys[..., :R])  # (B, 1, H, R) = (B, T, H, R)
        else:
            S = keys.shape[2]
            k = keys.expand(B, H, S, keys.shape[3])  # one latent for every head: a view
            v = keys[..., :R].contiguous().expand(B, H, S, R)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, mask.bool_mask, 0.0, mask.is_causal, scale=self.scale
            ).transpose(1, 2)  # (B, T, H, R)
        y = torch.bmm(o.reshape(B * T, H, R).transpose(0, 1), w_uv.transpose(1, 2))  # (H, BT, V)
        return y.transpose(0, 1).view(B, T, H, V).transpose(1, 2)  # (B, H, T, V)
