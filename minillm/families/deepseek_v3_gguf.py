"""llama.cpp's `deepseek2` for `export --format gguf` of a `model.attention: mla` model (the
DeepSeek-V3 family's GGUF, minillm.families.deepseek_v3).

Offers `deepseek2_arch`, `deepseek2_problem`, `add_deepseek2_keys` and `split_kv_b`. The
mapping is llama.cpp's own converter's (convert_hf_to_gguf.py's DeepseekV2Model, which converts
DeepseekV3ForCausalLM too) for the llama.cpp that llama-cpp-python 0.3.36 bundles:

- attention: `attn_q` (no query bottleneck) or `attn_q_a`, `attn_q_a_norm`, `attn_q_b`;
  `attn_kv_a_mqa` (the latent and the RoPE key), `attn_kv_a_norm`; `kv_b_proj` split per head
  into `attn_k_b` (H, R, N), W_uk transposed, and `attn_v_b` (H, V, R), which its graph
  absorbs as minillm's decode does (an older llama.cpp took the whole `attn_kv_b`); keys
  `attention.q_lora_rank` (0: none), `kv_lora_rank`, `key_length` R + P and `value_length` R
  (the latent as one key/value head: `head_count_kv` 1), `key_length_mla` N + P and
  `value_length_mla` V, `rope.dimension_count` P. Its RoPE rotates adjacent pairs, the layout
  of DeepSeek's weights that the Hugging Face names already hold (deepseek_v3): no permutation.
- DeepSeekMoE: `leading_dense_block_count` (its dense blocks come first), the experts' stacks,
  `ffn_gate_inp`, the routing bias `exp_probs_b.bias`, the shared experts `*_shexp` of
  `expert_shared_count` x `expert_feed_forward_length`; `expert_gating_func` sigmoid,
  `expert_weights_norm`, `expert_weights_scale`, `expert_group_count`, `expert_group_used_count`.
  A dense model is every block dense, as the converter writes one.
- YaRN: `rope.scaling.yarn_log_mul` 0.1 x mscale_all_dim (the converter's legacy factor, which
  the loader divides out); its graph multiplies the softmax scale by mscale(factor,
  mscale_all_dim)^2 and leaves cos and sin unscaled.

What its graph computes otherwise is one CheckpointError naming the key (`deepseek2_problem`).
llama.cpp itself takes a model of 26 or 27 layers for V2-Lite (llama-model.cpp's is_lite): a
query bottleneck there is refused, as its loader would not read it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from minillm.config import ModelConfig
from minillm.errors import CheckpointError
from minillm.families.base import gguf_refusal
from minillm.families.llama import check_yarn_ranges
from minillm.model.rope import yarn_mscale

Refuse = Callable[[str, str], CheckpointError]


def deepseek2_arch(cfg: ModelConfig) -> Any:
    """gguf.MODEL_ARCH.DEEPSEEK2, or the CheckpointError of what its graph computes otherwise."""
    import gguf

    problem = deepseek2_problem(cfg, gguf_refusal)
    if problem is not None:
        raise problem
    if cfg.rope_scaling.type == "yarn":
        check_yarn_ranges(cfg.rope_scaling)
    return gguf.MODEL_ARCH.DEEPSEEK2


def deepseek2_problem(cfg: ModelConfig, refuse: Refuse) -> CheckpointError | None:
    """The CheckpointError for the first option of an mla model llama.cpp's deepseek2 computes
    otherwise, or None."""
    s = cfg.rope_scaling
    if s.type not in ("none", "yarn"):
        # its graph takes the softmax scale for YaRN's: linear would get mscale(factor)^2 too
        return refuse("rope_scaling.type", f"{s.type} in a deepseek2 model (none or yarn)")
    if s.type == "yarn":
        if not s.mscale_all_dim:
            return refuse(
                "rope_scaling.mscale_all_dim",
                "null (llama.cpp's deepseek2 scales every logit by yarn's mscale squared: it "
                "needs DeepSeek's mscale_all_dim)",
            )
        # transformers' attention factor on cos and sin; deepseek2's graph applies none
        if s.attention_factor is not None:
            key, factor = "attention_factor", s.attention_factor
        elif s.mscale:
            key = "mscale"
            factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
        else:
            key, factor = "mscale", yarn_mscale(s.factor)
        if not math.isclose(factor, 1.0, rel_tol=1e-6):
            value = getattr(s, key)
            return refuse(
                f"rope_scaling.{key}",
                f"{value} (cos and sin scaled by {factor:.4g}: llama.cpp's deepseek2 leaves "
                "them unscaled, as mscale equal to mscale_all_dim does)",
            )
    lite = cfg.n_layer in (26, 27) or (cfg.n_layer == 48 and cfg.vocab_size == 128256)
    if cfg.q_lora_rank and lite:
        return refuse(
            "q_lora_rank",
            f"{cfg.q_lora_rank} in {cfg.n_layer} layers (llama.cpp's deepseek2 takes such a "
            "model for V2-Lite, whose queries have no bottleneck)",
        )
    if not cfg.n_experts:
        return None
    if cfg.moe_router != "sigmoid":
        return refuse(
            "moe_router", f"{cfg.moe_router} with mla (its deepseek2: DeepSeekMoE's sigmoid)"
        )
    S, F = cfg.moe_shared_ffn_hidden, cfg.moe_ffn_hidden
    if not S or S % F:
        return refuse(
            "moe_shared_ffn_hidden",
            f"{S} (llama.cpp's deepseek2 has shared experts of moe_ffn_hidden={F} each: a "
            "positive multiple of it)",
        )
    dense = sorted(cfg.moe_dense_layers)
    if dense != list(range(len(dense))):
        return refuse(
            "moe_dense_layers",
            f"{cfg.moe_dense_layers} (llama.cpp's deepseek2 has its dense blocks first: 0 .. k-1)",
        )
    return None


def add_deepseek2_keys(w: Any, m: ModelConfig) -> None:
    """deepseek2's attention, FFN and YaRN keys (the module docstring) on a gguf.GGUFWriter."""
    import gguf

    R, P = m.kv_lora_rank, m.qk_rope_head_dim
    w.add_head_count_kv(1)  # the latent, one key/value head of every query head
    w.add_key_length(R + P)
    w.add_value_length(R)
    w.add_key_length_mla(m.qk_nope_head_dim + P)
    w.add_value_length_mla(m.v_head_dim)
    w.add_q_lora_rank(m.q_lora_rank or 0)  # 0: attn_q, no bottleneck (its loader reads the key)
    w.add_kv_lora_rank(R)
    if m.n_experts:
        w.add_leading_dense_block_count(len(m.moe_dense_layers))
        w.add_expert_feed_forward_length(m.moe_ffn_hidden)
        w.add_expert_shared_count(m.moe_shared_ffn_hidden // m.moe_ffn_hidden)
        w.add_expert_count(m.n_experts)
        w.add_expert_used_count(m.n_experts_per_token)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(m.moe_norm_topk)
        w.add_expert_weights_scale(m.moe_routed_scale)
        if m.moe_n_group > 1:
            w.add_expert_group_count(m.moe_n_group)
            w.add_expert_group_used_count(m.moe_topk_group)
    else:  # every block dense, as the converter writes a dense model
        w.add_leading_dense_block_count(m.n_layer)
        w.add_expert_feed_forward_length(m.ffn_hidden)
        w.add_expert_shared_count(0)
    if m.rope_scaling.type == "yarn":
        w.add_rope_scaling_yarn_log_mul(0.1 * m.rope_scaling.mscale_all_dim)


def split_kv_b(w: torch.Tensor, m: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj (H (N + V), R) as deepseek2's attn_k_b (H, R, N) and attn_v_b (H, V, R)."""
    H, N, V = m.n_head, m.qk_nope_head_dim, m.v_head_dim
    k_b, v_b = w.view(H, N + V, -1).split((N, V), dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()
