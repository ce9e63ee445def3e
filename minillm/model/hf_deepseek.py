"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, model_type deepseek_v3) in minillm's names: the config
and the weights of a model with `model.attention: mla` and, past its first dense blocks, the
sigmoid-routed experts of `model.moe_router: sigmoid`.

Offers `DEEPSEEK_DEFAULTS`, `check_deepseek`, `deepseek_config`, `deepseek_from_hf`,
`deepseek_to_hf_state` and `deepseek_from_hf_state`; `minillm.model.hf_names` calls them for this
family (it reads RoPE's keys and passes them in, so neither module imports the other twice).

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

from typing import Any

import torch

from minillm.config import ModelConfig
from minillm.errors import ConfigError

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


def deepseek_config(cfg: ModelConfig, rope_scaling: dict | None) -> dict[str, Any]:
    """A DeepseekV3Config's config.json for `cfg` (check_deepseek passed) but the keys every
    family's ends with (hf_names' _config_tail: token ids, dtype); a dense model has
    every block dense (first_k_dense_replace = n_layer) and placeholder expert keys."""
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
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def deepseek_from_hf(
    hf: dict[str, Any], rope_theta: float, scaling: dict[str, Any], where: str
) -> ModelConfig:
    """Our ModelConfig of a DeepseekV3Config's config.json (DEEPSEEK_DEFAULTS filled in), RoPE
    already read (hf_names' _rope_from_hf); what minillm does not compute names its key."""
    # rope_interleave false (rows already in halves) would need the folder's config with its
    # weights; no published DeepSeek folder has it.
    for key, ok in (("attention_bias", False), ("hidden_act", "silu"), ("rope_interleave", True)):
        if hf.get(key, ok) != ok:
            raise ConfigError(key, f"{hf[key]!r} is not supported (minillm needs {ok!r})", where)
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


def _swiglu(sd: dict[str, torch.Tensor], ours: str, theirs: str, to_hf: bool) -> dict:
    if to_hf:
        gate, up = sd[ours + "w_gate_up.weight"].chunk(2, dim=0)
        return {
            theirs + "gate_proj.weight": gate,
            theirs + "up_proj.weight": up,
            theirs + "down_proj.weight": sd[ours + "w_down.weight"],
        }
    return {
        ours + "w_gate_up.weight": torch.cat(
            [sd[theirs + "gate_proj.weight"], sd[theirs + "up_proj.weight"]], dim=0
        ),
        ours + "w_down.weight": sd[theirs + "down_proj.weight"],
    }


def _names(cfg: ModelConfig) -> dict[str, str]:
    """Our attention's parameter names -> self_attn's, for this model's query path."""
    names = {"wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj"}
    names["wo"] = "o_proj"
    if cfg.q_lora_rank is None:
        names["wq"] = "q_proj"
    else:
        names.update(wq_a="q_a_proj", q_norm="q_a_layernorm", wq_b="q_b_proj")
    return names


def _convert(sd: dict[str, torch.Tensor], cfg: ModelConfig, to_hf: bool) -> dict:
    """Both directions of the mapping; missing names raise KeyError."""
    H, N, P, R = cfg.n_head, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q_rows = _rope_rows(cfg, H, N + P, to_hf)
    kv_rows = _rope_rows(cfg, 1, R + P, to_hf)
    pairs = [("tok_emb.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        pairs += [
            (ours + "attn_norm.weight", theirs + "input_layernorm.weight"),
            (ours + "ffn_norm.weight", theirs + "post_attention_layernorm.weight"),
        ]
        for a, b in _names(cfg).items():
            src = ours + f"attn.{a}.weight" if to_hf else theirs + f"self_attn.{b}.weight"
            rows = {"wq": q_rows, "wq_b": q_rows, "wkv_a": kv_rows}.get(a)
            w = sd[src] if rows is None else sd[src][rows]
            out[theirs + f"self_attn.{b}.weight" if to_hf else ours + f"attn.{a}.weight"] = w
        if not cfg.n_experts or i in cfg.moe_dense_layers:
            out.update(_swiglu(sd, ours + "ffn.", theirs + "mlp.", to_hf))
        else:
            out.update(_experts(sd, cfg, ours + "ffn.", theirs + "mlp.", to_hf))
    for a, b in pairs:
        out[b if to_hf else a] = sd[a if to_hf else b]
    return out


def _experts(sd: dict, cfg: ModelConfig, ours: str, theirs: str, to_hf: bool) -> dict:
    """One MoE layer: router, routing bias, experts (per-expert names, or transformers 5's
    stacks on reading), shared experts."""
    out = {}
    pairs = [("router.weight", "gate.weight"), ("router_bias", "gate.e_score_correction_bias")]
    for a, b in pairs:
        out[theirs + b if to_hf else ours + a] = sd[ours + a if to_hf else theirs + b]
    if cfg.moe_shared_ffn_hidden:
        out.update(_swiglu(sd, ours + "shared.", theirs + "shared_experts.", to_hf))
    if to_hf:
        for e in range(cfg.n_experts):
            gate, up = sd[ours + "w_gate_up"][e].chunk(2, dim=0)
            x = theirs + f"experts.{e}."
            out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = gate, up
            out[x + "down_proj.weight"] = sd[ours + "w_down"][e]
        return out
    if theirs + "experts.gate_up_proj" in sd:
        out[ours + "w_gate_up"] = sd[theirs + "experts.gate_up_proj"]
        out[ours + "w_down"] = sd[theirs + "experts.down_proj"]
        return out
    experts = [theirs + f"experts.{e}." for e in range(cfg.n_experts)]
    out[ours + "w_gate_up"] = torch.stack(
        [torch.cat([sd[x + "gate_proj.weight"], sd[x + "up_proj.weight"]]) for x in experts]
    )
    out[ours + "w_down"] = torch.stack([sd[x + "down_proj.weight"] for x in experts])
    return out


def deepseek_to_hf_state(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """Our state_dict -> DeepseekV3's names, RoPE rows interleaved."""
    return _convert(sd, cfg, to_hf=True)


def deepseek_from_hf_state(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """DeepseekV3's state_dict (RoPE rows interleaved) -> ours. KeyError on a missing name."""
    return _convert(sd, cfg, to_hf=False)
