"""`minillm export --format peft`: a LoRA run's adapters as a Hugging Face peft folder.

Offers `export_peft(ckpt, out, force)`. The folder holds adapter_config.json and
adapter_model.safetensors under peft's names (`base_model.model.model.layers.N.self_attn.q_proj.
lora_A.weight`, ... `mlp.down_proj.lora_B.weight`), so that
`peft.PeftModel.from_pretrained(base, DIR)` puts them on the Hugging Face export of the run's base
(`minillm export --ckpt BASE --out DIR`), or on the published model's folder itself when the run
started from one (adapter_config.json names it by its absolute path), and computes the run's
function: the fused wqkv and
w_gate_up adapters become peft's per-projection ones exactly (minillm.model.lora).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from minillm.checkpoint.hf_export import KEPT, check_export_target
from minillm.errors import UserError
from minillm.model.hf_phi3 import is_phi3
from minillm.model.lora import peft_modules, to_peft_state_dict
from minillm.runtime.disk_space import raise_if_disk_full
from minillm.runtime.files import commit_dir, save_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def adapter_config(
    lora: Any, base: str, token_ids: list[int] | None = None, phi3: bool = False
) -> dict[str, Any]:
    """peft's LoraConfig of a `train.lora` section (plain LoRA: scale alpha / r, no bias);
    token_ids: the embedding rows that trained (train.lora.train_tokens); phi3: a
    Phi3ForCausalLM base, whose modules are qkv_proj and gate_up_proj."""
    extra = {"trainable_token_indices": token_ids} if token_ids else {}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": peft_modules(lora.targets, phi3),
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
        config = adapter_config(cfg.train.lora, base, ids, is_phi3(cfg.model))
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
