"""The LLaMA-style decoder-only Transformer.

Offers `RMSNorm`, `rms_norm`, `rope_tables`, `apply_rope`, `rope_rotation`, `attention`,
`cross_entropy`, `Attention`, `SwiGLU`, `Block`, `AttentionMask` and `Transformer`. The model is
the same function as Hugging Face's `LlamaForCausalLM` given the same weights (RoPE in its
"rotate half" layout; `minillm.model.hf_names` maps the parameter names). In eager mode on CPU
the hand-written autograd Functions of `minillm.model.kernels_cpu` compute the same math in fewer
memory passes; under torch.compile the plain formulas are traced instead. The KV cache is
`minillm.model.kv_cache`, the decoding fast path `minillm.model.decode`.

Shape legend: B batch, T new tokens, S keys (cached + new), H query heads, K key/value heads,
D head dim, C model dim (H*D), F SwiGLU hidden dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import minillm.model.kernels_cpu as kernels
from minillm.config import ModelConfig
from minillm.model.inputs import check_inputs
from minillm.model.kv_cache import KVCache

# `enable_gqa` arrived in torch 2.5; on 2.4 key/value heads are repeated by hand.
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in float32 like LLaMA."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32 and kernels.eager_cpu(x):
            return kernels.RMSNormCPU.apply(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., C) with gain weight (C,), normalised in float32 whatever x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * y.to(x.dtype)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE angles, (max_len, D), in the "rotate half" layout (frequencies twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.int64).float(), inv_freq)  # (S, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (S, D)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x (B, T, H, D) by cos/sin, (T, 1, D) or (B, T, 1, D).

    x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. The two halves of the tables are equal, so only
    the first is read. Returns a new contiguous tensor.
    """
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    if kernels.compiling():  # the plain formula: inductor fuses it and its backward
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if not torch.is_grad_enabled():  # a prefill or eval: no autograd node to build
        return kernels.rotate(x, cos, sin)
    return kernels.RoPE.apply(x, cos, sin)


def rotate_half_matrix(head_dim: int) -> torch.Tensor:
    """The (D, D) matrix P with x @ P = [-x2, x1], HF's rotate_half(x), for x = [x1, x2]."""
    half = head_dim // 2
    i = torch.arange(half)
    p = torch.zeros(head_dim, head_dim)
    p[i + half, i] = -1.0
    p[i, i + half] = 1.0
    return p


def rope_rotation(cos: torch.Tensor, sin: torch.Tensor, rotate_half: torch.Tensor) -> torch.Tensor:
    """The matrices R (..., D, D) with x @ R == apply_rope(x, cos, sin) at one position per row.

    apply_rope(x) = x cos + rotate_half(x) sin = x @ (diag(cos) + P diag(sin)), P the
    `rotate_half_matrix`; cos, sin (..., D) are table rows. Decoding rotates all q and k heads of
    a token with this one small matmul instead of apply_rope's elementwise ops.
    """
    return torch.diag_embed(cos).addcmul_(rotate_half, sin[..., None, :])


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """SDPA of q (B, H, T, D) over k, v (B, K, S, D), K dividing H (grouped-query heads)."""
    extra = {}
    if k.shape[1] != q.shape[1]:
        if _SDPA_HAS_GQA:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **extra
    )


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """F.cross_entropy(logits.float(), targets, ignore_index=-100) of logits (N, V), in the form
    that is fastest where it runs (see minillm.model.kernels_cpu)."""
    if reduction in ("mean", "sum"):
        if kernels.eager_cpu(logits) and logits.dtype == torch.float32:
            return kernels.CrossEntropyCPU.apply(logits, targets, reduction == "sum")
    # .float(): the softmax of bf16 logits in fp32 (a no-op on fp32 logits)
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction=reduction)


