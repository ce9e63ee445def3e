"""What the endpoints of `minillm serve` do with a request once it is parsed into a `Job`.

Offers `Handler`: the served model's tokenizer, limits and engine; it encodes prompts, submits a
job's rows to the engine thread (the decoding core seeds them as it seeds the CLI's), and
answers with the whole OpenAI object (`complete`) or a stream of server-sent chunks
(`stream`). The model runs on the engine's thread, never on the event loop; events cross to
the loop in batches, one wake-up per step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from minillm.errors import UserError
from minillm.infer.engine import Event
from minillm.infer.grammar import Grammar, grammar_tokenizer
from minillm.serve import protocol as P
from minillm.serve import responses as R
from minillm.serve.reply import ReplySplitter, join_deltas
from minillm.serve.structured import Plan
from minillm.serve.tokens import TokenText
from minillm.serve.toolcalls import ToolFormat, tool_format
from minillm.serve.worker import EngineThread, QueueFull, Ticket
from minillm.tokenizer.bpe import special_tokens
from minillm.tokenizer.conventions import PublishedConventions
from minillm.tokenizer.jinja_chat import render


class Handler:
    """The state behind the endpoints: the model's tokenizer, limits and engine."""

    def __init__(
        self, ckpt: Any, name: str, engine: EngineThread, max_body: int, api_key: str | None
    ) -> None:
        self.name, self.engine, self.max_body = name, engine, max_body
        self.api_key = api_key.encode() if api_key else None
        self.tok, self.conv = ckpt.tokenizer, ckpt.conventions
        # A chat reply stops where `minillm chat`'s does; a completion where `minillm sample`'s.
        self.stops = {"completion": self.conv.text_stops, "chat": self.conv.stop_ids}
        # A `stop` string that names a special token stops at that token (which has no text).
        ids = {t: self.tok.token_to_id(t) for t in special_tokens(self.tok)}
        self.special = {t: i for t, i in ids.items() if i is not None}
        cfg = ckpt.config
        self.limits = P.Limits(
            model=name,
            context=cfg.model.max_seq_len,
            vocab_size=self.tok.get_vocab_size(),
            max_n=engine.max_batch,
            defaults=cfg.sample,
            lead=len(self.conv.prompt_ids("")),
        )
        self.text = TokenText(self.conv)
        self.created = R.now()
        self._lock = threading.Lock()
        self._outbox: list[tuple[asyncio.Queue, Event]] = []
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ requests

    async def body(self, request: Request) -> dict[str, Any]:
        """The JSON body, refused with 413 past max_body bytes before it is all read."""
        length = request.headers.get("content-length", "")
        too_big = P.APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_body} bytes",
            code="request_too_large",
        )
        if length.isdigit() and int(length) > self.max_body:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise too_big
            chunks.append(chunk)
        return P.parse_json(b"".join(chunks))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.conv.has_chat:
            raise P.APIError(
                400,
                f"`{self.name}` has no chat template: use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        try:
            return self.conv.chat_ids(messages, add_generation_prompt=True)
        except UserError as e:  # the template refused the conversation (a role order)
            raise P.APIError(400, str(e), param="messages", code="invalid_messages") from None

    # ------------------------------------------------------------------ agents (structured)

    def tool_format(self) -> ToolFormat:
        """The template's tool-call format (a UserError naming why there is none)."""
        return tool_format(self.conv.template)

    def token_id(self, text: str) -> int | None:
        """The id of `text` where it is one token of the vocabulary."""
        return self.tok.token_to_id(text)

    def compile(self, grammar: str, lazy_trigger: int | None = None) -> Grammar:
        """A grammar for this tokenizer; its end admits a chat reply's stop tokens."""
        return Grammar.compile(
            grammar_tokenizer(self.tok, self.stops["chat"]), grammar, lazy_trigger
        )

    @property
    def thinking(self) -> bool:
        """The template writes think blocks (Qwen3, DeepSeek-R1): replies carry reasoning."""
        return bool(self.conv.template) and "</think>" in self.conv.template

    def render_chat(self, messages: list[dict[str, Any]], plan: Plan) -> tuple[list[int], bool]:
        """The prompt's ids through the template, with the plan's tools and variables; and
        whether it ends inside an open think block (the reply starts as reasoning)."""
        agentic = any(m["role"] == "tool" or "tool_calls" in m for m in messages)
        if not (plan.tools or plan.extra or agentic):
            ids = self.encode_chat(messages)
            if not self.thinking:
                return ids, False
            text = self.tok.decode(ids[-8:], skip_special_tokens=False)
            return ids, text.rstrip().endswith("<think>")
        if not isinstance(self.conv, PublishedConventions):  # minillm's own: no variables
            field = "chat_template_kwargs" if plan.extra else "messages"
            raise P.APIError(
                400,
                f"{field}: minillm's own chat template has no tools, tool messages or variables",
                param=field,
            )
        if not self.conv.has_chat:
            return self.encode_chat(messages), False  # the 400 that says so
        try:
            # apply_chat_template(messages, tools=..., **chat_template_kwargs), as the template
            # of a published model is rendered everywhere (minillm.tokenizer.jinja_chat).
            text, _ = render(
                self.conv.template, messages, True, self.conv.special, plan.tools, plan.extra
            )
        except UserError as e:
            raise P.APIError(400, str(e), param="messages", code="invalid_messages") from None
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ids, self.thinking and text.rstrip().endswith("<think>")

    def splitter(self, job: P.Job) -> ReplySplitter | None:
        """The reply's splitter for a chat job with tool calls or think blocks (None: the text
        is all content)."""
        if job.kind != "chat" or not (job.plan.format or self.thinking):
            return None
        return ReplySplitter(job.plan.format, self.thinking, job.in_thought, job.plan.parallel)

    def piece(self, job: P.Job, event: Event) -> str:
        """The event's text as the splitter reads it: a trigger that is a special token (whose
        text decoding drops) is written out."""
        fmt = job.plan.format
        if fmt is not None and event.token is not None and event.token == self.trigger_of(fmt):
            return event.text + fmt.trigger
        return event.text

    def trigger_of(self, fmt: ToolFormat) -> int | None:
        token = self.token_id(fmt.trigger)
        return token if token in self.special.values() else None

    def encode_text(self, text: str) -> list[int]:
        """A string prompt is a fresh document, as in `minillm sample`."""
        return self.conv.prompt_ids(text)

    def _deliver(self, queue: asyncio.Queue, event: Event) -> None:
        """On the engine thread: hand the event to the loop. Events of one step (one per row)
        go over in one wake-up of the loop, not one each."""
        with self._lock:
            self._outbox.append((queue, event))
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch, self._outbox, self._scheduled = self._outbox, [], False
        for queue, event in batch:
            queue.put_nowait(event)

    def submit(self, job: P.Job) -> tuple[Ticket, asyncio.Queue]:
        self._loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:  # on the engine thread
            self._deliver(queue, event)

        named = {self.special[s] for s in job.sampling.stop if s in self.special}
        params = dataclasses.replace(
            job.sampling,
            stop_ids=self.stops[job.kind] | named,
            stop=tuple(s for s in job.sampling.stop if s not in self.special),
        )
        try:
            ticket = self.engine.submit(job.prompts, params, job.n, sink)
        except QueueFull as e:
            raise P.APIError(
                429, str(e), code="rate_limit_exceeded", type_="rate_limit_error"
            ) from None
        return ticket, queue

    @staticmethod
    def _hidden(job: P.Job, i: int) -> int:
        """Leading prompt ids of choice i not echoed (a text prompt's end-of-text)."""
        return job.hidden[i // job.n] if job.hidden else 0

    def cancel(self, ticket: Ticket) -> None:
        ticket.cancel()
        self.engine.wake()

    def prompt_tokens(self, job: P.Job) -> int:
        return sum(len(p) for p in job.prompts)

    # ------------------------------------------------------------------ plain responses

    async def complete(self, request: Request, job: P.Job) -> dict[str, Any]:
        """Wait for every choice; the OpenAI object. A client gone meanwhile cancels them."""
        ticket, queue = self.submit(job)
        n = len(ticket)
        texts, reasons = [""] * n, [None] * n
        splits = [self.splitter(job) for _ in range(n)]
        deltas: list[list] = [[] for _ in range(n)]
        tokens: list[list] = [[] for _ in range(n)]
        prompts: list[Any] = [None] * n
        used = [0] * n
        try:
            while any(r is None for r in reasons):
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError() from None
                    continue
                if event.error is not None:
                    raise P.APIError(500, event.error, type_="server_error")
                i = ticket.index[id(event.row)]
                texts[i] += event.text
                if splits[i] is not None:
                    deltas[i] += splits[i].push(self.piece(job, event))
                tokens[i] += [event.logprob] if event.logprob is not None else []
                if event.prompt is not None:
                    prompts[i] = event.prompt[self._hidden(job, i) :]
                used[i] = len(event.row.tokens)
                reasons[i] = event.finish_reason
        finally:
            self.cancel(ticket)  # a no-op for rows that finished
        rid, use = R.new_id("chatcmpl" if job.kind == "chat" else "cmpl"), None
        use = R.usage(self.prompt_tokens(job), sum(used))
        choices = []
        for i in range(n):
            c = {"index": i, "text": texts[i], "finish_reason": reasons[i], "logprobs": None}
            if splits[i] is not None:
                c["message"] = join_deltas(deltas[i] + splits[i].finish())
                if splits[i].calls and reasons[i] == "stop":
                    c["finish_reason"] = "tool_calls"
            if job.kind == "chat" and job.sampling.logprobs is not None:
                c["logprobs"] = {"content": self.text.chat_logprobs(tokens[i])}
            elif job.kind == "completion":
                c.update(self._completion_choice(job, i, texts[i], tokens[i], prompts[i]))
            choices.append(c)
        build = R.chat_response if job.kind == "chat" else R.completion_response
        return build(rid, self.name, R.now(), choices, use)

    def _completion_choice(
        self, job: P.Job, i: int, text: str, tokens: list, prompt: list | None
    ) -> dict[str, Any]:
        """A completion choice's text (the prompt first with echo) and legacy logprobs."""
        echo = job.prompt_texts[i // job.n] if job.echo else ""
        out: dict[str, Any] = {"text": echo + text}
        if job.sampling.logprobs is not None:
            infos = (prompt or []) + tokens if job.echo else tokens
            out["logprobs"], _ = self.text.completion_logprobs(infos, 0)
        return out

    # ------------------------------------------------------------------ streams

    async def stream(self, job: P.Job) -> StreamingResponse:
        ticket, queue = self.submit(job)  # a full queue is a 429 before the stream starts
        return StreamingResponse(
            _coalesce(self._events(job, ticket, queue), queue),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(self, job: P.Job, ticket: Ticket, queue: asyncio.Queue) -> AsyncIterator[str]:
        chat = job.kind == "chat"
        rid, created = R.new_id("chatcmpl" if chat else "cmpl"), R.now()
        n = len(ticket)
        used = [0] * n
        data = [b""] * n  # completions with logprobs: each choice's bytes so far (offsets)
        shown = [0] * n  # characters sent per choice
        started = [False] * n  # completions with echo: the prompt was sent
        splits = [self.splitter(job) for _ in range(n)]
        wu = job.include_usage

        def chunk(i: int, text: str = "", reason: str | None = None, lp: Any = None, **d: Any):
            if chat:
                delta = dict(d)
                if text:
                    delta["content"] = text
                return R.sse(R.chat_chunk(rid, self.name, created, i, delta, reason, lp, wu))
            return R.sse(R.completion_chunk(rid, self.name, created, i, text, reason, lp, wu))

        try:
            if chat:
                for i in range(n):
                    yield chunk(i, role="assistant", content="")
            left = n
            while left:
                event = await queue.get()
                if event.error is not None:
                    error = P.APIError(500, event.error, type_="server_error")
                    yield R.sse(error.body())
                    break
                i = ticket.index[id(event.row)]
                used[i] = len(event.row.tokens)
                lp = None
                if job.echo and not started[i]:  # the echoed prompt first, in its own chunk
                    started[i] = True
                    echo, plp = job.prompt_texts[i // job.n], None
                    if job.sampling.logprobs is not None:
                        shown_prompt = (event.prompt or [])[self._hidden(job, i) :]
                        plp, data[i] = self.text.completion_logprobs(shown_prompt, 0)
                    if echo or plp is not None:
                        yield chunk(i, echo, lp=plp)
                    shown[i] = len(echo)
                if job.sampling.logprobs is not None and event.logprob is not None:
                    if chat:
                        lp = {"content": self.text.chat_logprobs([event.logprob])}
                    else:
                        lp, data[i] = self.text.completion_logprobs(
                            [event.logprob], shown[i], data[i]
                        )
                split = splits[i]
                if split is not None:  # reasoning, content and tool calls, each its own delta
                    deltas = split.push(self.piece(job, event)) or ([{}] if lp is not None else [])
                    for k, delta in enumerate(deltas):  # the token's logprobs with its first
                        yield chunk(i, lp=lp if k == 0 else None, **delta)
                elif event.text or lp is not None:
                    yield chunk(i, event.text, lp=lp)
                    shown[i] += len(event.text)
                if event.finish_reason is not None:
                    left -= 1
                    reason = event.finish_reason
                    if split is not None:
                        for delta in split.finish():
                            yield chunk(i, **delta)
                        reason = "tool_calls" if split.calls and reason == "stop" else reason
                    yield chunk(i, reason=reason)
            else:  # every choice finished (no error): the usage, if asked
                if job.include_usage:
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    use = R.usage(self.prompt_tokens(job), sum(used))
                    yield R.sse(R.usage_chunk(rid, obj, self.name, created, use))
            yield R.sse("[DONE]")
        finally:  # also when the client went away and the response was cancelled
            self.cancel(ticket)


async def _coalesce(events: AsyncIterator[str], queue: asyncio.Queue) -> AsyncIterator[str]:
    """The SSE events, those already ready sent together: one write per batch, not per event."""
    ready: list[str] = []
    async for event in events:
        ready.append(event)
        if queue.empty():
            yield "".join(ready)
            ready.clear()
    if ready:
        yield "".join(ready)
