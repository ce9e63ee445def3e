"""The LLaMA-style decoder-only Transformer.

Offers `RMSNorm`, `rope_tables`, `apply_rope`, `cross_entropy`, `Attention`, `SwiGLU`, `Block`,
`Transformer` and `KVCache`. The model is the same function as Hugging Face's `LlamaForCausalLM`
given the same weights (RoPE in its "rotate half" layout; `export.py` maps the parameter names).
In eager mode on CPU a few hand-written autograd Functions (at the end of the file) compute the
same math in fewer memory passes; under torch.compile the plain formulas are traced instead.

Shape legend: B batch, T new tokens, S keys (cached + new), H query heads, K key/value heads,
D head dim, C model dim (H*D), F SwiGLU hidden dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.config import ModelConfig

# `enable_gqa` arrived in torch 2.5; on 2.4 key/value heads are repeated by hand.
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _compiling() -> bool:
    """True while torch.compile traces: the plain formulas are what inductor fuses best."""
    return torch.compiler.is_compiling()


def _eager_cpu(x: torch.Tensor) -> bool:
    """Whether to use the hand-written CPU kernels below (see "Eager CPU kernels"): they pay off
    in training; without autograd (eval, decoding) the native ops are as fast and cost less."""
    return x.device.type == "cpu" and torch.is_grad_enabled() and not _compiling()


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in float32 like LLaMA."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32 and _eager_cpu(x):
            return _RMSNormCPU.apply(x, self.weight, self.eps)
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
    if _compiling():  # the plain formula: inductor fuses it and its backward
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if not torch.is_grad_enabled():  # a prefill or eval: no autograd node to build
        return _rotate(x, cos, sin)
    return _RoPE.apply(x, cos, sin)


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
    that is fastest where it runs (see "Eager CPU kernels" at the end of this file)."""
    if reduction in ("mean", "sum"):
        if _eager_cpu(logits) and logits.dtype == torch.float32:
            return _CrossEntropyCPU.apply(logits, targets, reduction == "sum")
    # .float(): the softmax of bf16 logits in fp32 (a no-op on fp32 logits)
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction=reduction)


class KVCache:
    """Keys and values of past tokens for incremental decoding, preallocated to `max_len`.

    Kept outside the modules so that the block math is the same with and without a cache. It also
    remembers which keys are padding (left-padded batches) and how many real tokens each row has
    seen, which gives the RoPE position of the next token.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if max_len > cfg.max_seq_len:
            raise ValueError(f"KV cache of {max_len} exceeds max_seq_len={cfg.max_seq_len}")
        shape = (cfg.n_layer, batch_size, cfg.kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.key_valid = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self.n_seen = torch.zeros(
            batch_size, dtype=torch.long, device=device
        )  # real tokens per row
        self.max_len = max_len
        self.pos = 0  # slots filled
        self.has_padding = False

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, K, T, D) after the filled slots; return all keys/values (B, K, S, D)."""
        end = self.pos + k.shape[2]
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def reset(self) -> None:
        self.pos = 0
        self.has_padding = False
        self.key_valid.fill_(True)
        self.n_seen.zero_()


