"""The LLaMA-style decoder-only Transformer, as docs/architecture.md derives it.

Offers `RMSNorm` and `rms_norm` (from `minillm.model.norm`), `attention` and `Attention` (from
`minillm.model.attention`), `cross_entropy`, `SwiGLU`, `Block`, `Transformer` and `dropout_off`;
RoPE (its tables, rotation and
scaled frequencies) is `minillm.model.rope`. The model is the same function as Hugging Face's
`LlamaForCausalLM` given the same weights (RoPE in its "rotate half" layout;
`minillm.families` maps the parameter names), and its options are the other families'
differences: `head_dim`, `attention_bias` (Qwen2), `qk_norm` (Qwen3), `sliding_window`
(Mistral) and `rope_scaling` (Llama 3.1 and the long-context methods); `attention: mla` is
DeepSeek's latent attention (`minillm.model.mla`); Gemma 3 adds `sandwich_norm`,
`ffn_activation` (GeGLU), `embed_scale`, `query_pre_attn_scalar` and local layers
(`sliding_window_pattern`, `rope_local_theta`). Gemma's RMSNorm gain (1 + w) is held as the one
number 1 + w (`minillm.families.gemma3` adds and removes the 1), so its norms are these.

Everything here is the plain PyTorch of the formulas. The fast paths sit on top and are chosen by
their callers: `minillm.model.kernels_cpu.use_cpu_kernels(model)` swaps in hand-written autograd
kernels for eager CPU training (the trainer asks for them), and `minillm.model.decode.Decoder`
runs these same modules' forwards one token at a time for sampling. The KV cache is
`minillm.model.kv_cache`, what forward derives from its arguments (positions, masks)
`minillm.model.inputs`.

Shape legend: B batch, T new tokens, S keys (cached + new), H query heads, K key/value heads,
D head dim, C model dim (H*D unless model.head_dim says otherwise), F SwiGLU hidden dim,
V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from minillm.config import ModelConfig

# defined there; attention re-exported for the decoder
from minillm.model.attention import Attention, SelfAttention, attention  # noqa: F401
from minillm.model.bf16_cpu import linear
from minillm.model.inputs import AttentionMask, forward_inputs
from minillm.model.kv_cache import CacheWrite, KVCache
from minillm.model.mla import MLA
from minillm.model.moe import MoE, swiglu  # defined there: the experts use it too

# defined there (MLA's latents use it too); rms_norm re-exported for the decoder
from minillm.model.norm import RMSNorm, rms_norm  # noqa: F401
from minillm.model.rope import (
    Rope,
    apply_rope,
    cos_sin,
    dynamic_rope,
    inv_frequencies,
    longrope_rows,
    plain_frequencies,
    rotate_half_matrix,
)

# ----------------------------------------------------------------------------- SwiGLU


class SwiGLU(nn.Module):
    """w_down(silu(x W_gate) * x W_up), with gate and up projections in one matmul."""

    activation = staticmethod(swiglu)  # kernels_cpu swaps in a fused one

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hidden = cfg.ffn_hidden
        self.w_gate_up = nn.Linear(cfg.d_model, 2 * self.hidden, bias=False)
        self.w_down = nn.Linear(self.hidden, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.w_down(self.activation(self.w_gate_up(x))))  # (B, T, 2F) -> (B, T, C)


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up = [gate, up] (..., 2F): Gemma's gelu_pytorch_tanh."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeGLU(SwiGLU):
    """w_down(gelu_tanh(x W_gate) * x W_up): model.ffn_activation gelu_tanh (Gemma)."""

    activation = staticmethod(geglu)


# ----------------------------------------------------------------------------- the model


class Block(nn.Module):
    """Pre-norm residual block: x + Attn(RMSNorm(x)), then x + FFN(RMSNorm(x)), the attention
    grouped-query heads or, with model.attention mla, latent attention (minillm.model.mla), the
    FFN a SwiGLU
    (a GeGLU with model.ffn_activation gelu_tanh) or, with model.n_experts, a mixture of SwiGLU
    experts (minillm.model.moe) unless block `layer` is one of model.moe_dense_layers. With
    model.sandwich_norm each branch's output is normalised too before it is added:
    x + RMSNorm(Attn(RMSNorm(x))) (Gemma)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = MLA(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.n_experts and layer not in cfg.moe_dense_layers:
            self.ffn = MoE(cfg)
        else:
            self.ffn = GeGLU(cfg) if cfg.ffn_activation == "gelu_tanh" else SwiGLU(cfg)
        sandwich = cfg.sandwich_norm
        self.attn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if sandwich else None
        self.ffn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if sandwich else None

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        mask: AttentionMask,
        cache: CacheWrite | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        if self.attn_post_norm is not None:  # model.sandwich_norm
            x = x + self.attn_post_norm(self.attn(self.attn_norm(x), rope, mask, cache, layer))
            return x + self.ffn_post_norm(self.ffn(self.ffn_norm(x)))
        x = x + self.attn(self.attn_norm(x), rope, mask, cache, layer)
        return x + self.ffn(self.ffn_norm(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mean or sum cross-entropy of logits (N, V) over targets (N,) that are not -100."""
    # .float(): the softmax of bf16 logits in fp32 (a no-op on fp32 logits)
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction=reduction)


class Transformer(nn.Module):
    """Token embedding, n_layer pre-norm blocks, final RMSNorm, output head (tied or not)."""

    loss_function = staticmethod(cross_entropy)  # kernels_cpu swaps in a fused one
    rotate = staticmethod(apply_rope)  # and a RoPE whose backward saves nothing

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        # train.activation_checkpointing: keep each block's input only, recompute the rest.
        self.activation_checkpointing = False
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # A tied head reuses tok_emb.weight and owns no parameter, so state_dict has no duplicate.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, False)
        # The tables of every position (dynamic NTK's up to its original length: past it, they
        # are recomputed per forward, `rope`).
        inv_freq, scale = inv_frequencies(cfg)
        cos, sin = cos_sin(inv_freq, torch.arange(cfg.max_seq_len), scale)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, D)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("rope_rotate_half", rotate_half_matrix(cfg.head_dim), persistent=False)
        if cfg.rope_scaling.type == "longrope":  # the tables of a sequence past the original
            original = cfg.rope_scaling.original_max_position_embeddings
            inv_freq, scale = inv_frequencies(cfg, original + 1)
            cos, sin = cos_sin(inv_freq, torch.arange(cfg.max_seq_len), scale)
            self.register_buffer("rope_long_cos", cos, persistent=False)
            self.register_buffer("rope_long_sin", sin, persistent=False)
        # model.rope_local_theta: the sliding layers' own plain RoPE tables (Gemma 3)
        self.local_layers = [cfg.local_layer(i) for i in range(cfg.n_layer)]
        # Some layers local and others global: each kind its own mask (once here, not per forward)
        self.local_window = cfg.sliding_window if cfg.mixed_layers else None
        if cfg.rope_local_theta is not None:
            local = plain_frequencies(cfg.head_dim, cfg.rope_local_theta)
            cos, sin = cos_sin(local, torch.arange(cfg.max_seq_len))
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)
        if cfg.embed_scale:  # sqrt(d_model) rounded to the embedding's dtype, as Gemma's
            scale = torch.tensor(cfg.d_model**0.5)
            self.register_buffer("embed_multiplier", scale, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """normal(0, 0.02); projections into the residual stream scaled by 1/sqrt(2 n_layer)."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        residual = set(map(id, self.residual_projections()))
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif id(p) in residual:
                nn.init.normal_(p, mean=0.0, std=resid_std)
            else:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def residual_projections(self) -> list[nn.Parameter]:
        """The weights that write into the residual stream: each block's attn.wo and ffn.w_down
        (an MoE's (E, C, F) stack of its experts' down projections, and its shared expert's)."""
        out = []
        for b in self.blocks:
            out.append(b.attn.wo.weight)
            if not isinstance(b.ffn, MoE):
                out.append(b.ffn.w_down.weight)
                continue
            out.append(b.ffn.w_down)
            if b.ffn.shared is not None:
                out.append(b.ffn.shared.w_down.weight)
        return out

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    def rope(
        self, positions: slice | torch.Tensor, write: CacheWrite | None = None, local: bool = False
    ) -> Rope:
        """RoPE at positions (a slice of the tables, or (B, T) indices) for every layer (with
        `local`, the sliding layers' of model.rope_local_theta); `write` places this forward in a
        KV cache (dynamic NTK rotates the cached keys too)."""
        if local:
            cos = self.rope_local_cos[positions][..., None, :]
            return Rope(cos, self.rope_local_sin[positions][..., None, :], self.rotate)
        if self.cfg.rope_scaling.type == "dynamic":
            scaled = dynamic_rope(self.cfg, positions, write, self.rotate, self.rope_cos.device)
            if scaled is not None:
                return scaled
        cos = self.rope_cos[positions][..., None, :]  # (T, 1, D) or (B, T, 1, D)
        sin = self.rope_sin[positions][..., None, :]
        if self.cfg.rope_scaling.type == "longrope":
            long = longrope_rows(self.cfg, positions, write)
            long_cos = self.rope_long_cos[positions][..., None, :]
            long_sin = self.rope_long_sin[positions][..., None, :]
            if long is True:
                cos, sin = long_cos, long_sin
            elif long is not False:  # rows on either side of the original length
                rows = long.to(cos.device)[:, None, None, None]  # (B, 1, 1, 1)
                cos, sin = torch.where(rows, long_cos, cos), torch.where(rows, long_sin, sin)
        return Rope(cos, sin, self.rotate)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | Any | None = None,
        last_only: bool = False,
        reduction: str = "mean",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) for idx (B, T); with targets also the cross-entropy (targets != -100).

        attention_mask (B, T): 1 for real tokens, 0 for padding (left-padded batches).
        doc_ids (B, T): packed documents; attention stays inside a document and positions restart.
        position_ids (B, T) or (1, T): RoPE positions. Wrong shapes or dtypes: a ValueError.
        kv_cache: continue from the cached keys/values of each row and append this call's (a
            KVCache, or `cache.rows(r0, r1)` for some of its rows); no padding, documents or
            position_ids with it: each row's positions continue from its length.
        last_only: compute logits for the last position only (decoding).
        reduction: "mean" or "sum" of the per-token losses.
        """
        if kv_cache is not None and self.cfg.rope_scaling.type in ("dynamic", "longrope"):
            logits = self._refill_past_original(idx, kv_cache, last_only)
            if logits is not None:
                loss = None
                if targets is not None:
                    loss = self.loss_function(logits.flatten(0, 1), targets.reshape(-1), reduction)
                return logits, loss
        positions, mask, write = forward_inputs(
            idx,
            attention_mask,
            doc_ids,
            position_ids,
            kv_cache,
            self.cfg.max_seq_len,
            None if self.local_window else self.cfg.sliding_window,
            self.local_window,
        )
        rope = self.rope(positions, write)
        local_rope = rope
        if self.cfg.rope_local_theta is not None:
            local_rope = self.rope(positions, write, local=True)
        x = self.tok_emb(idx)  # (B, T, C)
        if self.cfg.embed_scale:
            x = x * self.embed_multiplier.to(x.dtype)
        x = self.drop(x)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            block_rope, block_mask = rope, mask
            if self.local_layers[i]:  # model.sliding_window_pattern's local layers
                block_rope, block_mask = local_rope, mask.local or mask
            if recompute and write is None:  # non-reentrant: replays dropout's RNG exactly
                x = checkpoint(block, x, block_rope, block_mask, None, i, use_reentrant=False)
            else:
                x = block(x, block_rope, block_mask, write, i)
        x = self.norm(x[:, -1:] if last_only else x)
        # lm_head: an untied head, or an int8 model's (tied or not: minillm.model.quantize)
        tied = self.lm_head is None  # (bf16_cpu.linear: F.linear's, in fp32 where bf16 is slow)
        logits = linear(x, self.tok_emb.weight) if tied else self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits, None
        loss = self.loss_function(logits.flatten(0, 1), targets.reshape(-1), reduction)
        return logits, loss

    def _refill_past_original(
        self, idx: torch.Tensor, kv_cache: KVCache | Any, last_only: bool
    ) -> torch.Tensor | None:
        """Dynamic NTK or longrope with a KV cache: logits (n, T | 1, V), or None for the plain
        cached path.

        The frequencies change with the length, and with them every hidden state of a sequence
        from the second layer on, so keys cached at a shorter length are stale once a row passes
        the original length. Such a row is refilled: cleared, then its whole sequence (the cache
        keeps each row's ids) forwarded from position 0, what a full forward computes. Dynamic
        NTK's frequencies change at every length past the original, so it decodes without a
        cache there; longrope's long factors are one set, so a row is refilled once, at the
        step that takes it past the original length, and its cache is used as it is after.
        (transformers' cached generate keeps the keys rotated at the short factors and rotates
        the new ones at the long: not its own full forward. Ours is.) Up to the original length
        the cache is used as it is.
        """
        cache, r0 = getattr(kv_cache, "cache", kv_cache), getattr(kv_cache, "r0", 0)
        rows = range(r0, r0 + idx.shape[0])
        seqs = [torch.cat((cache.ids[r], idx[i])) for i, r in enumerate(rows)]
        original = self.cfg.rope_scaling.original_max_position_embeddings
        once = self.cfg.rope_scaling.type == "longrope"  # stale only at the crossing
        stale = any(
            cache.lengths[r] and len(s) > original and not (once and cache.lengths[r] > original)
            for r, s in zip(rows, seqs)
        )
        for r, s in zip(rows, seqs):
            cache.ids[r] = s
        if not stale:
            return None
        out = []
        for r, s in zip(rows, seqs):
            cache.clear_row(r)
            logits, _ = self(s[None], kv_cache=cache.rows(r, r + 1), last_only=last_only)
            out.append(logits[:, -idx.shape[1] :] if not last_only else logits)
        return torch.cat(out)

    # ------------------------------------------------------------------ sizes

    def param_count(self, non_embedding: bool = False) -> int:
        """Distinct parameters (a tied head counts once); optionally without embedding matrices."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if self.lm_head is not None:
                n -= self.lm_head.weight.numel()
        return n

    def active_param_count(self) -> int:
        """Parameters one token uses: param_count less the experts it is not routed to."""
        return self.param_count() - self._inactive_expert_params()

    def _inactive_expert_params(self) -> int:
        n = 0
        for ffn in (b.ffn for b in self.blocks):
            if isinstance(ffn, MoE):
                E = ffn.w_down.shape[0]
                n += (ffn.w_gate_up.numel() + ffn.w_down.numel()) // E * (E - ffn.k)
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per matmul weight (head included, tied or not) + attention.

        The embedding lookup is no matmul; the head always is. An MoE counts its router and the
        k experts a token goes through (the active parameters). The attention term is the PaLM
        one, 12 * n_layer * (n_head * head_dim) * seq_len (scores and weighted values, forward
        and backward), its keys capped at model.sliding_window.
        """
        cfg = self.cfg
        matmul = sum(
            p.numel() for n, p in self.named_parameters() if p.dim() >= 2 and n != "tok_emb.weight"
        )
        matmul -= self._inactive_expert_params()
        # Weights held as buffers, not parameters (a QLoRA base: minillm.model.nf4.NF4Linear).
        matmul += sum(getattr(m, "buffer_weight_numel", 0) for m in self.modules())
        if self.lm_head is None:
            matmul += self.tok_emb.weight.numel()
        window = cfg.sliding_window or seq_len
        keys = sum(min(seq_len, window) if local else seq_len for local in self.local_layers)
        width = cfg.head_dim  # per head: the mean of the query/key and the value widths
        if cfg.attention == "mla":
            width = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2
        return 6 * matmul + int(12 * cfg.n_head * width * keys)


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with every dropout at 0 for the block (attention, residual, embedding, LoRA's),
    still in training mode (activation checkpointing stays on): a loss that compares the policy
    with a reference that runs without dropout (DPO) or with the distribution it sampled from
    (GRPO) must not add dropout's noise to one side."""
    drops = [(m, m.p) for m in model.modules() if isinstance(m, nn.Dropout)]
    attns = [(m, m.dropout) for m in model.modules() if isinstance(m, SelfAttention)]
    try:
        for m, _ in drops:
            m.p = 0.0
        for m, _ in attns:
            m.dropout = 0.0
        yield model
    finally:
        for m, p in drops:
            m.p = p
        for m, p in attns:
            m.dropout = p
