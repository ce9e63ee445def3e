"""The files beside a tokenizer.json that carry a published model's conventions, and the special
ids an export writes.

Offers the files' names (`TOKENIZER_COMPANIONS`, copied with a tokenizer into runs, checkpoints
and exports, by `copy_companions`), `minillms_companions` (whether they are minillm's own),
what they say (`token_string`, `read_eos_ids`, `read_generation_config`), `ModelTokens` (the
special ids an export writes; a published model's: `published_model_tokens`) and
`hf_tokenizer_config` (the tokenizer_config.json of minillm's own tokenizer).
`minillm.tokenizer.conventions` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minillm.runtime.files import copy_if_changed, read_json_object
from minillm.tokenizer import jinja_chat
from minillm.tokenizer.bpe import EOT
from minillm.tokenizer.chat_template import END, HF_CHAT_TEMPLATE

GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
TOKENIZER_COMPANIONS: tuple[str, ...] = (
    jinja_chat.TOKENIZER_CONFIG_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    jinja_chat.CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_FILE,
)
# The names transformers gives a template's special tokens (its special_tokens_map).
SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def copy_companions(src_folder: Path, dst_folder: Path) -> None:
    """Copy the tokenizer's companion files that exist in `src_folder` (same names), each
    atomically; a file already as it would be written is left alone (a finished run started
    again touches none of its files)."""
    for name in TOKENIZER_COMPANIONS:
        if (src_folder / name).is_file():
            copy_if_changed(src_folder / name, dst_folder / name)


def minillms_companions(folder: Path) -> bool:
    """Whether the files beside a tokenizer are minillm's own: none (a run or a checkpoint of a
    tokenizer minillm trained), or the tokenizer_config.json minillm's export writes (end-of-
    text as bos, eos and pad, a fast tokenizer padding on the left). A published folder whose
    only special token is <|endoftext|> (GPT-2's style) writes its own config and is a
    published model's, used as transformers uses it."""
    config = jinja_chat.read_tokenizer_config(folder)
    if not config:
        return not (folder / SPECIAL_TOKENS_MAP_FILE).is_file()
    return (
        config.get("tokenizer_class") == "PreTrainedTokenizerFast"
        and config.get("padding_side") == "left"
        and config.get("add_bos_token") is False
        and all(token_string(config.get(k)) == EOT for k in ("bos_token", "eos_token", "pad_token"))
    )


def token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def read_eos_ids(folder: Path) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list), else config.json's."""
    for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
        path = folder / name
        if not path.is_file():
            continue
        value = read_json_object(path).get("eos_token_id")
        ids = value if isinstance(value, list) else [value]
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
        if ids:
            return ids
    return []


@dataclass
class ModelTokens:
    """A model's special token ids as its exports write them; None where the model has none."""

    bos: int | None
    eos: list[int]  # what generation stops at; the first is the eos token itself
    eos_token: int | None  # the one eos token (tokenizer_config.json's eos_token)
    pad: int | None
    eot: int | None  # the end of a chat turn (the token the template writes after a reply)
    config_eos: int | list[int] | None  # config.json's eos_token_id
    # The folder's generation_config.json, as read ({} where there is none).
    generation: dict[str, Any] = field(default_factory=dict)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def published_model_tokens(
    folder: Path, ids: dict[str, int | None], added_bos: int | None, turn_end: int | None
) -> ModelTokens:
    """A published model's special ids, read where transformers reads them: `folder`'s
    generation_config.json (`bos_token_id`, `eos_token_id`, which may be a list, `pad_token_id`),
    else the ids of tokenizer_config.json's token strings (`ids`, by name: bos_token, ...), the
    BOS its post-processor adds (`added_bos`), and the end-of-turn token its chat template writes.
    """
    gen = read_generation_config(folder)
    bos = _int_or_none(gen.get("bos_token_id"))
    if bos is None:
        bos = ids.get("bos_token")
    if bos is None:  # a post-processor that adds a BOS names it
        bos = added_bos
    value = gen.get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    eos = [i for i in values if _int_or_none(i) is not None]
    eos_token = ids.get("eos_token")
    if not eos:  # no generation config: the eos token and the template's end of turn
        eos = list(dict.fromkeys(i for i in (eos_token, turn_end) if i is not None))
    if eos_token is None and eos:
        eos_token = eos[0]
    pad = _int_or_none(gen.get("pad_token_id"))
    if pad is None:
        pad = ids.get("pad_token")
    config_eos = eos[0] if len(eos) == 1 else (eos or None)
    return ModelTokens(bos, eos, eos_token, pad, turn_end, config_eos, gen)


def read_generation_config(folder: Path) -> dict[str, Any]:
    """generation_config.json of `folder` ({} where there is none); unreadable is one error."""
    return read_json_object(folder / GENERATION_CONFIG_FILE)


def hf_tokenizer_config(
    eot: str, eot_id: int, max_len: int, specials: dict[str, int] | None = None
) -> dict[str, Any]:
    """tokenizer_config.json of minillm's own tokenizer for PreTrainedTokenizerFast: end-of-text
    is bos, eos and pad (what `minillms_companions` recognises).

    specials: every special token -> id (default: end-of-text alone). With the chat tokens among
    them the config carries the chat template, so `apply_chat_template` gives minillm's ids.
    """
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
