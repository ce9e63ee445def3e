"""The decoding fast path: one token per row at a time through a Transformer and its KV cache.

Offers `Decoder`, made by the decoding core (`minillm.infer.engine`) after the model and the
cache, and `layer_weights(cfg)`, the weights a token's products read in a layer (by which the
core picks a one-row step's threads). Rows join and leave between steps (continuous batching):

    cache = KVCache(model.cfg)          # rows are added as sequences arrive (cache.add_rows)
    decoder = Decoder(model, cache)
    logits = decoder.prefill(row, ids)  # (V,): prompt ids (P,) into row `row`, alone
    logits = decoder.step(tokens)       # (n, V): rows 0..n-1 advance by tokens (n,), each at
                                        # its own position; rows n.. are untouched and cost nothing
    cache.move_row(src, dst)            # compaction when dst's sequence left: src moves into dst

Each row gets the logits it would get decoded alone (to float rounding), whatever the other rows
hold, so keep the active rows at 0..n-1 (move the last one into a freed slot).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from minillm.config import ModelConfig
from minillm.model.kv_cache import CacheWrite, KVCache
from minillm.model.moe import MoE
from minillm.model.rope import rope_rotation
from minillm.model.transformer import Transformer, attention, rms_norm, swiglu


class Decoder:
    """Decodes one token per row at a time through a Transformer and its KV cache, for inference.

    `step(tokens)` is the same function as `model(tokens[:, None], kv_cache=kv_cache,
    last_only=True)[0][:, 0]` after a prefill (in eval mode and without autocast, as the decoding
    core runs), with far less overhead. On a CPU a decoded token costs its matrix-vector products
    plus 1-4 us for every op, module call and module attribute lookup around them, and the module
    forward spends more on the latter. So the weights are looked up once, here, and each block runs
    as one flat loop over the component functions of `minillm.model.transformer` (`rms_norm`,
    `swiglu`, `attention`; RoPE as one (D, D) matmul per layer, `rope_rotation`), with the residual
    adds folded into the output projections (addmm). Only the wiring of a block is written here a
    second time (pre-norm, residuals, the q/k/v split); tests/test_model.py pins it to the module
    forward. The KV cache places each row's token (`KVCache.append`). A mixture-of-experts FFN
    runs as its module (`minillm.model.moe.MoE`): its routing is not written a second time. Make
    a new Decoder for each cache: it holds the parameters and the cache it was made with.
    """

    def __init__(self, model: Transformer, kv_cache: KVCache) -> None:
        if model.training and model.cfg.dropout > 0:
            raise ValueError("the Decoder applies no dropout: call model.eval() first")
        self.model, self.cache = model, kv_cache
        cfg = model.cfg
        # What the loop does not compute steps through the model's forward (fast_path_serves).
        self.by_forward = not fast_path_serves(cfg)
        if self.by_forward:
            return
        self.heads = (cfg.n_head, cfg.n_kv_head, cfg.head_dim)
        # Each projection as a function: x -> x W^T (+ b), and the output projections with the
        # residual add, (x, y) -> x + y W^T. An int8 model's layers are their own
        # (minillm.model.quantize). The FFN as (gate_up, down, None), or a mixture of experts as
        # (None, None, the MoE module).
        t = transposed_copies(model)  # the rule: COPY_LIMIT_BYTES
        ffns = [
            (None, None, block.ffn)
            if isinstance(block.ffn, MoE)
            else (_projection(block.ffn.w_gate_up, t), _residual(block.ffn.w_down), None)
            for block in model.blocks
        ]
        self.layers = [
            (
                block.attn_norm.weight,
                _projection(block.attn.wqkv, t),  # with model.attention_bias's bias
                _residual(block.attn.wo),
                block.ffn_norm.weight,
                *ffn,
            )
            for block, ffn in zip(model.blocks, ffns)
        ]
        # model.qk_norm: each layer's q and k gains (None without)
        self.qk_norms = [
            (b.attn.q_norm.weight, b.attn.k_norm.weight) if b.attn.q_norm is not None else None
            for b in model.blocks
        ]
        # An int8 model (minillm.model.quantize) rounds each token's activations to an 8-bit
        # grid, so a float rounding difference that moves one across a rounding edge changes its
        # logits by a grid step, enough to flip a near-tie: rows that would read different
        # numbers of keys (a mask) then attend one at a time over their own keys, as each would
        # alone (batched == alone, exactly).
        self.rowwise_attention = getattr(model, "quantized", None) == "int8"
        self.embedding = model.tok_emb.weight
        self.head = (
            _projection(model.lm_head, t)
            if model.lm_head is not None
            else partial(F.linear, weight=model.tok_emb.weight)
        )
        # A one-row step's head on a CPU: x @ W^T from a contiguous copy of W^T (C, V), about
        # 2x faster than F.linear(x, W) for a (V, C) head of millions of weights (its product
        # streams W^T's rows; the other reads each of V rows for one dot product), 11% of a
        # step at every shape of scripts/bench_sample.py. It costs a second head in memory,
        # so only float heads on the CPU; several rows use F.linear, which is as fast there.
        self.head_t = _transposed_head(model) if t else None
        self.norm, self.eps = model.norm.weight, cfg.norm_eps
        self.rope = (model.rope_cos, model.rope_sin, model.rope_rotate_half)

    def prefill(self, row: int, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Put prompt ids (P,) into row `row` (emptied first); logits (V,) of its next token, or
        with all_logits those after every prompt token, (P, V).

        One model forward of the prompt alone, writing its keys and values straight into the
        row: the row then holds what a one-row cache would.
        """
        if torch.is_grad_enabled():
            raise RuntimeError("Decoder.prefill is for inference: use torch.inference_mode()")
        cache = self.cache
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"prefill wants a non-empty 1-D tensor of token ids, got {ids.shape}")
        view = cache.rows(row, row + 1)  # a ValueError for a row the cache does not have
        cache.clear_row(row)
        logits, _ = self.model(ids[None].to(cache.device), kv_cache=view, last_only=not all_logits)
        return logits[0] if all_logits else logits[0, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (n, V) of the next token after tokens (n,), appended to rows 0..n-1 each at its
        own position (n <= the cache's rows)."""
        if torch.is_grad_enabled():
            raise RuntimeError("Decoder.step is for inference: use torch.inference_mode()")
        cache = self.cache
        n = tokens.shape[0]
        if n > cache.batch_size:
            raise ValueError(f"{n} tokens for a KV cache of {cache.batch_size} rows")
        if self.by_forward:
            view = cache.rows(0, n)
            return self.model(tokens[:, None].to(cache.device), kv_cache=view, last_only=True)[0][
                :, 0
            ]
        write = cache.append(1, range(n))
        key_mask = write.key_mask  # (n, 1, 1, S) or None
        positions = write.positions  # the new tokens' RoPE positions: a slice, or (n, 1)
        if isinstance(positions, torch.Tensor):
            positions = positions[:, 0]
        H, K, D = self.heads
        eps = self.eps
        cos, sin, rotate_half = self.rope
        rot = rope_rotation(cos[positions], sin[positions], rotate_half)  # (n | 1, D, D)
        x = F.embedding(tokens, self.embedding)  # (n, C)
        for layer, (norm1, qkv_proj, wo_add, norm2, gate_up, down_add, moe) in enumerate(
            self.layers
        ):
            qkv = qkv_proj(rms_norm(x, norm1, eps)).view(n, H + 2 * K, D)
            qk = qkv[:, : H + K]
            if self.qk_norms[layer] is not None:
                q_gain, k_gain = self.qk_norms[layer]
                qk = torch.cat(
                    (rms_norm(qk[:, :H], q_gain, eps), rms_norm(qk[:, H:], k_gain, eps)), 1
                )
            if qk.dtype == rot.dtype:
                qk = torch.matmul(qk, rot)  # q and k heads rotated
            else:  # RoPE in the tables' precision, as apply_rope does
                qk = torch.matmul(qk.to(rot.dtype), rot).to(qkv.dtype)
            keys, values = write.update(layer, qk[:, H:, None], qkv[:, H + K :, None])
            if key_mask is not None and self.rowwise_attention:
                y = self._rows_alone(qk[:, :H, None], keys, values, write)
            else:
                y = attention(qk[:, :H, None], keys, values, key_mask)  # (n, H, 1, D)
            x = wo_add(x, y.reshape(n, H * D))  # x + wo(y)
            if moe is not None:
                x = x + moe(rms_norm(x, norm2, eps))
                continue
            h = swiglu(gate_up(rms_norm(x, norm2, eps)))
            x = down_add(x, h)  # x + w_down(swiglu(...))
        x = rms_norm(x, self.norm, eps)
        if n == 1 and self.head_t is not None:
            return torch.mm(x, self.head_t)
        return self.head(x)

    def _rows_alone(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, write: CacheWrite
    ) -> torch.Tensor:
        """Attention of each row's one new query q (n, H, 1, D) over its own keys (the first
        S of keys, values (n, K, S, D), `CacheWrite.alone`), unmasked as it would be alone: the
        same call as a one-row step's."""
        out = []
        for i in range(write.n):
            S = write.alone(i)
            out.append(attention(q[i : i + 1], keys[i : i + 1, :, :S], values[i : i + 1, :, :S]))
        return torch.cat(out)  # (n, H, 1, D)


def fast_path_serves(cfg: ModelConfig) -> bool:
    """Whether `Decoder.step`'s loop computes `cfg`'s block: the plain formulas of a pre-norm
    SwiGLU block with RoPE. Dynamic NTK and LongRoPE rotate every cached key anew each step
    (Transformer.rope); sandwich norms, a GeGLU, scaled embeddings or attention, mixed local
    layers and latent attention (model.attention mla, whose cache and absorbed decode are
    minillm.model.mla's) step through the model's own forward."""
    return not (
        cfg.rope_scaling.type in ("dynamic", "longrope")
        or cfg.sandwich_norm
        or cfg.embed_scale
        or cfg.ffn_activation != "silu"
        or cfg.query_pre_attn_scalar is not None
        or cfg.rope_local_theta is not None
        or cfg.mixed_layers
        or cfg.attention == "mla"
    )


def layer_weights(cfg: ModelConfig) -> int:
    """About the weights one token's products read in a layer of `cfg`: q/k/v and the output
    projection as heads x head_dim, and one SwiGLU of ffn_hidden (the dense width, also under a
    mixture of experts; latent attention's ranks are not counted): the order of magnitude,
    which is what one_row_threads needs (attention alone passes its 8M from d_model 1,415)."""
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    return cfg.d_model * (2 * q + 2 * kv + 3 * cfg.ffn_hidden)


# The transposed copies pay for float32 weights only: x @ W^T in bfloat16 or float16 ran 10-17x
# slower than F.linear(x, W) for one row on an AVX2 CPU (torch 2.13, 1.1B's shapes and smaller),
# and fit only below a size: they add ~0.8x the weights (q/k/v, gate/up, the head), which a
# published model (1B and up) cannot spare and where they gain nothing (its products are bound by
# memory bandwidth either way): a 1.1B model's token 2,334 ms with them, 2,233 without; a 24M
# model's 687 vs 892 (scripts/bench_load.py decode, loadavg ~11).
COPY_LIMIT_BYTES = 2**30


def transposed_copies(model: Transformer) -> bool:
    """Whether the decoder multiplies copies of W^T: float32 weights of at most
    COPY_LIMIT_BYTES in all (the reasons above)."""
    if model.tok_emb.weight.dtype != torch.float32:  # (an int8 head has no float weight)
        return False
    return sum(p.numel() * p.element_size() for p in model.parameters()) <= COPY_LIMIT_BYTES


# One transposed copy of each weight that `_projection` and the head read as W^T, made anew when
# the weights change (an optimizer step between GRPO's rollouts bumps the tensor's version): an
# Engine, and so a Decoder, is made for every `generate` call.
# (Keyed by identity: a tensor's == is elementwise.)
_TRANSPOSED = WeakIdKeyDictionary()


def _transposed(weight: torch.Tensor) -> torch.Tensor | None:
    """A contiguous W^T (in, out) of a float weight W (out, in) on the CPU, else None (a
    sharded DTensor, an accelerator, an int8 layer's packed weight)."""
    if type(weight.data) is not torch.Tensor:
        return None  # a sharded DTensor (FSDP)
    if weight.device.type != "cpu" or not weight.is_floating_point():
        return None
    held = _TRANSPOSED.get(weight)
    if held is None or held[0] != weight._version:
        with torch.no_grad():
            held = (weight._version, weight.detach().t().contiguous())
        _TRANSPOSED[weight] = held
    return held[1]


def _transposed_head(model: Transformer) -> torch.Tensor | None:
    """W^T (C, V) of a float head on the CPU (Decoder.__init__ says why), else None."""
    if model.lm_head is not None and not isinstance(model.lm_head, nn.Linear):
        return None  # an int8 head (minillm.model.quantize) runs its own kernel
    return _transposed(model.head_weight)


def _projection(linear: nn.Module, transpose: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """x (n, in) -> linear(x): a layer with float weights (nn.Linear, LoRA's merged `weight`) as
    one op on them (a module call costs more on a CPU's decode step), an int8 one as its forward.

    On the CPU a layer wider than its input (q/k/v, gate/up) multiplies a contiguous copy of
    W^T (x @ W^T streams W^T's rows), 1.4-2x faster for one row than F.linear(x, W), which
    reads each of `out` rows for one dot product (the head's reason, Decoder.__init__): the
    decode step's largest products at every shape of scripts/bench_sample.py, for a second
    copy of them in memory. Narrower ones (attn.wo, w_down) are as fast or faster as they are.
    Only with `transpose` (`transposed_copies`).
    """
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return linear.forward  # not the module call: a decode step makes 4 a layer
    bias = linear.bias
    wide = transpose and weight.shape[0] > weight.shape[1]
    weight_t = _transposed(weight) if wide else None
    if weight_t is None:
        return partial(F.linear, weight=weight, bias=bias)
    if bias is None:
        return partial(torch.mm, mat2=weight_t)
    return partial(torch.addmm, bias, mat2=weight_t)


def _residual(linear: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(x, y) -> x + linear(y) in one op: float weights (no bias) as addmm, an int8 layer's
    own `add_to`."""
    if isinstance(getattr(linear, "weight", None), torch.Tensor):
        return partial(torch.addmm, mat2=linear.weight.t())
    return linear.add_to
