"""The one mapping between minillm's parameters and Hugging Face `LlamaForCausalLM`'s (a
mixture of experts: `MixtralForCausalLM`'s).

Offers `hf_config_dict`, `model_config_from_hf`, `to_hf_state_dict` and `from_hf_state_dict`.
Both models use RoPE's "rotate half" layout, so q/k weights need no permutation; only our fused
projections (wqkv, w_gate_up) are split into, or joined from, HF's separate ones. Mixtral's
experts are written under the names of its published checkpoints (block_sparse_moe.experts.N.w1,
w2, w3), which every transformers version loads, and read from those or from transformers 5's
in-memory stacks (mlp.experts.gate_up_proj, down_proj: our layout).
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.config import ModelConfig
from minillm.errors import ConfigError


def hf_config_dict(
    cfg: ModelConfig, bos_id: int | None, eos_id: int | None, router_aux_loss_coef: float = 0.0
) -> dict[str, Any]:
    """A `config.json` for `LlamaForCausalLM` (`MixtralForCausalLM` with model.n_experts) of the
    same architecture; router_aux_loss_coef is the run's train.moe_aux_loss."""
    moe = {}
    if cfg.n_experts:
        moe = {
            "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.n_experts_per_token,
            "router_aux_loss_coef": router_aux_loss_coef,
            "output_router_logits": False,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    return {
        "architectures": ["MixtralForCausalLM" if cfg.n_experts else "LlamaForCausalLM"],
        "model_type": "mixtral" if cfg.n_experts else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.moe_ffn_hidden if cfg.n_experts else cfg.ffn_hidden,
        **moe,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        # No pad id: LlamaModel hands it to nn.Embedding as padding_idx, whose row then never
        # gets a gradient, and ours is end-of-text, which a fine-tune must keep learning.
        "pad_token_id": None,
        "torch_dtype": "float32",
        "use_cache": True,
    }


# The HF model types minillm reads, with the class each names.
READABLE = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}


