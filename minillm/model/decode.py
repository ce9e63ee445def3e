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

from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.inputs import AttentionMask
from minillm.model.kv_cache import KVCache
from minillm.model.transformer import Transformer, rms_norm, rope_rotation


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def unwrapped(module: nn.Module) -> Callable[..., Any]:
    """module's own forward, for inference, without nn.Module's per-call machinery.

    The forward runs on a plain namespace holding the module's attributes, parameters and
    buffers, with each submodule itself unwrapped, so the code is the module's and nothing is
    re-typed. On a CPU, decoding one token costs its matrix-vector products plus 1-4 us for
    every op, module call and module attribute lookup around them; the calls and lookups were
    the larger part. Dropout becomes the identity (the Decoder refuses a model in training).
    """
    if isinstance(module, nn.Dropout):
        return _identity
    if type(module) is nn.Linear:  # straight to its op: one Python frame fewer per matmul
        return partial(F.linear, weight=module.weight, bias=module.bias)
    fields = {k: v for k, v in vars(module).items() if not k.startswith("_")}
    fields.update(module._parameters)
    fields.update(module._buffers)
    fields.update((name, unwrapped(child)) for name, child in module._modules.items())
    # Class-level functions the forward calls through self (e.g. SwiGLU.activation).
    for klass in type(module).__mro__:
        for name, value in vars(klass).items():
            if isinstance(value, staticmethod) and name not in fields:
                fields[name] = value.__func__
    return partial(type(module).forward, SimpleNamespace(**fields))


class Decoder:
    """Decodes one token per row at a time through a Transformer and its KV cache, for inference.

    `step(tokens)` is the same function as `model(tokens[:, None], kv_cache=kv_cache,
    last_only=True)[0][:, 0]` after a prefill (in eval mode and without autocast, as `generate`
    runs), with far less overhead: the blocks run their own forwards `unwrapped`, and RoPE
    rotates all q and k heads of a token with one (D, D) matmul per layer (`rope_rotation`)
    instead of apply_rope's elementwise ops. Make a new Decoder for each cache: it holds the
    parameters and the cache it was made with.
    """

    def __init__(self, model: Transformer, kv_cache: KVCache) -> None:
        if model.training and model.cfg.dropout > 0:
            raise ValueError("the Decoder applies no dropout: call model.eval() first")
        self.model, self.cache = model, kv_cache
        self.blocks = [unwrapped(block) for block in model.blocks]
        self.embedding, self.head = model.tok_emb.weight, model.head_weight
        self.norm, self.eps = model.norm.weight, model.cfg.norm_eps
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
        mask = AttentionMask(cache.start_step(n))
        try:
            cos, sin, rotate_half = self.rope
            positions = cache.n_seen[:n]  # (n,) real tokens so far: the new token's RoPE position
            rot = rope_rotation(cos[positions], sin[positions], rotate_half)[:, None]  # (n,1,D,D)
            if rot.dtype == self.embedding.dtype:
                rope = partial(torch.matmul, other=rot)  # (n, 1, H + K, D) @ (n, 1, D, D)
            else:  # RoPE in the tables' precision, as apply_rope does

                def rope(qk: torch.Tensor) -> torch.Tensor:
                    return torch.matmul(qk.to(rot.dtype), rot).to(qk.dtype)

            x = F.embedding(tokens[:, None], self.embedding)  # (n, 1, C)
            for layer, block in enumerate(self.blocks):
                x = block(x, rope, mask, cache, layer)
        except BaseException:
            cache.end_step(done=False)
            raise
        cache.end_step()
        return F.linear(rms_norm(x[:, 0], self.norm, self.eps), self.head)