class Attention(nn.Module):
    """Causal multi-head self-attention with grouped-query heads, through SDPA."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        # q, k and v in one matmul: one large GEMM is faster than three small ones.
        self.wqkv = nn.Linear(
            cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=False
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
        self.hidden = cfg.hidden_dim
        self.w_gate_up = nn.Linear(cfg.d_model, 2 * self.hidden, bias=False)
        self.w_down = nn.Linear(self.hidden, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up(x)  # (B, T, 2F)
        if _eager_cpu(gate_up) and gate_up.dtype == torch.float32:
            h = _SwiGLUCPU.apply(gate_up)
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
        kv_cache: continue from cached keys/values and append this call's.
        last_only: compute logits for the last position only (decoding).
        reduction: "mean" or "sum" of the per-token losses.
        """
        B, T = idx.shape
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds max_seq_len")
        if kv_cache is not None and start + T > kv_cache.max_len:
            raise ValueError(f"{start + T} tokens do not fit a KV cache of {kv_cache.max_len}")
        if doc_ids is not None and kv_cache is not None:
            raise ValueError("doc_ids (packed sequences) cannot be combined with a KV cache")

        key_valid = None
        if attention_mask is not None:
            attention_mask = attention_mask.to(torch.bool)
            if kv_cache is None and bool(attention_mask.all()):
                attention_mask = None  # no padding: plain causal attention is the same and faster
        if kv_cache is not None:
            new_valid = attention_mask if attention_mask is not None else True
            kv_cache.key_valid[:, start : start + T] = new_valid
            kv_cache.has_padding |= attention_mask is not None and not bool(attention_mask.all())
            if kv_cache.has_padding:
                key_valid = kv_cache.key_valid[:, : start + T]
        elif attention_mask is not None:
            key_valid = attention_mask

        if position_ids is None:
            position_ids = self._positions(B, T, attention_mask, doc_ids, kv_cache)
        if kv_cache is not None:
            kv_cache.n_seen += T if attention_mask is None else attention_mask.long().sum(dim=1)
        if position_ids is None:
            cos = self.rope_cos[start : start + T, None]  # (T, 1, D)
            sin = self.rope_sin[start : start + T, None]
        else:
            cos = self.rope_cos[position_ids][:, :, None]  # (B, T, 1, D)
            sin = self.rope_sin[position_ids][:, :, None]
        mask = AttentionMask.build(T, start, key_valid, doc_ids, idx.device)

        x = self.drop(self.tok_emb(idx))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask, kv_cache, i)
        if kv_cache is not None:
            kv_cache.pos += T
        x = self.norm(x)
        if last_only:
            x = x[:, -1:]
        logits = F.linear(x, self.head_weight)  # (B, T, V)
        if targets is None:
            return logits, None
        loss = cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), reduction)
        return logits, loss

    def decoder(self, kv_cache: KVCache) -> Decoder:
        """A `Decoder` that continues kv_cache one token per row at a time (inference only)."""
        return Decoder(self, kv_cache)

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


