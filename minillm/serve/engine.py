"""The engine of `minillm serve`: one thread owns the model and batches requests continuously.

Offers `Choice` (one row to generate), `TokenLogprob`, `Event` (what the engine reports about a
row), `Ticket` (a submitted request: its rows, where events go, a cancel flag), `QueueFull`,
`StopText` (text deltas that never split a character and stop at stop strings) and `Engine`.

The asyncio event loop never runs the model: it submits a Ticket and reads events that the
engine thread hands it. The engine loop, at each step boundary: drops cancelled rows (a client
that went away), admits waiting rows up to `max_batch` (each prefilled alone, so its prompt
costs what it costs alone, and its first token chosen), then advances every active row by one
token in one batched decoder step (`minillm.serve.rows.Rows`). A row that finishes (a stop
token, a stop string, max_tokens) leaves at once and frees its slot. Each row samples with its
own settings and its own generator (`minillm.infer.sampling`), so its tokens are those it gets
alone, to float rounding, whatever else is in the batch. An exception in a row's prefill or
sampling fails that row alone; one in the batched step fails the rows of that step, and the
engine goes on.

Shape legend: B active rows, T prompt tokens, V vocabulary.
"""

from __future__ import annotations

import collections
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from minillm.infer.generate import TextStreamer
from minillm.infer.sampling import sample_next
from minillm.serve.rows import Rows


@dataclass
class Choice:
    """One row to generate: ids to continue and how; nothing of HTTP.

    `hidden` leading prompt ids are not reported with the prompt log-probabilities (the
    end-of-text that starts a fresh document). `prompt_logprobs`: None, or the number of top
    alternatives to report for every prompt token (echo + logprobs).
    """

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    hidden: int = 0


@dataclass
class TokenLogprob:
    """A token, its log-probability under the model (None for a first token without context)
    and the most likely alternatives at its position, (id, logprob) best first."""

    id: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Event:
    """What the engine reports about row `index` of a ticket: new text (maybe empty) and the
    tokens that made it; `finish_reason` ("stop", "length") once, last; or `error`."""

    index: int
    text: str = ""
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt: list[TokenLogprob] | None = None
    error: str | None = None


class QueueFull(Exception):
    """More rows wait than the engine's queue limit: the caller answers 429."""


