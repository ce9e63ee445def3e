"""What a run starts from: its config, with the model taken from `train.init_from` when asked.

Offers `load_train_config(path, overrides)` (what `minillm train`, `tokenize` and `info` read),
`init_from(cfg)` (the starting weights and tokenizer) and `check_data` (shards vs config).
`train.init_from` is resolved here, once, and not in `minillm.config` (a leaf of the layers).
It names a Hugging Face Llama folder, or a minillm run directory (its newest intact checkpoint) or
one checkpoint: the model and the tokenizer are then the run's. For a minillm run an empty
`data.tokenizer` becomes the run's tokenizer (and an absent `data.vocab_size` its size), so `minillm
tokenize` makes the fine-tuning shards with the vocabulary the model was trained on (every tokenizer
reserves the chat tokens).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from minillm.checkpoint import store as ckpt
from minillm.checkpoint.hf_folder import hf_model_config, import_hf_folder
from minillm.config import (
    Config,
    config_from_dict,
    config_to_dict,
    override_keys,
    read_raw_config,
)
from minillm.data.meta import stale_data_keys
from minillm.data.tokenizer import tokenizer_sha256
from minillm.errors import ConfigError, UserError, warn


def _is_minillm(path: str | Path) -> bool:
    """Whether train.init_from names a minillm run or checkpoint (else an HF folder)."""
    p = Path(path)
    return (p / ckpt.CKPT_DIR).is_dir() or (p / ckpt.STATE_FILE).is_file()


def _minillm_source(path: str | Path) -> tuple[Config, Path]:
    """The config and tokenizer.json of a minillm run's newest checkpoint (or of a checkpoint)."""
    found = ckpt.resolve_checkpoint(path, verify=False)
    cfg = config_from_dict(ckpt.read_state(found)["config"], file=str(found / ckpt.STATE_FILE))
    # A run directory's own copy (stable while its checkpoints get pruned), else the checkpoint's.
    for tok in (Path(path) / ckpt.TOKENIZER_FILE, found / ckpt.TOKENIZER_FILE):
        if tok.is_file():
            return cfg, tok
    return cfg, found.parent.parent / ckpt.TOKENIZER_FILE


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """`load_config`, except that a config without a model section takes train.init_from's
    (and, from a minillm run, an empty data.tokenizer the run's)."""
    raw = read_raw_config(path, overrides)
    train = raw.get("train")
    init_from = train.get("init_from") if isinstance(train, dict) else None
    if init_from and _is_minillm(init_from):
        source, tok = _minillm_source(init_from)
        if "model" not in raw:
            raw["model"] = dataclasses.asdict(source.model)
        data = raw.setdefault("data", {})
        if isinstance(data, dict) and not data.get("tokenizer"):
            data["tokenizer"] = str(tok)
            data.setdefault("vocab_size", source.data.vocab_size)  # the size of that tokenizer
    elif "model" not in raw and init_from:
        raw["model"] = dataclasses.asdict(hf_model_config(init_from))
    return config_from_dict(raw, str(path), override_keys(overrides or []))


def init_from(
    cfg: Config, warn_: bool = True
) -> tuple[Config, dict[str, torch.Tensor] | None, Path]:
    """The run's config, starting weights and tokenizer file, from `train.init_from` if set.

    With init_from (a Hugging Face Llama folder, a minillm run or checkpoint) the model and
    tokenizer are its; config model keys that differ are named in a warning. Without it:
    (cfg, None, data.tokenizer_path).
    """
    if not cfg.train.init_from:
        return cfg, None, cfg.data.tokenizer_path
    if _is_minillm(cfg.train.init_from):
        source, tokenizer_file = _minillm_source(cfg.train.init_from)
        model_cfg = source.model
        state = ckpt.load_model_state(ckpt.resolve_checkpoint(cfg.train.init_from))
    else:
        model_cfg, state, tokenizer_file = import_hf_folder(cfg.train.init_from)
    differ = [f"model.{f.name}" for f in dataclasses.fields(model_cfg)
              if getattr(model_cfg, f.name) != getattr(cfg.model, f.name)]  # fmt: skip
    if differ and warn_:
        warn(f"train.init_from: the model is {cfg.train.init_from}'s; the config's "
             f"{', '.join(differ)} are not used")  # fmt: skip
    cfg.model = model_cfg
    cfg = config_from_dict(config_to_dict(cfg), file="train.init_from")
    return cfg, state, tokenizer_file


def check_data(
    cfg: Config, meta: dict[str, Any], tokenizer_file: Path, train_tokens: int, warn_: bool = True
) -> str:
    """Check the shards (meta.json) against the tokenizer and the config; return its sha256.

    A tokenizer other than the shards', a vocabulary larger than the model's or a train split
    shorter than one sequence are errors; shards made from other data settings a warning.
    """
    if not Path(tokenizer_file).is_file():
        raise UserError(f"{tokenizer_file}: tokenizer not found; run `minillm tokenize` first")
    sha = tokenizer_sha256(tokenizer_file)
    if meta.get("tokenizer_sha256") not in (None, sha) and cfg.train.init_from:
        raise ConfigError(
            "data.tokenizer",
            f"the shards in {cfg.data.out_dir} were made with another tokenizer than "
            f"train.init_from's {tokenizer_file}; set data.tokenizer to it (or leave it empty) "
            "and run `minillm tokenize` again",
        )
    if meta.get("tokenizer_sha256") not in (None, sha):
        raise UserError(
            f"{cfg.data.out_dir}/meta.json: shards were made with another tokenizer than "
            f"{tokenizer_file}; run `minillm tokenize` again"
        )
    stale = stale_data_keys(meta, cfg.data)
    if stale and warn_:
        warn(f"{cfg.data.out_dir}/meta.json: the shards were made with other "
             f"{', '.join(stale)} than this config's; run `minillm tokenize CONFIG` to "
             "remake them")  # fmt: skip
    vocab = int(meta["vocab_size"])
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{cfg.model.vocab_size} is smaller than the tokenizer's {vocab} tokens",
        )
    if train_tokens < cfg.train.seq_len + 1:
        raise ConfigError(
            "train.seq_len", f"the train split has {train_tokens} tokens, fewer than seq_len+1"
        )
    return sha