class Decoder:
    """Decodes one token per row at a time through a Transformer and its KV cache, for inference.

    `step(tokens)` is the same function as `model(tokens[:, None], kv_cache=kv_cache,
    last_only=True)[0][:, 0]` after a prefill (in eval mode and without autocast, as `generate`
    runs), in far fewer operations. On a CPU a decoded token costs its matrix-vector products
    plus 1-4 us for every small op, module call and module attribute lookup around them, and
    the module forward spent more on the latter than on the former. So
    the weights and cache slices are looked up once, here, each block runs as functional ops on
    them, the residual adds ride on the output projections (addmm), and RoPE rotates all q and k
    heads with one (D, D) matmul per layer (rope_rotation). Make a new Decoder for each
    generation: it holds the parameters and the cache it was made with.
    """

    def __init__(self, model: Transformer, kv_cache: KVCache) -> None:
        cfg = model.cfg
        if model.training and cfg.dropout > 0:
            raise ValueError("the Decoder applies no dropout: call model.eval() first")
        self.cache = kv_cache
        self.heads = (cfg.n_head, cfg.kv_heads, cfg.head_dim)
        self.eps = cfg.norm_eps
        self.layers = [
            (
                block.attn_norm.weight,
                block.attn.wqkv.weight,
                block.attn.wo.weight.t(),
                block.ffn_norm.weight,
                block.ffn.w_gate_up.weight,
                block.ffn.w_down.weight.t(),
                kv_cache.k[i],  # (B, K, max_len, D)
                kv_cache.v[i],
            )
            for i, block in enumerate(model.blocks)
        ]
        self.embedding, self.head = model.tok_emb.weight, model.head_weight
        self.norm = model.norm.weight
        self.rope = (model.rope_cos, model.rope_sin, model.rope_rotate_half)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) of the next token after tokens (B,), which are appended to the cache."""
        if torch.is_grad_enabled():
            raise RuntimeError("Decoder.step is for inference: use torch.inference_mode()")
        cache, eps = self.cache, self.eps
        H, K, D = self.heads
        pos = cache.pos
        if pos >= cache.max_len:
            raise ValueError(f"KV cache of {cache.max_len} tokens is full")
        cos, sin, rotate_half = self.rope
        positions = cache.n_seen  # (B,) real tokens so far: the new token's RoPE position
        rot = rope_rotation(cos[positions], sin[positions], rotate_half)  # (B, D, D)
        cache.key_valid[:, pos] = True
        key_mask = None  # the new token sees every key, but left padding must stay hidden
        if cache.has_padding:
            key_mask = cache.key_valid[:, None, None, : pos + 1]  # (B, 1, 1, S)

        x = F.embedding(tokens, self.embedding)  # (B, C)
        B = x.shape[0]
        for norm1, w_qkv, wo_t, norm2, w_gate_up, w_down_t, keys, values in self.layers:
            qkv = F.linear(rms_norm(x, norm1, eps), w_qkv).view(B, H + 2 * K, D)
            qk = qkv[:, : H + K]
            if qk.dtype == rot.dtype:
                qk = torch.matmul(qk, rot)  # q and k heads rotated
            else:  # RoPE in the tables' precision, as apply_rope does
                qk = torch.matmul(qk.to(rot.dtype), rot).to(qkv.dtype)
            keys.select(2, pos).copy_(qk[:, H:])
            values.select(2, pos).copy_(qkv[:, H + K :])
            q = qk[:, :H, None]  # (B, H, 1, D)
            y = attention(q, keys[:, :, : pos + 1], values[:, :, : pos + 1], key_mask)
            x = torch.addmm(x, y.reshape(B, H * D), wo_t)  # x + wo(y)
            gate, up = F.linear(rms_norm(x, norm2, eps), w_gate_up).chunk(2, dim=-1)
            x = torch.addmm(x, F.silu(gate) * up, w_down_t)  # x + w_down(silu(gate) * up)
        cache.pos += 1
        cache.n_seen += 1
        return F.linear(rms_norm(x, self.norm, eps), self.head)


# ----------------------------------------------------------------------------- eager CPU kernels
# Eager PyTorch makes one pass over memory per elementwise op, and autograd's generic backward of
# small formulas makes several more. On CPU, where these passes cost as much as the matmuls around
# them, the Functions below compute the same math in fewer passes and with fewer temporaries.
# They serve eager mode only: under torch.compile the plain formulas are traced and fused by
# inductor, and on a GPU the native fused kernels (F.rms_norm, F.cross_entropy) are used.


class _RMSNormCPU(torch.autograd.Function):
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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[x1 cos - x2 sin, x2 cos + x1 sin] for half tables cos, sin, written half by half."""
    dtype = torch.result_type(x, cos)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    x1, x2 = x.chunk(2, dim=-1)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out.to(x.dtype)


class _RoPE(torch.autograd.Function):
    """RoPE as a rotation: its backward is the inverse rotation (sin negated), and saves no x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


class _SwiGLUCPU(torch.autograd.Function):
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


class _CrossEntropyCPU(torch.autograd.Function):
    """Cross-entropy of fp32 logits (N, V) with ignore_index -100, mean or sum.

    F.cross_entropy materialises log_softmax (N, V) and, in the backward, a zero-filled (N, V)
    gradient and a second (N, V) one. This keeps only the per-row logsumexp and builds the
    gradient softmax - onehot once, in cache-sized chunks of rows.
    """

    CHUNK_BYTES = 1 << 21  # 2 MiB of logits per chunk, about one core's L2

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, sum_: bool) -> torch.Tensor:
        N, V = logits.shape
        rows = max(1, _CrossEntropyCPU.CHUNK_BYTES // (4 * V))
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
        rows = max(1, _CrossEntropyCPU.CHUNK_BYTES // (4 * V))
        for i in range(0, N, rows):
            chunk = out[i : i + rows]
            torch.sub(logits[i : i + rows], lse[i : i + rows, None], out=chunk).exp_()
            idx = safe[i : i + rows, None]
            chunk.scatter_(1, idx, chunk.gather(1, idx) - 1.0)  # softmax - onehot
            chunk.mul_(row_scale[i : i + rows])
        return out, None, None
