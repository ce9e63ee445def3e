"""What a tokenizer.json is, and the bytes each of its tokens spells.

Offers `tokenizer_kind(tok, where)` ("byte-level" or "sentencepiece"; anything else is one
CheckpointError naming the key), `byte_level_bytes(piece)` and `sentencepiece_bytes(piece)`.

Two kinds of BPE are what published models ship, and minillm applies both through `tokenizers`,
as transformers does:

- **byte-level** (GPT-2, Llama 3, Qwen, Mistral-Nemo, SmolLM, minillm's own): every byte is a
  token character (GPT-2's `bytes_to_unicode` alphabet), a `ByteLevel` pre-tokenizer and
  decoder. A token's bytes are its characters mapped back through that alphabet.
- **sentencepiece** (Llama 2, Mistral 7B v0.1-v0.3, Mixtral 8x7B, TinyLlama, Gemma): text is
  characters with U+2581 `▁` for a space, put in by a `Metaspace` pre-tokenizer or by a
  normalizer's `Replace(" ", "▁")` (and `Prepend("▁")`), and a character the vocabulary lacks
  falls back to its UTF-8 bytes, tokens `<0x00>`..`<0xFF>` (`byte_fallback`). A token's bytes
  are its text with `▁` as a space, or the one byte it names. The decoder drops the space the
  pre-tokenizer put before the first word (`Strip` or Metaspace's `prepend_scheme`), so a text
  decodes as it was written.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any

from minillm.errors import CheckpointError
from minillm.tokenizer.bpe import byte_alphabet

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPACE = "\u2581"  # sentencepiece's visible space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet of the 256 bytes, inverted."""
    return {char: b for b, char in enumerate(byte_alphabet())}


def byte_level_bytes(piece: str) -> bytes:
    """The bytes a byte-level BPE token spells (its characters through GPT-2's alphabet)."""
    decoder = _byte_decoder()
    return bytes(decoder[c] for c in piece if c in decoder)


def sentencepiece_bytes(piece: str) -> bytes:
    """The bytes a sentencepiece-style token spells: `<0xNN>` the byte NN, else its text with
    `▁` as a space."""
    match = _BYTE_TOKEN.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace(SPACE, " ").encode("utf-8")


def _types(node: Any, children: str) -> list[str]:
    """The component types of a pre_tokenizer / normalizer / decoder node (a Sequence's too)."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [t for child in node.get(children) or [] for t in _types(child, children)]
    return [str(node.get("type"))]


def _replaces_space(node: Any, children: str) -> bool:
    """Whether a normalizer or decoder (Sequence) holds a Replace between " " and "▁"."""
    if not isinstance(node, dict):
        return False
    if node.get("type") == "Sequence":
        return any(_replaces_space(c, children) for c in node.get(children) or [])
    if node.get("type") != "Replace":
        return False
    pattern = (node.get("pattern") or {}).get("String")
    return {pattern, node.get("content")} == {" ", SPACE}


def tokenizer_kind(tok: Tokenizer, where: str) -> str:
    """ "byte-level" or "sentencepiece" (module docstring); a CheckpointError naming `where`
    and the key for a tokenizer that is neither (a WordPiece, a Unigram, a BPE of another
    kind), which minillm cannot serve token by token or export as transformers does."""
    spec = json.loads(tok.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise CheckpointError(
            f"{where}: model: a {model.get('type')} tokenizer; minillm applies byte-level and "
            "sentencepiece-style (byte-fallback) BPE tokenizers only"
        )
    pre = _types(spec.get("pre_tokenizer"), "pretokenizers")
    decoder = _types(spec.get("decoder"), "decoders")
    if "ByteLevel" in pre and "ByteLevel" in decoder:
        return "byte-level"
    spaces = "Metaspace" in pre or _replaces_space(spec.get("normalizer"), "normalizers")
    decodes = "Metaspace" in decoder or _replaces_space(spec.get("decoder"), "decoders")
    if spaces and decodes:
        if not model.get("byte_fallback"):
            raise CheckpointError(
                f"{where}: model.byte_fallback: false: a sentencepiece-style BPE whose unknown "
                "characters become <unk>; minillm applies byte-fallback ones only"
            )
        if "ByteFallback" not in decoder:
            raise CheckpointError(
                f"{where}: decoder: {' + '.join(decoder)} without ByteFallback: its <0xNN> "
                "tokens would decode as that text, not as bytes; minillm applies only "
                "sentencepiece-style BPEs whose decoder has ByteFallback"
            )
        return "sentencepiece"
    key = "decoder" if "ByteLevel" in pre or spaces else "pre_tokenizer"
    kinds = decoder if key == "decoder" else pre
    raise CheckpointError(
        f"{where}: {key}: {' + '.join(kinds) or 'none'}: neither byte-level (ByteLevel) nor "
        "sentencepiece-style (Metaspace or a ▁ normalizer, with byte fallback); minillm "
        "applies those two BPE kinds only"
    )
