"""`train.init_from`: a run's starting model, and the config loading that applies it, once.

Offers `load_run_config(path, overrides)` (what `minillm tokenize`, `train` and `info` read),
`InitSource` / `init_source(path)` (what `train.init_from` names), `init_weights(path, model,
dtype)` (its model, loaded lazily), `lora_base(path, weights)` (the base identity a LoRA run
records) and `base_digest` (that identity's sha256, computed as init_weights reads the base).

`train.init_from` names a Hugging Face Llama folder (or its Hub name `org/name`, fetched into the
hub's cache: minillm.checkpoint.hub), or a minillm run directory (its newest intact checkpoint)
or one checkpoint. `load_run_config` is the one place it is applied to a config: the
model is then that source's (a model section of the config is not used, and a warning names its
keys that differ) but for the keys no weight depends on, `model.max_seq_len` and
`model.rope_scaling` (POSITION_KEYS: a context extension's), which the config may set; an empty
`data.tokenizer` becomes the source's tokenizer (and an absent
`data.vocab_size` its size; another tokenizer named there is a ConfigError), so `minillm
tokenize` makes the fine-tuning shards with the vocabulary the model was trained on and `info`
reports the model the run trains. The training stage only loads the weights (`init_weights`) of
the path the resolved config names. It lives here, not in `minillm.config` (a leaf of the
layers): reading a checkpoint's config or a Hugging Face folder is this stage's. A bad
`train.init_from` is a ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minillm.checkpoint import layout
from minillm.checkpoint import store as ckpt
from minillm.checkpoint.hf_import import hf_model_config, hf_source
from minillm.checkpoint.hub import resolve_model_path
from minillm.checkpoint.lazy import LazySafetensors, empty_model, fill_model, weight_group
from minillm.checkpoint.weights import SortedDigest, streamed_sha256, weights_sha256
from minillm.config import (
    POSITION_KEYS,
    Config,
    ModelConfig,
    config_from_dict,
    override_keys,
    read_raw_config,
)
from minillm.errors import CheckpointError, ConfigError, UserError, warn
from minillm.families import with_family
from minillm.tokenizer.bpe import load_tokenizer, tokenizer_sha256


@dataclass(frozen=True)
class InitSource:
    """What `train.init_from` names: its model config and tokenizer (read without the weights)."""

    path: str
    model: ModelConfig
    tokenizer_file: Path
    vocab_size: int  # the size of that tokenizer (a run's data.vocab_size)
    minillm: bool


def _is_minillm(path: str | Path) -> bool:
    """Whether train.init_from names a minillm run or checkpoint (else an HF folder)."""
    p = Path(path)
    return (p / layout.CKPT_DIR).is_dir() or (p / layout.STATE_FILE).is_file()


def init_source(path: str, file: str | None = None) -> InitSource:
    """The model config and tokenizer of a minillm run's newest checkpoint (or of one
    checkpoint), or of a Hugging Face Llama folder.

    What is wrong with it (no such folder, no checkpoint yet, not a model folder, no tokenizer)
    is a ConfigError `<file>: train.init_from: <what>`.
    """
    try:
        return _init_source(path)
    except UserError as e:
        raise ConfigError("train.init_from", str(e), file) from None


def _init_source(name: str) -> InitSource:
    # A hub name: its config and tokenizer (`tokenize` and `info` read no weights).
    path = str(resolve_model_path(name, weights=False))
    if not _is_minillm(path):
        model = hf_model_config(path)
        tok = Path(path) / layout.TOKENIZER_FILE
        if not tok.is_file():
            raise UserError(
                f"{path}: no {layout.TOKENIZER_FILE} (minillm needs the fast tokenizer file of "
                "the model)"
            )
        return InitSource(name, model, tok, load_tokenizer(tok).get_vocab_size(), False)
    found = layout.resolve_checkpoint(path, verify=False)  # the config only; init_weights verifies
    cfg = config_from_dict(layout.read_state(found)["config"], file=str(found / layout.STATE_FILE))
    # A run directory's own copy (stable while its checkpoints get pruned), else the checkpoint's.
    tok = found.parent.parent / layout.TOKENIZER_FILE
    for candidate in (Path(path) / layout.TOKENIZER_FILE, found / layout.TOKENIZER_FILE):
        if candidate.is_file():
            tok = candidate
            break
    return InitSource(path, cfg.model, tok, cfg.data.vocab_size, True)


def init_weights(
    path: str,
    model: ModelConfig,
    dtype: torch.dtype = torch.float32,
    on_filled: Callable[[str, torch.nn.Module], torch.nn.Module | None] | None = None,
    digest: SortedDigest | None = None,
) -> tuple[torch.nn.Module, str]:
    """The model `train.init_from` names: a Transformer of `model` (the run's: the source's,
    with its own POSITION_KEYS) built on the meta device and filled from the source tensor by
    tensor, in `dtype` on the CPU (a checkpoint's weights integrity-checked first); and where
    it came from, for the banner: `runs/x (step_000400)` for a run directory (its newest intact
    checkpoint), else the checkpoint or Hugging Face folder as given. A LoRA run's weights are
    its base with the adapters merged. A hub name reads its cached snapshot. `on_filled`:
    fill_model's (QLoRA's NF4 conversion, layer by layer as they are read). `digest`
    (base_digest's): fed each weight as it is read, a block at a time in the order it hashes
    them, so a LoRA base's sha256 costs no read of its own."""
    tensors, where, label = _source(path, model, dtype, digest is not None)
    on_read = digest.add if digest is not None else None
    filled = fill_model(
        empty_model(model), tensors(), where, dtype, on_filled=on_filled, on_read=on_read
    )
    return filled, label


def _source(
    path: str, model: ModelConfig, dtype: torch.dtype, sorted_blocks: bool = False
) -> tuple[Callable[[], Iterable[tuple[str, torch.Tensor]]], str, str]:
    """What init_weights reads: (a new pass over the (our name, tensor) pairs, the place errors
    name, the banner's label). `sorted_blocks`: a folder's a block at a time in the sorted
    order of the names (a checkpoint's come sorted)."""
    if not _is_minillm(path):
        passes, where = hf_source(resolve_model_path(path), model, sorted_blocks)
        return passes, where, path
    found = layout.resolve_checkpoint(path)
    given_one = (Path(path) / layout.STATE_FILE).is_file()
    label = path if given_one else f"{path} ({found.name})"
    where = str(found / layout.MODEL_FILE)
    if ckpt.lora_base_of(layout.read_state(found)) is not None:
        merged = ckpt.load_checkpoint(found, verify=False, dtype=dtype).model
        return lambda: sorted(merged.state_dict().items()), where, label
    if not (found / layout.MODEL_FILE).is_file():
        raise CheckpointError(f"{where}: missing")
    tensors = LazySafetensors([found / layout.MODEL_FILE])
    return lambda: ((name, tensors[name]) for name in sorted(tensors)), where, label


def lora_base(
    path: str,
    weights: Mapping[str, torch.Tensor] | None,
    dtype: torch.dtype = torch.float32,
    model: ModelConfig | None = None,
    sha256: str | None = None,
) -> dict[str, str]:
    """The identity of a LoRA run's base (what its checkpoints record in state.json's
    `lora_base`): train.init_from as given, the folder the weights came from (a run directory's
    newest checkpoint, resolved now), that folder's absolute path, and the sha256 of the weights
    (`weights_sha256`), with the dtype the base is frozen in where it is not float32 (the sha256
    is then of the weights rounded to it). `sha256`: that digest, computed as the weights were
    loaded (base_digest's); else it is computed from `weights`, or (None: a QLoRA base, held in
    NF4 only) from the weights read again from the source, as loaded in `dtype` for `model`."""
    source = resolve_model_path(path)  # a hub name: the snapshot its weights came from
    if _is_minillm(path):
        source = layout.resolve_checkpoint(path)  # the one init_weights read (intact)
    half = dtype != torch.float32
    if sha256 is not None:
        sha = sha256
    elif weights is not None:
        sha = weights_sha256(weights, dtype if half else None)
    else:
        assert model is not None, "lora_base: weights None needs the model config"
        sha = _streamed_sha256(path, model, dtype)
    base = {"path": path, "source": str(source), "abspath": str(source.resolve()), "sha256": sha}
    if half:
        base["dtype"] = str(dtype).removeprefix("torch.")
    return base


def _hash_plan(
    model: ModelConfig, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, torch.dtype], int]:
    """What the base's sha256 hashes: the meta model's state_dict, the dtype each weight loads
    in (fill_model's), and the bytes of its largest block (what a pass may hold)."""
    meta = empty_model(model).state_dict(keep_vars=True)
    params = {k for k, v in meta.items() if isinstance(v, torch.nn.Parameter)}
    want = {k: dtype if k in params and v.is_floating_point() else v.dtype for k, v in meta.items()}
    blocks: dict[str, int] = {}
    for k, v in meta.items():
        group = weight_group(k)
        blocks[group] = blocks.get(group, 0) + v.numel() * want[k].itemsize
    return meta, want, max(blocks.values())


