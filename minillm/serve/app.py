"""The FastAPI app of `minillm serve` and the function that runs it under uvicorn.

Offers `create_app(ckpt, name, ...)` (the endpoints over one `Engine`) and `serve(...)`, what the
command runs: bind, print the URL and the model's name, serve until Ctrl-C or SIGTERM, then
finish the requests in flight (a few seconds at most) and stop the engine.

Endpoints (OpenAI's shapes, see `minillm.serve.protocol`): GET /v1/models, GET /health,
POST /v1/chat/completions, POST /v1/completions, GET / (the chat page). Handlers only parse,
submit to the engine and turn its events into responses: the model runs on the engine's thread,
never on the event loop. A client that goes away cancels its rows (streams: when the response is
cancelled; plain requests: checked while they wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.resources
import json
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.data.chat import chat_ids, encode_prompt
from minillm.data.tokenizer import eot_id
from minillm.errors import UserError
from minillm.infer.sampling import row_seed
from minillm.serve import protocol as P
from minillm.serve.engine import Choice, Engine, Event, QueueFull
from minillm.serve.tokens import TokenText

MAX_BODY = 1 << 20  # bytes of a request body (a full context of text is far less)
OPEN_PATHS = ("/health", "/")  # the page is static; it sends the key with its API calls


def _choices(job: P.Job, stop_id: int) -> list[Choice]:
    """One Choice per (prompt, sample): choice j * n + k is sample k of prompt j.

    Seeds as the CLI draws them, so that a request with `seed` gives the text the command gives
    with `--seed`: `minillm sample` gives sample k of a prompt row_seed(seed, k) (k counting
    earlier rows with the same prompt), `minillm chat` its first reply row_seed(seed, 0), which
    `generate` then mixes again as its row 0."""
    s = job.sampling
    out, seen = [], {}
    for j, prompt in enumerate(job.prompts):
        for k in range(job.n):
            seed = None
            if s.seed is not None:
                if job.kind == "chat":
                    seed = row_seed(row_seed(s.seed, k), 0)
                else:
                    occurrence = seen.get(tuple(prompt), 0)
                    seen[tuple(prompt)] = occurrence + 1
                    seed = row_seed(s.seed, occurrence)
            out.append(
                Choice(
                    prompt=prompt,
                    max_tokens=s.max_tokens,
                    temperature=s.temperature,
                    top_k=s.top_k,
                    top_p=s.top_p,
                    seed=seed,
                    stop_ids=frozenset([stop_id]),
                    stop=s.stop,
                    logprobs=s.logprobs,
                    prompt_logprobs=s.logprobs if job.prompt_logprobs else None,
                    hidden=job.hidden[j] if job.hidden else 0,
                )
            )
    return out


class _Server:
    """The state behind the endpoints: the model's tokenizer, limits and engine."""

    def __init__(
        self, ckpt: Any, name: str, engine: Engine, max_body: int, api_key: str | None
    ) -> None:
        self.name, self.engine, self.max_body = name, engine, max_body
        self.api_key = api_key.encode() if api_key else None
        self.tok = ckpt.tokenizer
        self.tok.encode_special_tokens = True  # "<|end|>" typed in a message is text
        self.eot = eot_id(self.tok)
        try:
            self.chat_ids: dict[str, int] | None = chat_ids(self.tok)
        except UserError:
            self.chat_ids = None  # a tokenizer from before the chat tokens: completions only
        cfg = ckpt.config
        self.limits = P.Limits(
            model=name,
            context=cfg.model.max_seq_len,
            vocab_size=self.tok.get_vocab_size(),
            max_n=engine.max_batch,
            default_max_tokens=cfg.sample.max_new_tokens,
            default_temperature=cfg.sample.temperature,
            default_top_k=cfg.sample.top_k,
            default_top_p=cfg.sample.top_p,
        )
        self.text = TokenText(self.tok)
        self.created = P.now()
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
        if self.chat_ids is None:
            raise P.APIError(
                400,
                f"`{self.name}` has no chat template (its tokenizer lacks the chat tokens): "
                "use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        return encode_prompt(self.tok, messages, self.chat_ids)

    def encode_text(self, text: str) -> list[int]:
        """A string prompt is a fresh document, after end-of-text, as in `minillm sample`."""
        return [self.eot, *self.tok.encode(text, add_special_tokens=False).ids]

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

    def submit(self, job: P.Job) -> tuple[Any, asyncio.Queue]:
        self._loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:  # on the engine thread
            self._deliver(queue, event)

        stop_id = self.chat_ids["end"] if job.kind == "chat" and self.chat_ids else self.eot
        try:
            ticket = self.engine.submit(_choices(job, stop_id), sink)
        except QueueFull as e:
            raise P.APIError(
                429, str(e), code="rate_limit_exceeded", type_="rate_limit_error"
            ) from None
        return ticket, queue

    def cancel(self, ticket: Any) -> None:
        ticket.cancel()
        self.engine.wake()

    def prompt_tokens(self, job: P.Job) -> int:
        return sum(len(p) for p in job.prompts)

    # ------------------------------------------------------------------ plain responses

    async def complete(self, request: Request, job: P.Job) -> dict[str, Any]:
        """Wait for every choice; the OpenAI object. A client gone meanwhile cancels them."""
        ticket, queue = self.submit(job)
        n = len(ticket.choices)
        texts, reasons = [""] * n, [None] * n
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
                i = event.index
                texts[i] += event.text
                tokens[i] += event.tokens
                if event.prompt is not None:
                    prompts[i] = event.prompt
                used[i] = max(used[i], event.completion_tokens)
                reasons[i] = event.finish_reason
        finally:
            self.cancel(ticket)  # a no-op for rows that finished
        rid, use = P.new_id("chatcmpl" if job.kind == "chat" else "cmpl"), None
        use = P.usage(self.prompt_tokens(job), sum(used))
        choices = []
        for i in range(n):
            c = {"index": i, "text": texts[i], "finish_reason": reasons[i], "logprobs": None}
            if job.kind == "chat" and job.sampling.logprobs is not None:
                c["logprobs"] = {"content": self.text.chat_logprobs(tokens[i])}
            elif job.kind == "completion":
                c.update(self._completion_choice(job, i, texts[i], tokens[i], prompts[i]))
            choices.append(c)
        build = P.chat_response if job.kind == "chat" else P.completion_response
        return build(rid, self.name, P.now(), choices, use)

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

    async def _events(self, job: P.Job, ticket: Any, queue: asyncio.Queue) -> AsyncIterator[str]:
        chat = job.kind == "chat"
        rid, created = P.new_id("chatcmpl" if chat else "cmpl"), P.now()
        n = len(ticket.choices)
        used = [0] * n
        data = [b""] * n  # completions with logprobs: each choice's bytes so far (offsets)
        shown = [0] * n  # characters sent per choice
        started = [False] * n  # completions with echo: the prompt was sent
        wu = job.include_usage

        def chunk(i: int, text: str = "", reason: str | None = None, lp: Any = None, **d: Any):
            if chat:
                delta = dict(d)
                if text:
                    delta["content"] = text
                return P.sse(P.chat_chunk(rid, self.name, created, i, delta, reason, lp, wu))
            return P.sse(P.completion_chunk(rid, self.name, created, i, text, reason, lp, wu))

        try:
            if chat:
                for i in range(n):
                    yield chunk(i, role="assistant", content="")
            left = n
            while left:
                event = await queue.get()
                if event.error is not None:
                    error = P.APIError(500, event.error, type_="server_error")
                    yield P.sse(error.body())
                    break
                i = event.index
                used[i] = max(used[i], event.completion_tokens)
                lp = None
                if job.echo and not started[i]:  # the echoed prompt first, in its own chunk
                    started[i] = True
                    echo, plp = job.prompt_texts[i // job.n], None
                    if job.sampling.logprobs is not None:
                        plp, data[i] = self.text.completion_logprobs(event.prompt or [], 0)
                    if echo or plp is not None:
                        yield chunk(i, echo, lp=plp)
                    shown[i] = len(echo)
                if job.sampling.logprobs is not None and event.tokens:
                    if chat:
                        lp = {"content": self.text.chat_logprobs(event.tokens)}
                    else:
                        lp, data[i] = self.text.completion_logprobs(event.tokens, shown[i], data[i])
                if event.text or lp is not None:
                    yield chunk(i, event.text, lp=lp)
                    shown[i] += len(event.text)
                if event.finish_reason is not None:
                    left -= 1
                    yield chunk(i, reason=event.finish_reason)
            else:  # every choice finished (no error): the usage, if asked
                if job.include_usage:
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    use = P.usage(self.prompt_tokens(job), sum(used))
                    yield P.sse(P.usage_chunk(rid, obj, self.name, created, use))
            yield P.sse("[DONE]")
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


def _error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(
    ckpt: Any,
    name: str,
    *,
    api_key: str | None = None,
    max_batch: int = 16,
    max_queue: int = 64,
    max_body: int = MAX_BODY,
    on_stop: Callable[[], None] | None = None,
) -> FastAPI:
    """The app serving a LoadedCheckpoint as model `name`; its engine runs while the app does
    (on_stop is called once it has stopped)."""
    engine = Engine(
        ckpt.model,
        ckpt.tokenizer,
        max_batch=max_batch,
        max_queue=max_queue,
        vocab_limit=ckpt.tokenizer.get_vocab_size(),
    )
    server = _Server(ckpt, name, engine, max_body, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.close()
            if on_stop is not None:
                on_stop()

    app = FastAPI(title="minillm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        if server.api_key is not None and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            scheme, _, key = given.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                key.strip().encode(), server.api_key
            )
            if not ok:
                return _error_response(
                    P.APIError(
                        401,
                        "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                        code="invalid_api_key",
                    )
                )
        return await call_next(request)

    @app.exception_handler(P.APIError)
    async def api_error(request: Request, e: P.APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return _error_response(P.APIError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        message = f"internal error: {type(e).__name__}: {e}"
        return _error_response(P.APIError(500, message, type_="server_error"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": name,
            "active": engine.active(),
            "waiting": engine.waiting(),
            "steps": engine.steps,
            "generated_tokens": engine.generated,
        }

    def model_card() -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": server.created,
            "owned_by": "minillm",
            "max_model_len": server.limits.context,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict[str, Any]:
        if model != name:
            raise P.APIError(404, f"The model `{model}` does not exist", "model", "model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        job = P.parse_chat(await server.body(request), server.limits, server.encode_chat)
        return await server.stream(job) if job.stream else await server.complete(request, job)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        job = P.parse_completion(
            await server.body(request), server.limits, server.encode_text, server.tok.decode
        )
        return await server.stream(job) if job.stream else await server.complete(request, job)

    page = importlib.resources.files("minillm.serve").joinpath("page/index.html").read_text("utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page

    return app


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, or a UserError naming --host/--port (before the slow startup)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror})") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(
    ckpt: Any,
    name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_batch: int = 16,
    max_queue: int = 64,
) -> None:
    """What `minillm serve` runs (module docstring); returns after a clean shutdown."""
    import uvicorn

    if max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {max_batch}")
    if max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {max_queue}")
    sock = _bind(host, port)
    app = create_app(
        ckpt,
        name,
        api_key=api_key,
        max_batch=max_batch,
        max_queue=max_queue,
        # Printed here: after a signal uvicorn re-raises it once shut down, which ends us.
        on_stop=lambda: print("server stopped", file=sys.stderr, flush=True),
    )
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    device = next(ckpt.model.parameters()).device
    print(
        f"serving model {json.dumps(name)} ({ckpt.path}) on {device} at http://{shown}:{bound}\n"
        f"  OpenAI API: http://{shown}:{bound}/v1   chat page: http://{shown}:{bound}/\n"
        f"  up to {max_batch} requests at once"
        + ("; API key required" if api_key else "")
        + "; Ctrl-C stops",
        flush=True,
    )
    torch.set_grad_enabled(False)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