class Attention(nn.Module):
    """Causal multi-head self-attention with grouped-query heads, through SDPA."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # q, k and v in one matmul: one large GEMM is faster than three small ones.
        self.wqkv = nn.Linear(
            cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=False
        )
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        kv_cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        B, T, C = x.shape
        H, K, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * K, D)
        # split, not slicing: the backward of a split is one cat, that of a slice a zero-filled copy
        qk, v = qkv.split((H + K, K), dim=2)
        q, k = apply_rope(qk, cos, sin).split((H, K), dim=2)  # q and k rotated in one pass
        # SDPA takes these strided views as they are; its output is laid out (B, T, H, D) in
        # memory, so the transpose back below is free.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|K, T, D)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)  # (B, K, S, D)
        dropout = self.dropout if self.training else 0.0
        y = attention(q, k, v, mask.bool_mask, mask.is_causal, dropout)  # (B, H, T, D)
        if mask.empty_rows is not None:
            # A query that may see no key at all (a left pad) outputs zeros, not an average.
            y = y.masked_fill(mask.empty_rows, 0.0)
        y = y.transpose(1, 2).reshape(B, T, H * D)
        return self.resid_drop(self.wo(y))


class SwiGLU(nn.Module):
    """w_down(silu(x W_gate) * x W_up), with gate and up projections in one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hidden = cfg.ffn_hidden
        self.w_gate_up = nn.Linear(cfg.d_model, 2 * self.hidden, bias=False)
        self.w_down = nn.Linear(self.hidden, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up(x)  # (B, T, 2F)
        if kernels.eager_cpu(gate_up) and gate_up.dtype == torch.float32:
            h = kernels.SwiGLUCPU.apply(gate_up)
        else:
            gate, up = gate_up.split(self.hidden, dim=-1)  # (B, T, F) each
            h = F.silu(gate) * up
        return self.drop(self.w_down(h))


class Block(nn.Module):
    """Pre-norm residual block: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        kv_cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, kv_cache, layer)
        return x + self.ffn(self.ffn_norm(x))


class AttentionMask:
    """What SDPA needs to know about which keys each query may see, built once per forward.

    bool_mask: (B, 1, T, S) True = may attend, or None when plain causality (or nothing) suffices.
    empty_rows: (B, 1, T, 1) True where a query may see no key; those outputs are set to zero.
    """

    def __init__(
        self,
        bool_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        empty_rows: torch.Tensor | None = None,
    ) -> None:
        self.bool_mask, self.is_causal, self.empty_rows = bool_mask, is_causal, empty_rows

    @classmethod
    def build(
        cls,
        T: int,
        start: int,
        key_valid: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
        device: torch.device,
    ) -> AttentionMask:
        """Causal mask for queries at start..start+T-1, with optional padding and documents."""
        if key_valid is None and doc_ids is None and (start == 0 or T == 1):
            # Plain causality, or one new token that may see every cached key.
            return cls(None, is_causal=start == 0 and T > 1)
        q_pos = torch.arange(start, start + T, device=device)
        k_pos = torch.arange(start + T, device=device)
        allowed = (k_pos[None, :] <= q_pos[:, None])[None]  # (1, T, S)
        if key_valid is not None:
            allowed = allowed & key_valid[:, None, :]  # (B, T, S)
        if doc_ids is not None:
            allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
        empty = ~allowed.any(dim=-1, keepdim=True)  # (B, T, 1)
        if not bool(empty.any()):
            return cls(allowed[:, None])
        # An all-False row would make SDPA return NaN (and NaN gradients): let it attend anywhere,
        # then zero its output.
        return cls((allowed | empty)[:, None], empty_rows=empty[:, None])


class Transformer(nn.Module):
    """Token embedding, n_layer pre-norm blocks, final RMSNorm, output head (tied or not)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        # train.activation_checkpointing: keep each block's input only, recompute the rest.
        self.activation_checkpointing = False
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # A tied head reuses tok_emb.weight and owns no parameter, so state_dict has no duplicate.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, D)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("rope_rotate_half", rotate_half_matrix(cfg.head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """normal(0, 0.02); projections into the residual stream scaled by 1/sqrt(2 n_layer)."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("attn.wo.weight", "ffn.w_down.weight")):
                nn.init.normal_(p, mean=0.0, std=resid_std)
            else:
                nn.init.normal_(p, mean=0.0, std=0.02)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        last_only: bool = False,
        reduction: str = "mean",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) for idx (B, T); with targets also the cross-entropy (targets != -100).

        attention_mask (B, T): 1 for real tokens, 0 for padding (left-padded batches).
        doc_ids (B, T): packed documents; attention stays inside a document and positions restart.
        position_ids (B, T) or (1, T): RoPE positions. Wrong shapes or dtypes: a ValueError.
        kv_cache: continue from cached keys/values and append this call's.
        last_only: compute logits for the last position only (decoding).
        reduction: "mean" or "sum" of the per-token losses.
        """
        check_inputs(idx, attention_mask, doc_ids, position_ids, self.cfg.max_seq_len)
        B, T = idx.shape
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds max_seq_len")
        if kv_cache is not None:
            kv_cache.check_room(T)
        if doc_ids is not None and kv_cache is not None:
            raise ValueError("doc_ids (packed sequences) cannot be combined with a KV cache")

        if attention_mask is not None:
            attention_mask = attention_mask.to(torch.bool)
            if kv_cache is None and bool(attention_mask.all()):
                attention_mask = None  # no padding: plain causal attention is the same and faster
        if position_ids is None:
            position_ids = self._positions(B, T, attention_mask, doc_ids, kv_cache)
        if kv_cache is not None:
            key_valid = kv_cache.mark_keys(attention_mask, T)
        else:
            key_valid = attention_mask
        if position_ids is None:
            cos = self.rope_cos[start : start + T, None]  # (T, 1, D)
            sin = self.rope_sin[start : start + T, None]
        else:
            cos = self.rope_cos[position_ids][:, :, None]  # (B, T, 1, D)
            sin = self.rope_sin[position_ids][:, :, None]
        mask = AttentionMask.build(T, start, key_valid, doc_ids, idx.device)

        x = self.drop(self.tok_emb(idx))  # (B, T, C)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if recompute and kv_cache is None:  # non-reentrant: replays dropout's RNG exactly
                x = checkpoint(block, x, cos, sin, mask, None, i, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, kv_cache, i)
        if kv_cache is not None:
            kv_cache.advance(T, attention_mask)
        x = self.norm(x)
        if last_only:
            x = x[:, -1:]
        logits = F.linear(x, self.head_weight)  # (B, T, V)
        if targets is None:
            return logits, None
        loss = cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), reduction)
        return logits, loss

    @staticmethod
    def _positions(
        B: int,
        T: int,
        attention_mask: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor | None:
        """RoPE positions (B, T) where they are not simply start..start+T-1, else None."""
        if doc_ids is not None:  # restart at 0 at each document boundary
            t = torch.arange(T, device=doc_ids.device).expand(B, T)
            boundary = torch.ones_like(doc_ids, dtype=torch.bool)
            boundary[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
            first = torch.where(boundary, t, torch.zeros_like(t)).cummax(dim=1).values
            return t - first
        if attention_mask is None and (kv_cache is None or not kv_cache.has_padding):
            return None
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.bool, device=kv_cache.n_seen.device)
        # Real tokens count from 0 in each row, whatever padding precedes them (as HF does).
        seen = kv_cache.n_seen[:, None] if kv_cache is not None else 0
        return (seen + attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)

    # ------------------------------------------------------------------ sizes

    def param_count(self, non_embedding: bool = False) -> int:
        """Distinct parameters (a tied head counts once); optionally without embedding matrices."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if self.lm_head is not None:
                n -= self.lm_head.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per matmul weight (head included, tied or not) + attention.

        The embedding lookup is no matmul; the head always is. The attention term is the PaLM one,
        12 * n_layer * d_model * seq_len (scores and weighted values, forward and backward).
        """
        cfg = self.cfg
        matmul = sum(
            p.numel() for n, p in self.named_parameters() if p.dim() == 2 and n != "tok_emb.weight"
        )
        if self.lm_head is None:
            matmul += self.tok_emb.weight.numel()
        return 6 * matmul + 12 * cfg.n_layer * cfg.d_model * seq_len
