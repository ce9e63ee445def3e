"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, model_type deepseek_v3) in minillm's names: the config
and the weights of a model with `model.attention: mla` and, past its first dense blocks, the
sigmoid-routed experts of `model.moe_router: sigmoid`. Its llama.cpp architecture, deepseek2, is
minillm.families.deepseek_v3_gguf's.

Offers `DeepseekV3`, `DEEPSEEK_DEFAULTS` and `check_deepseek`.

The names are those of DeepSeek's published checkpoints, which transformers' save_pretrained
also writes: self_attn.q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj; mlp.gate.weight and mlp.gate.e_score_correction_bias (our
router and its routing bias), mlp.experts.N.{gate,up,down}_proj and mlp.shared_experts.*; the
dense blocks' mlp.{gate,up,down}_proj. transformers 5's in-memory stacks (mlp.experts.gate_up_proj,
down_proj: our layout) are read too. Tensors of layers past num_hidden_layers (the
multi-token-prediction module) are not read, as transformers ignores them.

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (rope_interleave, true in its
folders); minillm rotates halves. Taking the rotated rows of the q and kv_a projections in the
order evens-then-odds turns one into the other exactly (a dot product of q and k is the same
under one permutation of both), so import permutes those rows and export puts them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from minillm.config import ModelConfig
from minillm.errors import ConfigError
from minillm.families.base import (
    Family,
    Named,
    Tensor,
    experts_from_hf,
    experts_to_hf,
    hf_rope_scaling,
    rope_from_hf,
    swiglu_from_hf,
    swiglu_to_hf,
)

_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


# What transformers' DeepseekV3Config gives a key config.json leaves out (tests/test_mla.py
# checks them against the class).
DEEPSEEK_DEFAULTS: dict[str, Any] = {
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "tie_word_embeddings": False, "rope_interleave": True,
}  # fmt: skip


def check_deepseek(cfg: ModelConfig) -> None:
    """A ConfigError naming the key unless DeepseekV3 computes `cfg` (model.attention mla)."""
    for key, used in (
        ("sandwich_norm", cfg.sandwich_norm),
        ("embed_scale", cfg.embed_scale),
        ("ffn_activation", cfg.ffn_activation != "silu"),
        ("rope_local_theta", cfg.rope_local_theta is not None),
    ):
        if used:
            raise ConfigError(f"model.{key}", f"{getattr(cfg, key)!r}: not in DeepSeek-V3")
    if not cfg.n_experts:
        return
    if cfg.moe_router != "sigmoid":
        raise ConfigError("model.moe_router", "softmax: DeepSeek-V3's experts route by sigmoid")
    first = len(cfg.moe_dense_layers)
    if sorted(cfg.moe_dense_layers) != list(range(first)):
        raise ConfigError(
            "model.moe_dense_layers",
            f"{cfg.moe_dense_layers}: DeepSeek-V3's dense blocks are the first k (0 .. k-1)",
        )
    if cfg.moe_shared_ffn_hidden % cfg.moe_ffn_hidden:
        raise ConfigError(
            "model.moe_shared_ffn_hidden",
            f"{cfg.moe_shared_ffn_hidden}: DeepSeek-V3's shared experts are a whole number of "
            f"moe_ffn_hidden={cfg.moe_ffn_hidden}",
        )


