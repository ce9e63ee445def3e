"""The decoding fast path: one token per row at a time through a Transformer and its KV cache.

Offers `Decoder`, made by its caller (`minillm.infer.generate`) after the model and the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.model.kv_cache import KVCache
from minillm.model.transformer import Transformer, attention, rms_norm, rope_rotation


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
        self.heads = (cfg.n_head, cfg.n_kv_head, cfg.head_dim)
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
        cache.check_room(1)
        pos = cache.pos
        cos, sin, rotate_half = self.rope
        positions = cache.n_seen  # (B,) real tokens so far: the new token's RoPE position
        rot = rope_rotation(cos[positions], sin[positions], rotate_half)  # (B, D, D)
        # The new token sees every key, but left padding must stay hidden.
        key_valid = cache.mark_keys(None, 1)  # (B, S) or None
        key_mask = key_valid[:, None, None] if key_valid is not None else None  # (B, 1, 1, S)

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
        cache.advance(1)
        return F.linear(rms_norm(x, self.norm, eps), self.head)
