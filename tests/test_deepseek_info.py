"""`minillm info` counts DeepSeek-V3 (671B) and a DeepSeek-V2-Lite shape (15.7B) as transformers
does: its DeepseekV3ForCausalLM built on the meta device (which, as when it loads a published
folder, has no multi-token-prediction layer: num_nextn_predict_layers is not built)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from minillm.config import Config
from minillm.families import model_config_from_hf
from minillm.info import model_info

# deepseek-ai/DeepSeek-V3's config.json, the keys that shape the model
DEEPSEEK_V3 = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, num_nextn_predict_layers=1, max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                      beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
)  # fmt: skip
# DeepSeek-V2-Lite's shape as a DeepseekV3 config: no query bottleneck, 2 shared experts
V2_LITE = dict(
    DEEPSEEK_V3, vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
    n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
    first_k_dense_replace=1, q_lora_rank=None,
)  # fmt: skip


def transformers_count(values: dict[str, Any]) -> int:
    cfg = transformers.DeepseekV3Config(**values)
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(cfg)
    assert len(hf.model.layers) == values["num_hidden_layers"]  # no MTP layer
    return sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize(
    "values, total, active",
    [(DEEPSEEK_V3, 671_026_404_352, 37_552_282_624), (V2_LITE, 15_706_484_224, 2_661_150_208)],
    ids=["deepseek-v3", "v2-lite"],
)
def test_info_counts_deepseek_as_transformers_does(
    values: dict[str, Any], total: int, active: int
) -> None:
    hf_total = transformers_count(values)
    cfg = model_config_from_hf({**values, "model_type": "deepseek_v3",
                                "architectures": ["DeepseekV3ForCausalLM"]})  # fmt: skip
    assert cfg.attention == "mla" and cfg.kv_lora_rank == 512
    info = model_info(Config(model=cfg))
    assert info["params"] == hf_total == total
    # a token runs k of the E routed experts of each MoE block
    C, F = values["hidden_size"], values["moe_intermediate_size"]
    E, k = values["n_routed_experts"], values["num_experts_per_tok"]
    moe_blocks = values["num_hidden_layers"] - values["first_k_dense_replace"]
    assert info["params_active"] == hf_total - moe_blocks * (E - k) * 3 * C * F == active
