"""Read a Hugging Face folder as our config, weights and tokenizer (an HF folder -> us): Llama,
Qwen2, Qwen3, Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE, Gemma 3's text model, Phi-3 or DeepSeek-V3
(minillm.families.FAMILIES).

Offers `hf_tensors(dir, cfg)` (the folder's tensors as ours, one at a time), `hf_source`
(passes over them, for a load that reads them more than once), `load_hf_model(dir,
cfg, dtype, device)` (them in a model built lazily: what `--ckpt DIR` and `train.init_from: DIR`
load), `hf_dtype` (what `--dtype auto` means for it), `import_hf_folder(dir) -> (ModelConfig,
float32 state_dict, tokenizer.json path)`, `hf_model_config` (the ModelConfig of config.json
alone), `check_hf_tokenizer` and `read_hf_checkpoint(dir) -> (Config, Tokenizer)` (what
`--ckpt DIR` reads before the weights, through `minillm.checkpoint.store.load_checkpoint`).
Writing a folder is minillm.checkpoint.hf_export; parameter names and the config mapping are
the family's (minillm.families), which the config records (model.family).

A folder is read only where minillm computes what transformers would: one of those families
with the options our model has (the family says which key is not: another rope_type, sliding
windows in some layers, an MLP or output bias), and a byte-level BPE tokenizer (its special
tokens, chat template and eos are the model's: minillm.tokenizer.conventions); anything else is
one CheckpointError or ConfigError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minillm.checkpoint.layout import (
    HF_CONFIG_FILE,
    HF_GENERATION_FILE,
    HF_WEIGHTS_FILE,
    HF_WEIGHTS_INDEX,
    TOKENIZER_FILE,
)
from minillm.checkpoint.lazy import (
    LazySafetensors,
    by_group,
    empty_model,
    fill_model,
    stored_dtype,
)
from minillm.config import Config, DataConfig, ModelConfig, SampleConfig, TrainConfig
from minillm.errors import CheckpointError, ConfigError, UserError
from minillm.families import family_of, model_config_from_hf
from minillm.runtime.files import read_json_object
from minillm.tokenizer.pieces import tokenizer_kind

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def _read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / HF_CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {HF_CONFIG_FILE}; not a Hugging Face model folder")
    return read_json_object(path)  # model_config_from_hf checks that it is a Llama


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors file(s) of an HF folder: one file or the shards of an index."""
    single, index = folder / HF_WEIGHTS_FILE, folder / HF_WEIGHTS_INDEX
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard {missing[0]} is missing")
        return [folder / s for s in shards]
    if any((folder / n).is_file() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise CheckpointError(
            f"{folder}: has pytorch_model.bin (pickle) weights only; minillm loads safetensors, "
            "which run no code. Convert it: AutoModelForCausalLM.from_pretrained(DIR)"
            ".save_pretrained(NEW_DIR, safe_serialization=True)"
        )
    raise CheckpointError(f"{folder}: no {HF_WEIGHTS_FILE} (nor {HF_WEIGHTS_INDEX})")


def _stores_head(folder: Path) -> bool:
    """Whether the folder's weights hold an `lm_head.weight` (the files' headers only; False
    for weights that cannot be read, which loading then reports naming the file)."""
    from safetensors import SafetensorError, safe_open

    try:
        for path in _weight_files(folder):
            with safe_open(str(path), framework="pt") as f:
                if "lm_head.weight" in f.keys():
                    return True
    except (CheckpointError, SafetensorError, OSError, ValueError):
        return False
    return False


def hf_model_config(folder: str | Path) -> ModelConfig:
    """Our ModelConfig from an HF Llama folder's config.json alone (no weights read)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder")
    hf = _read_hf_config(folder)
    cfg_path = str(folder / HF_CONFIG_FILE)
    try:
        cfg = model_config_from_hf(hf, where=cfg_path)
        if cfg.tie_embeddings and _stores_head(folder):
            # tie_word_embeddings with an lm_head.weight stored too: transformers computes with
            # the stored head, untied, where it differs from the embedding (where it equals it,
            # untied gives the same numbers).
            cfg = dataclasses.replace(cfg, tie_embeddings=False)
        return cfg
    except ConfigError as e:
        e.file = e.file or cfg_path
        raise
    except KeyError as e:
        raise CheckpointError(f"{cfg_path}: {e.args[0]}: missing") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: invalid value ({e})") from None


def _tokenizer_file(folder: Path) -> Path:
    """The folder's tokenizer.json; a CheckpointError when it has none."""
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{folder}: no {TOKENIZER_FILE} (minillm needs the fast tokenizer file of the model)"
        )
    return path


