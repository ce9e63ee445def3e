"""A published model's chat template (Jinja), rendered as transformers' `apply_chat_template`
renders it.

Offers `read_chat_template(folder)` (the folder's default template: `chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`, a string or a list of named templates), `render`
(messages -> text, and the spans a template marks with `{% generation %}`) and
`assistant_spans` (the character spans of each assistant turn's reply and its end-of-turn token,
from the markers where the template has them, else found from the template itself).

The environment is transformers': a sandbox (templates are untrusted code), `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` that does not escape HTML, and the
globals `raise_exception`, `strftime_now`; the template sees the messages, `add_generation_prompt`
and the tokenizer's special tokens by name (`bos_token`, `eos_token`, ...). Text so rendered is
encoded with special tokens recognised and no post-processor (transformers'
`add_special_tokens=False`): the template writes its own BOS.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from minillm.errors import CheckpointError, UserError
from minillm.runtime.files import read_json_object

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# The blocks rendered so far and the spans marked, of the render in progress in this context.
_TRACKER: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "generation_tracker", default=None
)


def read_chat_template(folder: Path) -> str | None:
    """The default chat template of a tokenizer's folder, as transformers picks it; None: none.

    `chat_template.jinja` wins over `tokenizer_config.json`; a list of named templates there
    gives the one named "default" (a list without it is one error naming the names)."""
    file = folder / CHAT_TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    config = read_tokenizer_config(folder)
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    where = folder / TOKENIZER_CONFIG_FILE
    if not isinstance(template, list) or not all(
        isinstance(t, dict) and isinstance(t.get("template"), str) for t in template
    ):
        raise CheckpointError(f"{where}: chat_template: not a string or a list of named templates")
    named = {t.get("name"): t["template"] for t in template}
    if "default" not in named:
        raise CheckpointError(
            f"{where}: chat_template: named templates {sorted(map(str, named))} and none is "
            "'default', the one minillm (and transformers) uses"
        )
    return named["default"]


def read_tokenizer_config(folder: Path) -> dict[str, Any]:
    """`tokenizer_config.json` of a folder ({} where there is none)."""
    return read_json_object(folder / TOKENIZER_CONFIG_FILE)


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body and records where it
        landed in the output (transformers' AssistantTracker)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_mark")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            text = caller()
            tracker = _TRACKER.get()
            if tracker is not None:
                blocks, spans = tracker
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render(
    source: str,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool,
    special: dict[str, str],
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The template's text for `messages`, and the character spans it marked with
    `{% generation %}` (none for a template without markers). `tools` (OpenAI's tool objects)
    and `extra` (chat_template_kwargs, e.g. enable_thinking) reach the template as
    `apply_chat_template(tools=..., **extra)` passes them. A template that raises (a role
    order it refuses) is a UserError with its message."""
    import jinja2

    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    token = _TRACKER.set((blocks, spans))
    try:
        template = _compile(source)
        for block in template.generate(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=tools or None,
            documents=None,
            **{**special, **(extra or {})},
        ):
            blocks.append(block)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise UserError(f"the model's chat template is not valid Jinja: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise UserError(f"the model's chat template refused the conversation: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        # A template computing with what it was not given (content None + str, ...).
        raise UserError(
            f"the model's chat template failed on the conversation: {type(e).__name__}: {e}"
        ) from None
    finally:
        _TRACKER.reset(token)
    return "".join(blocks), spans


def has_generation_markers(source: str) -> bool:
    return bool(_GENERATION_TAG.search(source))


# What stands in for a reply's content to locate it (`assistant_spans`): a private-use
# character, which no template writes and no reply of a test or a user holds.
_PROBE = "\U000f0000"


def assistant_spans(
    source: str,
    messages: Sequence[dict[str, str]],
    special: dict[str, str],
    end_tokens: Sequence[str],
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, per assistant turn, the span of its reply and the
    end-of-turn token after it: the template's `{% generation %}` spans where it has them.

    Without markers, from renderings of the conversation, never by searching its text (a short
    reply also occurs in the questions): the reply is where the rendering changes when that
    reply alone is replaced by a probe character, so whatever the template does with the
    content (trim it, keep its leading whitespace, cut a <think> part) the span is what it
    wrote. The span starts where the template's generation prompt for the reply ends (the
    conversation before it, rendered with `add_generation_prompt`) when that rendering is a
    prefix of the conversation's and more than whitespace lies between that and the content
    (else at the content), and it ends after the content and the first of `end_tokens`
    (the tokenizer's special tokens) that follows it, whitespace between them included; so
    ChatML's `\\n` after `<|im_end|>` is not a target, as in the templates that carry markers.
    """
    text, spans = render(source, messages, False, special)
    if has_generation_markers(source):
        return text, spans
    ends = sorted(end_tokens, key=len, reverse=True)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        at, end = _written_at(source, messages, i, special, text)
        prompt, _ = render(source, messages[:i], True, special)
        # Mistral v0.3 and Nemo move the system prompt into the last user turn, and R1's
        # generation prompt opens a <think> its finished turns lack: the conversation so far
        # then renders otherwise, and the reply starts where its content does.
        prefix = text.startswith(prompt) and cursor <= len(prompt) <= at
        start = len(prompt) if prefix else at
        if not text[start:at].strip():
            # Only whitespace between the generation prompt and the reply (Llama 2's and
            # Mistral v0.1's ' ' after [/INST]) is the template's separator, not the reply: a
            # `▁` token of its own there is no target, as in transformers' mask with the
            # {% generation %} markers around the content.
            start = at
        rest = text[end:]
        gap = len(rest) - len(rest.lstrip())
        token = next((t for t in ends if rest[gap:].startswith(t)), None)
        if token is not None:
            end += gap + len(token)
        spans.append((start, end))
        cursor = end
    return text, spans


def _written_at(
    source: str, messages: Sequence[dict[str, str]], i: int, special: dict[str, str], text: str
) -> tuple[int, int]:
    """Where the template writes message i's content in `text` (the whole conversation): the
    span that differs from a rendering with that content replaced by a probe."""
    probe = [dict(m) for m in messages]
    probe[i]["content"] = _PROBE
    other, _ = render(source, probe, False, special)
    if _PROBE not in other:
        raise UserError(
            f"the model's chat template does not write assistant turn {i + 1}'s content, so its "
            "target tokens cannot be found (add {% generation %} markers to the template, or "
            "set data.loss_on: all)"
        )
    head = len(os.path.commonprefix([text, other]))
    tail = len(os.path.commonprefix([text[head:][::-1], other[head:][::-1]]))
    return head, len(text) - tail


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Per token, whether it overlaps a span (transformers' `return_assistant_tokens_mask`)."""
    mask = [False] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = True
    return mask