def _config(cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
    """A DeepseekV3Config's config.json for `cfg` (check_deepseek passed) but the keys every
    family's ends with (base.config_tail: token ids, dtype); a dense model has
    every block dense (first_k_dense_replace = n_layer) and placeholder expert keys.

    It holds the routing keys of DeepSeek's published config.json too, which transformers'
    class does not read but DeepSeek's own code, vLLM and SGLang do (`getattr(config,
    "scoring_func", "softmax")`): without them they would route by softmax and drop the
    correction bias."""
    E = cfg.n_experts
    moe_width = cfg.moe_ffn_hidden if E else cfg.ffn_hidden
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "moe_intermediate_size": moe_width,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head,
        "n_routed_experts": E or 2,
        "num_experts_per_tok": cfg.n_experts_per_token if E else 1,
        "n_shared_experts": cfg.moe_shared_ffn_hidden // moe_width if E else 0,
        "routed_scaling_factor": cfg.moe_routed_scale,
        "n_group": cfg.moe_n_group,
        "topk_group": cfg.moe_topk_group,
        "norm_topk_prob": cfg.moe_norm_topk,
        "first_k_dense_replace": len(cfg.moe_dense_layers) if E else cfg.n_layer,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_interleave": True,  # DeepSeek's layout: deepseek_to_hf_state permutes to it
        "num_nextn_predict_layers": 0,  # no multi-token-prediction module
        "scoring_func": "sigmoid",  # DeepSeekMoE's router (model.moe_router sigmoid)
        "topk_method": "noaux_tc",  # group-limited top-k with e_score_correction_bias
        "moe_layer_freq": 1,  # every block past the first k dense ones has experts
        "ep_size": 1,
        "seq_aux": True,
        "aux_loss_alpha": router_aux_loss_coef,
        "pretraining_tp": 1,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": hf_rope_scaling(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def _config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """Our ModelConfig of a DeepseekV3Config's config.json (DEEPSEEK_DEFAULTS filled in); what
    minillm does not compute names its key."""
    # rope_interleave false (rows already in halves) would need the folder's config with its
    # weights; no published DeepSeek folder has it.
    for key, ok in (("attention_bias", False), ("hidden_act", "silu"), ("rope_interleave", True)):
        if hf.get(key, ok) != ok:
            raise ConfigError(key, f"{hf[key]!r} is not supported (minillm needs {ok!r})", where)
    rope_theta, scaling = rope_from_hf(hf, where)
    n_layer = hf["num_hidden_layers"]
    first = hf["first_k_dense_replace"]
    moe: dict[str, Any] = {}
    E = hf.get("n_routed_experts", hf.get("num_local_experts"))
    if first < n_layer:  # some blocks have experts
        if not isinstance(E, int) or E < 2:
            raise ConfigError("n_routed_experts", f"{E!r}: minillm needs 2 or more experts", where)
        F = hf["moe_intermediate_size"]
        moe = dict(
            n_experts=E,
            n_experts_per_token=hf["num_experts_per_tok"],
            moe_ffn_hidden=F,
            moe_norm_topk=bool(hf["norm_topk_prob"]),
            moe_shared_ffn_hidden=F * (hf["n_shared_experts"] or 0),
            moe_dense_layers=list(range(first)),
            moe_router="sigmoid",
            moe_n_group=hf["n_group"] or 1,
            moe_topk_group=hf["topk_group"] or 1,
            moe_routed_scale=float(hf["routed_scaling_factor"]),
        )
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layer=n_layer,
        n_head=hf["num_attention_heads"],
        attention="mla",
        q_lora_rank=hf["q_lora_rank"],
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_scaling=scaling,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        rope_theta=rope_theta,
        norm_eps=float(hf["rms_norm_eps"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        family="deepseek_v3",
        **moe,
    )


def _rope_rows(cfg: ModelConfig, heads: int, width: int, to_hf: bool) -> torch.Tensor:
    """Row order of a projection of `heads` blocks of `width` rows whose last P rows rotate:
    DeepSeek's interleaved pairs -> minillm's halves (evens, then odds), or back with to_hf."""
    P = cfg.qk_rope_head_dim
    halves = torch.cat((torch.arange(0, P, 2), torch.arange(1, P, 2)))
    rope = halves.argsort() if to_hf else halves
    block = torch.cat((torch.arange(width - P), width - P + rope))
    return (torch.arange(heads)[:, None] * width + block).reshape(-1)


def _attention_names(cfg: ModelConfig) -> dict[str, str]:
    """Our attention's parameter names -> self_attn's, for this model's query path."""
    names = {"wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj"}
    names["wo"] = "o_proj"
    if cfg.q_lora_rank is None:
        names["wq"] = "q_proj"
    else:
        names.update(wq_a="q_a_proj", q_norm="q_a_layernorm", wq_b="q_b_proj")
    return names


def _attention(cfg: ModelConfig, sd: Mapping[str, Tensor], i: int, to_hf: bool) -> Named:
    """One layer's latent attention, either way, the RoPE rows of wq (wq_b) and wkv_a permuted."""
    H, N, P, R = cfg.n_head, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    ours, theirs = f"blocks.{i}.attn.", f"model.layers.{i}.self_attn."
    for a, b in _attention_names(cfg).items():
        src, dst = (ours + a, theirs + b) if to_hf else (theirs + b, ours + a)
        w = sd[src + ".weight"]
        if a in ("wq", "wq_b"):
            w = w[_rope_rows(cfg, H, N + P, to_hf)]
        elif a == "wkv_a":
            w = w[_rope_rows(cfg, 1, R + P, to_hf)]
        yield dst + ".weight", w


class DeepseekV3(Family):
    """DeepseekV3ForCausalLM: latent attention (mla), sigmoid-routed DeepSeekMoE."""

    name = model_type = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"
    llama_cpp_arch = "deepseek2"
    defaults = DEEPSEEK_DEFAULTS

    def config_from_hf(self, hf: dict[str, Any], where: str) -> ModelConfig:
        return _config_from_hf(hf, where)

    def config_to_hf(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        check_deepseek(cfg)
        return _config(cfg, router_aux_loss_coef)

    def from_hf(self, cfg: ModelConfig, src: Mapping[str, Tensor]) -> Named:
        for i in range(cfg.n_layer):
            ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
            yield from _attention(cfg, src, i, to_hf=False)
            yield ours + "attn_norm.weight", src[theirs + "input_layernorm.weight"]
            yield ours + "ffn_norm.weight", src[theirs + "post_attention_layernorm.weight"]
            mlp = theirs + "mlp."
            if not cfg.n_experts or i in cfg.moe_dense_layers:
                yield from swiglu_from_hf(src, mlp, ours + "ffn.")
                continue
            yield ours + "ffn.router.weight", src[mlp + "gate.weight"]
            yield ours + "ffn.router_bias", src[mlp + "gate.e_score_correction_bias"]
            if cfg.moe_shared_ffn_hidden:
                yield from swiglu_from_hf(src, mlp + "shared_experts.", ours + "ffn.shared.")
            yield from experts_from_hf(src, mlp, ours + "ffn.", _EXPERT_NAMES, cfg.n_experts)
        yield "tok_emb.weight", src["model.embed_tokens.weight"]
        yield "norm.weight", src["model.norm.weight"]
        if not cfg.tie_embeddings:
            yield "lm_head.weight", src["lm_head.weight"]

    def to_hf(self, cfg: ModelConfig, sd: Mapping[str, Tensor]) -> Named:
        for i in range(cfg.n_layer):
            ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
            yield from _attention(cfg, sd, i, to_hf=True)
            yield theirs + "input_layernorm.weight", sd[ours + "attn_norm.weight"]
            yield theirs + "post_attention_layernorm.weight", sd[ours + "ffn_norm.weight"]
            mlp = theirs + "mlp."
            if not cfg.n_experts or i in cfg.moe_dense_layers:
                yield from swiglu_to_hf(sd, ours + "ffn.", mlp)
                continue
            yield mlp + "gate.weight", sd[ours + "ffn.router.weight"]
            yield mlp + "gate.e_score_correction_bias", sd[ours + "ffn.router_bias"]
            if cfg.moe_shared_ffn_hidden:
                yield from swiglu_to_hf(sd, ours + "ffn.shared.", mlp + "shared_experts.")
            yield from experts_to_hf(sd, ours + "ffn.", mlp, _EXPERT_NAMES, cfg.n_experts)
        yield "model.embed_tokens.weight", sd["tok_emb.weight"]
        yield "model.norm.weight", sd["norm.weight"]
        if not cfg.tie_embeddings:
            yield "lm_head.weight", sd["lm_head.weight"]

    def check_peft(self, cfg: ModelConfig) -> None:
        raise ConfigError(
            "model.attention",
            "mla: its adapters have no peft layout minillm writes; merge them (export without "
            "--format peft)",
        )

    def gguf_arch(self, cfg: ModelConfig) -> Any:
        from minillm.families.deepseek_v3_gguf import deepseek2_arch

        return deepseek2_arch(cfg)

    def add_gguf_keys(self, w: Any, cfg: ModelConfig) -> None:
        from minillm.families.deepseek_v3_gguf import add_deepseek2_keys

        w.add_feed_forward_length(cfg.ffn_hidden)
        w.add_head_count(cfg.n_head)
        add_deepseek2_keys(w, cfg)

    def gguf_tensor(self, cfg: ModelConfig, hf_name: str, w: Tensor) -> list[tuple[str, Tensor]]:
        if not hf_name.endswith("kv_b_proj.weight"):
            return [(hf_name, w)]
        from minillm.families.deepseek_v3_gguf import split_kv_b

        # W_uk, W_uv as its graph absorbs them
        k_b, v_b = split_kv_b(w, cfg)
        return [
            (hf_name.replace("kv_b_proj", "k_b_proj"), k_b),
            (hf_name.replace("kv_b_proj", "v_b_proj"), v_b),
        ]
