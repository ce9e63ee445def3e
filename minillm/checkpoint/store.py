"""Checkpoints: atomic save, pruning, integrity-checked load, loading a run.

Offers `save_checkpoint` and `prune_checkpoints` (written by minillm.checkpoint.save, named here
too), `load_model_state`, `load_trainer_state`,
`check_model_config` (state.json's model config against the one stored with the weights),
`load_checkpoint` (config + model + tokenizer from a checkpoint alone, or from a Hugging Face
folder; a LoRA run's base + adapters, merged), `at_context` (a loaded checkpoint read at
another context: `eval --seq-len`, `--set model.rope_scaling.*`), `auto_dtype` (what
`--dtype auto` loads in, without loading), `lora_base_of` and `LoadedCheckpoint`. The
layout on disk, and finding the checkpoint a `--ckpt` means (`find_latest`,
`resolve_checkpoint`, `verify_checkpoint`, `read_state`), are `minillm.checkpoint.layout`.

A checkpoint is written into a hidden temporary folder, every file fsynced, then the folder is
renamed into place and only then LATEST is replaced (temp file + rename). A crash at any instant
therefore leaves the previous checkpoint whole and LATEST pointing at a complete one; state.json
records the sha256 of every file, so damage after the fact is detected at load time.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minillm.checkpoint.layout import (
    CONFIG_KEY,
    MODEL_FILE,
    STATE_FILE,
    TOKENIZER_FILE,
    TRAINER_FILE,
    is_hf_folder,
    read_state,
    resolve_checkpoint,
)
from minillm.checkpoint.lazy import LazySafetensors, empty_model, fill_model, resolve_dtype
from minillm.checkpoint.quantized_load import as_loaded, finish
from minillm.checkpoint.save import prune_checkpoints as prune_checkpoints
from minillm.checkpoint.save import save_checkpoint as save_checkpoint
from minillm.checkpoint.weights import load_weights_into, weights_sha256
from minillm.config.hub_id import is_hub_id
from minillm.errors import CheckpointError, UserError
from minillm.families import model_conventions, with_family

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from minillm.config import Config
    from minillm.tokenizer.conventions import Conventions


def load_model_state(
    ckpt: str | Path, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint (safetensors: no code runs while loading)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(ckpt) / MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def check_model_config(ckpt: str | Path, state: dict[str, Any]) -> None:
    """CheckpointError unless state.json's model config is the one stored with the weights.

    The weights file carries the model config in its metadata (since it has been written there);
    a checkpoint from before that carries none and is taken as it is.
    """
    from safetensors import SafetensorError, safe_open

    from minillm.config import ModelConfig

    path = Path(ckpt) / MODEL_FILE
    if not path.is_file():
        return  # load_model_state says so, with the weights
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = (f.metadata() or {}).get(CONFIG_KEY)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if stored is None:
        return
    where = Path(ckpt) / STATE_FILE
    try:
        weights_cfg = json.loads(stored)
        assert isinstance(weights_cfg, dict)
    except (ValueError, AssertionError):
        raise CheckpointError(f"{path}: its model config metadata is not a JSON object") from None
    state_cfg = state.get("config", {}).get("model", {})
    keys = [f.name for f in dataclasses.fields(ModelConfig)]
    differ = [
        f"{k} {state_cfg.get(k)!r} here, {weights_cfg.get(k)!r} with the weights"
        for k in keys
        if state_cfg.get(k) != weights_cfg.get(k)
    ]
    if differ:
        raise CheckpointError(
            f"{where}: model.{'; model.'.join(differ)}: the config was edited after the "
            "checkpoint was saved; it must be the one the weights were trained with"
        )


def load_trainer_state(ckpt: str | Path) -> dict[str, Any]:
    """Optimizer, scaler and RNG state; `weights_only=True` refuses pickled code."""
    path = Path(ckpt) / TRAINER_FILE
    try:
        with warnings.catch_warnings():  # torch's note on a foreign pickle protocol: noise here
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # torch raises UnpicklingError and friends for unsafe or broken files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: refused or unreadable trainer state ({first})") from None


@dataclass
class LoadedCheckpoint:
    """Everything `eval`, `sample` and `export` need, rebuilt from a checkpoint alone."""

    path: Path
    config: Config
    model: torch.nn.Module
    tokenizer: Tokenizer
    state: dict[str, Any]
    # How the tokenizer is used: minillm's own conventions or the published model's
    # (minillm.tokenizer.conventions): prompts, the chat template, stop tokens.
    conventions: Conventions
    hf_folder: bool = False  # a Hugging Face folder: no run, no validation shards, no state.json
    # A LoRA run's adapters as trained (`model` holds them merged into the base): for
    # `minillm export --format peft`. None for any other checkpoint.
    adapters: dict[str, torch.Tensor] | None = None
    # The tokenizer.json the tokenizer was read from; its companion files lie beside it (an
    # export of a published model's tokenizer copies them).
    tokenizer_path: Path | None = None


def load_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    verify: bool = True,
    best: bool = False,
    dtype: str | torch.dtype | None = None,
    quantize: str = "none",
) -> LoadedCheckpoint:
    """Config, model (eval mode) and tokenizer from `--ckpt` (a run, a checkpoint or a Hugging
    Face Llama folder). The model is built on the meta device and each weight read (memory-
    mapped) and materialised once, in `dtype` on `device` (minillm.checkpoint.lazy): `auto` the
    weights' own (a folder's config.json dtype), a name of `lazy.DTYPES`, None float32.
    `quantize` (`--quantize` nf4 or int8) makes each linear layer so as it is read
    (minillm.checkpoint.quantized_load); int8 that cannot run here is one warning and fp32.

    A run directory gives its newest intact checkpoint (a damaged newer one is skipped with a
    warning naming both, as `train` resumes), `best` the one BEST names; a checkpoint folder
    named explicitly that fails its check is an error. Each file is hashed once, here. A Hugging
    Face folder is read by minillm.checkpoint.hf_import, which refuses what minillm would not
    compute as transformers does (another architecture, RoPE scaling, another tokenizer kind).
    """
    from minillm.config import config_from_dict, config_to_dict
    from minillm.errors import ConfigError
    from minillm.tokenizer.bpe import load_tokenizer

    if is_hf_folder(path):
        from minillm.checkpoint.hf_import import hf_dtype, load_hf_model, read_hf_checkpoint

        if best:
            raise CheckpointError(
                f"{path}: --best takes a run directory, not a Hugging Face folder"
            )
        cfg, tokenizer = read_hf_checkpoint(path)
        want = resolve_dtype(dtype, hf_dtype(path) if dtype == "auto" else None)
        hook, problem = as_loaded(quantize, cfg.model, device)
        model = load_hf_model(path, cfg.model, want, device, hook)
        model = _quantized(model, quantize, cfg, problem)
        state = {"config": config_to_dict(cfg)}
        conventions = model_conventions(tokenizer, Path(path), cfg.model)
        return LoadedCheckpoint(
            Path(path),
            cfg,
            model,
            tokenizer,
            state,
            conventions,
            hf_folder=True,
            tokenizer_path=Path(cfg.data.tokenizer),
        )
    ckpt = resolve_checkpoint(path, verify=verify, best=best)
    state = read_state(ckpt)
    check_model_config(ckpt, state)
    try:
        cfg = config_from_dict(state["config"], file=str(ckpt / STATE_FILE))
        # A checkpoint saved before model.family was stored: its family resolves on load.
        cfg = dataclasses.replace(cfg, model=with_family(cfg.model))
    except ConfigError as e:
        raise CheckpointError(f"{ckpt / STATE_FILE}: its config is invalid: {e}") from None
    adapters = None
    hook, problem = as_loaded(quantize, cfg.model, device)
    if lora_base_of(state) is not None:  # merged in float: quantized whole, after
        model, adapters = _lora_model(cfg, state, ckpt, device, dtype)
    else:
        weights = _lazy_weights(ckpt)
        want = resolve_dtype(dtype, weights.float_dtype() if dtype == "auto" else None)
        where = str(ckpt / MODEL_FILE)
        model = fill_model(empty_model(cfg.model), weights.items(), where, want, device, hook)
    model = _quantized(model, quantize, cfg, problem)
    tok_path = ckpt / TOKENIZER_FILE
    if not tok_path.is_file():
        tok_path = ckpt.parent.parent / TOKENIZER_FILE
    try:
        tokenizer = load_tokenizer(tok_path)  # literal "<|endoftext|>" in text stays text
    except UserError as e:
        raise CheckpointError(f"{tok_path}: cannot load the run's tokenizer ({e})") from None
    _check_vocab(tokenizer, cfg, tok_path)
    conventions = model_conventions(tokenizer, tok_path.parent, cfg.model)
    return LoadedCheckpoint(
        ckpt, cfg, model, tokenizer, state, conventions, adapters=adapters, tokenizer_path=tok_path
    )


def at_context(
    ckpt: LoadedCheckpoint, overrides: list[str], seq_len: int | None = None
) -> LoadedCheckpoint:
    """`ckpt` read at another context: `overrides` (`--set`) of model keys no weight depends on
    (POSITION_KEYS: `model.max_seq_len`, `model.rope_scaling.*`), and model.max_seq_len raised
    to `seq_len` where it is shorter and not given (windows of seq_len tokens: plain RoPE
    extrapolates).

    The same weights in a model built from the changed config; `ckpt` itself when nothing
    changes. Any other key is a UserError naming it; an invalid value a ConfigError naming
    `--set`.
    """
    from minillm.config import POSITION_KEYS, apply_override, config_from_dict, config_to_dict

    for override in overrides:
        parts = override.split("=", 1)[0].strip().split(".")
        if parts[0] != "model" or len(parts) < 2 or parts[1] not in POSITION_KEYS:
            raise UserError(
                f"--set {override}: only model.max_seq_len and model.rope_scaling.* can change "
                "on a checkpoint (no weight depends on them)"
            )
    raw = config_to_dict(ckpt.config)
    for override in overrides:
        apply_override(raw, override)
    given = any(o.split("=", 1)[0].strip() == "model.max_seq_len" for o in overrides)
    if seq_len is not None and seq_len > raw["model"]["max_seq_len"] and not given:
        raw["model"]["max_seq_len"] = seq_len  # one given shorter: evaluate_checkpoint refuses
    # Every change is the command line's: a key it left invalid (a scaling type without
    # original_max_position_embeddings) is --set's to fix, not the checkpoint's.
    cfg = config_from_dict(raw, "--set")
    if cfg.model == ckpt.config.model:
        return ckpt
    param = next(ckpt.model.parameters())
    model = empty_model(cfg.model)
    _move_quantized(ckpt.model, model)
    weights = ckpt.model.state_dict().items()  # the same tensors, shared: no copy
    model = fill_model(model, weights, str(ckpt.path), param.dtype, param.device)
    return dataclasses.replace(ckpt, config=cfg, model=model)


def _move_quantized(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """`old`'s quantized layers (--quantize's NF4Linear, Int8Linear, Int8MoE, an int8 copy of a
    tied head) put into `new` as they are, where `new` (a model of the same weights, another
    context) has a float layer or none: they hold no weight a state_dict names, and no position
    key changes them."""
    mine = dict(new.named_modules())
    for name, module in old.named_modules():
        if name and (name not in mine or type(mine[name]) is not type(module)):
            parent, _, attr = name.rpartition(".")
            setattr(new.get_submodule(parent), attr, module)
    if hasattr(old, "quantized"):
        new.quantized = old.quantized


# ------------------------------------------------------------------ LoRA runs


def lora_base_of(state: dict[str, Any]) -> dict[str, str] | None:
    """The base identity a LoRA run's checkpoint records in state.json (`lora_base`: path,
    source, abspath, sha256, minillm.checkpoint.init_from.lora_base); None for other runs."""
    base = state.get("lora_base")
    return base if isinstance(base, dict) and "sha256" in base else None


def auto_dtype(ckpt: str | Path, state: dict[str, Any] | None = None) -> torch.dtype:
    """The dtype `load_checkpoint(ckpt, dtype="auto")` loads in, from config.json, state.json
    and safetensors headers alone (no weight is read; `info --ckpt`'s run row): a Hugging Face
    folder's `hf_dtype`; a LoRA run's checkpoint, the dtype its base was frozen in; another
    checkpoint (a folder resolve_checkpoint gave, its `state`), its weights' stored dtype."""
    if is_hf_folder(ckpt):
        from minillm.checkpoint.hf_import import hf_dtype

        return hf_dtype(ckpt)
    base = lora_base_of(read_state(Path(ckpt)) if state is None else state)
    if base is not None:
        return _base_dtype(base)
    return resolve_dtype("auto", _lazy_weights(Path(ckpt)).float_dtype())


def _base_dtype(base: dict[str, str]) -> torch.dtype:
    """The dtype a LoRA run froze its base in (lora_base.dtype; float32 before it was kept)."""
    return getattr(torch, str(base.get("dtype", "float32")), torch.float32)


def _lora_model(
    cfg: Config,
    state: dict[str, Any],
    ckpt: Path,
    device: str | torch.device,
    dtype: str | torch.dtype | None,
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A LoRA checkpoint's model: its recorded base (loaded as any --ckpt is, in float32 to
    check it against the recorded sha256) with the checkpoint's adapters merged in, then in
    `dtype` (`auto`: the dtype the base was frozen in, lora_base.dtype) on `device`; and the
    adapters."""
    from minillm.model.lora import add_lora, is_adapter, merge_lora

    base = lora_base_of(state)
    where = ckpt / STATE_FILE
    tried = dict.fromkeys([base["source"], base.get("abspath", ""), base.get("path", "")])
    folder = next((Path(p) for p in tried if p and Path(p).exists()), None)
    if folder is None and is_hub_id(base.get("path", "")):  # a hub name: its cache, wherever
        from minillm.checkpoint.hub import resolve_model_path

        folder = resolve_model_path(base["path"])
    if folder is None:
        raise CheckpointError(
            f"{where}: the LoRA base {base['source']} is missing (train.init_from "
            f"{base.get('path')!r}); the adapters need the weights they were trained on"
        )
    try:
        model = load_checkpoint(folder, device="cpu").model
    except UserError as e:
        raise CheckpointError(f"{where}: the LoRA base {folder} does not load: {e}") from None
    # A base frozen in bf16 (train.precision's) was trained on, and is known by, its rounding.
    base_dtype = _base_dtype(base)
    half = base_dtype if base_dtype != torch.float32 else None
    if weights_sha256(model.state_dict(), half) != base["sha256"]:
        raise CheckpointError(
            f"{folder}: the LoRA base of {ckpt} has changed since the adapters were trained "
            f"(the sha256 of its weights is not the recorded {base['sha256'][:16]}...)"
        )
    if half is not None:
        model = model.to(half).float()
    if dtype == "auto":  # a LoRA run's own: the dtype its base was frozen in
        dtype = base_dtype
    if getattr(model, "cfg", None) != cfg.model:
        raise CheckpointError(f"{folder}: the LoRA base's model is not {where}'s model section")
    if cfg.train.lora.quantize == "nf4":  # QLoRA trained on the base as NF4 holds it
        from minillm.families import fused_rows
        from minillm.model.nf4 import nf4_round_trip

        nf4_round_trip(model, fused_rows(cfg.model))
    add_lora(model, cfg.train.lora)
    adapters = load_model_state(ckpt)
    frozen = {k: v for k, v in model.state_dict().items() if not is_adapter(k)}
    load_weights_into(model, {**frozen, **adapters}, str(ckpt / MODEL_FILE))
    merged = merge_lora(model).to(device=device, dtype=resolve_dtype(dtype, None))
    return merged.eval(), adapters


def _quantized(
    model: torch.nn.Module, quantize: str, cfg: Config, problem: str | None
) -> torch.nn.Module:
    """`model` quantized to the end (quantized_load.finish), or `problem`, int8's reason it
    cannot run here, as one warning (the model stays fp32)."""
    from minillm.errors import warn

    if problem is None:
        problem = finish(model, quantize, cfg.model)
    if problem is not None:
        warn(f"--quantize {quantize}: {problem}; running in fp32")
    return model


def _lazy_weights(ckpt: Path) -> LazySafetensors:
    """A checkpoint's model.safetensors, read tensor by tensor (`load_model_state` reads it
    whole)."""
    path = ckpt / MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    return LazySafetensors([path])


def _check_vocab(tokenizer: Tokenizer, cfg: Config, tok_path: Path) -> None:
    if tokenizer.get_vocab_size() > cfg.model.vocab_size:
        raise CheckpointError(
            f"{tok_path}: tokenizer has {tokenizer.get_vocab_size()} tokens, more than "
            f"model.vocab_size={cfg.model.vocab_size}"
        )
