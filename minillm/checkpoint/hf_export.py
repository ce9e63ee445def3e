"""Export a checkpoint as a Hugging Face Llama folder (our model -> an HF folder).

Offers `export_checkpoint(ckpt, out, force)` (what `minillm export` runs),
`published_generation_config`, `sampling_config`, and `check_export_target` /
`check_not_over_source` (the checks every export's `--out` passes: this one's, peft's and GGUF's).
Reading a folder back is minillm.checkpoint.hf_import; parameter names and the config mapping are
the model's family's (minillm.families, model.family).

An exported folder holds config.json, the weights (HF names, the model's dtype) as
model.safetensors or, past `--max-shard-size`, shards and their index (minillm.checkpoint.hf_shards,
written tensor by tensor: no second copy of the model), tokenizer.json,
tokenizer_config.json, special_tokens_map.json and generation_config.json; it loads with
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`. The tokenizer's files
are what its kind writes (minillm.tokenizer.conventions' `write_hf_files`). With the chat tokens,
tokenizer_config.json carries minillm's chat template (`apply_chat_template` gives the same ids) and
generation stops at `<|end|>` as well as at end-of-text. A published model's tokenizer (a fine-tune
of its folder, or the folder itself; minillm.tokenizer.conventions) is exported as the model has it:
its tokenizer.json and companion files (chat template, special tokens) copied as they are, its bos,
eos (a list where it has one) and pad in config.json and generation_config.json
(minillm.checkpoint.model_tokens), so that the folder's `apply_chat_template` and `generate` are the
original's. The class is that of the model's family (model.family: set on import, resolved from
the options for minillm's own runs, minillm.families.resolve_family).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from minillm.checkpoint.hf_shards import DEFAULT_MAX_SHARD_SIZE, parse_size, write_weight_shards
from minillm.checkpoint.layout import HF_CONFIG_FILE, HF_GENERATION_FILE
from minillm.checkpoint.model_tokens import model_tokens
from minillm.config import SampleConfig
from minillm.errors import UserError
from minillm.families import family_of, hf_config_dict
from minillm.runtime.disk_space import raise_if_disk_full
from minillm.runtime.files import commit_dir
from minillm.tokenizer.conventions import ModelTokens


def sampling_config(sample: SampleConfig) -> dict[str, Any]:
    """generation_config.json's sampling keys for a run's `sample` section.

    It sets max_new_tokens, not max_length: transformers warns when a caller's max_new_tokens
    meets a max_length from the folder.
    """
    out: dict[str, Any] = {"max_new_tokens": sample.max_new_tokens}
    if sample.temperature > 0:
        out.update(do_sample=True, temperature=sample.temperature, top_p=sample.top_p)
        out["top_k"] = sample.top_k  # 0 = off, in HF as here
    else:
        out["do_sample"] = False
    return out


def published_generation_config(
    tokens: ModelTokens, sample: SampleConfig, from_run: bool
) -> dict[str, Any]:
    """generation_config.json of a published model's export: its own (eos list, bos, pad and
    every other key kept), with a run's `sample` section as the sampling defaults (a folder
    exported as it is keeps its own, which are what minillm read as its `sample`)."""
    gen = {k: v for k, v in tokens.generation.items() if k != "_from_model_config"}
    ids = {"bos_token_id": tokens.bos, "pad_token_id": tokens.pad}
    gen.update({k: v for k, v in ids.items() if v is not None})
    if tokens.eos:
        gen["eos_token_id"] = tokens.eos[0] if len(tokens.eos) == 1 else tokens.eos
    if from_run:
        for key in ("do_sample", "temperature", "top_p", "top_k", "max_length", "max_new_tokens"):
            gen.pop(key, None)
        gen.update(sampling_config(sample))
    return gen


# What a failed export promises (a full disk: minillm.runtime.disk_space).
KEPT = "nothing at --out was changed; free some space or choose another --out"


def check_export_target(out: str | Path, force: bool, source: str | Path | None = None) -> None:
    """UserError if `out` is a file, a non-empty folder without force, or would overwrite the
    checkpoint being exported (`source`, a run or a checkpoint folder) or any of its run's.

    --force replaces an earlier export only: a folder holding folders (a run directory, a home
    folder) is never deleted.
    """
    out = Path(out)
    if source is not None:
        check_not_over_source(out, Path(source))
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UserError(f"{out}: folder exists and is not empty (pass --force to replace it)")
        if any(p.is_dir() for p in out.iterdir()):
            raise UserError(
                f"{out}: holds folders, so it is not an exported model; --force only replaces "
                "an earlier export (choose another --out)"
            )


def check_not_over_source(out: Path, source: Path) -> None:
    """UserError if `out` is, holds or lies inside the checkpoint being exported (`source`) or
    its run's checkpoints: an export must never replace or land among the weights it reads."""
    o, s = out.resolve(), source.resolve()
    if s.parent.name == "checkpoints":  # one checkpoint of a run
        run, ckpts = s.parent.parent, s.parent
    else:
        run, ckpts = s, s / "checkpoints"
    inside = o == s or o.is_relative_to(ckpts) or (s != run and o.is_relative_to(s))
    if inside or s.is_relative_to(o) or run.is_relative_to(o):
        raise UserError(
            f"--out {out}: overlaps the checkpoint being exported ({source}); choose another folder"
        )


def weights_dtype(model: torch.nn.Module) -> str:
    """config.json's torch_dtype for a model: the dtype most of its floating-point weights have."""
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return str(max(set(dtypes), key=dtypes.count, default=torch.float32)).removeprefix("torch.")


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def export_checkpoint(
    ckpt: Any,
    out: str | Path,
    force: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a LoadedCheckpoint as an HF folder at `out`, all at once (temp + rename), its
    weights in the model's dtype, in shards of at most `max_shard_size` (hf_shards).

    A non-empty `out` is refused unless force, and then replaced only once the new one is whole.
    """
    out = Path(out)
    max_bytes = parse_size(max_shard_size)
    check_export_target(out, force, ckpt.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = ckpt.config
    tokens = model_tokens(ckpt)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # Views of the model's own tensors, in its dtype: nothing is copied until a family's
        # to_hf computes a tensor, and then one shard's worth at most is held (hf_shards).
        state = {k: v.detach() for k, v in ckpt.model.state_dict().items()}
        named = family_of(cfg.model).to_hf(cfg.model, state)
        write_weight_shards(named, tmp, max_bytes, metadata={"format": "pt"})
        files = ckpt.conventions.write_hf_files(ckpt.tokenizer_path, tmp, cfg.model.max_seq_len)
        files[HF_GENERATION_FILE] = published_generation_config(
            tokens, cfg.sample, from_run=not ckpt.hf_folder
        )
        files[HF_CONFIG_FILE] = hf_config_dict(
            cfg.model,
            bos_id=tokens.bos,
            eos_id=tokens.config_eos,
            router_aux_loss_coef=cfg.train.moe_aux_loss,
            dtype=weights_dtype(ckpt.model),
        )
        for name, obj in files.items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
        check_export_target(out, force, ckpt.path)  # again: someone may have written meanwhile
        commit_dir(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        need = lambda: weights_bytes(ckpt.model)  # noqa: E731
        raise_if_disk_full(e, out.parent, f"the hf export {out.name}", need, KEPT)
        raise
    return out
