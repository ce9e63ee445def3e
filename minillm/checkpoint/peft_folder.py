"""`minillm export --format peft`: a LoRA run's adapters as a Hugging Face peft folder.

Offers `export_peft(ckpt, out, force)`, `adapter_config`, `peft_modules` and
`to_peft_state_dict`; the module names are the model's family's (minillm.families). The folder
holds adapter_config.json and adapter_model.safetensors under peft's names
(`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, ...
`mlp.down_proj.lora_B.weight`), so that
`peft.PeftModel.from_pretrained(base, DIR)` puts them on the Hugging Face export of the run's base
(`minillm export --ckpt BASE --out DIR`), or on the published model's folder itself when the run
started from one (adapter_config.json names it by its absolute path), and computes the run's
function: the fused wqkv and
w_gate_up adapters become peft's per-projection ones exactly (minillm.model.lora): A copied to each
projection of a fused layer, B split by rows (Phi-3's fused modules take them whole, its q/k rows
in HF's order).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from minillm.checkpoint.hf_export import KEPT, check_export_target
from minillm.config import LORA_TARGETS, ModelConfig
from minillm.errors import UserError
from minillm.families import Family, family_of
from minillm.runtime.disk_space import raise_if_disk_full
from minillm.runtime.files import commit_dir, save_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


# Our LoRA target -> the module that holds it in a block.
_OWNER = {"wqkv": "attn", "wo": "attn", "w_gate_up": "ffn", "w_down": "ffn"}


def peft_modules(targets: Sequence[str], family: Family) -> list[str]:
    """peft's target_modules for our targets in `family` (q_proj ... down_proj; Phi-3's
    qkv_proj and gate_up_proj)."""
    return [m for t in LORA_TARGETS if t in targets for m in family.peft_modules[t][1]]


def to_peft_state_dict(
    adapters: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our adapters -> peft's adapter_model.safetensors names and tensors (exact: A copied to
    each projection of a fused layer, B split by rows as the family's modules are). Tensors
    are contiguous."""
    family = family_of(cfg)
    family.check_peft(cfg)
    out = {}
    for i in range(cfg.n_layer):
        for target, (part, modules) in family.peft_modules.items():
            ours = f"blocks.{i}.{_OWNER[target]}.{target}."
            if ours + "lora_A" not in adapters:
                continue
            a, b = adapters[ours + "lora_A"], adapters[ours + "lora_B"]
            prefix = f"base_model.model.model.layers.{i}.{part}."
            parts = family.peft_rows(cfg, target, b)
            for module, b_rows in zip(modules, parts, strict=True):
                out[f"{prefix}{module}.lora_A.weight"] = a.clone().contiguous()
                out[f"{prefix}{module}.lora_B.weight"] = b_rows.contiguous()
    if "tok_emb.token_rows" in adapters:  # peft holds the rows themselves, as TokenRows does
        key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
        out[key] = adapters["tok_emb.token_rows"].contiguous()
    return out


def adapter_config(
    lora: Any, base: str, token_ids: list[int] | None = None, family: Family | None = None
) -> dict[str, Any]:
    """peft's LoraConfig of a `train.lora` section (plain LoRA: scale alpha / r, no bias);
    token_ids: the embedding rows that trained (train.lora.train_tokens); family: the base's,
    whose module names target_modules lists (Llama's without one)."""
    from minillm.families import FAMILIES

    family = family or FAMILIES["llama"]
    extra = {"trainable_token_indices": token_ids} if token_ids else {}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": peft_modules(lora.targets, family),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
        **extra,
    }


def _base_name(lora_base: dict[str, str]) -> str:
    """adapter_config.json's base_model_name_or_path: train.init_from as given, or, when that is
    a Hugging Face folder (a published model's), its absolute path, which transformers loads from
    any folder (AutoPeftModelForCausalLM.from_pretrained(DIR) reads it). A minillm run or
    checkpoint is named as given: transformers loads its `minillm export`, not the run. A Hub
    name (no such folder here) is written as it is: peft fetches it as minillm did."""
    from minillm.checkpoint.layout import is_hf_folder
    from minillm.config.hub_id import is_hub_id

    abspath, given = lora_base.get("abspath", ""), lora_base["path"]
    if is_hub_id(given) and not Path(given).exists():
        return given
    return abspath if abspath and is_hf_folder(abspath) else given


def export_peft(ckpt: Any, out: str | Path, force: bool = False) -> Path:
    """Write a LoadedCheckpoint's adapters as a peft folder at `out` (temp + rename); a run that
    is not LoRA is a UserError, a non-empty `out` needs force."""
    if ckpt.adapters is None:
        raise UserError(
            f"--format peft: {ckpt.path} is not a LoRA run (train.lora.rank is 0): it has no "
            "adapters; export it with --format hf"
        )
    out = Path(out)
    check_export_target(out, force, ckpt.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = ckpt.config
    base = _base_name(ckpt.state["lora_base"])
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        adapters = {k: v.detach().float().cpu() for k, v in ckpt.adapters.items()}
        tensors = to_peft_state_dict(adapters, cfg.model)
        save_safetensors(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        ids = ckpt.adapters.get("tok_emb.token_ids")
        ids = None if ids is None else [int(i) for i in ids.tolist()]
        config = adapter_config(cfg.train.lora, base, ids, family_of(cfg.model))
        text = json.dumps(config, indent=2) + "\n"
        (tmp / CONFIG_FILE).write_text(text, encoding="utf-8")
        check_export_target(out, force, ckpt.path)  # again: someone may have written meanwhile
        commit_dir(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        need = lambda: 4 * sum(v.numel() for v in ckpt.adapters.values())  # noqa: E731
        raise_if_disk_full(e, out.parent, f"the peft export {out.name}", need, KEPT)
        raise
    return out
