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
from minillm.model.transformer import Transformer, attention, rms_norm, rope_rotation, swiglu


class Decoder:
    """Decodes one token per row at a time through a Transformer and its KV cache, for inference.

    `step(tokens)` is the same function as `model(tokens[:, None], kv_cache=kv_cache,
    last_only=True)[0][:, 0]` after a prefill (in eval mode and without autocast, as `generate`
    runs), with far less overhead. On a CPU a decoded token costs its matrix-vector products
    plus 1-4 us for every op, module call and module attribute lookup around them, and the
    module forward spends more on the latter. So the weights are looked up once, here, and each
    block runs as one flat loop over the component functions of `minillm.model.transformer`
    (`rms_norm`, `swiglu`, `attention`; RoPE as one (D, D) matmul per layer, `rope_rotation`),
    with the residual adds folded into the output projections (addmm). Only the wiring of a
    block is written here a second time (pre-norm, residuals, the q/k/v split);
    tests/test_model.py pins it to the module forward. The KV cache places each row's token
    (`KVCache.start_step`). Make a new Decoder for each cache: it holds the parameters and the
    cache it was made with.
    """

    def __init__(self, model: Transformer, kv_cache: KVCache) -> None:
        if model.training and model.cfg.dropout > 0:
            raise ValueError("the Decoder applies no dropout: call model.eval() first")
        self.model, self.cache = model, kv_cache
        cfg = model.cfg
        self.heads = (cfg.n_head, cfg.n_kv_head, cfg.head_dim)
        self.layers = [
            (
                block.attn_norm.weight,
                block.attn.wqkv.weight,
                block.attn.wo.weight.t(),
                block.ffn_norm.weight,
                block.ffn.w_gate_up.weight,
                block.ffn.w_down.weight.t(),
            )
            for block in model.blocks
        ]
        self.embedding, self.head = model.tok_emb.weight, model.head_weight
        self.norm, self.eps = model.norm.weight, cfg.norm_eps
        self.rope = (model.rope_cos, model.rope_sin, model.rope_rotate_half)

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
        cache = self.cache
        n = tokens.shape[0]
        if n > cache.batch_size:
            raise ValueError(f"{n} tokens for a KV cache of {cache.batch_size} rows")
        key_mask = cache.start_step(n)  # (n, 1, 1, S) or None
        H, K, D = self.heads
        eps = self.eps
        try:
            cos, sin, rotate_half = self.rope
            positions = cache.n_seen[:n]  # (n,) real tokens so far: the new token's RoPE position
            rot = rope_rotation(cos[positions], sin[positions], rotate_half)  # (n, D, D)
            x = F.embedding(tokens, self.embedding)  # (n, C)
            for layer, (norm1, w_qkv, wo_t, norm2, w_gate_up, w_down_t) in enumerate(self.layers):
                qkv = F.linear(rms_norm(x, norm1, eps), w_qkv).view(n, H + 2 * K, D)
                qk = qkv[:, : H + K]
                if qk.dtype == rot.dtype:
                    qk = torch.matmul(qk, rot)  # q and k heads rotated
                else:  # RoPE in the tables' precision, as apply_rope does
                    qk = torch.matmul(qk.to(rot.dtype), rot).to(qkv.dtype)
                keys, values = cache.update(layer, qk[:, H:, None], qkv[:, H + K :, None])
                y = attention(qk[:, :H, None], keys, values, key_mask)  # (n, H, 1, D)
                x = torch.addmm(x, y.reshape(n, H * D), wo_t)  # x + wo(y)
                h = swiglu(F.linear(rms_norm(x, norm2, eps), w_gate_up))
                x = torch.addmm(x, h, w_down_t)  # x + w_down(swiglu(...))
        except BaseException:
            cache.end_step(done=False)
            raise
        cache.end_step()
        return F.linear(rms_norm(x, self.norm, eps), self.head)