def hf_tensors(
    folder: Path, cfg: ModelConfig, sorted_blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's weights as (our name, our tensor), one at a time, in the stored dtype: the
    one call that turns a folder's tensors into ours (KeyError for a missing tensor).
    `sorted_blocks`: a block at a time in the sorted order of the names (lazy.by_group), for a
    load that hashes the weights as it reads them."""
    # The family's adapter reads each source tensor when it needs it (from the memory-mapped
    # shards), so one layer's worth is held beyond the model at a time.
    src = LazySafetensors(_weight_files(folder))
    family = family_of(cfg)
    if sorted_blocks:
        yield from by_group(lambda s: family.from_hf(cfg, s), src)
    else:
        yield from family.from_hf(cfg, src)


def _checked(
    folder: Path, cfg: ModelConfig, where: str, sorted_blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """hf_tensors with a missing tensor, or q/k/v of widths that cannot be joined, as a
    CheckpointError naming `where`."""
    try:
        yield from hf_tensors(folder, cfg, sorted_blocks)
    except KeyError as e:
        raise CheckpointError(
            f"{where}: weights do not fit {HF_CONFIG_FILE}: tensor {e.args[0]} is missing"
        ) from None
    except RuntimeError as e:  # q/k/v or gate/up of different widths cannot be joined
        raise CheckpointError(f"{where}: weights do not fit {HF_CONFIG_FILE} ({e})") from None


def hf_dtype(folder: str | Path) -> torch.dtype:
    """The dtype `--dtype auto` loads the folder in: config.json's, else its weights'; float32
    where neither says (`info` of a hub name fetches config.json alone, no weights)."""
    folder = Path(folder)
    config = _read_hf_config(folder)
    weights = (folder / HF_WEIGHTS_FILE).is_file() or (folder / HF_WEIGHTS_INDEX).is_file()
    return stored_dtype(config, LazySafetensors(_weight_files(folder) if weights else []))


def load_hf_model(
    folder: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    on_filled: Callable[[str, torch.nn.Module], torch.nn.Module | None] | None = None,
) -> torch.nn.Module:
    """The Transformer of `cfg` (hf_model_config's) holding the folder's weights in `dtype` on
    `device`, in eval mode, each tensor read and converted once (minillm.checkpoint.lazy;
    `on_filled` its hook: `--quantize`'s layers quantized as they are read).

    CheckpointError (a UserError) names the file at fault: missing, pickled or truncated
    weights, tensors missing or of the wrong shape."""
    passes, where = hf_source(folder, cfg)
    return fill_model(empty_model(cfg), passes(), where, dtype, device, on_filled)


def hf_source(
    folder: str | Path, cfg: ModelConfig, sorted_blocks: bool = False
) -> tuple[Callable[[], Iterator[tuple[str, torch.Tensor]]], str]:
    """(a new pass over the folder's (our name, tensor) pairs, errors as load_hf_model's, in
    hf_tensors' order; the file or index those errors name): what a lazy load reads, as often
    as it needs to."""
    folder = Path(folder)
    files = _weight_files(folder)
    where = str(files[0]) if len(files) == 1 else str(folder / HF_WEIGHTS_INDEX)
    return lambda: _checked(folder, cfg, where, sorted_blocks), where


def import_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """Our ModelConfig, our float32 state_dict and the tokenizer.json path of an HF Llama
    folder (tests and tools that want the tensors; loading a model is `load_hf_model`).

    CheckpointError (a UserError) names the file at fault: no config.json, another architecture,
    missing, pickled or truncated weights, tensors missing or of the wrong shape.
    """
    folder = Path(folder)
    cfg = hf_model_config(folder)
    tokenizer = _tokenizer_file(folder)
    return cfg, load_hf_model(folder, cfg).state_dict(), tokenizer


# ----------------------------------------------------------------------------- --ckpt

# eval's default batch over a folder, which has no train.batch_size of its own: as many windows
# of the model's context as the default config's batch holds tokens (8 x 256), at least one.
EVAL_BATCH_TOKENS = 2048


def check_hf_tokenizer(tok: Tokenizer, path: Path) -> None:
    """CheckpointError unless minillm applies `tok` as transformers does: a byte-level or a
    sentencepiece-style (byte-fallback) BPE (minillm.tokenizer.pieces.tokenizer_kind). Its
    special tokens, template and eos are the model's own (minillm.tokenizer.conventions)."""
    tokenizer_kind(tok, str(path))


def _sample_config(folder: Path, context: int) -> SampleConfig:
    """The `sample` defaults of a folder: its generation_config.json as transformers' generate
    reads it (greedy unless do_sample; then temperature 1, top_k 50, top_p 1 where unset), or
    minillm's defaults where it has none. An exported folder so keeps its run's defaults.
    Without a max_new_tokens, minillm's default, at most half the model's `context` (a reply
    leaves room for its prompt)."""
    path = folder / HF_GENERATION_FILE
    room = min(SampleConfig().max_new_tokens, max(1, context // 2))
    if not path.is_file():
        return SampleConfig(max_new_tokens=room)
    gen = read_json_object(path)
    values: dict[str, Any] = {"max_new_tokens": room}
    if gen.get("max_new_tokens") is not None:
        values["max_new_tokens"] = gen["max_new_tokens"]
    if gen.get("do_sample"):
        for key, hf_default in (("temperature", 1.0), ("top_k", 50), ("top_p", 1.0)):
            values[key] = hf_default if gen.get(key) is None else gen[key]
    else:
        values["temperature"] = 0.0
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{path}: {key}: {value!r} is not a number")
    values = {
        k: (int(v) if k in ("max_new_tokens", "top_k") else float(v)) for k, v in values.items()
    }
    try:
        return SampleConfig(**values)
    except ConfigError as e:
        e.file = str(path)
        raise


def read_hf_checkpoint(folder: str | Path) -> tuple[Config, Tokenizer]:
    """What `--ckpt FOLDER` reads from a Hugging Face Llama folder before its weights: a config
    (its model; the `sample` defaults of generation_config.json; train.seq_len its whole
    context, so `eval` scores windows as long as the model reads; data.out_dir the folder,
    which holds no shards) and the tokenizer, each checked. The weights are `load_hf_model`'s."""
    from minillm.tokenizer.bpe import load_tokenizer

    folder = Path(folder)
    model = hf_model_config(folder)
    tok_path = _tokenizer_file(folder)
    try:
        tokenizer = load_tokenizer(tok_path)  # literal "<|endoftext|>" in text stays text
    except UserError as e:
        raise CheckpointError(f"{tok_path}: cannot load the tokenizer ({e})") from None
    check_hf_tokenizer(tokenizer, tok_path)
    sample = _sample_config(folder, model.max_seq_len)
    try:
        data = DataConfig(
            vocab_size=tokenizer.get_vocab_size(), tokenizer=str(tok_path), out_dir=str(folder)
        )
        batch = max(1, EVAL_BATCH_TOKENS // model.max_seq_len)
        config = Config(
            model, data, TrainConfig(seq_len=model.max_seq_len, batch_size=batch), sample
        )
    except ConfigError as e:  # a tokenizer too small for a byte-level BPE or larger than the model
        raise CheckpointError(f"{tok_path}: does not fit {HF_CONFIG_FILE} ({e})") from None
    _weight_files(folder)  # no weights, or pickled ones: said before a slow load begins
    return config, tokenizer
