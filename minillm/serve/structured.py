"""The request fields agents send, validated: tools, tool_choice, parallel_tool_calls,
response_format, chat_template_kwargs, and tool calls and results in the history.

Offers `Plan` (what a chat request asks of its reply: the tools to render, the format whose calls
to parse, the grammar that forces the text, the template's extra variables), `plan(body, model)`
(a body -> Plan, or an APIError naming the field), `history_message` (one assistant or tool
message of the history, as a chat template reads it) and the field lists `CHAT_FIELDS` and
`COMPLETION_FIELDS` (every other field is refused by name, as OpenAI's API refuses it).

`model` is the served model's side (`minillm.serve.handlers.Handler`): its template's tool-call
format, token ids and the grammar compiler.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from minillm.errors import UserError
from minillm.infer.grammar import Grammar, GrammarError, json_object_grammar, json_schema_grammar
from minillm.serve.api_error import APIError
from minillm.serve.toolcalls import ToolFormat

# The fields each endpoint reads; `user` and `metadata` are tags for the caller's own records,
# read and not used (as an OpenAI-compatible server without accounts reads them).
COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
    "stream_options", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
    "user", "metadata",
}  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "response_format", "chat_template_kwargs",
}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
# Fields of OpenAI's API that this server knows and does not do, said in words.
NOT_DONE = {
    "functions": "the legacy `functions` field: send `tools`",
    "function_call": "the legacy `function_call` field: send `tool_choice`",
    "audio": "audio output",
    "modalities": "output other than text",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "reasoning_effort": "a reasoning budget (send chat_template_kwargs the template reads, "
    "such as enable_thinking)",
    "store": "stored completions",
    "service_tier": "service tiers",
    "verbosity": "a verbosity setting",
}
# Chat fields sent to /v1/completions: said in words there.
CHAT_ONLY = {
    "messages": "/v1/chat/completions",
    "tools": "/v1/chat/completions (a completion has no template to render tools)",
    "tool_choice": "/v1/chat/completions",
    "response_format": "/v1/chat/completions (or `minillm sample --json-schema FILE`)",
    "chat_template_kwargs": "/v1/chat/completions",
}
# Template variables a request may not set: the server sets them.
RESERVED_KWARGS = {"messages", "tools", "documents", "add_generation_prompt"}


def _bad(param: str, what: str) -> Any:
    return APIError(400, f"{param}: {what}", param=param, code="invalid_value")


def check_fields(body: dict[str, Any], known: set[str]) -> None:
    """Every field is one this endpoint reads (a 400 naming the first that is not)."""
    for key in body:
        if key in CHAT_ONLY and key not in known:
            raise _bad(key, f"not supported by /v1/completions: send it to {CHAT_ONLY[key]}")
        if key in NOT_DONE:
            raise _bad(key, f"not supported by this server ({NOT_DONE[key]} is not implemented)")
        if key not in known:
            raise _bad(key, "unrecognized request argument (this server reads " + _list(known))


def _list(known: set[str]) -> str:
    return ", ".join(sorted(known)) + ")"


@dataclass
class Plan:
    """What a chat request asks of its reply, beyond sampling (module docstring)."""

    tools: list[dict[str, Any]] | None = None  # rendered into the template
    format: ToolFormat | None = None  # whose calls the reply is parsed for
    grammar: Grammar | None = None  # forces the reply's text (None: free)
    parallel: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    structured: bool = False  # a response_format or forced tool call: no logprobs


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools")
    if tools is None or tools == []:
        return []
    if not isinstance(tools, list):
        raise _bad("tools", "expected an array of {type: function, function: {...}}")
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad(f"{where}.type", "only function tools are supported")
        f = t.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise _bad(f"{where}.function.name", "expected a non-empty string")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", "expected a JSON schema object")
    return tools


def _choice(body: dict[str, Any], names: list[str]) -> tuple[str, str | None]:
    """tool_choice as (mode, function name): auto, none, required, or a named function."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad("tool_choice", f"{json.dumps(choice)} is not auto, none or required")
        if choice != "none" and not names:
            raise _bad("tool_choice", f"{choice} without tools")
        return choice, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not name:
        raise _bad("tool_choice", 'expected "auto", "none", "required" or a named function')
    if name not in names:
        raise _bad("tool_choice.function.name", f"{json.dumps(name)} is not one of the tools")
    return "named", name


def _compile(model: Any, grammar: str, param: str, trigger: int | None = None) -> Grammar:
    try:
        return model.compile(grammar, trigger)
    except GrammarError as e:
        raise _bad(param, f"the grammar engine cannot compile it: {e}") from None


def _response_format(body: dict[str, Any], model: Any) -> Grammar | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _compile(model, json_object_grammar(), "response_format")
    if kind != "json_schema":
        raise _bad("response_format.type", "expected text, json_object or json_schema")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "expected a JSON schema object")
    try:
        grammar = json_schema_grammar(schema)
    except GrammarError as e:
        raise _bad("response_format.json_schema.schema", str(e)) from None
    return _compile(model, grammar, "response_format.json_schema.schema")


def plan(body: dict[str, Any], model: Any) -> Plan:
    """The agent fields of a chat body (module docstring) -> Plan."""
    out = Plan()
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs", "expected an object of template variables")
        taken = sorted(RESERVED_KWARGS & set(kwargs))
        if taken:
            raise _bad(f"chat_template_kwargs.{taken[0]}", "set by the server, not the request")
        out.extra = dict(kwargs)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "expected a boolean")
    out.parallel = parallel is not False
    tools = _tools(body)
    names = [t["function"]["name"] for t in tools]
    mode, name = _choice(body, names)
    out.grammar = _response_format(body, model)
    out.structured = out.grammar is not None
    if not tools:
        return out
    try:
        fmt = model.tool_format()
    except UserError as e:
        raise _bad("tools", str(e).removeprefix("tools: ")) from None
    out.tools = tools
    if mode == "none":
        return out
    if out.grammar is not None:
        raise _bad("response_format", "with tools, only with tool_choice none")
    out.format = fmt
    functions = [t["function"] for t in tools if mode != "named" or t["function"]["name"] == name]
    trigger = model.token_id(fmt.trigger)
    if mode == "auto":  # free text until the trigger token; the calls after it follow the tools
        if trigger is not None:
            lazy = fmt.lazy_grammar(functions, model.token_id)
            out.grammar = _compile(model, lazy, "tools", trigger)
        return out
    parallel_ok = out.parallel and mode == "required"
    out.grammar = _compile(model, fmt.grammar(functions, model.token_id, parallel_ok), "tools")
    out.structured = True
    return out


def history_message(m: dict[str, Any], where: str, role: str, content: Any) -> dict[str, Any]:
    """An assistant message with tool_calls or a tool result, as templates read them
    (transformers' and vLLM's form: a call's arguments an object, not a JSON text)."""
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise _bad(f"{where}.tool_call_id", "expected the id of the call it answers")
        out["tool_call_id"] = call_id
        return out
    calls = m.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise _bad(f"{where}.tool_calls", "expected a non-empty array of calls")
    out["tool_calls"] = []
    for j, call in enumerate(calls):
        here = f"{where}.tool_calls[{j}]"
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise _bad(f"{here}.function", "expected {name, arguments}")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise _bad(f"{here}.function.arguments", "not a JSON text") from None
        entry = copy.deepcopy(call)
        entry["function"] = {**f, "arguments": args}  # the client's key order: the template's
        entry.setdefault("type", "function")
        out["tool_calls"].append(entry)
    return out
