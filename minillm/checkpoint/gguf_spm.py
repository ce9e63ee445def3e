"""The sentencepiece-style vocabulary of a GGUF file: llama.cpp's `llama` (SPM) tokenizer model
for a published BPE with byte fallback and "▁" for a space (minillm.tokenizer.pieces).

Offers `space_prefix` (llama.cpp's add_space_prefix for the tokenizer's shape, or one error
naming the key) and `sentencepiece_vocab` (tokens, scores, types).

llama.cpp's SPM tokenizer (llama-vocab.cpp, llm_tokenizer_spm_session) starts from a text's
UTF-8 characters ("▁" for a space) and repeatedly merges the adjacent pair whose joined text is
a token with the highest score, the leftmost of equal ones; a character that is no token
becomes its `<0xNN>` byte tokens. tokenizers' BPE merges the pair of lowest merge rank, the
leftmost of equal ones. So each token's score here is minus the rank of the first merge that
makes it: llama.cpp then takes the merges in tokenizer.json's order (gguf-py's LlamaHfVocab
writes -1000 for every token, which merges leftmost first instead). Tokens no merge makes
(characters, bytes, specials) score below every merge; llama.cpp never needs their score.

Where the space goes: llama.cpp puts one space before the text of the first fragment and of
every fragment after a special token (add_space_prefix), always, and turns each space into
"▁". tokenizers' Llama 2 normalizer (Prepend "▁", Replace " " -> "▁") does the same for every
text between added tokens; Gemma's (Replace alone) puts none, as add_space_prefix false; a
Metaspace pre-tokenizer with prepend_scheme `first` puts one before the text's start only, and
none where the text already starts with a space, where llama.cpp puts a second (`always`: the
same, at each fragment). Those differences are one warning (llama.cpp issue 23840).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from minillm.errors import CheckpointError, warn
from minillm.tokenizer.pieces import SPACE

_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
_PREPEND = {"type": "Prepend", "prepend": SPACE}
_REPLACE = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}


@dataclass
class SpmVocab:
    """A sentencepiece-style tokenizer as llama.cpp's `llama` tokenizer model stores it."""

    tokens: list[str]
    scores: list[float]
    types: list[int]  # gguf.TokenType values
    add_space_prefix: bool
    unk: int | None  # the unk token's id (tokenizer.ggml.unknown_token_id)


def _refuse(where: str, key: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: {key}: {what}; llama.cpp has no equivalent, not exported")


def _normalizers(node: Any) -> list[Any]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return list(node.get("normalizers") or [])
    return [node]


def space_prefix(spec: dict[str, Any], where: str) -> bool:
    """llama.cpp's add_space_prefix for tokenizer.json `spec` (module docstring); a shape
    llama.cpp's SPM tokenizer cannot follow is a CheckpointError naming the key, and one where
    it differs around special tokens or a leading space is one warning."""
    normalizer, pre = _normalizers(spec.get("normalizer")), spec.get("pre_tokenizer")
    if normalizer and pre is not None:
        raise _refuse(where, "pre_tokenizer", f"a {pre.get('type')} after a normalizer")
    if normalizer == [_PREPEND, _REPLACE]:  # Llama 2, Mistral v0.1, TinyLlama
        return True
    if normalizer == [_REPLACE]:  # Gemma: no space before the text
        return False
    if normalizer:
        shape = " + ".join(str(n.get("type")) for n in normalizer)
        raise _refuse(where, "normalizer", f"{shape} (llama.cpp's SPM turns spaces into ▁ only)")
    if (pre or {}).get("type") != "Metaspace":
        raise _refuse(where, "pre_tokenizer", f"{json.dumps(pre)} is not a Metaspace")
    if pre.get("replacement") != SPACE:
        raise _refuse(where, "pre_tokenizer.replacement", f"{pre.get('replacement')!r}")
    if pre.get("split", True):  # llama.cpp merges across spaces: ▁▁ tokens, "▁a▁b" pieces
        raise _refuse(where, "pre_tokenizer.split", "true (llama.cpp does not split at spaces)")
    scheme = pre.get("prepend_scheme", "always")
    if scheme == "never":
        return False
    if scheme not in ("first", "always"):
        raise _refuse(where, "pre_tokenizer.prepend_scheme", f"{scheme!r}")
    differs = (
        "puts a ▁ before a text after a special token, where tokenizers puts none, and a second "
        "one before a text that starts with a space"
        if scheme == "first"
        else "puts a second ▁ before a text that starts with a space, after a special token too"
    )
    chat = ", a chat's text after a special token among them" if scheme == "first" else ""
    warn(
        f"{where}: pre_tokenizer.prepend_scheme: {scheme}: llama.cpp {differs} "
        f"(add_space_prefix, llama.cpp issue 23840): such texts get other ids there{chat} "
        "(exported all the same)"
    )
    return True


def sentencepiece_vocab(tok: Any, spec: dict[str, Any], vocab_size: int, where: str) -> SpmVocab:
    """Tokens, scores and types of a sentencepiece-style `tokenizers.Tokenizer` (its parsed
    tokenizer.json `spec`) for `vocab_size` embedding rows, as llama.cpp's `llama` model reads
    them: NORMAL, CONTROL (special added tokens), USER_DEFINED (other added tokens), BYTE
    (`<0xNN>`), UNKNOWN (the unk token) and UNUSED `[PAD<i>]` rows past the tokenizer."""
    from gguf import TokenType

    model = spec.get("model") or {}
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges"):
        if model.get(key):
            raise _refuse(where, f"model.{key}", f"{model[key]!r}")
    post = spec.get("post_processor")
    if post is not None and post.get("type") != "TemplateProcessing":
        raise _refuse(where, "post_processor", f"a {post.get('type')} post-processor")
    add_space_prefix = space_prefix(spec, where)
    vocab = tok.get_vocab(with_added_tokens=True)
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:  # llama.cpp's byte fallback looks every byte's token up (and aborts without)
        named = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise _refuse(where, "model.vocab", f"lacks {len(missing)} byte tokens ({named})")
    ranks: dict[str, int] = {}
    merges = model.get("merges") or []
    for rank, m in enumerate(merges):
        pair = m.split(" ") if isinstance(m, str) else list(m)
        ranks.setdefault("".join(pair), rank)
    unmerged = -float(len(merges) + 1)
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    unk = model.get("unk_token")
    by_id = {i: s for s, i in vocab.items()}
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            scores.append(unmerged)
            types.append(TokenType.UNUSED)
            continue
        tokens.append(text)
        scores.append(-float(ranks[text]) if text in ranks else unmerged)
        if text == unk:
            types.append(TokenType.UNKNOWN)
        elif _BYTE_TOKEN.fullmatch(text):  # a byte even where it is an added token
            types.append(TokenType.BYTE)
        elif i in added:
            types.append(TokenType.CONTROL if added[i]["special"] else TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
    unk_id = vocab.get(unk) if unk is not None else None
    return SpmVocab(tokens, scores, [int(t) for t in types], add_space_prefix, unk_id)
