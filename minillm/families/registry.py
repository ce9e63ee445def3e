"""The families minillm reads and writes, by name: `FAMILIES`, and the one place a model's
options are turned into a family (`resolve_family`), for a config that has none stored yet.

Offers `FAMILIES`, `family_named`, `family_of`, `family_of_hf`, `resolve_family`,
`with_family`, `add_end_of_turn` and `model_conventions`. Adding a family: its module (a
`minillm.families.base.Family`) and a line in `FAMILIES`; `resolve_family` only where minillm's
own runs should be exported as it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from minillm.config import ModelConfig
from minillm.errors import ConfigError
from minillm.families.base import Family
from minillm.families.deepseek_v3 import DeepseekV3
from minillm.families.gemma3 import Gemma3, has_gemma_option
from minillm.families.llama import Llama, Mistral, Qwen2, Qwen3
from minillm.families.moe import Mixtral, Qwen2Moe, Qwen3Moe, moe_family_name
from minillm.families.phi3 import Phi3

# model.family -> its family, in the order docs and tables list them.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Llama(),
        Mixtral(),
        Qwen2(),
        Qwen3(),
        Mistral(),
        Gemma3(),
        Qwen2Moe(),
        Qwen3Moe(),
        DeepseekV3(),
        Phi3(),
    )
}


def family_named(name: str) -> Family:
    """The family called `name` (model.family); a ConfigError names the key otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError("model.family", f"{name!r} is not one of {', '.join(FAMILIES)}") from None


def resolve_family(cfg: ModelConfig) -> str:
    """The family whose transformers class computes `cfg`'s options: DeepSeek-V3 with latent
    attention (its config writer names what DeepseekV3Config lacks); Phi-3 with partial RoPE or
    LongRoPE; Gemma 3 with its block; with experts Qwen3-MoE (qk_norm), Qwen2-MoE (a shared
    expert) or Mixtral; Qwen3 with qk_norm, Qwen2 with q/k/v biases, Mistral with a sliding
    window, else Llama. A ConfigError names an option no family has with the others."""
    if cfg.attention == "mla":  # what its class lacks beside is its writer's to name
        return "deepseek_v3"
    if cfg.partial_rotary != 1.0 or cfg.rope_scaling.type == "longrope":
        FAMILIES["phi3"].check_options(cfg)  # type: ignore[attr-defined]
        return "phi3"
    if has_gemma_option(cfg):
        FAMILIES["gemma3"].check_options(cfg)  # type: ignore[attr-defined]
        return "gemma3"
    if cfg.qk_norm and cfg.attention_bias:  # Qwen3's attention_bias biases o_proj too
        raise ConfigError("model.attention_bias", "with model.qk_norm: no transformers family")
    if cfg.n_experts:
        return moe_family_name(cfg)
    if cfg.qk_norm:
        return "qwen3"
    if cfg.attention_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window is not None else "llama"


def family_of(cfg: ModelConfig) -> Family:
    """The family `cfg` stores (model.family), or, for a config from before it was stored (or
    built in code), the one its options resolve to."""
    return family_named(cfg.family if cfg.family is not None else resolve_family(cfg))


def with_family(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with model.family set: a stored one checked against the options, a missing one
    resolved from them, or left null where no family computes them (a minillm-only model,
    which trains and samples but exports to no family's format)."""
    if cfg.family is not None:
        family = family_named(cfg.family)
        found = resolve_family(cfg)
        if found != family.name and found not in family.accepts:
            raise ConfigError("model.family", f"{family.name}, but the other options are {found}'s")
        return cfg
    try:
        name = resolve_family(cfg)
    except ConfigError:
        return cfg
    return dataclasses.replace(cfg, family=name)


def family_of_hf(hf: dict[str, Any]) -> Family | None:
    """The family of an HF config.json: its model_type, and its class among its architectures
    where it lists any; None for another model."""
    archs = hf.get("architectures") or []
    for family in FAMILIES.values():
        if family.model_type == hf.get("model_type"):
            return family if not archs or family.hf_class in archs else None
    return None


def add_end_of_turn(conventions: Any, cfg: ModelConfig, folder: Path) -> None:
    """The family's end of a chat turn on `conventions` (a tokenizer's, read from `folder`), in
    place: its `turn_end` (Phi-3's <|end|>) where the template probe found none, and, where the
    folder has no generation_config.json (which transformers' generate stops at, and so do
    the conventions), its `end_of_turn` stop tokens (<|endoftext|>, <|assistant|>, <|end|>),
    which its published generation_config.json lists: a reply stops there, and exports write
    them (GGUF's end-of-turn id)."""
    family = FAMILIES.get(cfg.family or "")
    if family is None:
        return
    tok = conventions.tok
    if conventions.turn_end is None and family.turn_end is not None:
        conventions.turn_end = tok.token_to_id(family.turn_end)
    if not family.end_of_turn or (folder / "generation_config.json").is_file():
        return
    ids = [i for t in family.end_of_turn if (i := tok.token_to_id(t)) is not None]
    conventions.stop_ids = conventions.stop_ids | frozenset(ids)


def model_conventions(tok: Any, folder: Path, cfg: ModelConfig) -> Any:
    """How a model of `cfg` uses its tokenizer `tok` (read from `folder`): the tokenizer's
    conventions (minillm.tokenizer.conventions) with the family's end of turn added
    (add_end_of_turn): what every command that samples, chats, serves or scores a model builds,
    a loaded checkpoint and a run's probes and objectives alike."""
    from minillm.tokenizer.conventions import Conventions

    conventions = Conventions.of(tok, folder)
    add_end_of_turn(conventions, cfg, folder)
    return conventions
