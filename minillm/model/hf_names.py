"""The one mapping between minillm's parameters and Hugging Face `LlamaForCausalLM`'s, and the
families that are our model with options: `Qwen2ForCausalLM` (model.attention_bias),
`Qwen3ForCausalLM` (model.qk_norm), `MistralForCausalLM` (model.sliding_window) and, with
experts, `MixtralForCausalLM`, `Qwen2MoeForCausalLM` (a shared expert, model.moe_norm_topk,
model.moe_dense_layers, q/k/v biases) and `Qwen3MoeForCausalLM` (qk_norm), and
`Gemma3ForCausalLM` (model_type gemma3_text: model.qk_norm, sandwich_norm, ffn_activation
gelu_tanh, embed_scale, query_pre_attn_scalar, local layers) and `Phi3ForCausalLM`
(model.partial_rotary, rope_scaling longrope, fused qkv_proj and gate_up_proj: its own module,
minillm.model.hf_phi3); each takes model.rope_scaling and model.head_dim.
`DeepseekV3ForCausalLM` (model.attention mla) is minillm.model.hf_deepseek's. Gemma's RMSNorm
multiplies by (1 + w) where HF stores w: our norms hold 1 + w, so the 1 is added on reading
and taken off on writing.

Offers `READABLE`, `FAMILY_DEFAULTS`, `hf_model_type`, `hf_rope_scaling`, `hf_config_dict`,
`is_llama_config`, `model_config_from_hf`, `to_hf_state_dict` and `from_hf_state_dict`.
Both models use RoPE's "rotate half" layout, so q/k weights need no permutation (but for
model.partial_rotary's, hf_phi3); only our fused
projections (wqkv, w_gate_up) are split into, or joined from, HF's separate ones. Mixtral's
experts are written under the names of its published checkpoints (block_sparse_moe.experts.N.w1,
w2, w3), which every transformers version loads, and read from those or from transformers 5's
in-memory stacks (mlp.experts.gate_up_proj, down_proj: our layout); the Qwen MoEs' likewise
(mlp.experts.N.gate_proj, up_proj, down_proj, as Qwen publishes them).

config.json's router_aux_loss_coef and output_router_logits are not read: they change no logit,
only transformers' training loss; a run's coefficient is its train.moe_aux_loss, which the
export writes as router_aux_loss_coef.
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.config import ModelConfig
from minillm.errors import ConfigError
from minillm.model.hf_deepseek import (
    DEEPSEEK_DEFAULTS,
    check_deepseek,
    deepseek_config,
    deepseek_from_hf,
    deepseek_from_hf_state,
    deepseek_to_hf_state,
)
from minillm.model.hf_phi3 import (
    PHI3_DEFAULTS,
    check_phi3_options,
    is_phi3,
    join_fused,
    phi3_family_config,
    phi3_normalized,
    rotary_rows_to_hf,
    rotary_rows_to_ours,
    split_fused,
)

# The HF model types minillm reads and writes, with the class each names.
READABLE = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# The options that make a model Gemma 3's block, each its transformers config's.
_GEMMA_OPTIONS = ("qk_norm", "sandwich_norm", "embed_scale")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# model.rope_scaling's keys as transformers' rope_parameters spell them (all but `type`).
_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "truncate",
        "mscale",
        "mscale_all_dim",
    ),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "short_factor",
        "long_factor",
    ),
}


def hf_model_type(cfg: ModelConfig) -> str:
    """The transformers family that computes `cfg`: Gemma 3 with sandwich norms; with experts
    Qwen3-MoE (qk_norm), Qwen2-MoE (a shared expert) or Mixtral; Qwen3 with qk_norm, Qwen2 with
    q/k/v biases, Mistral with a sliding window, else Llama (every one takes rope_scaling and
    head_dim); Phi-3 with partial RoPE or LongRoPE. A ConfigError names an option no
    family has with the others."""
    if cfg.attention == "mla":  # DeepSeek-V3: minillm.model.hf_deepseek
        check_deepseek(cfg)
        return "deepseek_v3"
    if is_phi3(cfg):
        check_phi3_options(cfg)
        return "phi3"
    gemma = cfg.sandwich_norm or cfg.embed_scale or cfg.ffn_activation != "silu"
    gemma = gemma or cfg.query_pre_attn_scalar is not None or cfg.rope_local_theta is not None
    gemma = gemma or cfg.sliding_window_pattern > 0
    if gemma:
        for key in _GEMMA_OPTIONS:
            if not getattr(cfg, key):
                raise ConfigError(
                    f"model.{key}",
                    "false: Gemma 3, the family of this model's other options, has it",
                )
        if cfg.ffn_activation != "gelu_tanh":
            raise ConfigError("model.ffn_activation", "silu: Gemma 3's FFN is a GeGLU (gelu_tanh)")
        for key in ("attention_bias", "n_experts"):
            if getattr(cfg, key):
                raise ConfigError(f"model.{key}", "not in Gemma 3, the family of the others")
        return "gemma3_text"
    if cfg.qk_norm and cfg.attention_bias:  # Qwen3's attention_bias biases o_proj too
        raise ConfigError("model.attention_bias", "with model.qk_norm: no transformers family")
    if cfg.n_experts:
        return _moe_type(cfg)
    if cfg.qk_norm:
        return "qwen3"
    if cfg.attention_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window is not None else "llama"


def _moe_type(cfg: ModelConfig) -> str:
    """The MoE family of `cfg` (n_experts > 0): Qwen3-MoE has qk_norm and no shared expert,
    Qwen2-MoE a shared expert and no qk_norm (its own sliding-window pattern is not ours),
    Mixtral neither, its top-k renormalised in every layer."""
    if cfg.moe_router == "sigmoid":
        raise ConfigError(
            "model.moe_router",
            "sigmoid without model.attention mla: DeepSeek-V3, the family that routes so, has "
            "latent attention",
        )
    if cfg.qk_norm:
        if cfg.moe_shared_ffn_hidden:
            raise ConfigError(
                "model.moe_shared_ffn_hidden",
                f"{cfg.moe_shared_ffn_hidden} with model.qk_norm: no transformers family has "
                "both (Qwen3-MoE has no shared expert)",
            )
        return "qwen3_moe"
    if cfg.moe_shared_ffn_hidden:
        if cfg.sliding_window is not None:
            raise ConfigError(
                "model.sliding_window",
                f"{cfg.sliding_window} with a shared expert (Qwen2-MoE): its window is in "
                "alternate layers only",
            )
        return "qwen2_moe"
    for key, used in (
        ("attention_bias", cfg.attention_bias),
        ("moe_norm_topk", not cfg.moe_norm_topk),
        ("moe_dense_layers", cfg.moe_dense_layers),
    ):
        if used:
            raise ConfigError(
                f"model.{key}",
                f"{getattr(cfg, key)!r} on a mixture of experts needs a shared expert "
                "(Qwen2-MoE) or model.qk_norm (Qwen3-MoE): Mixtral has neither",
            )
    return "mixtral"


def hf_rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """config.json's rope_scaling for model.rope_scaling (None for plain RoPE), which
    transformers 4 reads as such and 5 as its rope_parameters."""
    s = cfg.rope_scaling
    if s.type == "none":
        return None
    out: dict[str, Any] = {"rope_type": s.type, "rope_theta": cfg.rope_theta}
    out.update({k: getattr(s, k) for k in _ROPE_KEYS[s.type] if getattr(s, k) is not None})
    return out


def hf_config_dict(
    cfg: ModelConfig, bos_id: int | None, eos_id: int | None, router_aux_loss_coef: float = 0.0
) -> dict[str, Any]:
    """A `config.json` for the transformers class of the same architecture (`hf_model_type`);
    router_aux_loss_coef is the run's train.moe_aux_loss."""
    model_type = hf_model_type(cfg)
    if model_type == "gemma3_text":
        return {**_gemma3_config(cfg), **_config_tail(bos_id, eos_id)}
    if model_type == "deepseek_v3":
        return {**deepseek_config(cfg, hf_rope_scaling(cfg)), **_config_tail(bos_id, eos_id)}
    family: dict[str, Any] = {}
    if model_type == "mixtral":
        family = {
            "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.n_experts_per_token,
            "router_aux_loss_coef": router_aux_loss_coef,
            "output_router_logits": False,
            "router_jitter_noise": 0.0,
        }
    if model_type in ("qwen2_moe", "qwen3_moe"):
        family = {
            "num_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.n_experts_per_token,
            "moe_intermediate_size": cfg.moe_ffn_hidden,
            "norm_topk_prob": cfg.moe_norm_topk,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.moe_dense_layers),
            "router_aux_loss_coef": router_aux_loss_coef,
            "output_router_logits": False,
            "use_sliding_window": cfg.sliding_window is not None,
            "sliding_window": cfg.sliding_window,
            "max_window_layers": cfg.n_layer,
        }
    if model_type == "qwen2_moe":  # transformers 5's qkv_bias (4.x: always biased)
        family.update(
            shared_expert_intermediate_size=cfg.moe_shared_ffn_hidden,
            qkv_bias=cfg.attention_bias,
        )
    if model_type in ("mixtral", "mistral"):
        family["sliding_window"] = cfg.sliding_window
    if model_type in ("qwen2", "qwen3"):  # every layer slides (max_window_layers 0) or none does
        window = cfg.sliding_window is not None
        kind = "sliding_attention" if window else "full_attention"
        family.update(
            use_sliding_window=window,
            sliding_window=cfg.sliding_window,
            max_window_layers=0 if window else cfg.n_layer,
            layer_types=[kind] * cfg.n_layer,
        )
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        family["attention_bias"] = False
    if model_type == "llama":
        family["mlp_bias"] = False
    if model_type == "phi3":
        family = phi3_family_config(cfg)
    # transformers' dynamic NTK scales past max_position_embeddings: our original length.
    dynamic = cfg.rope_scaling.type == "dynamic"
    max_len = cfg.rope_scaling.original_max_position_embeddings if dynamic else cfg.max_seq_len
    return {
        "architectures": [READABLE[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        # Mixtral's is its experts' width; the Qwen MoEs' that of their dense layers.
        "intermediate_size": cfg.moe_ffn_hidden if model_type == "mixtral" else cfg.ffn_hidden,
        **family,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": max_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": hf_rope_scaling(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        **_config_tail(bos_id, eos_id),
    }


def _config_tail(bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """The keys every config.json minillm writes ends with, whatever the family."""
    return {
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        # No pad id: LlamaModel hands it to nn.Embedding as padding_idx, whose row then never
        # gets a gradient, and ours is end-of-text, which a fine-tune must keep learning.
        "pad_token_id": None,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _layer_types(cfg: ModelConfig) -> list[str]:
    kinds = ("full_attention", "sliding_attention")
    return [kinds[cfg.local_layer(i)] for i in range(cfg.n_layer)]


def _gemma3_config(cfg: ModelConfig) -> dict[str, Any]:
    """A Gemma3TextConfig's config.json but its _config_tail, in the keys of the published
    folders (rope_theta, rope_local_base_freq, rope_scaling), which transformers 4 and 5 both
    read."""
    local_theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    if cfg.rope_local_theta is None and cfg.sliding_window is not None:
        if cfg.rope_scaling.type != "none":  # Gemma's sliding layers take plain RoPE
            raise ConfigError(
                "model.rope_local_theta",
                "null with rope_scaling: Gemma 3's sliding layers take plain RoPE at their own "
                "base; set it",
            )
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
        # No sliding layer reads it then; Gemma3TextConfig wants a number.
        "sliding_window": cfg.sliding_window or cfg.max_seq_len,
        **(
            {"sliding_window_pattern": cfg.sliding_window_pattern}
            if cfg.sliding_window_pattern
            else {}
        ),
        "layer_types": _layer_types(cfg),
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_local_base_freq": local_theta,
        "rope_scaling": hf_rope_scaling(cfg),
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def is_llama_config(hf: dict[str, Any]) -> bool:
    """Whether an HF config.json describes a family minillm computes: a model_type of READABLE,
    and its class among its architectures where it lists any."""
    archs = hf.get("architectures") or []
    model_class = READABLE.get(hf.get("model_type"))
    return model_class is not None and (not archs or model_class in archs)


def _rope_from_hf(hf: dict[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """rope_theta and model.rope_scaling's values from config.json's rope_scaling (transformers
    4) or rope_parameters (5), `hf` with its family's defaults filled in (FAMILY_DEFAULTS);
    what minillm does not compute is a ConfigError naming the key."""
    key, params = "rope_parameters", hf.get("rope_parameters")
    if isinstance(hf.get("rope_scaling"), dict):
        key, params = "rope_scaling", hf["rope_scaling"]
    params = params if isinstance(params, dict) else {}
    theta = params.get("rope_theta", hf["rope_theta"])
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), {}
    if kind not in _ROPE_KEYS or (kind == "longrope" and hf.get("model_type") != "phi3"):
        kinds = ", ".join(k for k in _ROPE_KEYS if k != "longrope") + "; longrope in Phi-3 only"
        raise ConfigError(key, f"rope_type {kind!r} is not supported (minillm: {kinds})", where)
    for extra in ("mscale", "mscale_all_dim"):  # DeepSeek's (MLA's softmax scale) for any type
        if kind != "yarn" and params.get(extra):
            message = f"{params[extra]!r} with {kind} is not supported"
            raise ConfigError(f"{key}.{extra}", message, where)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{key}.partial_rotary_factor", "partial RoPE is not supported", where)
    scaling = {
        "type": kind,
        **{k: params[k] for k in _ROPE_KEYS[kind] if params.get(k) is not None},
    }
    max_len = hf["max_position_embeddings"]
    if kind == "dynamic":  # transformers scales past max_position_embeddings
        scaling["original_max_position_embeddings"] = max_len
    elif kind in ("yarn", "llama3", "longrope"):  # transformers' defaults where it has none
        # transformers 5 prefers a top-level original_max_position_embeddings (Phi-3's place
        # for it) to rope_scaling's own.
        if hf.get("original_max_position_embeddings") is not None:
            scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        scaling.setdefault("original_max_position_embeddings", max_len)
        if "factor" not in scaling:
            scaling["factor"] = max_len / scaling["original_max_position_embeddings"]
    return float(theta), scaling


def _window_from_hf(hf: dict[str, Any], where: str) -> int | None:
    """model.sliding_window: Mistral's and Mixtral's sliding_window; Qwen's where every layer
    slides (layer_types, or use_sliding_window from max_window_layers 0 on); some layers only
    is a ConfigError naming the key."""
    window = hf.get("sliding_window")
    n_layer = hf["num_hidden_layers"]
    if hf.get("model_type") in ("qwen2", "qwen3"):
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first = hf.get("max_window_layers", 28) if hf.get("use_sliding_window") else n_layer
            layer_types = [
                "sliding_attention" if window is not None and i >= first else "full_attention"
                for i in range(n_layer)
            ]
        if len(set(layer_types)) > 1:
            raise ConfigError(
                "layer_types",
                "sliding-window attention in some layers only is not supported",
                where,
            )
        return window if layer_types and layer_types[0] == "sliding_attention" else None
    if hf.get("model_type") == "qwen3_moe":  # every layer slides or none does
        return window if hf.get("use_sliding_window") else None
    if hf.get("model_type") == "qwen2_moe":
        layer_types = hf.get("layer_types") or [  # transformers' pattern: alternate layers
            "sliding_attention"
            if (i + 1) % 2 and i < hf.get("max_window_layers", 28) and hf.get("use_sliding_window")
            else "full_attention"
            for i in range(n_layer)
        ]
        if "sliding_attention" in layer_types:
            key = "layer_types" if hf.get("layer_types") else "use_sliding_window"
            raise ConfigError(key, "Qwen2-MoE's sliding-window attention is not supported", where)
        return None
    return window if hf.get("model_type") in ("mistral", "mixtral", "phi3") else None


# What transformers' config classes (4.x and 5.x) give a key config.json leaves out, per family
# where it is not Llama's (tests/test_hf_families.py checks them against the classes): a
# Mixtral folder without rope_theta rotates at 1e6, not Llama's 10,000.
_LLAMA_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": {**_LLAMA_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096,
                "num_key_value_heads": 8},
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2": {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 32},
    "qwen3": {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 32},
    "gemma3_text": {"rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                    "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "rope_local_base_freq": 10000.0,
                    "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
                    "tie_word_embeddings": True},
    "qwen2_moe": {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 16,
                  "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "qkv_bias": True},
    "qwen3_moe": {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 4,
                  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1},
    "deepseek_v3": DEEPSEEK_DEFAULTS,
    "phi3": PHI3_DEFAULTS,
}  # fmt: skip


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Our ModelConfig from an HF config.json of a family minillm reads (READABLE); refuses, one
    key named, what our model cannot express. A key config.json leaves out is the family's
    default in transformers (FAMILY_DEFAULTS), not Llama's."""

    if not is_llama_config(hf):
        archs = hf.get("architectures") or []
        raise ConfigError(
            "model_type",
            f"a {hf.get('model_type')!r} model ({', '.join(archs) or 'no architectures'}), "
            f"not one of the architectures minillm reads ({', '.join(READABLE.values())})",
            where,
        )
    model_type = hf["model_type"]
    if hf.get("quantization_config"):  # e.g. DeepSeek-V3's published fp8 blocks: read raw, garbage
        method = hf["quantization_config"].get("quant_method", "quantized")
        raise ConfigError("quantization_config", f"{method} weights are not supported", where)
    if "num_local_experts" in hf and model_type == "qwen3_moe":  # transformers 5 saves this name
        hf = {"num_experts": hf["num_local_experts"], **hf}
    hf = {**FAMILY_DEFAULTS.get(model_type, _LLAMA_DEFAULTS), **hf}
    if model_type == "gemma3_text":
        return _gemma3_from_hf(hf, where)
    if model_type == "deepseek_v3":
        return deepseek_from_hf(hf, *_rope_from_hf(hf, where), where)
    partial = 1.0
    if model_type == "phi3":
        hf, partial = phi3_normalized(hf, where)
    refused: list[tuple[str, Any]] = [("mlp_bias", False), ("hidden_act", "silu")]
    if model_type in ("llama", "qwen3", "mistral", "mixtral", "qwen3_moe"):  # biases o_proj too
        refused.append(("attention_bias", False))
    for key, ok in refused:
        if hf.get(key, ok) != ok:
            raise ConfigError(key, f"{hf[key]!r} is not supported (minillm needs {ok!r})", where)
    rope_theta, scaling = _rope_from_hf(hf, where)
    n_head = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    moe = {}
    if model_type == "mixtral":
        moe = dict(
            n_experts=hf["num_local_experts"],
            n_experts_per_token=hf["num_experts_per_tok"],
            moe_ffn_hidden=hf["intermediate_size"],
        )
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        moe = _qwen_moe_from_hf(hf, where)
    max_len = hf["max_position_embeddings"]
    if scaling.get("type") == "dynamic":  # reads past it: the length its factor reaches
        max_len = int(max_len * scaling["factor"])
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,
        head_dim=head_dim,
        attention_bias=model_type == "qwen2" or bool(model_type == "qwen2_moe" and hf["qkv_bias"]),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=_window_from_hf(hf, where),
        rope_scaling=scaling,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=max_len,
        rope_theta=rope_theta,
        norm_eps=float(hf["rms_norm_eps"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        partial_rotary=partial,
        **moe,
    )


def _gemma3_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """Our ModelConfig of a Gemma3TextConfig's config.json (its family defaults filled in)."""
    refused: list[tuple[str, Any]] = [
        ("hidden_activation", "gelu_pytorch_tanh"),
        ("attention_bias", False),
        ("final_logit_softcapping", None),
        ("attn_logit_softcapping", None),
        ("use_bidirectional_attention", False),
    ]
    for key, ok in refused:
        if hf.get(key, ok) != ok:
            raise ConfigError(key, f"{hf[key]!r} is not supported (minillm needs {ok!r})", where)
    params = hf.get("rope_parameters")
    local_theta = hf["rope_local_base_freq"]
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5's own
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(
                "rope_parameters.sliding_attention.rope_type",
                f"{local['rope_type']!r} is not supported (minillm: default)",
                where,
            )
        local_theta = local.get("rope_theta", local_theta)
        hf = {**hf, "rope_parameters": params["full_attention"], "rope_scaling": None}
    rope_theta, scaling = _rope_from_hf(hf, where)
    if scaling.get("type") == "dynamic":
        raise ConfigError(
            "rope_scaling", "dynamic with Gemma 3's local layers is not supported", where
        )
    n_layer, window = hf["num_hidden_layers"], hf["sliding_window"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        N = hf["sliding_window_pattern"]
        layer_types = [
            "sliding_attention" if (i + 1) % N else "full_attention" for i in range(n_layer)
        ]
    window, pattern = _gemma3_layers(layer_types, window, n_layer, where)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layer=n_layer,
        n_head=hf["num_attention_heads"],
        n_kv_head=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        qk_norm=True,
        sandwich_norm=True,
        ffn_activation="gelu_tanh",
        embed_scale=True,
        query_pre_attn_scalar=int(hf["query_pre_attn_scalar"]),
        sliding_window=window,
        sliding_window_pattern=pattern,
        rope_local_theta=float(local_theta),
        rope_scaling=scaling,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        rope_theta=rope_theta,
        norm_eps=float(hf["rms_norm_eps"]),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
    )


def _gemma3_layers(
    layer_types: list[str], window: int, n_layer: int, where: str
) -> tuple[int | None, int]:
    """model.sliding_window and sliding_window_pattern of Gemma 3's layer_types: none sliding,
    all, or all but every N-th; another arrangement is a ConfigError naming layer_types."""
    kinds = {"sliding_attention": True, "full_attention": False}
    if len(layer_types) != n_layer or any(t not in kinds for t in layer_types):
        raise ConfigError("layer_types", f"{layer_types!r}: want {n_layer} of {list(kinds)}", where)
    local = [kinds[t] for t in layer_types]
    if not any(local):
        return None, 0
    if all(local):
        return window, 0
    for N in range(2, n_layer + 1):
        if local == [bool((i + 1) % N) for i in range(n_layer)]:
            return window, N
    raise ConfigError("layer_types", "global layers other than every N-th are not supported", where)


def _norm_offset(cfg: ModelConfig) -> float:
    """What our norm weights hold more than HF's: Gemma's 1 of (1 + w), else 0."""
    return 1.0 if hf_model_type(cfg) == "gemma3_text" else 0.0


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _qwen_moe_from_hf(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """model.n_experts and the other MoE keys of a Qwen2-MoE or Qwen3-MoE config.json (its
    defaults filled in): a block is dense where transformers' decoder layer makes it so, in
    mlp_only_layers or off every decoder_sparse_step-th."""
    n_layer, n_experts, step = hf["num_hidden_layers"], hf["num_experts"], hf["decoder_sparse_step"]
    if not isinstance(step, int) or step < 1:
        raise ConfigError("decoder_sparse_step", f"{step!r} must be a whole number >= 1", where)
    if not isinstance(n_experts, int) or n_experts < 2:
        raise ConfigError("num_experts", f"{n_experts!r}: minillm needs 2 or more experts", where)
    k = hf["num_experts_per_tok"]
    if not isinstance(k, int) or not 1 <= k <= n_experts:
        raise ConfigError(
            "num_experts_per_tok", f"{k!r} must be 1 to num_experts={n_experts}", where
        )
    only = hf.get("mlp_only_layers") or []
    dense = [i for i in range(n_layer) if i in only or (i + 1) % step]
    if len(dense) == n_layer:
        key = "mlp_only_layers" if only else "decoder_sparse_step"
        raise ConfigError(key, "makes every block dense: no expert is used", where)
    moe = dict(
        n_experts=n_experts,
        n_experts_per_token=k,
        moe_ffn_hidden=hf["moe_intermediate_size"],
        moe_norm_topk=bool(hf["norm_topk_prob"]),
        moe_dense_layers=dense,
    )
    if hf["model_type"] == "qwen2_moe":
        shared = hf["shared_expert_intermediate_size"]
        if not isinstance(shared, int) or shared < 1:
            raise ConfigError(
                "shared_expert_intermediate_size", f"{shared!r} must be a width >= 1", where
            )
        moe["moe_shared_ffn_hidden"] = shared
    return moe


def to_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state_dict -> HF names, splitting fused projections. Tensors are made contiguous."""
    if cfg.attention == "mla":
        return {k: v.contiguous() for k, v in deepseek_to_hf_state(sd, cfg).items()}
    H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    offset = _norm_offset(cfg)
    if offset:
        sd = {k: v - offset if _is_norm(k) else v for k, v in sd.items()}
    out = {
        "model.embed_tokens.weight": sd["tok_emb.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        wqkv = rotary_rows_to_hf(sd[ours + "attn.wqkv.weight"], cfg)  # model.partial_rotary's
        q, k, v = wqkv.split((H * D, K * D, K * D), dim=0)
        out.update(
            {
                theirs + "input_layernorm.weight": sd[ours + "attn_norm.weight"],
                theirs + "self_attn.q_proj.weight": q,
                theirs + "self_attn.k_proj.weight": k,
                theirs + "self_attn.v_proj.weight": v,
                theirs + "self_attn.o_proj.weight": sd[ours + "attn.wo.weight"],
            }
        )
        if cfg.sandwich_norm:  # Gemma's names: post_attention_layernorm is the attention's own
            out[theirs + "post_attention_layernorm.weight"] = sd[ours + "attn_post_norm.weight"]
            out[theirs + "pre_feedforward_layernorm.weight"] = sd[ours + "ffn_norm.weight"]
            out[theirs + "post_feedforward_layernorm.weight"] = sd[ours + "ffn_post_norm.weight"]
        else:
            out[theirs + "post_attention_layernorm.weight"] = sd[ours + "ffn_norm.weight"]
        if cfg.attention_bias:  # Qwen2's q/k/v biases, split as the rows are
            for name, b in zip("qkv", sd[ours + "attn.wqkv.bias"].split((H * D, K * D, K * D))):
                out[theirs + f"self_attn.{name}_proj.bias"] = b
        if cfg.qk_norm:  # Qwen3's per-head norms
            out[theirs + "self_attn.q_norm.weight"] = sd[ours + "attn.q_norm.weight"]
            out[theirs + "self_attn.k_norm.weight"] = sd[ours + "attn.k_norm.weight"]
        if ours + "ffn.router.weight" in sd:
            out.update(_experts_to_hf(sd, ours + "ffn.", theirs, cfg))
        else:
            out.update(_swiglu_to_hf(sd, ours + "ffn.", theirs + "mlp."))
    if hf_model_type(cfg) == "phi3":
        out = join_fused(out, cfg)
    return {k: v.contiguous() for k, v in out.items()}


def _swiglu_to_hf(sd: dict[str, torch.Tensor], ours: str, theirs: str) -> dict[str, torch.Tensor]:
    """A SwiGLU's fused [gate; up] and down as gate_proj, up_proj and down_proj."""
    gate, up = sd[ours + "w_gate_up.weight"].chunk(2, dim=0)
    return {
        theirs + "gate_proj.weight": gate,
        theirs + "up_proj.weight": up,
        theirs + "down_proj.weight": sd[ours + "w_down.weight"],
    }


def _experts_to_hf(
    sd: dict[str, torch.Tensor], ours: str, theirs: str, cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """One MoE layer under its family's published names: Mixtral's block_sparse_moe.experts.N.w1,
    w2, w3, the Qwen MoEs' mlp.experts.N.gate_proj, up_proj, down_proj (and shared expert)."""
    out = {}
    mixtral = hf_model_type(cfg) == "mixtral"
    moe = theirs + ("block_sparse_moe." if mixtral else "mlp.")
    out[moe + "gate.weight"] = sd[ours + "router.weight"]
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for e in range(cfg.n_experts):
        gate, up = sd[ours + "w_gate_up"][e].chunk(2, dim=0)
        expert = moe + f"experts.{e}."
        out[expert + f"{names[0]}.weight"] = gate
        out[expert + f"{names[1]}.weight"] = up
        out[expert + f"{names[2]}.weight"] = sd[ours + "w_down"][e]
    if cfg.moe_shared_ffn_hidden:
        out.update(_swiglu_to_hf(sd, ours + "shared.", moe + "shared_expert."))
        out[moe + "shared_expert_gate.weight"] = sd[ours + "shared.gate.weight"]
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Llama (Mixtral) state_dict -> ours, joining q/k/v and gate/up (and stacking experts).
    Raises KeyError on a missing name."""
    if cfg.attention == "mla":
        return deepseek_from_hf_state(sd, cfg)
    sd = split_fused(sd, cfg)  # Phi-3's qkv_proj and gate_up_proj
    out = {
        "tok_emb.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn, mlp = theirs + "self_attn.", theirs + "mlp."
        out.update(
            {
                ours + "attn_norm.weight": sd[theirs + "input_layernorm.weight"],
                ours + "attn.wqkv.weight": rotary_rows_to_ours(
                    torch.cat([sd[attn + f"{n}_proj.weight"] for n in ("q", "k", "v")], dim=0),
                    cfg,
                ),
                ours + "attn.wo.weight": sd[attn + "o_proj.weight"],
            }
        )
        if cfg.sandwich_norm:
            out[ours + "attn_post_norm.weight"] = sd[theirs + "post_attention_layernorm.weight"]
            out[ours + "ffn_norm.weight"] = sd[theirs + "pre_feedforward_layernorm.weight"]
            out[ours + "ffn_post_norm.weight"] = sd[theirs + "post_feedforward_layernorm.weight"]
        else:
            out[ours + "ffn_norm.weight"] = sd[theirs + "post_attention_layernorm.weight"]
        if cfg.attention_bias:
            out[ours + "attn.wqkv.bias"] = torch.cat(
                [sd[attn + f"{n}_proj.bias"] for n in ("q", "k", "v")], dim=0
            )
        if cfg.qk_norm:
            out[ours + "attn.q_norm.weight"] = sd[attn + "q_norm.weight"]
            out[ours + "attn.k_norm.weight"] = sd[attn + "k_norm.weight"]
        if cfg.n_experts and i not in cfg.moe_dense_layers:
            out.update(_experts_from_hf(sd, theirs, ours + "ffn.", cfg))
        else:
            out[ours + "ffn.w_gate_up.weight"] = torch.cat(
                [sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]], dim=0
            )
            out[ours + "ffn.w_down.weight"] = sd[mlp + "down_proj.weight"]
    offset = _norm_offset(cfg)
    if offset:  # in float32: a bfloat16 1 + w would round w away
        out = {k: v.float() + offset if _is_norm(k) else v for k, v in out.items()}
    return out


def _experts_from_hf(
    sd: dict[str, torch.Tensor], theirs: str, ours: str, cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """One MoE layer's router, stacked experts (and shared expert), from the published
    per-expert names (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj) or from transformers 5's
    stacks (already our layout)."""
    stacked = theirs + "mlp.experts."
    out = {}
    if cfg.moe_shared_ffn_hidden:
        shared = theirs + "mlp.shared_expert."
        out[ours + "shared.w_gate_up.weight"] = torch.cat(
            [sd[shared + "gate_proj.weight"], sd[shared + "up_proj.weight"]], dim=0
        )
        out[ours + "shared.w_down.weight"] = sd[shared + "down_proj.weight"]
        out[ours + "shared.gate.weight"] = sd[theirs + "mlp.shared_expert_gate.weight"]
    if stacked + "gate_up_proj" in sd:
        return {
            **out,
            ours + "router.weight": sd[theirs + "mlp.gate.weight"],
            ours + "w_gate_up": sd[stacked + "gate_up_proj"],
            ours + "w_down": sd[stacked + "down_proj"],
        }
    if theirs + "block_sparse_moe.gate.weight" in sd:  # Mixtral's published names
        moe, names = theirs + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        moe, names = theirs + "mlp.", ("gate_proj", "up_proj", "down_proj")
    experts = [moe + f"experts.{e}." for e in range(cfg.n_experts)]
    gate, up, down = (f"{n}.weight" for n in names)
    return {
        **out,
        ours + "router.weight": sd[moe + "gate.weight"],
        ours + "w_gate_up": torch.stack(
            [torch.cat([sd[x + gate], sd[x + up]], dim=0) for x in experts]
        ),
        ours + "w_down": torch.stack([sd[x + down] for x in experts]),
    }
