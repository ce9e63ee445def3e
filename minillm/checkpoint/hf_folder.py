"""Hugging Face Llama folders: export a checkpoint as one, and read one as our config + weights.

Offers `export_checkpoint(ckpt, out, force)` (what `minillm export` runs), `hf_tokenizer_config`,
`generation_config`, `import_hf_folder(dir) -> (ModelConfig, state_dict, tokenizer.json path)`
(what `train.init_from: DIR` uses) and `read_hf_checkpoint(dir) -> (Config, state_dict,
Tokenizer)` (what `--ckpt DIR` loads, through `minillm.checkpoint.store.load_checkpoint`).
Parameter names and the config mapping live in minillm/model/hf_names.py.

An exported folder holds config.json, model.safetensors (HF names), tokenizer.json,
tokenizer_config.json, special_tokens_map.json and generation_config.json; it loads with
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`. With the chat tokens,
tokenizer_config.json carries minillm's chat template (`apply_chat_template` gives the same ids)
and generation stops at `<|end|>` as well as at end-of-text.

A model with `model.n_experts` is written as a MixtralForCausalLM. A folder is read only where
minillm computes what transformers would: a LlamaForCausalLM or MixtralForCausalLM (without
sliding-window attention) without RoPE scaling or biases (hf_names says which key is not), and a
byte-level BPE tokenizer with `<|endoftext|>`; anything else is one CheckpointError or
ConfigError naming the file and the key.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minillm.checkpoint.weights import load_weights_into
from minillm.config import Config, DataConfig, ModelConfig, SampleConfig, TrainConfig
from minillm.errors import CheckpointError, ConfigError, UserError
from minillm.model.hf_names import (
    from_hf_state_dict,
    hf_config_dict,
    model_config_from_hf,
    to_hf_state_dict,
)
from minillm.runtime.files import commit_dir, save_safetensors

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_FILE = "generation_config.json"

# ----------------------------------------------------------------------------- export


def hf_tokenizer_config(
    eot: str, eot_id: int, max_len: int, specials: dict[str, int] | None = None
) -> dict[str, Any]:
    """tokenizer_config.json for PreTrainedTokenizerFast: end-of-text is bos, eos and pad.

    specials: every special token -> id (default: end-of-text alone). With the chat tokens among
    them the config carries the chat template, so `apply_chat_template` gives minillm's ids.
    """
    from minillm.data.chat_template import END, HF_CHAT_TEMPLATE

    specials = specials or {eot: eot_id}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eot,
        "eos_token": eot,
        "pad_token": eot,
        "unk_token": None,
        # Our tokenizer adds no special tokens and decodes byte-exactly; keep HF from "cleaning".
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "padding_side": "left",
        "added_tokens_decoder": {
            str(i): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for name, i in sorted(specials.items(), key=lambda kv: kv[1])
        },
    }
    if END in specials:
        config["chat_template"] = HF_CHAT_TEMPLATE
    return config


def generation_config(
    sample: SampleConfig, eot_id: int, end_id: int | None = None
) -> dict[str, Any]:
    """generation_config.json: the run's `sample` defaults, stopping at end-of-text (and at
    `<|end|>`, the end of a chat turn, when the tokenizer has it).

    It sets max_new_tokens, not max_length: transformers warns when a caller's max_new_tokens
    meets a max_length from the folder.
    """
    out: dict[str, Any] = {
        "bos_token_id": eot_id,
        "eos_token_id": eot_id if end_id is None else [eot_id, end_id],
        "pad_token_id": eot_id,
        "max_new_tokens": sample.max_new_tokens,
    }
    if sample.temperature > 0:
        out.update(do_sample=True, temperature=sample.temperature, top_p=sample.top_p)
        out["top_k"] = sample.top_k  # 0 = off, in HF as here
    else:
        out["do_sample"] = False
    return out


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


def export_checkpoint(ckpt: Any, out: str | Path, force: bool = False) -> Path:
    """Write a LoadedCheckpoint as an HF Llama folder at `out`, all at once (temp + rename).

    A non-empty `out` is refused unless force, and then replaced only once the new one is whole.
    """

    from minillm.data.chat_template import END
    from minillm.data.tokenizer import EOT, eot_id, special_tokens

    out = Path(out)
    check_export_target(out, force, ckpt.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = ckpt.config
    eot = eot_id(ckpt.tokenizer)
    specials = {name: ckpt.tokenizer.token_to_id(name) for name in special_tokens(ckpt.tokenizer)}
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        state = {k: v.detach().float().cpu() for k, v in ckpt.model.state_dict().items()}
        tensors = to_hf_state_dict(state, cfg.model)
        save_safetensors(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        files: dict[str, Any] = {
            CONFIG_FILE: hf_config_dict(
                cfg.model, bos_id=eot, eos_id=eot, router_aux_loss_coef=cfg.train.moe_aux_loss
            ),
            "tokenizer_config.json": hf_tokenizer_config(EOT, eot, cfg.model.max_seq_len, specials),
            "special_tokens_map.json": {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT},
            "generation_config.json": generation_config(cfg.sample, eot, specials.get(END)),
        }
        for name, obj in files.items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
        ckpt.tokenizer.save(str(tmp / TOKENIZER_FILE))
        check_export_target(out, force, ckpt.path)  # again: someone may have written meanwhile
        commit_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ----------------------------------------------------------------------------- import


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return obj


def _read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG_FILE}; not a Hugging Face model folder")
    return _read_json_object(path)  # model_config_from_hf checks that it is a Llama


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors file(s) of an HF folder: one file or the shards of an index."""
    single, index = folder / WEIGHTS_FILE, folder / WEIGHTS_INDEX
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
    raise CheckpointError(f"{folder}: no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX})")


