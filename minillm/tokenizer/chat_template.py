"""minillm's own chat template: messages -> token ids and the mask of training targets.

Offers `ROLES`, `check_messages` (a bad row is one error line naming file, row and field),
`chat_ids` (the special-token ids, or a UserError for a tokenizer without them),
`encode_conversation` (ids + target mask), `HF_CHAT_TEMPLATE` (the same template in Jinja, for an
exported tokenizer_config.json), `assistant_bytes`, `content_bytes` and `resolve_loss_on`
(`data.loss_on`, auto resolved against the data). Commands reach it through
minillm.tokenizer.conventions, which applies a published model's own template instead where the
tokenizer is a published model's.

A conversation is, per message, `<|role|>` + content + `<|end|>`; a generation prompt is
`<|assistant|>`. No newline or space is added: the role and end tokens are special tokens inserted
by id, and each content is encoded on its own, so a content never merges with its neighbours and
Hugging Face's `apply_chat_template` (which splits the rendered text at special tokens) gives the
same ids. With the loss on the assistant, the targets are each assistant content's tokens and its
`<|end|>`: the model learns what to answer and when to stop, never what a user says. A reply
ends at its `<|end|>`, or at `<|endoftext|>` (the end of the document, which a model may emit
instead): the conventions' `stop_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from minillm.errors import ConfigError, UserError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ROLES = ("system", "user", "assistant")
END = "<|end|>"
GENERATION_PROMPT = "<|assistant|>"

# Jinja for transformers' apply_chat_template: the template above, as text that the tokenizer
# splits at its special tokens.
HF_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def check_messages(
    messages: Any,
    file: str,
    row: int,
    field: str = "messages",
    need_assistant: bool = True,
    unit: str = "row",
) -> list[dict[str, str]]:
    """The row's messages, or a ConfigError `file: data.text_field: row N: field[i].key: what`.

    `row` counts from 1; `unit` is "line" where it is a jsonl file's line number. An unknown
    role, a content that is not a string, or (need_assistant) a conversation without an
    assistant turn is refused: any of them would train on nothing or on a turn the template
    cannot express.
    """

    def fail(what: str) -> ConfigError:
        return ConfigError("data.text_field", f"{unit} {row}: {what}", file)

    if not isinstance(messages, list) or not messages:
        raise fail(f"{field}: expected a non-empty list of {{role, content}} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise fail(f"{field}[{i}]: expected {{role, content}}, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise fail(f"{field}[{i}].role: {role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            got = "missing" if "content" not in m else f"got {type(content).__name__}"
            raise fail(f"{field}[{i}].content: expected a string, {got}")
        out.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise fail(f"{field}: no assistant turn, so nothing to learn from")
    return out


def chat_ids(tok: Tokenizer, where: str = "") -> dict[str, int]:
    """{"system", "user", "assistant", "end"} -> special-token id; a UserError when missing."""
    ids = {r: tok.token_to_id(f"<|{r}|>") for r in ROLES}
    ids["end"] = tok.token_to_id(END)
    missing = [k for k, v in ids.items() if v is None]
    if missing:
        raise UserError(
            f"{where + ': ' if where else ''}the tokenizer has no chat tokens "
            f"({', '.join(f'<|{k}|>' for k in missing)}): it was made before minillm reserved "
            "them; retrain it (`minillm tokenize --retrain`) and the model"
        )
    return ids


def _content_ids(tok: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    # Quoted special tokens in a content are text (the caller's tokenizer has
    # encode_special_tokens set; minillm.tokenizer.bpe.load_tokenizer does that).
    return [e.ids for e in tok.encode_batch_fast(list(texts), add_special_tokens=False)]


def encode_conversation(
    tok: Tokenizer, messages: list[dict[str, str]], ids: dict[str, int] | None = None
) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation and, per token, whether it is an assistant target."""
    ids = ids or chat_ids(tok)
    out: list[int] = []
    target: list[bool] = []
    for m, content in zip(messages, _content_ids(tok, [m["content"] for m in messages])):
        is_answer = m["role"] == "assistant"
        out += [ids[m["role"]], *content, ids["end"]]
        target += [False] + [is_answer] * (len(content) + 1)
    return out, target


def assistant_bytes(messages: list[dict[str, str]]) -> int:
    """UTF-8 bytes of the assistant contents: what bits per byte divides by for chat data."""
    return sum(len(m["content"].encode("utf-8")) for m in messages if m["role"] == "assistant")


def content_bytes(messages: list[dict[str, str]]) -> int:
    """UTF-8 bytes of every content (the conversation's text, without its special tokens)."""
    return sum(len(m["content"].encode("utf-8")) for m in messages)


def resolve_loss_on(data: Any, chat: bool, label: str) -> str:
    """data.loss_on resolved: auto = assistant for chat data, all otherwise."""
    if data.loss_on == "assistant" and not chat:
        raise ConfigError(
            "data.loss_on",
            f"assistant needs chat data (a column of {{role, content}} messages); "
            f"data.text_field {data.text_field!r} holds plain text",
            label,
        )
    return data.loss_on if data.loss_on != "auto" else ("assistant" if chat else "all")
