"""The engine thread of `minillm serve`: the decoding core (`minillm.infer.engine`) on a thread
of its own, fed from the asyncio event loop.

Offers `Ticket` (a submitted request: its rows, where their events go, a cancel flag),
`QueueFull` and `EngineThread`. The event loop never runs the model: it submits a Ticket and
reads the events that the engine thread hands its sink, one call per event. The thread takes
new tickets at each step boundary and runs `Engine.step()` while any row is in flight; the
core does the batching, the sampling, the stops and the failures of single rows.
"""

from __future__ import annotations

import collections
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

from minillm.infer.engine import Engine, Event, Row, SamplingParams


class QueueFull(Exception):
    """More rows wait than the engine's queue limit: the caller answers 429."""


class Ticket:
    """A submitted request: n samples of each prompt. `sink(event)` is called on the engine
    thread; `cancel()` from any thread makes its rows leave at the next step boundary."""

    def __init__(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        sink: Callable[[Event], None],
    ) -> None:
        self.prompts, self.params, self.n, self.sink = prompts, params, n, sink
        self.rows: list[Row] = []  # once the engine took it: row j * n + i is choice j * n + i
        self.index: dict[int, int] = {}  # id(row) -> its choice index
        self.cancelled = False

    def __len__(self) -> int:
        return len(self.prompts) * self.n

    def cancel(self) -> None:
        self.cancelled = True


class EngineThread:
    """The engine and its thread (module docstring): `start()`, `submit()`, `close()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_batch: int = 16,
        max_queue: int = 64,
    ) -> None:
        self.engine = Engine(model, tokenizer, max_batch=max_batch)
        self.max_batch, self.max_queue = max_batch, max_queue
        self._incoming: collections.deque[Ticket] = collections.deque()
        self._tickets: list[Ticket] = []  # taken by the engine, rows still in flight
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="minillm-engine", daemon=True)

    @property
    def steps(self) -> int:
        return self.engine.steps

    @property
    def generated(self) -> int:
        return self.engine.generated

    def start(self) -> None:
        self._thread.start()

    def submit(
        self, prompts: list[list[int]], params: SamplingParams, n: int, sink: Callable
    ) -> Ticket:
        """Queue a request's rows; QueueFull when more than max_queue rows would wait."""
        ticket = Ticket(prompts, params, n, sink)
        with self._cond:
            if self._closing:
                raise QueueFull("the server is shutting down")
            waiting = self.waiting()
            if waiting + len(ticket) > self.max_queue:
                raise QueueFull(
                    f"{waiting} rows are waiting (the server's limit is {self.max_queue}); "
                    "retry later"
                )
            self._incoming.append(ticket)
            self._cond.notify()
        return ticket

    def wake(self) -> None:
        """Make an idle engine look at its rows again (a cancel while it waits)."""
        with self._cond:
            self._cond.notify()

    def active(self) -> int:
        return len(self.engine.active)

    def waiting(self) -> int:
        return len(self.engine.waiting) + sum(len(t) for t in self._incoming)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; rows still waiting or active get an error event."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._closing and not self._incoming and not engine.busy():
                    self._cond.wait()
                if self._closing:
                    break
                new, self._incoming = list(self._incoming), collections.deque()
            for ticket in new:
                self._take(ticket)
            for ticket in self._tickets:
                if ticket.cancelled:
                    for row in ticket.rows:
                        engine.cancel(row)
            try:
                events = engine.step()
            except Exception as e:  # a bug outside one row's work: fail every row, go on
                traceback.print_exc()
                events = engine.abort(f"the engine failed: {type(e).__name__}: {e}")
            for event in events:
                self._emit(event)
            self._tickets = [t for t in self._tickets if not all(r.done for r in t.rows)]
        for ticket in self._incoming:
            self._take(ticket)
        for event in engine.abort("the server is shutting down"):
            self._emit(event)

    def _take(self, ticket: Ticket) -> None:
        """The ticket's rows go to the engine (they start at its next step)."""
        ticket.rows = self.engine.submit(ticket.prompts, ticket.params, ticket.n, ticket)
        ticket.index = {id(row): i for i, row in enumerate(ticket.rows)}
        self._tickets.append(ticket)

    def _emit(self, event: Event) -> None:
        ticket: Ticket = event.row.tag
        if ticket.cancelled and event.error is None:
            return  # nobody is listening
        try:
            ticket.sink(event)
        except Exception:  # a sink that fails (its loop closed) must not stop the engine
            ticket.cancel()