def _load_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(str(path), device="cpu"))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{path}: not a readable safetensors file ({reason})") from None
    return tensors


def hf_model_config(folder: str | Path) -> ModelConfig:
    """Our ModelConfig from an HF Llama folder's config.json alone (no weights read)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder")
    hf = _read_hf_config(folder)
    cfg_path = str(folder / CONFIG_FILE)
    try:
        return model_config_from_hf(hf, where=cfg_path)
    except ConfigError as e:
        e.file = e.file or cfg_path
        raise
    except KeyError as e:
        raise CheckpointError(f"{cfg_path}: {e.args[0]}: missing") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: invalid value ({e})") from None


def import_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """Our ModelConfig, our float32 state_dict and the tokenizer.json path of an HF Llama folder.

    CheckpointError (a UserError) names the file at fault: no config.json, another architecture,
    missing, pickled or truncated weights, tensors missing or of the wrong shape.
    """
    from minillm.model import Transformer

    folder = Path(folder)
    cfg = hf_model_config(folder)
    tokenizer = folder / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise CheckpointError(
            f"{folder}: no {TOKENIZER_FILE} (minillm needs the fast tokenizer file of the model)"
        )
    files = _weight_files(folder)
    tensors = _load_safetensors(files)
    where = str(files[0]) if len(files) == 1 else str(folder / WEIGHTS_INDEX)
    try:
        state = from_hf_state_dict(tensors, cfg)
    except KeyError as e:
        raise CheckpointError(
            f"{where}: weights do not fit {CONFIG_FILE}: tensor {e.args[0]} is missing"
        ) from None
    except RuntimeError as e:  # q/k/v or gate/up of different widths cannot be joined
        raise CheckpointError(f"{where}: weights do not fit {CONFIG_FILE} ({e})") from None
    state = {k: v.float() for k, v in state.items()}
    # Names and shapes checked against a model on the meta device: no memory for a second copy,
    # the same messages as a checkpoint's. Loading into meta tensors is a no-op torch warns about.
    with torch.device("meta"):
        skeleton = Transformer(cfg)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*meta parameter.*")
        load_weights_into(skeleton, state, where)
    return cfg, state, tokenizer


# ----------------------------------------------------------------------------- --ckpt

# eval's default batch over a folder, which has no train.batch_size of its own: as many windows
# of the model's context as the default config's batch holds tokens (8 x 256), at least one.
EVAL_BATCH_TOKENS = 2048


def _kinds(node: Any, children: str) -> list[str]:
    """The types of a tokenizer.json component, a Sequence's parts in order (none: [])."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [k for part in node.get(children) or [] for k in _kinds(part, children)]
    return [str(node.get("type"))]