class Ticket:
    """A submitted request. `sink(event)` is called on the engine thread; `cancel()` from any
    thread makes its rows leave at the next step boundary."""

    def __init__(self, choices: list[Choice], sink: Callable[[Event], None]) -> None:
        self.choices, self.sink = choices, sink
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class StopText:
    """Text deltas of a row: whole characters only (TextStreamer), cut at the first stop string.

    Text that could be the start of a stop string is held back until it is known not to be.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.streamer = TextStreamer(tokenizer)
        self.stop = stop
        self.text = ""  # everything decoded so far
        self.sent = 0  # text[:sent] was released
        self.stopped = False

    def push(self, token: int) -> str:
        self.text += self.streamer.push(token)
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.streamer.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        if self.stop:
            longest = max(len(s) for s in self.stop)
            # A stop string starts in the held-back text: released text never begins one.
            hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)
                self.stopped = True
            elif not final:
                for n in range(min(longest - 1, end - self.sent), 0, -1):
                    tail = self.text[end - n :]
                    if any(s.startswith(tail) for s in self.stop):
                        end -= n
                        break
        out = self.text[self.sent : end]
        self.sent = end
        return out


class _Seq:
    """A row in the engine: its choice, generator, text and progress."""

    def __init__(self, ticket: Ticket, index: int, tokenizer: Any) -> None:
        self.ticket, self.index = ticket, index
        self.choice = c = ticket.choices[index]
        self.generator = None
        if c.temperature > 0:
            seed = c.seed if c.seed is not None else int(torch.randint(0, 2**62, ()).item())
            self.generator = torch.Generator().manual_seed(seed)
        self.text = StopText(tokenizer, c.stop)
        self.generated = 0
        self.pending = -1  # the token chosen last, fed to the model at the next step
        self.done = False

    @property
    def key(self) -> tuple[float, int, float]:
        c = self.choice
        return (c.temperature, c.top_k, c.top_p)


def _logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, top: int, limit: int) -> list:
    """TokenLogprob of each chosen id (N,) from log-probabilities (N, V); `top` alternatives
    among the ids below `limit` (the tokenizer's: a padded table's extra rows are no tokens)."""
    values = logprobs.gather(-1, chosen[:, None])[:, 0].tolist()
    alts: list[list[tuple[int, float]]] = [[] for _ in values]
    if top > 0:
        best = torch.topk(logprobs[:, :limit], min(top, limit), dim=-1)
        alts = [
            list(zip(i, v, strict=True))
            for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        ]
    return [TokenLogprob(t, v, a) for t, v, a in zip(chosen.tolist(), values, alts, strict=True)]


class Engine:
    """The engine thread and its queue (module docstring). `start()`, `submit()`, `close()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_batch: int = 16,
        max_queue: int = 64,
        vocab_limit: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.vocab_limit = vocab_limit or model.cfg.vocab_size
        self.rows = Rows(model, max_batch)
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="minillm-engine", daemon=True)
        self.steps = 0  # batched decoder steps run
        self.generated = 0  # tokens chosen, over all rows (GET /health shows both)

    # ------------------------------------------------------------------ the caller's side

    def start(self) -> None:
        self._thread.start()

    def submit(self, choices: list[Choice], sink: Callable[[Event], None]) -> Ticket:
        """Queue a request's rows; QueueFull when more than max_queue rows would wait."""
        ticket = Ticket(choices, sink)
        with self._cond:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) + len(choices) > self.max_queue:
                raise QueueFull(
                    f"{len(self._waiting)} rows are waiting (the server's limit is "
                    f"{self.max_queue}); retry later"
                )
            self._waiting.extend(_Seq(ticket, i, self.tokenizer) for i in range(len(choices)))
            self._cond.notify()
        return ticket

    def wake(self) -> None:
        """Make an idle engine look at its rows again (a cancel while it waits)."""
        with self._cond:
            self._cond.notify()

    def active(self) -> int:
        return len(self.rows.seqs)

    def waiting(self) -> int:
        return len(self._waiting)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; rows still waiting or active get an error event."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._closing and not self._waiting and not self.rows.seqs:
                        self._cond.wait()
                    if self._closing:
                        break
                    admit = []
                    while self._waiting and len(self.rows.seqs) + len(admit) < self.max_batch:
                        admit.append(self._waiting.popleft())
                    # Cancelled rows still in the queue leave without costing anything.
                    for seq in [s for s in self._waiting if s.ticket.cancelled]:
                        self._waiting.remove(seq)
                try:
                    self.rows.remove([s for s in self.rows.seqs if s.ticket.cancelled])
                    for seq in admit:
                        if not seq.ticket.cancelled:
                            self._admit(seq)
                    if self.rows.seqs:
                        self._step()
                except Exception as e:  # a bug outside one row's work: fail the rows, go on
                    traceback.print_exc()
                    for seq in list(self.rows.seqs):
                        self._fail(seq, f"the engine failed: {type(e).__name__}: {e}")
                    self.rows.remove(list(self.rows.seqs))
        for seq in [*self._waiting, *self.rows.seqs]:
            self._fail(seq, "the server is shutting down")
        self._waiting.clear()
        self.rows.remove(list(self.rows.seqs))

    def _emit(self, seq: _Seq, event: Event) -> None:
        try:
            seq.ticket.sink(event)
        except Exception:  # a sink that fails (its loop closed) must not stop the engine
            seq.ticket.cancel()

    def _fail(self, seq: _Seq, message: str) -> None:
        seq.done = True
        self._emit(seq, Event(seq.index, error=message))

    def _admit(self, seq: _Seq) -> None:
        """Prefill the row alone, report its prompt log-probabilities if asked, choose its first
        token; it joins the batch unless that already ends it."""
        c = seq.choice
        try:
            prompt = None
            if c.prompt_logprobs is not None:
                prompt = self._prompt_logprobs(c)
            if c.max_tokens == 0:
                seq.done = True
                self._emit(seq, Event(seq.index, finish_reason="length", prompt=prompt))
                return
            logits = self.rows.prefill(c.prompt)[None]  # (1, V)
            self._choose([seq], logits, prompt)
            if not seq.done:
                self.rows.add(seq)
        except Exception as e:
            traceback.print_exc()
            self._fail(seq, f"the engine failed on this request: {type(e).__name__}: {e}")

    def _prompt_logprobs(self, c: Choice) -> list[TokenLogprob]:
        """Each prompt token's log-probability given the ones before it: one forward of the
        prompt, as `minillm eval` scores text (the first token has no context: None)."""
        device = next(self.model.parameters()).device
        idx = torch.tensor([c.prompt], dtype=torch.long, device=device)  # (1, P)
        logits, _ = self.model(idx)  # (1, P, V)
        lp = torch.log_softmax(logits[0, :-1].float(), dim=-1)  # (P-1, V)
        rest = _logprobs(lp, idx[0, 1:], c.prompt_logprobs or 0, self.vocab_limit)
        return [TokenLogprob(c.prompt[0], None), *rest][c.hidden :]

    def _step(self) -> None:
        """One batched decoder step for every active row, then each row's next token."""
        seqs = list(self.rows.seqs)
        try:
            logits = self.rows.step()  # (B, V)
        except Exception as e:
            traceback.print_exc()
            for seq in seqs:
                self._fail(seq, f"the engine failed on this request: {type(e).__name__}: {e}")
            self.rows.remove(seqs)
            return
        self.steps += 1
        self._choose(seqs, logits)
        self.rows.remove([s for s in seqs if s.done])

    def _choose(
        self, seqs: list[_Seq], logits: torch.Tensor, prompt: list[TokenLogprob] | None = None
    ) -> None:
        """Sample each row's next token from logits (B, V), grouped by settings, and report it."""
        if self.vocab_limit < logits.shape[-1]:
            logits[:, self.vocab_limit :] = float("-inf")
        groups: dict[tuple[float, int, float], list[int]] = {}
        for r, seq in enumerate(seqs):
            groups.setdefault(seq.key, []).append(r)
        chosen = torch.empty(len(seqs), dtype=torch.long)
        for (temperature, top_k, top_p), rows in groups.items():
            gens = [seqs[r].generator for r in rows] if temperature > 0 else None
            picked = sample_next(logits[rows], temperature, top_k, top_p, gens)
            chosen[rows] = picked.cpu()
        tokens = chosen.tolist()  # the one host sync per step
        want = [r for r, s in enumerate(seqs) if s.choice.logprobs is not None]
        infos: dict[int, TokenLogprob] = {}
        if want:
            lp = torch.log_softmax(logits[want].float(), dim=-1)
            top = max(seqs[r].choice.logprobs or 0 for r in want)
            for r, info in zip(
                want, _logprobs(lp, chosen[want].to(lp.device), top, self.vocab_limit)
            ):
                info.top = info.top[: seqs[r].choice.logprobs]
                infos[r] = info
        for r, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            try:
                self._advance(seq, token, infos.get(r), prompt)
            except Exception as e:
                traceback.print_exc()
                self._fail(seq, f"the engine failed on this request: {type(e).__name__}: {e}")

    def _advance(
        self, seq: _Seq, token: int, info: TokenLogprob | None, prompt: list | None
    ) -> None:
        c = seq.choice
        seq.generated += 1
        self.generated += 1
        seq.pending = token
        reason = None
        if token in c.stop_ids:
            text, reason = seq.text.finish(), "stop"
        else:
            text = seq.text.push(token)
            if seq.text.stopped:
                reason = "stop"
            elif seq.generated >= c.max_tokens:
                text += seq.text.finish()
                reason = "length"
        seq.done = reason is not None
        self._emit(
            seq,
            Event(
                seq.index,
                text=text,
                tokens=[info] if info is not None else [],
                finish_reason=reason,
                completion_tokens=seq.generated,
                prompt=prompt,
            ),
        )
