"""OpenAI's protocol, as `minillm serve` reads it: the requests, validated, and the errors.

Offers `APIError` (an OpenAI error object with its HTTP status), `Limits`, `parse_json`,
`parse_chat` and `parse_completion` (a request body -> `Job`, or an APIError naming the
parameter at fault). The response and chunk objects are `minillm.serve.responses`'.

Validation is written out here rather than left to pydantic so that every refusal is OpenAI's
`{"error": {"message", "type", "param", "code"}}` with a message that names the parameter, the
shape clients such as the `openai` package parse and show. Every field is honoured or refused
by name: an unknown one (as OpenAI's API does), and a known one this server cannot honour
(penalties, logit_bias, suffix, logprobs under a grammar). The agents' fields (tools,
response_format, chat_template_kwargs) are `minillm.serve.structured`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from minillm.config.schema import SampleConfig
from minillm.infer.engine import SamplingParams
from minillm.serve import structured as S
from minillm.serve.api_error import APIError as APIError

# The chat template's roles; "developer" is OpenAI's newer name for the system message.
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
MAX_STOP = 4  # OpenAI's limit on `stop` sequences
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default cap; OpenAI's is 5 and 20)


@dataclass(frozen=True)
class Limits:
    """What the served model and the server allow. `defaults` is the run's `sample` section,
    as `minillm sample` and `minillm chat` use it (vLLM likewise takes a model folder's
    generation_config.json as its defaults)."""

    model: str
    context: int
    vocab_size: int
    max_n: int
    defaults: SampleConfig = field(default_factory=SampleConfig)
    lead: int = 1  # leading ids a string prompt is given (end-of-text, or a model's BOS)


@dataclass
class Job:
    """A validated request: prompts as token ids (one per choice group), sampling, output form.

    `prompts` holds each distinct prompt once; every prompt gets `n` choices. For completions
    `prompt_texts` are the texts echoed back (`echo`).
    """

    kind: str  # "chat" or "completion"
    prompts: list[list[int]]
    sampling: SamplingParams  # resolved; the same for every choice
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    prompt_texts: list[str] = field(default_factory=list)
    hidden: list[int] = field(default_factory=list)  # leading ids of each prompt not echoed
    plan: S.Plan = field(default_factory=S.Plan)  # chat: tools, grammar, template variables
    in_thought: bool = False  # chat: the prompt opened a think block (the reply starts in it)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(
            400, f"the request body is not valid JSON: {e}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(body)}")
    return body


# ----------------------------------------------------------------------------- field checks


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), "an array" if isinstance(value, list) else "an object"
    )


def _bad(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: {what}", param=param, code="invalid_value")


def _get(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """body[key] if it has the type (null = absent); a bool is never a number here."""
    value = body.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        names = " or ".join(_kind(k()) if k is not list else "an array" for k in kinds)
        raise _bad(key, f"expected {names}, got {_kind(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(key, f"must be a finite number, got {value}")
    return value


def _number(
    body: dict[str, Any], key: str, default: float | None, lo: float, hi: float
) -> float | None:
    value = _get(body, key, float, default)
    if value is None:
        return None
    value = float(value)
    if not lo <= value <= hi:
        raise _bad(key, f"must be between {lo:g} and {hi:g}, got {value:g}")
    return value


def _model(body: dict[str, Any], limits: Limits) -> None:
    """404 for a model this server does not serve (absent: the served one)."""
    name = _get(body, "model", str, limits.model)
    if name != limits.model:
        raise APIError(
            404,
            f"The model `{name}` does not exist; this server serves `{limits.model}` "
            "(GET /v1/models)",
            param="model",
            code="model_not_found",
        )


# What a known key this server cannot honour would ask for, in words.
_NOT_HONOURED = {
    "frequency_penalty": "repetition penalties are not implemented",
    "presence_penalty": "repetition penalties are not implemented",
    "logit_bias": "logit biases are not implemented",
    "suffix": "insertion (text after the completion) is not implemented",
}


def _unsupported(body: dict[str, Any], keys: dict[str, Any]) -> None:
    """A known key this server cannot honour must be absent or at its neutral value."""
    for key, neutral in keys.items():
        value = body.get(key)
        if value is not None and value != neutral and value != [] and value != {}:
            why = _NOT_HONOURED.get(key, "not supported by this server")
            raise _bad(key, f"{why} (only {json.dumps(neutral)})")


def _stop(body: dict[str, Any]) -> list[str]:
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP:
        raise _bad("stop", f"at most {MAX_STOP} sequences, got {len(stop)}")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise _bad(f"stop[{i}]", f"expected a non-empty string, got {_kind(s)}")
    return stop


def _sampling(
    body: dict[str, Any], limits: Limits, max_tokens_keys: tuple[str, ...], min_tokens: int
) -> tuple[SamplingParams, int | None]:
    """The shared sampling keys, an absent one from the run's defaults; the second value is the
    explicit max_tokens (None: the default)."""
    max_tokens = None
    for key in max_tokens_keys:  # the later key wins (max_completion_tokens over max_tokens)
        value = _get(body, key, int, None)
        if value is not None:
            if value < min_tokens:
                raise _bad(key, f"must be >= {min_tokens}, got {value}")
            if value > limits.context:
                raise _bad(
                    key,
                    f"must be <= {limits.context} (the model's context length), got {value}",
                )
            max_tokens = value
    temperature = _number(body, "temperature", None, 0.0, 2.0)
    top_p = _number(body, "top_p", None, 0.0, 1.0)
    if top_p is not None and top_p <= 0.0:
        raise _bad("top_p", "must be > 0 (1 = off), got 0")
    top_k = _get(body, "top_k", int, None)
    if top_k is not None and top_k < -1:
        raise _bad("top_k", f"must be >= 0 (0 or -1 = off), got {top_k}")
    params = SamplingParams(
        temperature=temperature,
        top_k=None if top_k is None else max(top_k, 0),
        top_p=top_p,
        seed=_get(body, "seed", int, None),
        stop=tuple(_stop(body)),
    )
    params = params.resolve(limits.defaults)  # max_tokens 0 (echo only) is no CLI setting
    if max_tokens is not None:
        params = dataclasses.replace(params, max_new_tokens=max_tokens)
    return params, max_tokens


def _n(body: dict[str, Any], limits: Limits) -> int:
    n = _get(body, "n", int, 1)
    if not 1 <= n <= limits.max_n:
        raise _bad("n", f"must be between 1 and {limits.max_n} (the server's --max-batch), got {n}")
    return n


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    include_usage = _get(options, "include_usage", bool, False) if options else False
    return stream, bool(stream and include_usage)


def _fit(
    sampling: SamplingParams,
    explicit: int | None,
    prompts: list[list[int]],
    limits: Limits,
    param: str,
) -> SamplingParams:
    """A prompt plus its completion must fit the context; the default max_tokens shrinks to fit
    (but leaves at least one token to generate)."""
    longest = max(len(p) for p in prompts)
    if explicit is None:
        fits = min(sampling.max_new_tokens, limits.context - longest)
        sampling = dataclasses.replace(sampling, max_new_tokens=fits)
        completion = max(fits, 1)
    else:
        completion = explicit
    if longest + completion > limits.context:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.context} tokens. However, you "
            f"requested {longest + completion} tokens ({longest} in the {param}, {completion} "
            f"in the completion). Please reduce the length of the {param} or the completion "
            "(max_tokens).",
            param=param,
            code="context_length_exceeded",
        )
    return sampling


# ----------------------------------------------------------------------------- the two requests


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`messages` as the chat template's {role, content} (and an assistant's tool_calls, a tool
    result's tool_call_id), or a 400 naming the bad element."""
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "messages: required", param="messages", code="missing_required")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"expected a non-empty array of messages, got {_kind(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"expected an object with role and content, got {_kind(m)}")
        role = m.get("role")
        if role not in ROLE_ALIASES:
            raise _bad(
                f"{where}.role",
                f"{json.dumps(role)} is not one of system, developer, user, assistant, tool",
            )
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: only text ones are readable
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise _bad(f"{where}.content[{j}]", "only {type: text} parts are supported")
                if not isinstance(part.get("text"), str):
                    raise _bad(f"{where}.content[{j}].text", "expected a string")
                texts.append(part["text"])
            content = "".join(texts)
        calls = role == "assistant" and m.get("tool_calls") not in (None, [])
        if content is None and role == "assistant":  # null beside tool_calls: templates (Qwen3's)
            content = ""  # test it as a string
        if not isinstance(content, str) and not calls:
            raise _bad(f"{where}.content", f"expected a string, got {_kind(content)}")
        if calls or role == "tool":
            out.append(S.history_message(m, where, role, content))
        else:
            out.append({"role": ROLE_ALIASES[role], "content": content})
    return out


