"""The tokenizer of a GGUF file: how llama.cpp is told to split, encode and end text as the
model's tokenizer does (minillm.checkpoint.gguf_file writes it).

Offers `llama_cpp_pre_tokenizer` (the split, or one error naming what llama.cpp lacks),
`gguf_vocab` (tokens, types, merges), `added_specials` (what the post-processor adds: llama.cpp's
add_bos_token / add_eos_token) and `gguf_specials` (bos, eos, end-of-turn and pad ids, the chat
template and the stop tokens of a checkpoint).

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
# Post-processors llama.cpp can follow: ByteLevel's changes offsets only; a TemplateProcessing
# adds fixed tokens around the text, as llama.cpp's add_bos_token / add_eos_token (added_specials).
POST_PROCESSORS = {"ByteLevel", "TemplateProcessing"}
# Bytes that never occur in UTF-8 text (overlong 2-byte leads and leads past U+10FFFF): a
# byte-level vocabulary may lack their tokens, llama.cpp never looks for them.
NOT_UTF8_BYTES = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])
# Control characters text almost never holds (C0 but tab, line feed, carriage return; DEL): a
# vocabulary trained without them still exports, with a warning that text holding them is
# tokenized differently by llama.cpp.
RARE_BYTES = frozenset([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])


def llama_cpp_pre_tokenizer(tokenizer: dict[str, Any], where: str) -> str:
    """The llama.cpp pre-tokenizer name that splits text as `tokenizer` (tokenizer.json, parsed)
    does, or a CheckpointError `where: key: what` naming the part llama.cpp cannot reproduce.

    llama.cpp's byte-level BPE (`gpt2` model) has no normalizer, no prefix space, no dropout,
    byte fallback or word prefixes/suffixes, and applies every merge (no `ignore_merges`).
    """

    def refuse(key: str, what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {key}: {what}; llama.cpp has no equivalent, not exported")

    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE":
        raise refuse("model.type", f"{model.get('type')!r} is not a byte-level BPE")
    for key in ("dropout", "byte_fallback", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise refuse(f"model.{key}", f"{model[key]!r}")
    if model.get("ignore_merges"):
        raise refuse("model.ignore_merges", "true (llama.cpp's gpt-2 split applies every merge)")
    if tokenizer.get("normalizer") is not None:
        kind = tokenizer["normalizer"].get("type")
        raise refuse("normalizer", f"a {kind} normalizer")
    pre = tokenizer.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise refuse("pre_tokenizer", f"{json.dumps(pre, sort_keys=True)} is not GPT-2's split")
    if pre.get("add_prefix_space"):
        raise refuse("pre_tokenizer.add_prefix_space", "true")
    if (tokenizer.get("decoder") or {}).get("type") != "ByteLevel":
        raise refuse("decoder", f"{json.dumps(tokenizer.get('decoder'))} is not ByteLevel")
    post = tokenizer.get("post_processor")
    kinds = [p.get("type") for p in post.get("processors", [])] if post else []
    if post is not None and post.get("type") not in POST_PROCESSORS | {"Sequence"}:
        raise refuse("post_processor", f"a {post.get('type')} post-processor")
    if any(kind not in POST_PROCESSORS for kind in kinds):
        raise refuse("post_processor", f"a Sequence of {' + '.join(map(str, kinds))}")
    return GPT2_PRE_TOKENIZER


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
    missing = [b for b, char in enumerate(byte_alphabet()) if char not in vocab]
    rare = [b for b in missing if b in RARE_BYTES]
    used = [b for b in missing if b not in NOT_UTF8_BYTES | RARE_BYTES]
    if rare and not used:
        warn(
            f"{where}: model.vocab: lacks the byte tokens of {len(rare)} control characters "
            f"({', '.join(f'0x{b:02X}' for b in rare[:4])}{', ...' if len(rare) > 4 else ''}): "
            "llama.cpp tokenizes a text that holds one differently (exported all the same)"
        )
    if used:
        # llama.cpp keeps a character it has no token for as a piece of its own (then drops it),
        # which blocks merges around it that tokenizers makes: text with it would differ.
        raise CheckpointError(
            f"{where}: model.vocab: lacks {len(missing)} of the 256 byte tokens, "
            f"{len(used)} of them bytes UTF-8 text has ({', '.join(f'0x{b:02X}' for b in used[:4])}"
            f"{', ...' if len(used) > 4 else ''}); llama.cpp's byte-level BPE needs those, "
            "not exported"
        )
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
