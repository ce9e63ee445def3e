"""`minillm serve`: an OpenAI-compatible HTTP server with continuous batching and a chat page.

Modules: `protocol` (requests validated into a `Job`, errors), `responses` (OpenAI's response
and chunk shapes), `engine` (the engine thread that owns the model and batches requests), `rows`
(the engine's KV-cache rows at different lengths), `tokens` (log-probability objects),
`handlers` (a job submitted to the engine, answered whole or streamed), `app` (the FastAPI app:
endpoints, API key, errors), `server` (`serve`, what the command runs: socket, uvicorn, signals)
and `page/index.html` (the chat page at GET /). FastAPI and uvicorn come with the `serve` extra:
`pip install 'minillm[serve]'`.
"""
