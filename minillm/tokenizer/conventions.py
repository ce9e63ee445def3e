"""How a model's tokenizer is used: one interface, one implementation per tokenizer kind.

Offers `Conventions` (built once by `Conventions.of(tokenizer, folder)`, which picks the kind;
a loaded checkpoint's `.conventions`) and its kinds `OwnConventions`, `ByteLevelConventions` and
`SentencePieceConventions`. The files beside a tokenizer.json that carry a published model's
conventions (`TOKENIZER_COMPANIONS`, `copy_companions`), `ModelTokens` (the special ids an
export writes) and `hf_tokenizer_config` are minillm.tokenizer.companions'.

Every command asks the conventions, never the tokenizer's special tokens or its kind, how to:
- encode plain text (`prompt_ids`: a sample's or a completion's prompt, a scored text;
  `text_ids` / `texts_ids`: documents in the shards; `cuttable`: whether a long text may be
  cut where minillm.data.text.is_cut says, to encode it in pieces),
- write a conversation (`chat_ids`, `chat_targets`: the ids and the answer-only mask),
- stop a reply (`stop_ids`) and end a document in the shards (`doc_end`),
- spell a token (`token_bytes`: serve's log-probabilities), name the special ids an export
  writes (`special_ids`) and write the tokenizer's Hugging Face files (`write_hf_files`).

**own** (`OwnConventions`): a tokenizer minillm trained (special tokens exactly minillm's:
minillm.tokenizer.bpe; no companion files, or the tokenizer_config.json minillm's export
writes). A prompt or document starts after `<|endoftext|>`, quoted special tokens are text, and
the chat template is minillm.tokenizer.chat_template's, inserting role tokens by id.

Any other tokenizer is a published model's, applied as transformers applies it: **byte-level**
(`ByteLevelConventions`) or **sentencepiece**-style (`SentencePieceConventions`); the kinds and
their token bytes: minillm.tokenizer.pieces. Plain text is `tokenizer(text)` (its
post-processor adds what it adds, e.g. Llama's BOS; special tokens written in the text are
recognised), a conversation is the folder's Jinja chat template (minillm.tokenizer.jinja_chat)
encoded without the post-processor, as `apply_chat_template`. A reply stops at the model's
end-of-sequence set: `generation_config.json`'s `eos_token_id` (or config.json's),
`tokenizer_config.json`'s `eos_token`, and the end-of-turn token the template writes after a
reply. Documents in the shards end with `doc_end`: the first of the eos token,
`<|endoftext|>`, `<|end_of_text|>`, `</s>` that the template does not write inside a
conversation before its end (document-aware packing must not cut a conversation at its turns),
else the eos (then a conversation's turns are separate documents to the packing, Mistral's
`</s>`: `tokenize` warns, `splits_turns`). A conversation whose template ends it with that token
(Phi-3's eos) gets no second one.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from minillm.errors import CheckpointError, UserError
from minillm.runtime.files import read_json_object
from minillm.tokenizer import jinja_chat
from minillm.tokenizer.bpe import EOT, LEGACY_SPECIAL_TOKENS, SPECIAL_TOKENS, special_tokens
from minillm.tokenizer.chat_template import HF_CHAT_TEMPLATE, chat_ids, encode_conversation
from minillm.tokenizer.companions import (
    GENERATION_CONFIG_FILE,
    MODEL_CONFIG_FILE,
    SPECIAL_NAMES,
    SPECIAL_TOKENS_MAP_FILE,
    TOKENIZER_FILE,
    ModelTokens,
    copy_companions,
    hf_tokenizer_config,
    minillms_companions,
    published_model_tokens,
    read_eos_ids,
    read_generation_config,
    token_string,
)
from minillm.tokenizer.pieces import byte_level_bytes, sentencepiece_bytes, tokenizer_kind

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DOC_END_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>")
# A conversation the template is asked to write once, to find its end-of-turn token and the
# tokens it writes between turns.
_PROBE = (
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "Bye"},
)


@dataclass
class Conventions:
    """A tokenizer and how every command uses it (module docstring). Built by `of`; each kind
    is a subclass."""

    kind: ClassVar[str]
    # Whether a long text may be cut where minillm.data.text.is_cut says (GPT-2's regex and
    # nothing added around a text): only minillm's own tokenizer is known to allow it.
    cuttable: ClassVar[bool] = False

    tok: Tokenizer
    doc_end: int  # ends a document in the shards (and is the padding there)
    stop_ids: frozenset[int]  # where a reply (and a sample) stops
    template: str | None  # the Jinja chat template (minillm's own: its export's)
    special: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... strings
    turn_end: int | None = None  # the token the template writes after a reply
    # What `tokenizer(text)` puts before and after the text (Llama's BOS before).
    text_prefix: tuple[int, ...] = ()
    text_suffix: tuple[int, ...] = ()
    # doc_end is also written between the template's turns (Mistral's </s> after each reply):
    # document-aware packing then cuts a conversation at its turns.
    splits_turns: bool = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A pickled tokenizer (a tokenize worker's copy) loses encode_special_tokens.
        self.__dict__.update(state)
        self.tok.encode_special_tokens = self.kind == OwnConventions.kind

    @classmethod
    def of(cls, tok: Tokenizer, folder: str | Path) -> Conventions:
        """The conventions of `tok`, whose companion files (if any) are in `folder`; a
        tokenizer of no kind minillm applies is a CheckpointError naming the key."""
        folder = Path(folder)
        template = jinja_chat.read_chat_template(folder)
        specials = special_tokens(tok)
        if (
            specials in (list(SPECIAL_TOKENS), list(LEGACY_SPECIAL_TOKENS))
            and template in (None, HF_CHAT_TEMPLATE)
            and minillms_companions(folder)
        ):
            return OwnConventions.of_own(tok)
        kind = tokenizer_kind(tok, str(folder / TOKENIZER_FILE))
        published = SentencePieceConventions if kind == "sentencepiece" else ByteLevelConventions
        return published.read(tok, folder, template)

    @classmethod
    def of_own(cls, tok: Tokenizer) -> OwnConventions:
        return OwnConventions.of_own(tok)

    # ------------------------------------------------------------------ plain text

    def text_ids(self, text: str) -> list[int]:
        """A document's ids without the end-of-document token."""
        return self.texts_ids([text])[0]

    def texts_ids(self, texts: list[str]) -> list[list[int]]:
        """`text_ids` of each text, encoded in one batch (on the tokenizer's threads)."""
        raise NotImplementedError

    def prompt_ids(self, text: str) -> list[int]:
        """A text to continue or to score."""
        raise NotImplementedError

    @property
    def text_stops(self) -> frozenset[int]:
        """Where a sampled text stops."""
        return self.stop_ids

    def empty_prompt(self) -> list[int]:
        """What an unprompted sample starts from: the start of a document."""
        return list(self.text_prefix) or [self.doc_end]

    def token_bytes(self, token: int) -> bytes:
        """The bytes token `token` spells in a text (a special token: none)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ conversations

    @property
    def has_chat(self) -> bool:
        return self.template is not None

    def check_chat(self, where: str) -> None:
        """A UserError naming `where` when the model has no chat template."""
        if self.template is None:
            raise UserError(
                f"{where}: the model's tokenizer has no chat template (no chat_template.jinja, "
                "no chat_template in tokenizer_config.json), so it cannot be talked to as a chat"
            )

    def chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """A conversation's ids, as `apply_chat_template(messages, add_generation_prompt=...)`."""
        raise NotImplementedError

    def chat_targets(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        """A conversation's ids and, per token, whether it is an assistant target (each reply
        and the end-of-turn token after it)."""
        raise NotImplementedError

    def reply_targets(
        self, prompt: list[dict[str, str]], reply: list[dict[str, str]]
    ) -> tuple[list[int], list[bool]]:
        """prompt + reply as one conversation; targets: the reply's assistant turns only (a
        preference pair's side; TRL renders the whole conversation likewise)."""
        raise NotImplementedError

    def chat_prompt(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        """The prompt of (role, content) pairs (a task's example, a GRPO prompt)."""
        return self.chat_ids([{"role": r, "content": c} for r, c in messages], True)

    # ------------------------------------------------------------------ exports

    def special_ids(self, folder: Path) -> ModelTokens:
        """The special ids the exports write (config.json, generation_config.json, GGUF's
        tokenizer.ggml.*); `folder` holds the tokenizer's generation_config.json, if any."""
        raise NotImplementedError

    def write_hf_files(self, source: Path | None, out: Path, max_len: int) -> dict[str, Any]:
        """Write tokenizer.json (and the companion files) into the Hugging Face folder `out`;
        return the JSON files still to write there, by name. `source`: the tokenizer.json the
        conventions were read from (None: save `tok`)."""
        raise NotImplementedError


@dataclass
class OwnConventions(Conventions):
    """A tokenizer minillm trained (module docstring)."""

    kind: ClassVar[str] = "own"
    cuttable: ClassVar[bool] = True

    @classmethod
    def of_own(cls, tok: Tokenizer) -> OwnConventions:
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
        return cls(tok, eot, stops, template, special, end)

    def texts_ids(self, texts: list[str]) -> list[list[int]]:
        """Nothing added: a document's ids are its text's."""
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def prompt_ids(self, text: str) -> list[int]:
        """After `<|endoftext|>`: a fresh document."""
        return [self.doc_end, *self.tok.encode(text, add_special_tokens=False).ids]

    @property
    def text_stops(self) -> frozenset[int]:
        """At end-of-text: the end of a document."""
        return frozenset([self.doc_end])

    def empty_prompt(self) -> list[int]:
        return [self.doc_end]

    def token_bytes(self, token: int) -> bytes:
        if token in self.tok.get_added_tokens_decoder():
            return b""
        return byte_level_bytes(self.tok.id_to_token(token) or "")

    def check_chat(self, where: str) -> None:
        # Its own error: a tokenizer from before the chat tokens, to retrain.
        chat_ids(self.tok, where)

    def chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        ids = chat_ids(self.tok)
        conv = encode_conversation(self.tok, messages, ids)[0]
        return conv + [ids["assistant"]] if add_generation_prompt else conv

    def chat_targets(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        return encode_conversation(self.tok, messages, chat_ids(self.tok))

    def reply_targets(
        self, prompt: list[dict[str, str]], reply: list[dict[str, str]]
    ) -> tuple[list[int], list[bool]]:
        ids = chat_ids(self.tok)
        head = encode_conversation(self.tok, prompt, ids)[0]
        tail, mask = encode_conversation(self.tok, reply, ids)
        return head + tail, [False] * len(head) + mask

    def special_ids(self, folder: Path) -> ModelTokens:
        """End-of-text is bos, eos and pad; a chat turn ends at `<|end|>` (eos is then
        [end-of-text, `<|end|>`]); config.json's eos is end-of-text."""
        eot, end = self.doc_end, self.turn_end
        eos = [eot] if end is None else [eot, end]
        return ModelTokens(eot, eos, eot, eot, end, eot, read_generation_config(folder))

    def write_hf_files(self, source: Path | None, out: Path, max_len: int) -> dict[str, Any]:
        """tokenizer.json, and the JSON files that give transformers minillm's conventions
        (end-of-text as bos, eos and pad; the chat template): `hf_tokenizer_config`."""
        tok = self.tok
        specials = {name: tok.token_to_id(name) for name in special_tokens(tok)}
        tok.save(str(out / TOKENIZER_FILE))
        return {
            jinja_chat.TOKENIZER_CONFIG_FILE: hf_tokenizer_config(
                EOT, self.doc_end, max_len, specials
            ),
            SPECIAL_TOKENS_MAP_FILE: {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT},
        }


@dataclass
class PublishedConventions(Conventions):
    """A published model's tokenizer, applied as transformers applies it (module docstring);
    its kinds differ in how a token spells bytes."""

    @classmethod
    def read(cls, tok: Tokenizer, folder: Path, template: str | None) -> PublishedConventions:
        """The conventions of `tok` from its companion files in `folder`."""
        tok.encode_special_tokens = False  # as transformers: a written "<|im_end|>" is the token
        config = jinja_chat.read_tokenizer_config(folder)
        # Older folders name their special tokens in special_tokens_map.json.
        legacy = read_json_object(folder / SPECIAL_TOKENS_MAP_FILE)
        special = {k: s for k in SPECIAL_NAMES if (s := token_string(config.get(k, legacy.get(k))))}
        eos_ids = read_eos_ids(folder)
        if "eos_token" not in special and eos_ids:
            token = tok.id_to_token(eos_ids[0])
            if token is not None:
                special["eos_token"] = token
        eos = tok.token_to_id(special["eos_token"]) if "eos_token" in special else None
        conv = cls(tok, -1, frozenset(), template, special)
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
                self.template, list(_PROBE), self.special, special_tokens(self.tok)
            )
        except UserError:
            return None, set()
        enc = self.tok.encode(text, add_special_tokens=False)
        in_chat = set(enc.ids[:-1])  # what it writes inside; its last token may end it
        if not spans:
            return None, in_chat
        end = spans[-1][1]
        # The token that writes the reply's last character: a special token that strips the
        # whitespace after it (Phi-3's <|end|>, `rstrip`) spans that newline too.
        last = [i for i, (a, b) in zip(enc.ids, enc.offsets) if a < end <= b]
        token = last[-1] if last else None
        specials = {self.tok.token_to_id(s) for s in special_tokens(self.tok)}
        return (token if token in specials else None), in_chat

    def texts_ids(self, texts: list[str]) -> list[list[int]]:
        """`tokenizer(text)`: its BOS included."""
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=True)]

    def prompt_ids(self, text: str) -> list[int]:
        """`tokenizer(text)`."""
        return self.tok.encode(text, add_special_tokens=True).ids

    def _spell(self, piece: str) -> bytes:
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes:
        if token in self.tok.get_added_tokens_decoder():
            return b""
        return self._spell(self.tok.id_to_token(token) or "")

    def chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        assert self.template is not None, "check_chat first"
        text, _ = jinja_chat.render(self.template, messages, add_generation_prompt, self.special)
        return self.tok.encode(text, add_special_tokens=False).ids

    def chat_targets(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        """The template's rendering; targets: minillm.tokenizer.jinja_chat.assistant_spans."""
        assert self.template is not None, "check_chat first"
        text, spans = jinja_chat.assistant_spans(
            self.template, messages, self.special, special_tokens(self.tok)
        )
        enc = self.tok.encode(text, add_special_tokens=False)
        return enc.ids, jinja_chat.token_mask(enc.offsets, spans)

    def reply_targets(
        self, prompt: list[dict[str, str]], reply: list[dict[str, str]]
    ) -> tuple[list[int], list[bool]]:
        assert self.template is not None, "check_chat first"
        text, spans = jinja_chat.assistant_spans(
            self.template, [*prompt, *reply], self.special, special_tokens(self.tok)
        )
        answers = sum(m["role"] == "assistant" for m in reply)
        enc = self.tok.encode(text, add_special_tokens=False)
        return enc.ids, jinja_chat.token_mask(enc.offsets, spans[len(spans) - answers :])

    def special_ids(self, folder: Path) -> ModelTokens:
        """Its own, read where transformers reads them (`published_model_tokens`)."""
        ids = {name: self.tok.token_to_id(text) for name, text in self.special.items()}
        added_bos = self.text_prefix[0] if self.text_prefix else None
        return published_model_tokens(folder, ids, added_bos, self.turn_end)

    def write_hf_files(self, source: Path | None, out: Path, max_len: int) -> dict[str, Any]:
        """Its own tokenizer.json and companion files (the chat template, the special tokens,
        tokenizer_config.json) copied as they are, so that AutoTokenizer loads the same
        tokenizer; a tokenizer_config.json of what the conventions used where it had none."""
        if source is not None and source.is_file():
            shutil.copyfile(source, out / TOKENIZER_FILE)
            copy_companions(source.parent, out)
        else:
            self.tok.save(str(out / TOKENIZER_FILE))
        if (out / jinja_chat.TOKENIZER_CONFIG_FILE).is_file():
            return {}
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special}
        config["model_max_length"] = max_len
        if self.template is not None and not (out / jinja_chat.CHAT_TEMPLATE_FILE).is_file():
            config["chat_template"] = self.template
        return {jinja_chat.TOKENIZER_CONFIG_FILE: config}


@dataclass
class ByteLevelConventions(PublishedConventions):
    """A published byte-level BPE (minillm.tokenizer.pieces)."""

    kind: ClassVar[str] = "byte-level"

    def _spell(self, piece: str) -> bytes:
        return byte_level_bytes(piece)


@dataclass
class SentencePieceConventions(PublishedConventions):
    """A published sentencepiece-style BPE with byte fallback (minillm.tokenizer.pieces)."""

    kind: ClassVar[str] = "sentencepiece"

    def _spell(self, piece: str) -> bytes:
        return sentencepiece_bytes(piece)


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return 0
