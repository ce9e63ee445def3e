"""Model families: what minillm knows of each published architecture it reads and writes, one
module per family (llama: Llama, Qwen2, Qwen3, Mistral; moe: Mixtral, Qwen2-MoE, Qwen3-MoE;
gemma3; phi3; deepseek_v3 with deepseek_v3_gguf), held by name in `registry.FAMILIES`.

A model's family is stored (`model.family`): set on import, resolved once from the options for
minillm's own runs (`with_family`). Everything that writes or reads another format asks it:
`family_of(cfg).from_hf(cfg, src)` / `.to_hf(cfg, sd)` (tensor by tensor), `.config_to_hf`,
`.peft_modules`, `.gguf_arch`, `.add_gguf_keys`, `.end_of_turn`. The model stage (minillm.model)
is the shared math and knows no family.

Offers `Family`, `FAMILIES`, `family_named`, `family_of`, `family_of_hf`, `resolve_family`,
`with_family`, and the whole-dict forms `model_config_from_hf`, `hf_config_dict`,
`to_hf_state_dict` and `from_hf_state_dict`; `fused_rows` (QLoRA's per-module NF4 blocks).
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.config import ModelConfig
from minillm.errors import ConfigError
from minillm.families.base import Family, config_tail
from minillm.families.registry import (
    FAMILIES,
    add_end_of_turn,
    family_named,
    family_of,
    family_of_hf,
    model_conventions,
    resolve_family,
    with_family,
)

__all__ = [
    "FAMILIES",
    "add_end_of_turn",
    "Family",
    "family_named",
    "fused_rows",
    "family_of",
    "family_of_hf",
    "from_hf_state_dict",
    "hf_config_dict",
    "model_config_from_hf",
    "model_conventions",
    "resolve_family",
    "to_hf_state_dict",
    "with_family",
]


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Our ModelConfig (model.family set) from an HF config.json of a family minillm reads;
    refuses, one key named, what our model cannot express. A key config.json leaves out is the
    family's default in transformers, not Llama's."""
    family = family_of_hf(hf)
    if family is None:
        archs = hf.get("architectures") or []
        classes = ", ".join(f.hf_class for f in FAMILIES.values())
        raise ConfigError(
            "model_type",
            f"a {hf.get('model_type')!r} model ({', '.join(archs) or 'no architectures'}), "
            f"not one of the architectures minillm reads ({classes})",
            where,
        )
    if hf.get("quantization_config"):  # e.g. DeepSeek-V3's published fp8 blocks: read raw, garbage
        method = hf["quantization_config"].get("quant_method", "quantized")
        raise ConfigError("quantization_config", f"{method} weights are not supported", where)
    if "num_local_experts" in hf and family.name == "qwen3_moe":  # transformers 5 saves this
        hf = {"num_experts": hf["num_local_experts"], **hf}
    return family.config_from_hf({**family.defaults, **hf}, where)


def hf_config_dict(
    cfg: ModelConfig,
    bos_id: int | None,
    eos_id: int | None,
    router_aux_loss_coef: float = 0.0,
    dtype: str = "float32",
) -> dict[str, Any]:
    """A `config.json` for the transformers class of the model's family; router_aux_loss_coef is
    the run's train.moe_aux_loss, dtype the weights' (its torch_dtype)."""
    family = family_of(cfg)
    tail = config_tail(bos_id, eos_id, dtype)
    return {**family.config_to_hf(cfg, router_aux_loss_coef), **tail}


def to_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state_dict -> HF names, splitting fused projections. Tensors are made contiguous."""
    return {k: v.contiguous() for k, v in family_of(cfg).to_hf(cfg, sd)}


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """An HF state_dict -> ours, joining q/k/v and gate/up (and stacking experts). Raises
    KeyError on a missing name."""
    return dict(family_of(cfg).from_hf(cfg, sd))


def fused_rows(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The family's `fused_rows` (the Hugging Face modules in our fused layers); a model no
    family computes takes the Llama layout, which is how peft would name its modules."""
    try:
        return family_of(cfg).fused_rows(cfg)
    except ConfigError:
        return Family().fused_rows(cfg)