def base_digest(model: ModelConfig, dtype: torch.dtype) -> SortedDigest:
    """The sha256 lora_base records, for init_weights(..., digest=) to compute as it loads the
    base in `dtype`: one block held at most (past that it gives up, and lora_base reads it)."""
    meta, _, budget = _hash_plan(model, dtype)
    return SortedDigest(meta, dtype if dtype != torch.float32 else None, budget)


def _streamed_sha256(path: str, model: ModelConfig, dtype: torch.dtype) -> str:
    """weights_sha256 of init_weights(path, model, dtype)'s state_dict without holding it: the
    source read in passes (streamed_sha256), each tensor converted as fill_model converts it,
    at most one block's worth kept between passes."""
    tensors, _, _ = _source(path, model, dtype)
    meta, want, budget = _hash_plan(model, dtype)
    half = dtype if dtype != torch.float32 else None

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(want[name] if t.is_floating_point() else meta[name].dtype)

    return streamed_sha256(list(meta), tensors, half, budget, convert)


def _same(given: Any, value: Any) -> bool:
    """Whether a YAML value (a list for a tuple) is the source's value."""
    return (tuple(given) if isinstance(given, list) else given) == value


def _keep_positions(model: dict[str, Any], own: dict[str, Any]) -> None:
    """The config's own POSITION_KEYS over the source's in `model` (the source's, as plain
    data): a context extension raises max_seq_len and sets rope_scaling on a trained model, whose
    weights depend on neither. rope_scaling is merged key by key, as `--set` over a YAML, so that
    `--set model.rope_scaling.factor=8` changes the factor of the source's scaling alone."""
    for key in POSITION_KEYS:
        if key not in own:
            continue
        if isinstance(own[key], dict) and isinstance(model[key], dict):
            model[key] = {**model[key], **own[key]}
        else:
            model[key] = own[key]


