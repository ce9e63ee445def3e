"""OpenAI's response and chunk objects, as `minillm serve` sends them.

Offers `chat_response` and `completion_response` (a whole answer), `chat_chunk` and
`completion_chunk` (one streamed piece), `usage_chunk` (a stream's last piece with
include_usage), `usage`, `new_id`, `now` and `sse` (one server-sent event). The four kinds share
one shape: an envelope (id, object, created, model), choices of {index, <content>, logprobs,
finish_reason}, and system_fingerprint; only the content key differs (message, delta, text).
Key order is kept as OpenAI sends it, so that the JSON bytes are the ones a client expects.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(rid: str, obj: str, model: str, created: int) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model}


def _choice(index: int, content: dict[str, Any], logprobs: Any, finish_reason: Any) -> dict:
    """One choice; `content` is its one content key: message (chat), delta (chat chunk), text."""
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}


def _response(
    rid: str, obj: str, model: str, created: int, choices: list[dict], use: dict[str, int]
) -> dict[str, Any]:
    return {
        **_envelope(rid, obj, model, created),
        "choices": choices,
        "usage": use,
        "system_fingerprint": None,
    }


def _chunk(
    rid: str, obj: str, model: str, created: int, choice: dict, with_usage: bool
) -> dict[str, Any]:
    chunk = {**_envelope(rid, obj, model, created), "choices": [choice], "system_fingerprint": None}
    if with_usage:
        chunk["usage"] = None  # OpenAI: null on every chunk but the last when usage is asked
    return chunk


def chat_response(
    rid: str, model: str, created: int, choices: list[dict[str, Any]], use: dict[str, int]
) -> dict[str, Any]:
    """choices: {index, text or message, finish_reason, logprobs} -> a chat.completion."""
    return _response(
        rid,
        "chat.completion",
        model,
        created,
        [
            _choice(
                c["index"],
                {"message": c.get("message") or {"role": "assistant", "content": c["text"]}},
                c.get("logprobs"),
                c["finish_reason"],
            )
            for c in choices
        ],
        use,
    )


def completion_response(
    rid: str, model: str, created: int, choices: list[dict[str, Any]], use: dict[str, int]
) -> dict[str, Any]:
    """choices: {index, text, finish_reason, logprobs} -> a text_completion object."""
    return _response(
        rid,
        "text_completion",
        model,
        created,
        [
            _choice(c["index"], {"text": c["text"]}, c.get("logprobs"), c["finish_reason"])
            for c in choices
        ],
        use,
    )


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: Any = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    choice = _choice(index, {"delta": delta}, logprobs, finish_reason)
    return _chunk(rid, "chat.completion.chunk", model, created, choice, with_usage)


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: str | None = None,
    logprobs: Any = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    choice = _choice(index, {"text": text}, logprobs, finish_reason)
    return _chunk(rid, "text_completion", model, created, choice, with_usage)


def usage_chunk(rid: str, obj: str, model: str, created: int, use: dict[str, int]) -> dict:
    """The last chunk of a stream with include_usage: no choices, the usage."""
    return {**_envelope(rid, obj, model, created), "choices": [], "usage": use}


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json>` (or `data: [DONE]`) and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"