def parse_chat(body: dict[str, Any], limits: Limits, encode: Any, model: Any = None) -> Job:
    """A /v1/chat/completions body -> Job; encode(messages) gives the prompt ids. `model` (the
    Handler) renders tools and compiles grammars; without it the agents' fields are refused."""
    S.check_fields(body, S.CHAT_FIELDS)
    _model(body, limits)
    messages = chat_messages(body)
    _unsupported(body, {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}})
    sampling, explicit = _sampling(body, limits, ("max_tokens", "max_completion_tokens"), 1)
    plan = S.plan(body, model) if model is not None else S.Plan()
    if plan.structured and _get(body, "logprobs", bool, False):
        raise _bad("logprobs", "not supported with a response_format or a forced tool call")
    if _get(body, "logprobs", bool, False):
        top = _get(body, "top_logprobs", int, 0)
        if not 0 <= top <= MAX_LOGPROBS:
            raise _bad("top_logprobs", f"must be between 0 and {MAX_LOGPROBS}, got {top}")
        sampling = dataclasses.replace(sampling, logprobs=top)
    elif body.get("top_logprobs") is not None:
        raise _bad("top_logprobs", "only with logprobs: true")
    n = _n(body, limits)
    stream, include_usage = _stream(body)
    in_thought = False
    if model is not None:
        prompt, in_thought = model.render_chat(messages, plan)
    else:
        prompt = encode(messages)
    sampling = _fit(sampling, explicit, [prompt], limits, "messages")
    # A reply, as `minillm chat`; the grammar (if any) forces its text.
    sampling = dataclasses.replace(sampling, text_alone=True, grammar=plan.grammar)
    return Job(
        "chat",
        [prompt],
        sampling,
        n=n,
        stream=stream,
        include_usage=include_usage,
        plan=plan,
        in_thought=in_thought,
    )


