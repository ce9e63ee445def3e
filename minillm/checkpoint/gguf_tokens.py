"""The tokenizer of a GGUF file: how llama.cpp is told to split, encode and end text as the
model's tokenizer does (minillm.checkpoint.gguf_file writes it).

Offers `llama_cpp_pre_tokenizer` (the split, or one error naming what llama.cpp lacks),
`gguf_vocab` (tokens, types, merges), `added_specials` (what the post-processor adds: llama.cpp's
add_bos_token / add_eos_token) and `gguf_specials` (bos, eos, end-of-turn and pad ids, the chat
template and the stop tokens of a checkpoint).

The splits llama.cpp has for a byte-level BPE are recognised by the exact shape of
tokenizer.json (`LLAMA_CPP_SPLITS`): GPT-2's (minillm's own, `gpt-2`), Qwen2's (`qwen2`),
Llama 3's (`llama-bpe`) and SmolLM's (`smollm`), each the regex llama-vocab.cpp applies for that
`tokenizer.ggml.pre`; any other is refused in one line naming the key.

minillm's own tokenizer: end-of-text is bos, eos and pad, nothing is added to a prompt, and a
chat turn ends at `<|end|>`. A published model's: its post-processor's BOS as add_bos_token
(Llama 3's), its bos and eos tokens (the ones its Jinja template sees as `bos_token` and
`eos_token`: llama.cpp hands the template those two), the end-of-turn token its template
writes, and its template. llama.cpp ends a generation at eos, end-of-turn and, by their text,
tokens such as `<|im_end|>` or `<|endoftext|>` (LLAMA_CPP_EOG_TEXTS); where that set is not the
model's stop set, a warning names the difference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from minillm.errors import CheckpointError, warn
from minillm.tokenizer.bpe import byte_alphabet

# llama.cpp's name for GPT-2's pre-tokenizer regex, the one minillm's ByteLevel(use_regex=True)
# applies (llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_GPT2).
GPT2_PRE_TOKENIZER = "gpt-2"
# The regexes of Qwen2's and Llama 3's tokenizer.json, as llama-vocab.cpp quotes them beside its
# own versions for LLAMA_VOCAB_PRE_TYPE_QWEN2 and _LLAMA3 (they differ in \p{N} versus
# \p{N}{1,3}: one digit or up to three per piece).
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_REGEX = QWEN2_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _split(regex: str) -> list[dict[str, Any]]:
    """A Split of `regex` (each match its own piece), then bytes to characters without GPT-2's
    regex: the Sequence Qwen2's and Llama 3's tokenizer.json carry."""
    return [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False},
    ]


# tokenizer.json's pre_tokenizer (ByteLevel's trim_offsets left out: it changes offsets, not ids)
# -> llama.cpp's tokenizer.ggml.pre and whether that split takes a word that is one token whole
# (llama.cpp's ignore_merges, which it sets for llama-bpe; tokenizers' model.ignore_merges).
LLAMA_CPP_SPLITS: list[tuple[dict[str, Any], str, bool]] = [
    ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, GPT2_PRE_TOKENIZER,
     False),
    ({"type": "Sequence", "pretokenizers": _split(QWEN2_REGEX)}, "qwen2", False),
    ({"type": "Sequence", "pretokenizers": _split(LLAMA3_REGEX)}, "llama-bpe", True),
    # SmolLM's: each digit alone, then GPT-2's regex (llama-vocab.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM)
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}]}, "smollm", False),
]  # fmt: skip
# Post-processors llama.cpp can follow: ByteLevel's changes offsets only; a TemplateProcessing
# adds fixed tokens around the text, as llama.cpp's add_bos_token / add_eos_token (added_specials).
POST_PROCESSORS = {"ByteLevel", "TemplateProcessing"}
# Bytes that never occur in UTF-8 text (overlong 2-byte leads and leads past U+10FFFF): a
# byte-level vocabulary that lacks their tokens needs no warning.
NOT_UTF8_BYTES = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])


def _shape(pre: Any) -> Any:
    """A pre_tokenizer without ByteLevel's trim_offsets (offsets only) and use_regex's default."""
    if isinstance(pre, list):
        return [_shape(p) for p in pre]
    if not isinstance(pre, dict):
        return pre
    out = {k: _shape(v) for k, v in pre.items() if k != "trim_offsets"}
    if out.get("type") == "ByteLevel":
        out.setdefault("use_regex", True)
    return out


def llama_cpp_pre_tokenizer(tokenizer: dict[str, Any], where: str) -> str:
    """The llama.cpp pre-tokenizer name that splits text as `tokenizer` (tokenizer.json, parsed)
    does, or a CheckpointError `where: key: what` naming the part llama.cpp cannot reproduce.

    llama.cpp's byte-level BPE (`gpt2` model) has no normalizer (an NFC one is let through with
    a warning: text already in NFC, most text, is tokenized the same), no prefix space, no
    dropout, byte fallback or word prefixes/suffixes, and takes a word whole only under
    llama-bpe (ignore_merges).
    """

    def refuse(key: str, what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {key}: {what}; llama.cpp has no equivalent, not exported")

    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE":
        raise refuse("model.type", f"{model.get('type')!r} is not a byte-level BPE")
    for key in ("dropout", "byte_fallback", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise refuse(f"model.{key}", f"{model[key]!r}")
    normalizer = tokenizer.get("normalizer")
    if normalizer is not None and normalizer != {"type": "NFC"}:
        raise refuse("normalizer", f"a {normalizer.get('type')} normalizer")
    pre = tokenizer.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("add_prefix_space"):
        raise refuse("pre_tokenizer.add_prefix_space", "true")
    match = [(name, whole) for shape, name, whole in LLAMA_CPP_SPLITS if _shape(pre) == shape]
    if not match:
        names = ", ".join(name for _, name, _ in LLAMA_CPP_SPLITS)
        raise refuse(
            "pre_tokenizer",
            f"{json.dumps(pre, sort_keys=True)} is none of the splits llama.cpp has ({names})",
        )
    name, whole = match[0]
    if bool(model.get("ignore_merges")) != whole:
        says = "takes" if whole else "does not take"
        raise refuse(
            "model.ignore_merges",
            f"{str(bool(model.get('ignore_merges'))).lower()} (llama.cpp's {name} split {says} "
            "a word that is one token whole)",
        )
    if (tokenizer.get("decoder") or {}).get("type") != "ByteLevel":
        raise refuse("decoder", f"{json.dumps(tokenizer.get('decoder'))} is not ByteLevel")
    post = tokenizer.get("post_processor")
    kinds = [p.get("type") for p in post.get("processors", [])] if post else []
    if post is not None and post.get("type") not in POST_PROCESSORS | {"Sequence"}:
        raise refuse("post_processor", f"a {post.get('type')} post-processor")
    if any(kind not in POST_PROCESSORS for kind in kinds):
        raise refuse("post_processor", f"a Sequence of {' + '.join(map(str, kinds))}")
    if normalizer is not None:
        warn(
            f"{where}: normalizer: NFC, which llama.cpp does not apply: a text not in NFC "
            "(a decomposed accent: e + U+0301) is tokenized otherwise there (exported all the "
            "same, as llama.cpp's convert_hf_to_gguf.py does)"
        )
    return name


def added_specials(conv: Any, where: str) -> tuple[int | None, int | None]:
    """The ids the tokenizer's post-processor puts before and after a text (`tokenizer(text)`:
    the conventions' text_prefix and text_suffix), which llama.cpp adds as its add_bos_token and
    add_eos_token do: (None, None) for one that adds nothing (ByteLevel's, a TemplateProcessing
    of `$A` alone), (BOS, None) for Llama 3's. More than one token on a side is a
    CheckpointError naming them."""
    tok = conv.tok
    before, after = conv.text_prefix, conv.text_suffix
    for side, ids in (("before", before), ("after", after)):
        if len(ids) > 1:
            names = " ".join(str(tok.id_to_token(i)) for i in ids)
            raise CheckpointError(
                f"{where}: post_processor: adds {names} {side} the text; llama.cpp adds at most "
                "one token on each side (its add_bos_token, add_eos_token), not exported"
            )
    return (before[0] if before else None), (after[0] if after else None)


@dataclass
class GgufVocab:
    """The tokenizer as GGUF stores it: one token and type per embedding row, and the merges."""

    tokens: list[str]
    types: list[int]  # gguf.TokenType values
    merges: list[str]  # "left right", in priority order
    pre: str  # tokenizer.ggml.pre


def gguf_vocab(tok: Any, vocab_size: int, where: str) -> GgufVocab:
    """Tokens, types and merges of a `tokenizers.Tokenizer` for `vocab_size` embedding rows.

    Special tokens are CONTROL (llama.cpp never produces them from text unless asked to parse
    specials, as ours never does), other added tokens USER_DEFINED, and the rows past the
    tokenizer (a padded embedding table) unused `[PAD<i>]` tokens, as convert_hf_to_gguf.py does.
    """
    from gguf import TokenType

    spec = json.loads(tok.to_str())
    pre = llama_cpp_pre_tokenizer(spec, where)
    vocab = tok.get_vocab(with_added_tokens=True)
    _warn_missing_bytes(spec, vocab, where)
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    by_id = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        if i in added:
            types.append(TokenType.CONTROL if added[i]["special"] else TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
    merges = []
    for m in spec["model"].get("merges", []):
        pair = m.split(" ") if isinstance(m, str) else list(m)  # tokenizers < 0.20: "a b"
        if len(pair) != 2 or any(" " in p or not p for p in pair):
            raise CheckpointError(f"{where}: model.merges: {m!r} cannot be written as 'a b'")
        merges.append(" ".join(pair))
    return GgufVocab(tokens, [int(t) for t in types], merges, pre)


def _warn_missing_bytes(spec: dict[str, Any], vocab: dict[str, int], where: str) -> None:
    """One warning naming the byte tokens a vocabulary lacks (but those of bytes UTF-8 never has).

    llama.cpp's converter writes such a vocabulary as it is; its BPE (llama-vocab.cpp,
    llm_tokenizer_bpe_session::tokenize) keeps a byte without a token as a symbol that no merge
    takes, then finds no token for it and leaves it out. tokenizers' BPE without an unk token
    leaves it out too, and merges nothing across it: the same ids. With an unk token, tokenizers
    writes that token where llama.cpp writes nothing.
    """
    missing = [b for b, char in enumerate(byte_alphabet()) if char not in vocab]
    used = [b for b in missing if b not in NOT_UTF8_BYTES]
    if not used:
        return
    unk = spec["model"].get("unk_token")
    unk = unk if unk in vocab else None
    named = ", ".join(f"0x{b:02X}" for b in used[:6]) + (", ..." if len(used) > 6 else "")
    tokenizers = f"tokenizers gives {unk} for it" if unk else "as tokenizers does"
    warn(
        f"{where}: model.vocab: lacks the tokens of {len(used)} bytes UTF-8 text can hold "
        f"({named}): llama.cpp leaves such a byte out of a text's tokens ({tokenizers}), "
        "so the model never sees it (exported all the same, as llama.cpp's converter does)"
    )


# llama.cpp ends a generation at these tokens by their text, whatever the file says
# (llama-vocab.cpp, `special_eog_ids`), besides the eos, end-of-turn and end-of-message ids.
LLAMA_CPP_EOG_TEXTS = frozenset(
    ["<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
     "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
     "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
     "<｜end▁of▁sentence｜>", "[e~["]
)  # fmt: skip


@dataclass
class GgufSpecials:
    """The tokenizer.ggml.* ids and flags of a file, its chat template, and its stop tokens."""

    bos: int | None
    eos: int | None
    eot: int | None  # end of a chat turn (tokenizer.ggml.eot_token_id)
    pad: int | None
    add_bos: bool  # llama.cpp puts bos before a text it tokenizes (as `tokenizer(text)`)
    add_eos: bool
    template: str | None  # the Jinja chat template (tokenizer.chat_template)
    stops: list[str]  # the texts of the tokens a reply stops at (the Modelfile's stops)


def gguf_specials(ckpt: Any, where: str) -> GgufSpecials:
    """The special ids, flags, template and stops of a LoadedCheckpoint's tokenizer; what the
    post-processor adds that llama.cpp cannot is a CheckpointError (added_specials)."""
    from minillm.checkpoint.model_tokens import model_tokens

    conv, tok = ckpt.conventions, ckpt.tokenizer
    tokens = model_tokens(ckpt)
    # minillm's own tokenizer adds nothing to a text (`minillm sample` puts end-of-text first by
    # id, `minillm chat` adds nothing): no add_bos; end-of-text is its bos, eos and padding.
    before, after = added_specials(conv, where)
    eos = tokens.eos_token
    if after is not None and eos is not None and after != eos:
        raise CheckpointError(
            f"{where}: post_processor: adds {tok.id_to_token(after)} after the text, which is "
            f"not the eos token {tok.id_to_token(eos)} (llama.cpp's add_eos_token adds its eos), "
            "not exported"
        )
    eos = after if eos is None else eos
    bos = before if before is not None else tokens.bos
    stop_ids = sorted(conv.stop_ids, key=lambda i: (i not in tokens.eos, i))
    _warn_other_stops(tok, set(conv.stop_ids), {eos, conv.turn_end} - {None})
    return GgufSpecials(bos, eos, conv.turn_end, tokens.pad, before is not None,
                        after is not None, conv.template,
                        [tok.id_to_token(i) for i in stop_ids])  # fmt: skip


def _warn_other_stops(tok: Any, stops: set[int], marked: set[Any]) -> None:
    """One warning where llama.cpp's end-of-generation set (the ids the file marks and the
    tokens it knows by their text) is not the model's stop set."""
    vocab = tok.get_vocab(with_added_tokens=True)
    eog = marked | {i for text, i in vocab.items() if text in LLAMA_CPP_EOG_TEXTS}
    if eog == stops:
        return

    def names(ids: set[int]) -> str:
        return ", ".join(str(tok.id_to_token(i)) for i in sorted(ids))

    differ = [f"does not stop at {names(stops - eog)}"] if stops - eog else []
    differ += [f"also stops at {names(eog - stops)}"] if eog - stops else []
    warn(
        f"llama.cpp {' and '.join(differ)}: the model stops at {names(stops)} (a GGUF file "
        "holds one eos and one end-of-turn id; llama.cpp adds the tokens it knows by their text)"
    )
