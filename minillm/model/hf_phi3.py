"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`, model_type phi3) beside minillm.model.hf_names.

Offers `PHI3_DEFAULTS`, `is_phi3`, `phi3_normalized`, `phi3_family_config`,
`rotary_rows_to_ours`, `rotary_rows_to_hf`, `split_fused` and `join_fused`.

Phi-3 is Llama's block with fused projections (`self_attn.qkv_proj` = [q; k; v] and
`mlp.gate_up_proj` = [gate; up], our own wqkv and w_gate_up), RoPE on the first
`partial_rotary_factor` of each head's dimensions (model.partial_rotary) and LongRoPE
(model.rope_scaling.type longrope). Ours rotates pairs (i, i + D/2); HF's partial RoPE pairs
(i, i + R/2) within the first R dimensions. So our q and k heads hold HF's dimensions in the
order [0..R/2-1, the first half of R..D-1, R/2..R-1, the second half of R..D-1]
(`rotary_rows_to_ours`): the rotated pairs are ours, the unrotated ones turn by angle 0
(minillm.model.rope). With partial_rotary 1 the order is HF's own.
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.config import ModelConfig
from minillm.errors import ConfigError

# What transformers' Phi3Config gives a key config.json leaves out (tests check it).
PHI3_DEFAULTS = {
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "sliding_window": None,
}


def is_phi3(cfg: ModelConfig) -> bool:
    """Whether `cfg` needs Phi-3's class: partial RoPE or LongRoPE. (A Phi-3 with neither is
    Llama's function, or Mistral's with a window, and is written as that class.)"""
    return cfg.partial_rotary != 1.0 or cfg.rope_scaling.type == "longrope"


def check_phi3_options(cfg: ModelConfig) -> None:
    """A ConfigError naming an option Phi3ForCausalLM does not have beside partial RoPE or
    LongRoPE."""
    for key in ("attention_bias", "qk_norm", "sandwich_norm", "embed_scale", "n_experts"):
        if getattr(cfg, key):
            raise ConfigError(
                f"model.{key}", "with partial_rotary or longrope (Phi-3's): no transformers family"
            )
    if cfg.ffn_activation != "silu" or cfg.query_pre_attn_scalar is not None:
        key = "ffn_activation" if cfg.ffn_activation != "silu" else "query_pre_attn_scalar"
        raise ConfigError(f"model.{key}", "not in Phi-3, the family of partial_rotary/longrope")
    if cfg.rope_local_theta is not None or cfg.sliding_window_pattern:
        raise ConfigError("model.rope_local_theta", "local layers are not in Phi-3")
    if cfg.rope_scaling.type not in ("none", "longrope"):
        raise ConfigError(
            "model.rope_scaling.type",
            f"{cfg.rope_scaling.type} with partial_rotary: Phi-3 takes none or longrope",
        )


def phi3_normalized(hf: dict[str, Any], where: str) -> tuple[dict[str, Any], float]:
    """A Phi3Config's config.json (its defaults filled in) as hf_names reads a Llama's, and its
    partial_rotary_factor: the factor out of rope_scaling/rope_parameters, Phi-3's older names
    of LongRoPE (su, yarn: transformers reads both as longrope) as longrope, and a window no
    shorter than the context (Phi-4-mini's 262144) as none."""
    key = "rope_scaling" if isinstance(hf.get("rope_scaling"), dict) else "rope_parameters"
    params = dict(hf.get(key) or {})
    partial = params.pop("partial_rotary_factor", None)
    if partial is None:
        partial = hf.get("partial_rotary_factor", 1.0)
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ConfigError("partial_rotary_factor", f"{partial!r} must be in (0, 1]", where)
    kind = params.get("rope_type", params.get("type"))
    if kind in ("su", "yarn"):
        params["rope_type"] = "longrope"
        params.pop("type", None)
    hf = {**hf, key: params or None}
    window = hf.get("sliding_window")
    if window is not None and window >= hf["max_position_embeddings"]:
        window = None
    return {**hf, "sliding_window": window}, float(partial)


def phi3_family_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's Phi-3 keys beside the Llama ones hf_names writes: the partial factor and
    the original length at the top level, where every transformers version reads them."""
    s = cfg.rope_scaling
    original = s.original_max_position_embeddings if s.type == "longrope" else cfg.max_seq_len
    return {
        "partial_rotary_factor": cfg.partial_rotary,
        "original_max_position_embeddings": original,
        "sliding_window": cfg.sliding_window,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }


def _head_order(cfg: ModelConfig) -> torch.Tensor:
    """HF's dimension of each of ours within a head (D,), for partial RoPE."""
    D, R = cfg.head_dim, cfg.rotary_dim
    half, rest = R // 2, (D - R) // 2
    return torch.cat(
        (
            torch.arange(half),
            torch.arange(R, R + rest),
            torch.arange(half, R),
            torch.arange(R + rest, D),
        )
    )


def _permute_qk(w: torch.Tensor, cfg: ModelConfig, order: torch.Tensor) -> torch.Tensor:
    """The rows (dim 0) of a [q; k; v] weight, bias or LoRA B with each q and k head's rows
    taken in `order`; v's as they are."""
    H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    qk, v = w[: (H + K) * D], w[(H + K) * D :]
    heads = qk.reshape(H + K, D, *w.shape[1:])
    return torch.cat((heads[:, order].reshape(qk.shape), v))


def rotary_rows_to_ours(w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF's qkv rows in our order (module docstring); unchanged with partial_rotary 1."""
    if cfg.rotary_dim == cfg.head_dim:
        return w
    return _permute_qk(w, cfg, _head_order(cfg))


def rotary_rows_to_hf(w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Our qkv rows in HF's order: rotary_rows_to_ours undone."""
    if cfg.rotary_dim == cfg.head_dim:
        return w
    return _permute_qk(w, cfg, torch.argsort(_head_order(cfg)))


def split_fused(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi-3's qkv_proj and gate_up_proj as Llama's q/k/v_proj and gate/up_proj (the rest as
    it is), so hf_names reads it as it reads a Llama's."""
    H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    out = dict(sd)
    for i in range(cfg.n_layer):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        if attn + "qkv_proj.weight" in out:
            q, k, v = out.pop(attn + "qkv_proj.weight").split((H * D, K * D, K * D), dim=0)
            out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k,
                        attn + "v_proj.weight": v})  # fmt: skip
        if mlp + "gate_up_proj.weight" in out:
            gate, up = out.pop(mlp + "gate_up_proj.weight").chunk(2, dim=0)
            out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = gate, up
    return out


def join_fused(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Llama's q/k/v_proj and gate/up_proj as Phi-3's qkv_proj and gate_up_proj."""
    out = dict(sd)
    for i in range(cfg.n_layer):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[attn + "qkv_proj.weight"] = torch.cat(
            [out.pop(attn + f"{n}_proj.weight") for n in ("q", "k", "v")], dim=0
        )
        out[mlp + "gate_up_proj.weight"] = torch.cat(
            [out.pop(mlp + "gate_proj.weight"), out.pop(mlp + "up_proj.weight")], dim=0
        )
    return out
