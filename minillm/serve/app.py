"""The FastAPI app of `minillm serve`: `create_app(ckpt, name, ...)`, the endpoints over one
`EngineThread` (the decoding core on its thread; the process that runs it is
`minillm.serve.server`).

Endpoints (OpenAI's shapes, see `minillm.serve.protocol` and `minillm.serve.responses`): GET
/v1/models, GET /health, POST /v1/chat/completions, POST /v1/completions, GET / (the chat page).
Endpoints only parse and hand the job to a `Handler` (`minillm.serve.handlers`), which submits
it to the engine and turns its events into responses. A client that goes away cancels its rows
(streams: when the response is cancelled; plain requests: checked while they wait). Every
refusal, also the API key's and the router's, is OpenAI's error object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import importlib.resources
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.serve import protocol as P
from minillm.serve.handlers import Handler
from minillm.serve.worker import EngineThread

MAX_BODY = 1 << 20  # bytes of a request body (a full context of text is far less)
OPEN_PATHS = ("/health", "/")  # the page is static; it sends the key with its API calls


def _error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class _Authorize:
    """ASGI middleware: every path but OPEN_PATHS wants `Authorization: Bearer KEY` (401).

    Plain ASGI, not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware relays every
    streamed chunk through an extra task and memory stream, a cost per SSE event."""

    def __init__(self, app: Any, key: bytes) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "")
            scheme, _, key = given.partition(" ")
            if not (
                scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.key)
            ):
                error = P.APIError(
                    401,
                    "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                    code="invalid_api_key",
                )
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
    engine = EngineThread(ckpt.model, ckpt.tokenizer, max_batch=max_batch, max_queue=max_queue)
    handler = Handler(ckpt, name, engine, max_body, api_key)

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
    app.state.handler = handler

    if handler.api_key is not None:
        app.add_middleware(_Authorize, key=handler.api_key)

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
            "created": handler.created,
            "owned_by": "minillm",
            "max_model_len": handler.limits.context,
            # The run's sample section, the defaults of a request that leaves a key out: the
            # chat page shows them (an extra key, as vLLM's max_model_len; clients ignore it).
            "sample": dataclasses.asdict(handler.limits.defaults),
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
        body = await handler.body(request)
        job = P.parse_chat(body, handler.limits, handler.encode_chat, handler)
        return await handler.stream(job) if job.stream else await handler.complete(request, job)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        job = P.parse_completion(
            await handler.body(request), handler.limits, handler.encode_text, handler.tok.decode
        )
        return await handler.stream(job) if job.stream else await handler.complete(request, job)

    page = importlib.resources.files("minillm.serve").joinpath("page/index.html").read_text("utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page

    return app