def completion_prompts(
    body: dict[str, Any], limits: Limits, encode: Any, decode: Any
) -> tuple[list[list[int]], list[str], list[int]]:
    """`prompt` (a string, strings, token ids or lists of them) -> ids and texts.

    A string starts a fresh document as in `minillm sample` (minillm's own: after end-of-text;
    a published model's: `tokenizer(text)`, its BOS included); token ids are taken as they
    are (a client that tokenizes, such as lm-evaluation-harness, decides).
    Returns the ids, the texts to echo and, per prompt, how many leading ids are not echoed.
    """
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "prompt: required", param="prompt", code="missing_required")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)
    ):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise _bad("prompt", "expected a string, an array of strings or of token ids")
    ids, texts, hidden = [], [], []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            ids.append(encode(p))
            texts.append(p)
            hidden.append(limits.lead)
        elif isinstance(p, list) and p and all(_is_id(t) for t in p):
            bad = [t for t in p if not 0 <= t < limits.vocab_size]
            if bad:
                raise _bad(
                    f"prompt[{i}]", f"token id {bad[0]} is outside 0..{limits.vocab_size - 1}"
                )
            ids.append(list(p))
            texts.append(decode(p))
            hidden.append(0)
        else:
            raise _bad(f"prompt[{i}]", "expected a string or a non-empty array of token ids")
    return ids, texts, hidden


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def parse_completion(body: dict[str, Any], limits: Limits, encode: Any, decode: Any) -> Job:
    """A /v1/completions body -> Job; encode(text) / decode(ids) are the tokenizer's."""
    S.check_fields(body, S.COMPLETION_FIELDS)
    _model(body, limits)
    prompts, texts, hidden = completion_prompts(body, limits, encode, decode)
    _unsupported(
        body,
        {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "suffix": ""},
    )
    sampling, explicit = _sampling(body, limits, ("max_tokens",), 0)
    n = _n(body, limits)
    best_of = _get(body, "best_of", int, n)
    if best_of != n:
        raise _bad("best_of", f"only best_of = n ({n}) is supported, got {best_of}")
    logprobs = _get(body, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise _bad("logprobs", f"must be between 0 and {MAX_LOGPROBS}, got {logprobs}")
    echo = _get(body, "echo", bool, False)
    prompt_logprobs = logprobs if echo else None
    sampling = dataclasses.replace(sampling, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    stream, include_usage = _stream(body)
    sampling = _fit(sampling, explicit, prompts, limits, "prompt")
    return Job(
        "completion",
        prompts,
        sampling,
        n=n,
        stream=stream,
        include_usage=include_usage,
        echo=echo,
        prompt_texts=texts,
        hidden=hidden,
    )
