"""`minillm serve`: an OpenAI-compatible HTTP server with continuous batching and a chat page.

Modules: `protocol` (request validation, OpenAI's response and chunk shapes, errors), `engine`
(the engine thread that owns the model and batches requests), `rows` (the engine's KV-cache
rows at different lengths), `tokens` (log-probability objects), `app` (the FastAPI app and
`serve`, what the command runs) and `page/index.html` (the chat page at GET /). FastAPI and
uvicorn come with the `serve` extra: `pip install 'minillm[serve]'`.
"""
