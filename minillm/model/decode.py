"""The decoding fast path: one token per row at a time through a Transformer and its KV cache.

Offers `Decoder`, made by its caller (`minillm.infer.generate`, a server's engine) after the
model and the cache. It serves a batch that moves together (generate's left-padded prompts) and
continuous batching, where rows join and leave between steps:

    cache = KVCache(model.cfg, batch_size=max_rows, max_len=...)
    decoder = Decoder(model, cache)
    logits = decoder.prefill(row, ids)  # (V,): prompt ids (P,) into an empty row, alone
    logits = decoder.step(tokens)       # (n, V): rows 0..n-1 advance by tokens (n,), each at
                                        # its own position; rows n.. are untouched and cost nothing
    cache.move_row(src, dst)            # compaction when dst's request left: src moves into dst
    cache.clear_row(row)                # free a row (prefill clears it too)

Each row gets the logits it would get decoded alone (to float rounding), whatever the other rows
hold, so keep the active rows at 0..n-1 (move the last one into a freed slot).
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
        self.model, self.cache = model, kv_cache
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
        self.slots = torch.arange(kv_cache.max_len, device=kv_cache.k.device)

    def prefill(self, row: int, ids: torch.Tensor) -> torch.Tensor:
        """Put prompt ids (P,) into row `row` (emptied first); logits (V,) of its next token.

        One model forward of the prompt alone, writing its keys and values straight into the
        row: the row then holds what a one-row cache would.
        """
        if torch.is_grad_enabled():
            raise RuntimeError("Decoder.prefill is for inference: use torch.inference_mode()")
        cache = self.cache
        if not 0 <= row < cache.batch_size:
            raise ValueError(f"row {row} is not in this KV cache of {cache.batch_size} rows")
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"prefill wants a non-empty 1-D tensor of token ids, got {ids.shape}")
        cache.clear_row(row)
        view = cache.row(row)
        logits, _ = self.model(ids[None].to(cache.k.device), kv_cache=view, last_only=True)
        cache.set_length(row, view.lengths[0])
        return logits[0, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (n, V) of the next token after tokens (n,), appended to rows 0..n-1 each at its
        own position (n <= the cache's rows)."""
        if torch.is_grad_enabled():
            raise RuntimeError("Decoder.step is for inference: use torch.inference_mode()")
        cache, eps = self.cache, self.eps
        H, K, D = self.heads
        B = tokens.shape[0]
        if B > cache.batch_size:
            raise ValueError(f"{B} tokens for a KV cache of {cache.batch_size} rows")
        cache.check_room(1, rows=B)
        lengths = cache.lengths[:B]
        S = max(lengths) + 1  # slots any of these rows attends to, its new one included
        cos, sin, rotate_half = self.rope
        positions = cache.n_seen[:B]  # (B,) real tokens so far: the new token's RoPE position
        rot = rope_rotation(cos[positions], sin[positions], rotate_half)  # (B, D, D)
        ragged = min(lengths) != S - 1
        if ragged:  # each row writes its own slot and sees its own filled slots only
            filled = torch.tensor(lengths, device=self.slots.device)  # (B,) the new slots
            rows = torch.arange(B, device=filled.device)
            key_valid = (self.slots[None, :S] <= filled[:, None]) & cache.key_valid[:B, :S]
        else:  # the new token sees every key, but left padding must stay hidden
            key_valid = cache.key_valid[:B, :S] if cache.has_padding else None
        key_mask = key_valid[:, None, None] if key_valid is not None else None  # (B, 1, 1, S)

        x = F.embedding(tokens, self.embedding)  # (B, C)
        for norm1, w_qkv, wo_t, norm2, w_gate_up, w_down_t, keys, values in self.layers:
            if B != keys.shape[0]:
                keys, values = keys[:B], values[:B]
            qkv = F.linear(rms_norm(x, norm1, eps), w_qkv).view(B, H + 2 * K, D)
            qk = qkv[:, : H + K]
            if qk.dtype == rot.dtype:
                qk = torch.matmul(qk, rot)  # q and k heads rotated
            else:  # RoPE in the tables' precision, as apply_rope does
                qk = torch.matmul(qk.to(rot.dtype), rot).to(qkv.dtype)
            if ragged:
                keys[rows, :, filled] = qk[:, H:]
                values[rows, :, filled] = qkv[:, H + K :]
            else:
                keys.select(2, S - 1).copy_(qk[:, H:])
                values.select(2, S - 1).copy_(qkv[:, H + K :])
            q = qk[:, :H, None]  # (B, H, 1, D)
            y = attention(q, keys[:, :, :S], values[:, :, :S], key_mask)
            x = torch.addmm(x, y.reshape(B, H * D), wo_t)  # x + wo(y)
            gate, up = F.linear(rms_norm(x, norm2, eps), w_gate_up).chunk(2, dim=-1)
            x = torch.addmm(x, F.silu(gate) * up, w_down_t)  # x + w_down(silu(gate) * up)
        cache.advance_rows(B)
        return F.linear(rms_norm(x, self.norm, eps), self.head)