def _apply_init_from(raw: dict[str, Any], source: InitSource, vocab_from: str = "") -> None:
    """Give `raw` (the parsed YAML) the source's model, and its tokenizer when data.tokenizer is
    empty; a model section of the config's own is replaced, the keys that differ named.

    A data.vocab_size that is not the size of the tokenizer taken so is an error naming both
    sources and the fix (`vocab_from`: where data.vocab_size was given, the file or `--set`):
    `tokenize` would otherwise refuse that tokenizer and point at --retrain, which must not
    replace a model's tokenizer."""
    own = raw.get("model")
    model = dataclasses.asdict(source.model)
    if isinstance(own, dict):
        # In the dataclass's order (the YAML's is sorted), then keys the schema does not know.
        differ = [f"model.{k}" for k in model if k in own and not _same(own[k], model[k])]
        differ += [f"model.{k}" for k in own if k not in model]
        differ = [k for k in differ if k.removeprefix("model.") not in POSITION_KEYS]
        if differ:
            warn(f"train.init_from: the model is {source.path}'s; the config's "
                 f"{', '.join(differ)} are not used")  # fmt: skip
        _keep_positions(model, own)
    raw["model"] = model
    data = raw.setdefault("data", {})
    if data is None:
        data = raw["data"] = {}
    if not isinstance(data, dict):
        return
    if data.get("tokenizer"):
        own, theirs = Path(str(data["tokenizer"])), source.tokenizer_file
        if own.is_file() and theirs.is_file() and tokenizer_sha256(own) != tokenizer_sha256(theirs):
            raise ConfigError(
                "data.tokenizer",
                f"{own} is another tokenizer than train.init_from's {theirs}: the model's ids "
                "would mean other tokens; leave data.tokenizer empty (the model's is used)",
            )
        if not own.is_file():
            return  # tokenize trains it or says what is missing
    else:
        data["tokenizer"] = str(source.tokenizer_file)
    # The model's own tokenizer (taken, or named in data.tokenizer): data.vocab_size is its size.
    given = data.setdefault("vocab_size", source.vocab_size)
    if given != source.vocab_size and str(given) != str(source.vocab_size):
        raise ConfigError(
            "data.vocab_size",
            f"{given}, but the tokenizer of train.init_from ({source.path}: "
            f"{source.tokenizer_file}) has {source.vocab_size} tokens, the ids its model was "
            f"trained on: leave data.vocab_size out (with train.init_from it is that "
            f"tokenizer's size) or set it to {source.vocab_size}",
            vocab_from,
        )


def load_run_config(
    path: str | Path, overrides: list[str] | None = None, require_model: bool = True
) -> Config:
    """`minillm.config.load_config` with `train.init_from` applied (module docstring): what
    `minillm tokenize`, `train` and `info` read, so all three see the model the run trains.

    `require_model=False` (`minillm tokenize`, which reads only the data section) accepts a
    config with neither a model section nor init_from.
    """
    raw = read_raw_config(path, overrides)
    overridden = override_keys(overrides or [])
    train = raw.get("train")
    init_from = train.get("init_from") if isinstance(train, dict) else None
    if init_from:
        where = "--set" if "train.init_from" in overridden else str(path)
        vocab_from = "--set" if "data.vocab_size" in overridden else str(path)
        _apply_init_from(raw, init_source(str(init_from), file=where), vocab_from)
    try:
        cfg = config_from_dict(raw, str(path), overridden, require_model=require_model)
        # The family is resolved once, here, and travels with the run (config.yaml, checkpoints).
        return dataclasses.replace(cfg, model=with_family(cfg.model))
    except ConfigError as e:
        if init_from and "model." in f"{e.key} {e.message}":
            # That model section is init_from's, not the file's: name each value's source.
            if e.key.startswith("model."):
                e.file = str(path)
            sources = [f"model.* from train.init_from {init_from}"]
            for key in dict.fromkeys(re.findall(r"data\.\w+", e.message)):
                sources.append(f"{key} from {'--set' if key in overridden else path}")
            e.message += f" ({'; '.join(sources)})"
        raise