def is_llama_config(hf: dict[str, Any]) -> bool:
    """Whether an HF config.json describes a model minillm computes: model_type "llama" or
    "mixtral", and its class (LlamaForCausalLM, MixtralForCausalLM) among its architectures
    where it lists any."""
    archs = hf.get("architectures") or []
    model_class = READABLE.get(hf.get("model_type"))
    return model_class is not None and (not archs or model_class in archs)


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Our ModelConfig from an HF Llama or Mixtral `config.json`; refuses what our model cannot
    express."""

    if not is_llama_config(hf):
        archs = hf.get("architectures") or []
        raise ConfigError(
            "model_type",
            f"a {hf.get('model_type')!r} model ({', '.join(archs) or 'no architectures'}), "
            "not LlamaForCausalLM or MixtralForCausalLM, the architectures minillm reads",
            where,
        )
    for key, ok in (
        ("attention_bias", False),
        ("mlp_bias", False),
        ("hidden_act", "silu"),
    ):
        if hf.get(key, ok) != ok:
            raise ConfigError(key, f"{hf[key]!r} is not supported (minillm needs {ok!r})", where)
    scaling = hf.get("rope_scaling")
    if scaling:  # minillm computes plain RoPE; a scaled one would give other logits
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        raise ConfigError(
            "rope_scaling", f"rope_type {kind!r} (RoPE scaling) is not supported", where
        )
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":  # transformers >= 5 moved RoPE scaling into rope_parameters
        raise ConfigError(
            "rope_parameters", f"rope_type {rope_type!r} (RoPE scaling) is not supported", where
        )
    rope_theta = hf.get("rope_theta")
    if rope_theta is None:  # transformers >= 5 nests it in rope_parameters
        rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    n_head = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    if head_dim * n_head != hf["hidden_size"]:
        raise ConfigError("head_dim", "head_dim * num_attention_heads != hidden_size", where)
    moe = {}
    if hf.get("model_type") == "mixtral":
        window = hf.get("sliding_window")
        if window is not None and window < hf.get("max_position_embeddings", 2048):
            raise ConfigError(
                "sliding_window", f"{window} (sliding-window attention) is not supported", where
            )
        moe = dict(
            n_experts=hf.get("num_local_experts", 8),
            n_experts_per_token=hf.get("num_experts_per_tok", 2),
            moe_ffn_hidden=hf["intermediate_size"],
        )
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope_theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **moe,
    )


def to_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state_dict -> HF names, splitting fused projections. Tensors are made contiguous."""
    H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    out = {
        "model.embed_tokens.weight": sd["tok_emb.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = sd[ours + "attn.wqkv.weight"].split((H * D, K * D, K * D), dim=0)
        out.update(
            {
                theirs + "input_layernorm.weight": sd[ours + "attn_norm.weight"],
                theirs + "self_attn.q_proj.weight": q,
                theirs + "self_attn.k_proj.weight": k,
                theirs + "self_attn.v_proj.weight": v,
                theirs + "self_attn.o_proj.weight": sd[ours + "attn.wo.weight"],
                theirs + "post_attention_layernorm.weight": sd[ours + "ffn_norm.weight"],
            }
        )
        if cfg.n_experts:
            moe = theirs + "block_sparse_moe."
            out[moe + "gate.weight"] = sd[ours + "ffn.router.weight"]
            for e in range(cfg.n_experts):
                w1, w3 = sd[ours + "ffn.w_gate_up"][e].chunk(2, dim=0)
                out[moe + f"experts.{e}.w1.weight"] = w1
                out[moe + f"experts.{e}.w2.weight"] = sd[ours + "ffn.w_down"][e]
                out[moe + f"experts.{e}.w3.weight"] = w3
        else:
            gate, up = sd[ours + "ffn.w_gate_up.weight"].chunk(2, dim=0)
            out[theirs + "mlp.gate_proj.weight"] = gate
            out[theirs + "mlp.up_proj.weight"] = up
            out[theirs + "mlp.down_proj.weight"] = sd[ours + "ffn.w_down.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Llama (Mixtral) state_dict -> ours, joining q/k/v and gate/up (and stacking experts).
    Raises KeyError on a missing name."""
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
                ours + "attn.wqkv.weight": torch.cat(
                    [sd[attn + f"{n}_proj.weight"] for n in ("q", "k", "v")], dim=0
                ),
                ours + "attn.wo.weight": sd[attn + "o_proj.weight"],
                ours + "ffn_norm.weight": sd[theirs + "post_attention_layernorm.weight"],
            }
        )
        if cfg.n_experts:
            out.update(_experts_from_hf(sd, theirs, ours + "ffn.", cfg.n_experts))
        else:
            out[ours + "ffn.w_gate_up.weight"] = torch.cat(
                [sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]], dim=0
            )
            out[ours + "ffn.w_down.weight"] = sd[mlp + "down_proj.weight"]
    return out


def _experts_from_hf(
    sd: dict[str, torch.Tensor], theirs: str, ours: str, n_experts: int
) -> dict[str, torch.Tensor]:
    """One Mixtral layer's router and stacked experts, from the published per-expert names or
    from transformers 5's stacks (already our layout)."""
    stacked = theirs + "mlp.experts."
    if stacked + "gate_up_proj" in sd:
        return {
            ours + "router.weight": sd[theirs + "mlp.gate.weight"],
            ours + "w_gate_up": sd[stacked + "gate_up_proj"],
            ours + "w_down": sd[stacked + "down_proj"],
        }
    moe = theirs + "block_sparse_moe."
    experts = [moe + f"experts.{e}." for e in range(n_experts)]
    return {
        ours + "router.weight": sd[moe + "gate.weight"],
        ours + "w_gate_up": torch.stack(
            [torch.cat([sd[x + "w1.weight"], sd[x + "w3.weight"]], dim=0) for x in experts]
        ),
        ours + "w_down": torch.stack([sd[x + "w2.weight"] for x in experts]),
    }
