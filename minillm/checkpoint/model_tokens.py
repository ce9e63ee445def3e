"""The special token ids an export writes: which token begins text, which ones end a generation,
which pads, which ends a chat turn.

Offers `ModelTokens` and `model_tokens(ckpt)`, which the Hugging Face export (config.json,
generation_config.json) and the GGUF export (tokenizer.ggml.*) both write.

minillm's own tokenizer: end-of-text is bos, eos and pad, and a chat turn ends at `<|end|>`
(eos is then [end-of-text, `<|end|>`]). A published model's are its own, read where
transformers reads them: generation_config.json beside its tokenizer.json (`bos_token_id`,
`eos_token_id`, which may be a list, `pad_token_id`), else tokenizer_config.json's token
strings (minillm.data.conventions), and the end-of-turn token its chat template writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minillm.checkpoint.layout import HF_GENERATION_FILE
from minillm.runtime.files import read_json_object


@dataclass
class ModelTokens:
    """A model's special token ids (module docstring); None where the model has none."""

    bos: int | None
    eos: list[int]  # what generation stops at; the first is the eos token itself
    eos_token: int | None  # the one eos token (tokenizer_config.json's eos_token)
    pad: int | None
    eot: int | None  # the end of a chat turn (the token the template writes after a reply)
    # The source's generation_config.json, as read ({} for minillm's own or where none is).
    generation: dict[str, Any] = field(default_factory=dict)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_generation_config(folder: Path) -> dict[str, Any]:
    """generation_config.json of `folder` ({} where there is none); unreadable is one error."""
    return read_json_object(folder / HF_GENERATION_FILE)


def model_tokens(ckpt: Any) -> ModelTokens:
    """The special ids of a LoadedCheckpoint's tokenizer as its exports write them."""
    from minillm.data.tokenizer import eot_id

    conv, tok = ckpt.conventions, ckpt.tokenizer
    if conv.own:
        eot = eot_id(tok)
        end = conv.turn_end
        return ModelTokens(eot, [eot] if end is None else [eot, end], eot, eot, end)
    folder = ckpt.tokenizer_path.parent if ckpt.tokenizer_path is not None else ckpt.path
    gen = read_generation_config(folder)

    def token(name: str) -> int | None:
        text = conv.special.get(name)
        return None if text is None else tok.token_to_id(text)

    bos = _int_or_none(gen.get("bos_token_id"))
    if bos is None:
        bos = token("bos_token")
    if bos is None and conv.text_prefix:  # a post-processor that adds a BOS names it
        bos = conv.text_prefix[0]
    value = gen.get("eos_token_id")
    eos = [
        i for i in (value if isinstance(value, list) else [value]) if _int_or_none(i) is not None
    ]
    eos_token = token("eos_token")
    if not eos:  # no generation config: the eos token and the template's end of turn
        eos = list(dict.fromkeys(i for i in (eos_token, conv.turn_end) if i is not None))
    if eos_token is None and eos:
        eos_token = eos[0]
    pad = _int_or_none(gen.get("pad_token_id"))
    if pad is None:
        pad = token("pad_token")
    return ModelTokens(bos, eos, eos_token, pad, conv.turn_end, gen)
