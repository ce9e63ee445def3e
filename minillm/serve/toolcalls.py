"""Tool calls as a model family writes them: which format a chat template uses, its calls parsed
from the reply's text, and the grammar that forces them.

Offers `ToolFormat` (one format: its trigger, `parse_calls`, `grammar`), `FORMATS`,
`tool_format(template)` (the template's format, or a UserError naming what it found),
`ToolCall` and `new_call_id`. The formats, as vLLM's parsers read them:

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`, one block per call, text before the first block is content.
- `llama3_json` (Llama 3.1, 3.2, 3.3): a reply that is `{"name": ..., "parameters": {...}}`, calls
  separated by `;`, maybe after `<|python_tag|>`.
- `mistral` (Mistral 7B v0.3, Nemo, Small): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from minillm.errors import UserError
from minillm.infer.grammar import schema_lark


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON text (OpenAI's form)."""

    name: str
    arguments: str


def _decoder_objects(text: str) -> tuple[list[Any], str]:
    """The JSON values at the start of text, one after another (`;` or `,` or whitespace
    between them), and what is left after the last whole one."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        rest = text[at:]
        skip = len(rest) - len(rest.lstrip(" \t\n;,"))
        try:
            value, end = decoder.raw_decode(text, at + skip)
        except json.JSONDecodeError:
            return values, text[at:]
        values.append(value)
        at = end


_CLOSE = "</tool_call>"
# A Hermes call whose name comes first: `{"name": "...", "arguments": ` and then its arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _trim_object_end(text: str) -> str:
    """`text` without what may end the call's object: trailing space, one `}`, space."""
    text = text.rstrip()
    return (text[:-1] if text.endswith("}") else text).rstrip()


def _raw_arguments(call: ToolCall | None, body: str) -> ToolCall | None:
    """A Hermes call's arguments as the model wrote them (the text streamed piece by piece),
    where its name comes first and they are JSON; else as parsed."""
    head = _HEAD.match(body)
    if call is None or head is None:
        return call
    raw = _trim_object_end(body[head.end() :])
    try:
        json.loads(raw)
    except json.JSONDecodeError:
        return call
    return ToolCall(call.name, raw) if not raw.startswith('"') else call


