"""A chat reply's text split as vLLM splits it: reasoning, content and tool calls.

Offers `ReplySplitter`: `push(text)` takes the reply's next piece and returns the deltas it
completes (`{"reasoning_content": ...}`, `{"content": ...}`, `{"tool_calls": [...]}`, OpenAI's
chunk shapes); `finish()` returns the rest; `message()` the whole reply as one message. The
stream and the whole reply come from the same pieces, so a client that joins the deltas gets the
message. Text that may be the start of a marker (`</think>`, `<tool_call>`) is held back until
the next piece says whether it is, so a partial marker never reaches `content`; a Hermes call's
arguments go out in fragments as they are written (`ToolFormat.open_call`).
"""

from __future__ import annotations

from typing import Any

from minillm.serve.toolcalls import ToolCall, ToolFormat

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _held(text: str, marker: str, space: str = "") -> int:
    """How many characters at the end of `text` to hold back: a proper start of `marker`, and
    the characters of `space` before it (dropped if the marker follows)."""
    held = 0
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            held = k
            break
    body = text[: len(text) - held]
    return held + len(body) - len(body.rstrip(space)) if space else held


class ReplySplitter:
    """One choice's reply, split as it comes (module docstring). `thinking`: the template has
    think blocks; `in_thought`: the prompt opened one (DeepSeek-R1's `<think>\\n`), so the reply
    starts in reasoning. `tools`: the format whose calls to parse (None: none are)."""

    def __init__(
        self, tools: ToolFormat | None, thinking: bool, in_thought: bool, parallel: bool = True
    ) -> None:
        self.tools, self.parallel = tools, parallel
        self.state = "reasoning" if in_thought else ("start" if thinking else "content")
        self.pending = ""  # text not yet sent: a marker's possible start, or calls in progress
        self.calls: list[ToolCall] = []
        self.sent_calls = 0
        self.streamed: dict[int, str] = {}  # per call index: the arguments sent so far
        self.started_content = False
        self.cut = ""
        self.reasoning, self.content = "", ""

    # ------------------------------------------------------------------ the pieces

    def push(self, text: str) -> list[dict[str, Any]]:
        """The deltas that `text`, the reply's next piece, completes."""
        self.pending += text
        return self._advance(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of whatever was held back, at the end of the reply."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            before = (self.state, len(self.pending))
            if self.state == "start":
                self._start(final)
            if self.state == "reasoning":
                out += self._reasoning(final)
            if self.state == "content":
                out += self._content(final)
            if self.state == "calls":
                out += self._calls(final)
            if (self.state, len(self.pending)) == before:
                return [d for d in out if d]

    def _start(self, final: bool) -> None:
        """A reply opens with `<think>` or not (held while it may)."""
        head = self.pending.lstrip()
        if head.startswith(THINK_OPEN):
            self.pending = head[len(THINK_OPEN) :]
            self.state = "reasoning"
        elif final or not THINK_OPEN.startswith(head):
            self.state = "content"

    def _reasoning(self, final: bool) -> list[dict[str, Any]]:
        text, found, after = self.pending.partition(THINK_CLOSE)
        if found:
            self.pending, self.state = after.lstrip("\n"), "content"
        else:
            keep = 0 if final else _held(text, THINK_CLOSE, "\n")
            text, self.pending = text[: len(text) - keep], text[len(text) - keep :]
        if not self.reasoning:
            text = text.lstrip("\n")
        if found:
            text = text.rstrip("\n")
        self.reasoning += text
        return [{"reasoning_content": text}] if text else []

    def _content(self, final: bool) -> list[dict[str, Any]]:
        fmt = self.tools
        if fmt is not None and not self.started_content and fmt.bare_json:
            head = self.pending.lstrip()
            if head.startswith("{"):
                self.pending, self.state = head, "calls"
                return []
            if not head and not final:
                return []
        if fmt is None:
            text, self.pending = self.pending, ""
        else:
            text, found, after = self.pending.partition(fmt.trigger)
            if found:
                self.pending, self.state = after, "calls"
                self.cut = text[len(text.rstrip()) :]  # given back if no calls follow
            else:
                keep = 0 if final else _held(text, fmt.trigger, " \n\t")
                text, self.pending = text[: len(text) - keep], text[len(text) - keep :]
            if found or final:
                text = text.rstrip() if self.calls or found else text
        if not self.started_content:
            text = text.lstrip("\n") if self.reasoning else text
        if not text:
            return []
        self.started_content = True
        self.content += text
        return [{"content": text}]

    def _calls(self, final: bool) -> list[dict[str, Any]]:
        """Whole calls are sent, and the one being written so far (Hermes, name first)."""
        assert self.tools is not None
        calls, whole = self.tools.parse_calls(self.pending, final)
        if final and not whole and not calls:  # not calls after all: the text is content
            text, self.pending, self.state = self.pending, "", "done"
            trigger = "" if self.tools.bare_json and text.startswith("{") else self.tools.trigger
            text = self.cut + trigger + text
            self.content += text
            return [{"content": text}]
        if not self.parallel:
            calls = calls[:1]
        out = []
        for i in range(self.sent_calls, len(calls)):
            out += self._send(i, calls[i].name, calls[i].arguments)
            self.calls.append(calls[i])
        self.sent_calls = len(calls)
        opened = None if final else self.tools.open_call(self.pending)
        if opened is not None and (self.parallel or not calls):
            out += self._send(self.sent_calls, *opened)  # the call being written, so far
        if final:
            self.pending, self.state = "", "done"
        return out

    def _send(self, i: int, name: str, arguments: str) -> list[dict[str, Any]]:
        """Call i's deltas not yet sent: its id, type and name once, then what its arguments
        have grown by (a Hermes call streams them as they come; the others whole)."""
        out = []
        if self.streamed.get(i) is None:
            head = {"name": name, "arguments": ""}
            call = {"index": i, "id": self.tools.call_id(), "type": "function", "function": head}
            out.append({"tool_calls": [call]})
            self.streamed[i] = ""
        sent = self.streamed[i]
        if arguments.startswith(sent) and len(arguments) > len(sent):
            part = {"index": i, "function": {"arguments": arguments[len(sent) :]}}
            out.append({"tool_calls": [part]})
            self.streamed[i] = arguments
        return out


def join_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's assistant message from a reply's deltas (what a streaming client assembles)."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for part in d.get("tool_calls", []):
            call = calls.setdefault(
                part["index"],
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            call["id"] = part.get("id", call["id"])
            function = part.get("function", {})
            call["function"]["name"] += function.get("name", "")
            call["function"]["arguments"] += function.get("arguments", "")
    if content or not calls:
        message["content"] = content
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if reasoning:
        message["reasoning_content"] = reasoning
    return message
