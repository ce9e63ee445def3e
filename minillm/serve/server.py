"""The process `minillm serve` runs: bind the socket, print where it listens, run uvicorn.

Offers `bind` (the listening socket; `minillm serve` binds before loading the checkpoint) and
`serve(...)`, what the command runs: check the limits, bind (a bad --host or --port is one
error line, before the slow startup), print the URL and the model's name, serve the app of
`minillm.serve.app` until Ctrl-C or SIGTERM, then finish the requests in flight (a few seconds at
most) and stop the engine.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

import torch

from minillm.errors import UserError
from minillm.runtime.cpus import default_num_proc
from minillm.serve.app import create_app


def bind(host: str, port: int) -> socket.socket:
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
    sock: socket.socket | None = None,
) -> None:
    """What `minillm serve` runs (module docstring); returns after a clean shutdown. `sock`:
    the socket `bind` made before the checkpoint loaded (None: bound here)."""
    import uvicorn

    if max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {max_batch}")
    if max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {max_queue}")
    sock = sock if sock is not None else bind(host, port)
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
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Leave a core to the event loop: torch's intra-op workers spin while they wait, so on
        # a machine with few cores they starve the loop (and each other under load). On 2 cores
        # one thread measured 1.2x the tokens/s of two, alone and at 8 streams.
        # The CPUs this process may use (affinity and container quota), not the host's count.
        torch.set_num_threads(max(1, default_num_proc() - 1))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