def _as_call(value: Any, args_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(args_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON text already
        return ToolCall(value["name"], args)
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


@dataclass(frozen=True)
class ToolFormat:
    """A family's way of writing tool calls. `trigger`: the text that opens them (a token of
    the family's vocabulary); `bare_json`: a reply that starts with `{` is calls too."""

    name: str
    trigger: str
    args_key: str = "arguments"
    bare_json: bool = False
    id_length: int = 0  # Mistral's templates want 9-character ids; 0: OpenAI's call_<hex>

    def parse_calls(self, text: str, final: bool) -> tuple[list[ToolCall], bool]:
        """The whole calls in `text` (what follows the trigger, or a bare-JSON reply) and
        whether the text was all calls (a final text that is not: it is content)."""
        if self.name == "hermes":
            calls, ok = [], True
            for block in re.split(r"\s*<tool_call>\s*", text.strip()):
                if not block:
                    continue
                body, closed, _ = block.partition("</tool_call>")
                if not closed and not final:
                    break
                values, rest = _decoder_objects(body)
                call = _as_call(values[0], self.args_key) if len(values) == 1 else None
                call = _raw_arguments(call, body)
                ok = ok and call is not None and not rest.strip()
                if call is not None:
                    calls.append(call)
            return calls, ok
        if self.name == "mistral":
            values, rest = _decoder_objects(text.strip())
            items = values[0] if values and isinstance(values[0], list) else []
            calls = [c for v in items if (c := _as_call(v, self.args_key))]
            return calls, bool(values) and len(calls) == len(items) and not rest.strip()
        values, rest = _decoder_objects(text.strip())  # llama3_json
        calls = [c for v in values if (c := _as_call(v, self.args_key))]
        return calls, len(calls) == len(values) and not rest.strip()

    def open_call(self, text: str) -> tuple[str, str] | None:
        """Hermes: the name of the call still being written and its arguments so far, as they
        will stand in the whole call (what may still close the call held back); None when the
        last block is closed, or its name does not come first."""
        if self.name != "hermes":
            return None
        last = re.split(r"\s*<tool_call>\s*", text.strip())[-1]
        head = _HEAD.match(last)
        if "</tool_call>" in last or head is None or last[head.end() :].startswith('"'):
            return None
        args = last[head.end() :]
        for k in range(min(len(_CLOSE) - 1, len(args)), 0, -1):  # a partial </tool_call>
            if _CLOSE.startswith(args[-k:]):
                args = args[:-k]
                break
        return json.loads(f'"{head.group(1)}"'), _trim_object_end(args)

    def _call_schema(self, tool: dict[str, Any]) -> dict[str, Any]:
        params = tool.get("parameters") or {"type": "object", "properties": {}}
        return {
            "type": "object",
            "properties": {"name": {"const": tool["name"]}, self.args_key: params},
            "required": ["name", self.args_key],
            "additionalProperties": False,
        }

    def grammar(self, tools: list[dict[str, Any]], token_id: Any, parallel: bool) -> str:
        """Lark for forced calls to one of `tools` (OpenAI's `function` objects), from the
        reply's start: the trigger, then the calls. token_id(text): the id of a marker that is
        one token (written `<[id]>`: the grammar engine reads added tokens by id, not text)."""
        schemas = [self._call_schema(t) for t in tools]
        one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        trigger = _ref(self.trigger, token_id)
        if self.name == "mistral":
            array = {"type": "array", "items": one, "minItems": 1}
            if not parallel:
                array["maxItems"] = 1
            return f"start: {trigger} {schema_lark(array)}\n"
        call = f"call: {schema_lark(one)}\n"
        if self.name == "hermes":
            close = _ref("</tool_call>", token_id)
            block = f'block: {trigger} "\\n" call "\\n" {close}\n'
            start = 'start: block ("\\n" block)*\n' if parallel else "start: block\n"
            return start + block + call
        start = 'start: call ("; " call)*\n' if parallel else "start: call\n"
        return start + call

    def lazy_grammar(self, tools: list[dict[str, Any]], token_id: Any) -> str:
        """Lark for what follows the trigger token in `auto` mode (the row is free before)."""
        schemas = [self._call_schema(t) for t in tools]
        one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        if self.name == "mistral":
            return f"start: {schema_lark({'type': 'array', 'items': one, 'minItems': 1})}\n"
        if self.name == "hermes":
            close = _ref("</tool_call>", token_id)
            return f'start: "\\n" call "\\n" {close}\ncall: {schema_lark(one)}\n'
        return f"start: {schema_lark(one)}\n"

    def call_id(self) -> str:
        if self.id_length:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(self.id_length))
        return new_call_id()


def _ref(text: str, token_id: Any) -> str:
    """A marker in Lark: its token `<[id]>` where it is one, else its text."""
    token = token_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>"),
    "llama3_json": ToolFormat("llama3_json", "<|python_tag|>", "parameters", bare_json=True),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", id_length=9),
}
# Other templates' call markers, named in the refusal (the formats minillm does not parse).
_OTHERS = {
    "<|tool_call_begin|>": "Kimi K2",
    "<｜tool▁calls▁begin｜>": "DeepSeek V3/R1",
    "<function=": "Qwen3-Coder XML",
    "<|tool_call|>": "Granite / Phi-4",
    "<start_function_call>": "FunctionGemma",
    "functools[": "Firefunction",
}


def tool_format(template: str | None) -> ToolFormat:
    """The tool-call format `template` (a chat template's source) writes, or a UserError that
    says why none: no template, a template without tools, or a format minillm does not parse."""
    if not template:
        raise UserError("tools: the model has no chat template, so it has no tool-call format")
    # Another family's markers first: Qwen3-Coder's XML calls also sit in <tool_call> blocks.
    found = next((name for marker, name in _OTHERS.items() if marker in template), None)
    if found:
        raise UserError(
            f"tools: the model's chat template writes the {found} format, which minillm does not "
            "parse (it parses Hermes/Qwen <tool_call>, Llama 3.1 JSON and Mistral [TOOL_CALLS])"
        )
    if "tools" not in template:
        raise UserError(
            "tools: the model's chat template does not use `tools`, so the model was not "
            "trained to call them"
        )
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if '"parameters"' in template or "<|python_tag|>" in template:
        return FORMATS["llama3_json"]
    raise UserError(
        "tools: the model's chat template writes a tool-call format minillm does not parse (it "
        "parses Hermes/Qwen <tool_call>, Llama 3.1 JSON and Mistral [TOOL_CALLS])"
    )
