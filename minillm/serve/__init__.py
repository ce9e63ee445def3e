"""`minillm serve`: an OpenAI-compatible HTTP server with continuous batching and a chat page.

Modules: `protocol` (requests validated into a `Job`, errors), `structured` (the agents' fields:
tools, tool_choice, response_format, chat_template_kwargs), `toolcalls` (the families' tool-call
formats), `reply` (a reply split into reasoning, content and tool-call deltas), `responses`
(OpenAI's response and chunk shapes), `worker` (the engine thread that owns the model and
batches requests), `tokens` (log-probability objects),
`handlers` (a job submitted to the engine, answered whole or streamed), `app` (the FastAPI app:
endpoints, API key, errors), `server` (`serve`, what the command runs: socket, uvicorn, signals)
and `page/index.html` (the chat page at GET /). FastAPI and uvicorn come with the `serve` extra:
`pip install 'minillm[serve]'`.
"""