def check_hf_tokenizer(tok: Tokenizer, path: Path) -> None:
    """CheckpointError unless minillm applies `tok` as transformers does: a byte-level BPE (what
    minillm trains; `serve` and the GGUF export read a token's bytes through GPT-2's byte
    alphabet) that has `<|endoftext|>`, which starts every document minillm samples or scores."""
    from minillm.data.tokenizer import EOT, special_tokens

    spec = json.loads(tok.to_str())
    model = (spec.get("model") or {}).get("type")
    if model != "BPE":
        raise CheckpointError(
            f"{path}: model: a {model} tokenizer; minillm applies only byte-level BPE ones"
        )
    for key, children in (("pre_tokenizer", "pretokenizers"), ("decoder", "decoders")):
        kinds = _kinds(spec.get(key), children)
        if "ByteLevel" not in kinds:
            raise CheckpointError(
                f"{path}: {key}: {' + '.join(kinds) or 'none'}, not ByteLevel: a BPE that is not "
                "byte-level (sentencepiece style); minillm applies only byte-level BPE tokenizers"
            )
    if tok.token_to_id(EOT) is None:
        specials = special_tokens(tok)
        shown = ", ".join(specials[:6]) + (" ..." if len(specials) > 6 else "")
        raise CheckpointError(
            f"{path}: no {EOT} token, which minillm puts before every document it samples or "
            f"scores (this tokenizer's special tokens: {shown or 'none'})"
        )


def _sample_config(folder: Path) -> SampleConfig:
    """The `sample` defaults of a folder: its generation_config.json as transformers' generate
    reads it (greedy unless do_sample; then temperature 1, top_k 50, top_p 1 where unset), or
    minillm's defaults where it has none. An exported folder so keeps its run's defaults."""
    path = folder / GENERATION_FILE
    if not path.is_file():
        return SampleConfig()
    gen = _read_json_object(path)
    values: dict[str, Any] = {}
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


def read_hf_checkpoint(folder: str | Path) -> tuple[Config, dict[str, torch.Tensor], Tokenizer]:
    """What `--ckpt FOLDER` loads from a Hugging Face Llama folder: a config (its model; the
    `sample` defaults of generation_config.json; train.seq_len its whole context, so `eval`
    scores windows as long as the model reads; data.out_dir the folder, which holds no shards),
    the float32 state_dict and the tokenizer, each checked before the weights are read."""
    from minillm.data.tokenizer import load_tokenizer

    folder = Path(folder)
    model = hf_model_config(folder)
    tok_path = folder / TOKENIZER_FILE
    if not tok_path.is_file():
        raise CheckpointError(
            f"{folder}: no {TOKENIZER_FILE} (minillm needs the fast tokenizer file of the model)"
        )
    try:
        tokenizer = load_tokenizer(tok_path)  # literal "<|endoftext|>" in text stays text
    except UserError as e:
        raise CheckpointError(f"{tok_path}: cannot load the tokenizer ({e})") from None
    check_hf_tokenizer(tokenizer, tok_path)
    sample = _sample_config(folder)
    try:
        data = DataConfig(
            vocab_size=tokenizer.get_vocab_size(), tokenizer=str(tok_path), out_dir=str(folder)
        )
        batch = max(1, EVAL_BATCH_TOKENS // model.max_seq_len)
        config = Config(
            model, data, TrainConfig(seq_len=model.max_seq_len, batch_size=batch), sample
        )
    except ConfigError as e:  # a tokenizer too small for a byte-level BPE or larger than the model
        raise CheckpointError(f"{tok_path}: does not fit {CONFIG_FILE} ({e})") from None
    _, state, _ = import_hf_folder(folder)
    return config, state, tokenizer
