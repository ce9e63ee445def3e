"""The special token ids an export writes: which token begins text, which ones end a generation,
which pads, which ends a chat turn.

Offers `model_tokens(ckpt)`, which the Hugging Face export (config.json,
generation_config.json) and the GGUF export (tokenizer.ggml.*) both write: the checkpoint's
tokenizer conventions say (minillm.tokenizer.conventions' `special_ids` and `ModelTokens`),
reading the generation_config.json beside its tokenizer.json.
"""

from __future__ import annotations

from typing import Any

from minillm.tokenizer.conventions import ModelTokens


def model_tokens(ckpt: Any) -> ModelTokens:
    """The special ids of a LoadedCheckpoint's tokenizer as its exports write them."""
    folder = ckpt.tokenizer_path.parent if ckpt.tokenizer_path is not None else ckpt.path
    return ckpt.conventions.special_ids(folder)
