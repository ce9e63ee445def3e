"""How a model's tokenizer is used: minillm's own conventions, or a published model's.

Offers `Conventions` (built by `Conventions.of(tokenizer, folder)`; a loaded checkpoint's
`.conventions`), `TOKENIZER_COMPANIONS` (the files beside a tokenizer.json that carry a published
model's conventions, copied with it into runs, checkpoints and exports) and `copy_companions`.

Every command asks the conventions, never the tokenizer's special tokens, how to:
- encode plain text (`prompt_ids`: a sample's or a completion's prompt, a scored text;
  `document_ids`: a document in the shards),
- write a conversation (`chat_ids`, `chat_targets`: the ids and the answer-only mask),
- stop a reply (`stop_ids`) and end a document in the shards (`doc_end`).

minillm's own tokenizers (special tokens exactly minillm's: minillm.data.tokenizer) keep their
conventions: a prompt or document starts after `<|endoftext|>`, quoted special tokens are text,
and the chat template is minillm.data.chat_template's, inserting role tokens by id.

Any other tokenizer is a published model's and is applied as transformers applies it: plain
text is `tokenizer(text)` (its post-processor adds what it adds, e.g. Llama 3's BOS; special
tokens written in the text are recognised), a conversation is the folder's Jinja chat template
(minillm.data.jinja_chat) encoded without the post-processor, as `apply_chat_template`. A reply
stops at the model's end-of-sequence set: `generation_config.json`'s `eos_token_id` (or
config.json's), `tokenizer_config.json`'s `eos_token`, and the end-of-turn token the template
writes after a reply. Documents in the shards end with `doc_end`: the first of the eos token,
`<|endoftext|>`, `<|end_of_text|>`, `</s>` that the template does not write inside a
conversation before its end (document-aware packing must not cut a conversation at its turns),
else the eos (then a conversation's turns are separate documents to the packing, Mistral's
`</s>`: `tokenize` warns, `splits_turns`). A conversation whose template ends it with that token
(Phi-3's eos) gets no second one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minillm.data import jinja_chat
from minillm.data.chat_template import (
    HF_CHAT_TEMPLATE,
    chat_ids,
    encode_conversation,
)
from minillm.data.tokenizer import EOT, LEGACY_SPECIAL_TOKENS, SPECIAL_TOKENS, special_tokens
from minillm.errors import CheckpointError, UserError
from minillm.runtime.files import copy_if_changed, read_json_object

if TYPE_CHECKING:
    from tokenizers import Tokenizer

GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
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
DOC_END_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>")
# A conversation the template is asked to write once, to find its end-of-turn token and the
# tokens it writes between turns.
_PROBE = (
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "Bye"},
)


def copy_companions(src_folder: Path, dst_folder: Path) -> None:
    """Copy the tokenizer's companion files that exist in `src_folder` (same names), each
    atomically; a file already as it would be written is left alone (a finished run started
    again touches none of its files)."""
    for name in TOKENIZER_COMPANIONS:
        if (src_folder / name).is_file():
            copy_if_changed(src_folder / name, dst_folder / name)


def _minillms_companions(folder: Path) -> bool:
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
        and all(
            _token_string(config.get(k)) == EOT for k in ("bos_token", "eos_token", "pad_token")
        )
    )


def _token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _eos_ids(folder: Path) -> list[int]:
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
class Conventions:
    """A tokenizer and how every command uses it (module docstring)."""

    tok: Tokenizer
    own: bool
    doc_end: int  # ends a document in the shards (and is the padding there)
    stop_ids: frozenset[int]  # where a reply (and a sample) stops
    template: str | None  # the Jinja chat template (minillm's own: its export's)
    special: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... strings
    turn_end: int | None = None  # the token the template writes after a reply
    # What `tokenizer(text)` puts before and after the text (Llama 3's BOS before).
    text_prefix: tuple[int, ...] = ()
    text_suffix: tuple[int, ...] = ()
    # doc_end is also written between the template's turns (Mistral's </s> after each reply):
    # document-aware packing then cuts a conversation at its turns.
    splits_turns: bool = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A pickled tokenizer (a tokenize worker's copy) loses encode_special_tokens.
        self.__dict__.update(state)
        self.tok.encode_special_tokens = self.own

    @classmethod
    def of(cls, tok: Tokenizer, folder: str | Path) -> Conventions:
        """The conventions of `tok`, whose companion files (if any) are in `folder`."""
        folder = Path(folder)
        template = jinja_chat.read_chat_template(folder)
        specials = special_tokens(tok)
        if (
            specials in (list(SPECIAL_TOKENS), list(LEGACY_SPECIAL_TOKENS))
            and template in (None, HF_CHAT_TEMPLATE)
            and _minillms_companions(folder)
        ):
            return cls.of_own(tok)
        return cls._published(tok, folder, template)

    @classmethod
    def of_own(cls, tok: Tokenizer) -> Conventions:
        """minillm's own conventions for `tok` (one minillm trained)."""
        tok.encode_special_tokens = True  # a quoted "<|endoftext|>" or "<|user|>" is text
        eot = tok.token_to_id(EOT)
        try:
            end: int | None = chat_ids(tok)["end"]
        except UserError:
            end = None  # a tokenizer from before the chat tokens: plain text only
        stops = frozenset([eot] if end is None else [end, eot])
        template = None if end is None else HF_CHAT_TEMPLATE
        special = {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT}
        return cls(tok, True, eot, stops, template, special, end)

    @classmethod
    def _published(cls, tok: Tokenizer, folder: Path, template: str | None) -> Conventions:
        tok.encode_special_tokens = False  # as transformers: a written "<|im_end|>" is the token
        config = jinja_chat.read_tokenizer_config(folder)
        # Older folders name their special tokens in special_tokens_map.json.
        legacy = read_json_object(folder / SPECIAL_TOKENS_MAP_FILE)
        special = {
            k: s for k in SPECIAL_NAMES if (s := _token_string(config.get(k, legacy.get(k))))
        }
        eos_ids = _eos_ids(folder)
        if "eos_token" not in special and eos_ids:
            token = tok.id_to_token(eos_ids[0])
            if token is not None:
                special["eos_token"] = token
        eos = tok.token_to_id(special["eos_token"]) if "eos_token" in special else None
        conv = cls(tok, False, -1, frozenset(), template, special)
        turn_end, in_chat = conv._probe_template()
        conv.turn_end = turn_end
        # No eos anywhere: replies run to their length, as transformers' generate does.
        conv.stop_ids = frozenset(i for i in [*eos_ids, eos, turn_end] if i is not None)
        names = [special.get("eos_token"), *DOC_END_CANDIDATES]
        ids = [i for n in names if n and (i := tok.token_to_id(n)) is not None]
        free = [i for i in ids if i not in in_chat]
        if not ids:
            raise CheckpointError(
                f"{folder}: no token to end a document with: no eos_token in "
                f"tokenizer_config.json or eos_token_id in {GENERATION_CONFIG_FILE} or "
                f"{MODEL_CONFIG_FILE}, and none of {', '.join(DOC_END_CANDIDATES)}"
            )
        conv.doc_end = free[0] if free else ids[0]
        conv.splits_turns = conv.doc_end in in_chat
        with_specials = tok.encode("x", add_special_tokens=True).ids
        bare = tok.encode("x", add_special_tokens=False).ids
        at = _find(with_specials, bare)
        conv.text_prefix = tuple(with_specials[:at])
        conv.text_suffix = tuple(with_specials[at + len(bare) :])
        return conv

    def _probe_template(self) -> tuple[int | None, set[int]]:
        """The template's end-of-turn token (the special token right after a reply) and the
        ids it writes in a conversation; (None, set()) without a template or when it refuses
        the probe."""
        if self.template is None:
            return None, set()
        try:
            text, spans = jinja_chat.assistant_spans(
                self.template, list(_PROBE), self.special, self._special_strings()
            )
        except UserError:
            return None, set()
        enc = self.tok.encode(text, add_special_tokens=False)
        in_chat = set(enc.ids[:-1])  # what it writes inside; its last token may end it
        if not spans:
            return None, in_chat
        end = spans[-1][1]
        last = [i for i, (a, b) in zip(enc.ids, enc.offsets) if b == end and a < end]
        token = last[-1] if last else None
        specials = {self.tok.token_to_id(s) for s in self._special_strings()}
        return (token if token in specials else None), in_chat

    def _special_strings(self) -> list[str]:
        return special_tokens(self.tok)

    # ------------------------------------------------------------------ plain text

    def text_ids(self, text: str) -> list[int]:
        """A document's ids without the end-of-document token: minillm's own tokenizer adds
        nothing; a published model's is `tokenizer(text)` (its BOS included)."""
        return self.tok.encode(text, add_special_tokens=not self.own).ids

    def prompt_ids(self, text: str) -> list[int]:
        """A text to continue or to score: minillm's own after `<|endoftext|>` (a fresh
        document); a published model's as `tokenizer(text)`."""
        if self.own:
            return [self.doc_end, *self.tok.encode(text, add_special_tokens=False).ids]
        return self.tok.encode(text, add_special_tokens=True).ids

    @property
    def text_stops(self) -> frozenset[int]:
        """Where a sampled text stops: minillm's own at end-of-text (the end of a document); a
        published model's at its end-of-sequence set, as `generate`."""
        return frozenset([self.doc_end]) if self.own else self.stop_ids

    def empty_prompt(self) -> list[int]:
        """What an unprompted sample starts from: the start of a document."""
        return [self.doc_end] if self.own else (list(self.text_prefix) or [self.doc_end])

    # ------------------------------------------------------------------ conversations

    @property
    def has_chat(self) -> bool:
        return self.template is not None

    def check_chat(self, where: str) -> None:
        """A UserError naming `where` when the model has no chat template."""
        if self.own:
            chat_ids(self.tok, where)  # its own error: a tokenizer from before the chat tokens
        elif self.template is None:
            raise UserError(
                f"{where}: the model's tokenizer has no chat template (no chat_template.jinja, "
                "no chat_template in tokenizer_config.json), so it cannot be talked to as a chat"
            )

    def chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """A conversation's ids, as `apply_chat_template(messages, add_generation_prompt=...)`."""
        if self.own:
            ids = chat_ids(self.tok)
            conv = encode_conversation(self.tok, messages, ids)[0]
            return conv + [ids["assistant"]] if add_generation_prompt else conv
        assert self.template is not None, "check_chat first"
        text, _ = jinja_chat.render(self.template, messages, add_generation_prompt, self.special)
        return self.tok.encode(text, add_special_tokens=False).ids

    def chat_targets(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        """A conversation's ids and, per token, whether it is an assistant target (each reply
        and the end-of-turn token after it: minillm.data.jinja_chat.assistant_spans)."""
        if self.own:
            return encode_conversation(self.tok, messages, chat_ids(self.tok))
        assert self.template is not None, "check_chat first"
        text, spans = jinja_chat.assistant_spans(
            self.template, messages, self.special, self._special_strings()
        )
        enc = self.tok.encode(text, add_special_tokens=False)
        return enc.ids, jinja_chat.token_mask(enc.offsets, spans)

    def reply_targets(
        self, prompt: list[dict[str, str]], reply: list[dict[str, str]]
    ) -> tuple[list[int], list[bool]]:
        """prompt + reply as one conversation; targets: the reply's assistant turns only (a
        preference pair's side; TRL renders the whole conversation likewise)."""
        if self.own:
            ids = chat_ids(self.tok)
            head = encode_conversation(self.tok, prompt, ids)[0]
            tail, mask = encode_conversation(self.tok, reply, ids)
            return head + tail, [False] * len(head) + mask
        assert self.template is not None, "check_chat first"
        text, spans = jinja_chat.assistant_spans(
            self.template, [*prompt, *reply], self.special, self._special_strings()
        )
        answers = sum(m["role"] == "assistant" for m in reply)
        enc = self.tok.encode(text, add_special_tokens=False)
        return enc.ids, jinja_chat.token_mask(enc.offsets, spans[len(spans) - answers :])

    def chat_prompt(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        """The prompt of (role, content) pairs (a task's example, a GRPO prompt)."""
        return self.chat_ids([{"role": r, "content": c} for r, c in messages], True)


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return 0
