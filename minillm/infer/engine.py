"""The decoding core: every generation in minillm runs here (sample, chat, eval --task, serve).

Offers `SamplingParams` (how a request is continued; the run's `sample` section fills what it
leaves unset), `TokenLogprob`, `Row` (one sequence in flight), `Event` (what a step did to a
row), `Engine` (the loop) and `generate` (prompts in, tokens out: the engine run to the end).

    engine = Engine(model, tokenizer)
    rows = engine.submit([prompt_ids], params, n=4)   # 4 samples of one prompt, queued
    while engine.busy():
        for event in engine.step():                    # one token for every active row
            ...event.row, event.text, event.finish_reason...

Each `step()` first lets go of cancelled rows, then admits waiting rows (up to `max_batch`):
each is prefilled alone into its own row of the KV cache (identical prompts of one admission
are prefilled once and copied), which also gives the prompt's log-probabilities when asked
(echo). Then one batched decoder forward advances every row that was already active by its
last token, each at its own position. Every row then draws its next token with its own settings
and its own generator, so a row's tokens do not depend on what else is in the batch (to float
rounding). A row leaves when it emits a stop id, its text reaches a stop string, it has
max_new_tokens, or it is cancelled; the last active row moves into its place, so rows 0..n-1
are always the active ones. A row whose text outgrows the context slides: that row alone is
refilled with its last `window_length` tokens. An exception in one row's prefill fails that row;
one in the batched forward fails the rows of that step; the engine goes on (`Event.error`).

Seeds: sample k of a request seeded s draws from `row_seed(s, k)`, k counting the earlier
samples of the same prompt in one `submit` (so `--num-samples`, the API's `n` and a repeated
prompt all differ, and a prompt's text does not depend on its place in the batch).

Shape legend: n active rows, P prompt tokens, V vocabulary.
"""

from __future__ import annotations

import collections
import dataclasses
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from minillm.config.schema import SampleConfig
from minillm.infer.grammar import Grammar, Masks, RowGrammar
from minillm.infer.sampling import (
    TokenLogprob,
    check_sampling,
    fresh_seed,
    row_seed,
    sample_next,
    token_logprobs,
)
from minillm.infer.text_stream import StopText
from minillm.model import KVCache
from minillm.model.decode import Decoder, layer_weights
from minillm.runtime.device import one_row_threads, threads


@dataclass(frozen=True)
class SamplingParams:
    """How one request is continued. None for the first four: the run's `sample` section."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # None: fresh randomness for every row
    stop_ids: frozenset[int] = frozenset()  # e.g. end-of-text or <|end|>; kept in the tokens
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    logprobs: int | None = None  # report each new token's log-probability and top alternatives
    prompt_logprobs: int | None = None  # also each prompt token's (echo), from the prefill
    # The generated text decoded on its own, as `tokenizer.decode(reply)` (a chat reply), not as
    # the prompt's continuation (a sentencepiece reply's first space: minillm.infer.text_stream).
    text_alone: bool = False
    # A grammar the text must follow (minillm.infer.grammar: a JSON schema, forced tool calls):
    # each row gets its own matcher and its logits a mask, so other rows of a batch stay free.
    grammar: Grammar | None = None

    @classmethod
    def greedy(cls, max_new_tokens: int, **settings: Any) -> SamplingParams:
        """Greedy decoding of up to max_new_tokens tokens, nothing left to a default."""
        return cls(max_new_tokens, 0.0, 0, 1.0, **settings)

    def resolve(self, defaults: SampleConfig) -> SamplingParams:
        """Unset settings from `defaults`; settings out of range are a UserError naming them."""
        pick = {
            name: getattr(defaults, name) if getattr(self, name) is None else getattr(self, name)
            for name in ("max_new_tokens", "temperature", "top_k", "top_p")
        }
        out = dataclasses.replace(
            self,
            max_new_tokens=int(pick["max_new_tokens"]),
            temperature=float(pick["temperature"]),
            top_k=int(pick["top_k"]),
            top_p=float(pick["top_p"]),
        )
        check_sampling(out.temperature, out.top_k, out.top_p, out.max_new_tokens)
        return out


class Row:
    """One sequence: its prompt, settings, generator and what it has generated so far."""

    def __init__(
        self, prompt: list[int], params: SamplingParams, k: int, tokenizer: Any, tag: Any
    ) -> None:
        self.prompt, self.params, self.k, self.tag = prompt, params, k, tag
        self.tokens: list[int] = []  # generated, a stop id included
        self.generator = None
        if params.temperature:  # uniforms on the CPU: a seed gives the same text on any device
            seed = fresh_seed() if params.seed is None else row_seed(params.seed, k)
            self.generator = torch.Generator().manual_seed(seed)
        context = () if params.text_alone else prompt
        self.text = StopText(tokenizer, params.stop, context) if tokenizer is not None else None
        self.finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
        self.cancelled = False
        self.cached = 0  # tokens of this row's window in the KV cache
        self.grammar: RowGrammar | None = params.grammar.start() if params.grammar else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Event:
    """What one step did to `row`: its new token (with `logprob` if asked) and the text it
    completes (maybe empty); `finish_reason` once, last; `prompt` on the first event with
    prompt_logprobs; or `error` (then `exception` is what was raised)."""

    row: Row
    token: int | None = None
    text: str = ""
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    prompt: list[TokenLogprob] | None = None
    error: str | None = None
    exception: BaseException | None = None


def window_length(n: int, context: int) -> int:
    """How many of the last tokens of a row's n-token text the model sees for the next token.

    All n while they fit the context. Past it the context slides like nanoGPT's crop, but in
    jumps so that the row is refilled rarely: the window restarts at the last context // 2
    tokens and grows by one per token back up to the full context, then restarts again. It is a
    function of n alone, so a row sees the same windows whatever shares its batch.
    """
    if n <= context:
        return n
    keep = max(1, context // 2)
    return keep + (n - context - 1) % (context - keep + 1)


class Engine:
    """The decoding loop over a model (module docstring). Not thread-safe: one caller steps it
    (`minillm serve` runs it on its engine thread)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        max_batch: int | None = None,
        vocab_limit: int | None = None,
        on_slide: Callable[[Row], None] | None = None,
        decoder: Callable[[torch.nn.Module, KVCache], Any] = Decoder,
    ) -> None:
        """tokenizer: for the rows' text (None: tokens only, no stop strings). vocab_limit:
        never choose ids >= it (the tokenizer's size: a padded embedding table's extra rows).
        on_slide(row): a row's text outgrew the context. decoder: the stepper (tests: a mock's).
        A model with dropout must be in eval mode."""
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        param = next(model.parameters())
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.context = model.cfg.max_seq_len
        if vocab_limit is None and tokenizer is not None:
            vocab_limit = tokenizer.get_vocab_size()
        self.vocab_limit = min(vocab_limit or model.cfg.vocab_size, model.cfg.vocab_size)
        self.on_slide = on_slide
        self.cache = KVCache(model.cfg, device=param.device, dtype=param.dtype)
        self.decoder = decoder(model, self.cache)
        self.device = param.device
        fp32 = param.dtype == torch.float32 and getattr(model, "quantized", None) is None
        self.step_threads = one_row_threads(self.device, layer_weights(model.cfg), fp32)
        self.active: list[Row] = []  # row i lives in row i of the cache
        self.waiting: collections.deque[Row] = collections.deque()
        self.masks = Masks(overlap=self.device.type != "cpu")  # grammar rows' token masks
        self.steps = 0  # batched forwards run
        self.generated = 0  # tokens chosen, over all rows

    # ------------------------------------------------------------------ the caller's side

    def submit(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1, tag: Any = None
    ) -> list[Row]:
        """Queue n samples of each prompt (row j * n + i is sample i of prompt j); settings
        must be resolved. The rows start at the next step."""
        unset = [
            k
            for k in ("max_new_tokens", "temperature", "top_k", "top_p")
            if getattr(params, k) is None
        ]
        if unset:
            raise ValueError(f"SamplingParams without {unset}: resolve them first (.resolve)")
        for p in prompts:
            if not 1 <= len(p) <= self.context:
                raise ValueError(f"a prompt of {len(p)} tokens for a context of {self.context}")
        rows, seen = [], collections.Counter()
        for prompt in prompts:
            for _ in range(n):
                key = tuple(prompt)
                rows.append(Row(list(prompt), params, seen[key], self.tokenizer, tag))
                seen[key] += 1
        self.waiting.extend(rows)
        return rows

    def cancel(self, row: Row) -> None:
        """The row leaves at the next step (from any thread: it only sets a flag)."""
        row.cancelled = True

    def abort(self, message: str) -> list[Event]:
        """Every row in flight or waiting fails with `message` (a server shutting down)."""
        rows = [*self.active, *self.waiting]
        self.waiting.clear()
        self._leave(self.active, None)
        self.cache.release()
        for row in rows:
            row.finish_reason = "error"
        return [Event(row, error=message, finish_reason="error") for row in rows]

    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    def run(self, on_event: Callable[[Event], None] | None = None) -> None:
        """Step until every row has finished, for in-process callers: a row's error is raised.
        on_event(event) sees each event as it comes (streaming)."""
        while self.busy():
            for event in self.step():
                if event.exception is not None:
                    raise event.exception
                if on_event is not None:
                    on_event(event)

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Cancelled rows leave, waiting rows join, every row gets one token (module docstring)."""
        events: list[Event] = []
        for row in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(row)
            row.finish_reason = "cancelled"
        self._leave([r for r in self.active if r.cancelled], "cancelled")
        stepping = list(self.active)
        chosen: list[Row] = []
        logits: list[torch.Tensor] = []
        masks = self.masks.start([r.grammar for r in stepping])  # computed beside the forward
        if stepping:
            try:
                logits.append(self._forward(stepping))  # (n, V)
                chosen += stepping
                self.steps += 1
            except Exception as e:
                traceback.print_exc()
                events += self._fail(stepping, e)
        prompts = self._admit(events, chosen, logits)
        if chosen:
            events += self._choose(chosen, torch.cat(logits), prompts, masks)
        self._leave([r for r in self.active if r.done], None)
        if not self.active:
            self.cache.release()  # nothing in flight: hold no memory for it
        return events

    def _forward(self, rows: list[Row]) -> torch.Tensor:
        """One batched decoder step: each row's last token at its own position; rows whose
        text outgrew the context are first refilled with their window, alone."""
        for i, row in enumerate(rows):
            w = window_length(len(row.prompt) + len(row.tokens), self.context)
            if w != row.cached + 1:  # the window restarts: refill the row without its last token
                if self.on_slide is not None:
                    self.on_slide(row)
                text = (row.prompt + row.tokens)[-w:-1]
                if text:
                    self.decoder.prefill(i, torch.tensor(text, device=self.device))
                else:
                    self.cache.clear_row(i)
            row.cached = w
        last = torch.tensor([row.tokens[-1] for row in rows], device=self.device)
        with threads(self.step_threads if len(rows) == 1 else None):
            return self.decoder.step(last)

    def _admit(
        self, events: list[Event], chosen: list[Row], logits: list[torch.Tensor]
    ) -> dict[int, list[TokenLogprob]]:
        """Prefill waiting rows into new cache rows; their next-token logits join `logits`.
        Returns the prompt log-probabilities of rows that asked, by id(row)."""
        prompts: dict[int, list[TokenLogprob]] = {}
        filled: dict[tuple[int, ...], tuple[int, torch.Tensor, list | None]] = {}
        while self.waiting and (self.max_batch is None or len(self.active) < self.max_batch):
            row = self.waiting.popleft()
            want = row.params.prompt_logprobs
            if row.params.max_new_tokens == 0 and want is None:  # nothing to compute
                row.finish_reason = "length"
                events.append(Event(row, finish_reason="length"))
                continue
            i = self.cache.add_rows(1)  # the cache holds the active rows and this one
            key = (*row.prompt, -1 if want is None else want)
            try:
                if key in filled:  # the same prompt in this admission: copy its row
                    src, last, prompt = filled[key]
                    self.cache.move_row(src, i)
                else:
                    ids = torch.tensor(row.prompt, device=self.device)
                    out = self.decoder.prefill(i, ids, want is not None)  # (P, V) or (V,)
                    prompt = None if want is None else self._prompt_logprobs(row, out)
                    last = out if want is None else out[-1]
            except Exception as e:
                traceback.print_exc()
                self.cache.pop_row()
                events += self._fail([row], e)
                continue
            if row.params.max_new_tokens == 0:  # echo only: the prompt's numbers, no token
                self.cache.pop_row()
                row.finish_reason = "length"
                events.append(Event(row, finish_reason="length", prompt=prompt))
                continue
            filled[key] = (i, last, prompt)
            row.cached = len(row.prompt)
            self.active.append(row)
            if prompt is not None:
                prompts[id(row)] = prompt
            chosen.append(row)
            logits.append(last[None])
        return prompts

    def _prompt_logprobs(self, row: Row, logits: torch.Tensor) -> list[TokenLogprob]:
        """Each prompt token's log-probability given the ones before it, from the prefill's
        logits (P, V): the numbers `minillm eval` gives the same text. The first has none."""
        ids = torch.tensor(row.prompt[1:], device=logits.device)
        rest = token_logprobs(logits[:-1], ids, row.params.prompt_logprobs or 0, self.vocab_limit)
        return [TokenLogprob(row.prompt[0], None), *rest]

    def _choose(
        self,
        rows: list[Row],
        logits: torch.Tensor,
        prompts: dict[int, list[TokenLogprob]],
        masks: Any = None,
    ) -> list[Event]:
        """Each row's next token from logits (n, V), drawn in groups of equal settings."""
        if self.vocab_limit < logits.shape[-1]:
            logits[:, self.vocab_limit :] = float("-inf")
        self.masks.apply([r.grammar for r in rows], logits, masks, self.vocab_limit)
        groups: dict[tuple, list[int]] = collections.defaultdict(list)
        for i, row in enumerate(rows):
            p = row.params
            groups[(p.temperature, p.top_k, p.top_p)].append(i)
        if len(groups) == 1:  # the common case (one caller's rows): no gather, no scatter
            (temperature, top_k, top_p), _ = groups.popitem()
            gens = [row.generator for row in rows] if temperature > 0 else None
            picked = sample_next(logits, temperature, top_k, top_p, gens).cpu()
        else:
            picked = torch.empty(len(rows), dtype=torch.long)
            for (temperature, top_k, top_p), idx in groups.items():
                gens = [rows[i].generator for i in idx] if temperature > 0 else None
                picked[idx] = sample_next(logits[idx], temperature, top_k, top_p, gens).cpu()
        want = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        infos: dict[int, TokenLogprob] = {}
        if want:
            top = max(rows[i].params.logprobs or 0 for i in want)
            lp = token_logprobs(logits[want], picked[want], top, self.vocab_limit)
            for i, info in zip(want, lp, strict=True):
                info.top = info.top[: rows[i].params.logprobs]
                infos[i] = info
        events = []
        for i, (row, token) in enumerate(zip(rows, picked.tolist(), strict=True)):  # one sync
            event = self._advance(row, token)
            event.logprob, event.prompt = infos.get(i), prompts.get(id(row))
            events.append(event)
        return events

    def _advance(self, row: Row, token: int) -> Event:
        """Append the token; the stop rules, written once for every caller."""
        row.tokens.append(token)
        self.generated += 1
        p, text, reason = row.params, "", None
        if row.grammar is not None:
            row.grammar.advance(token)
            if row.grammar.error is not None:
                row.finish_reason = "error"
                return Event(row, token, error=row.grammar.error, finish_reason="error")
        if token in p.stop_ids:
            reason = "stop"
            text = row.text.finish() if row.text is not None else ""
        else:
            if row.text is not None:
                text = row.text.push(token)
                reason = "stop" if row.text.stopped else None
            if reason is None and row.grammar is not None and row.grammar.finished:
                reason = "stop"  # the grammar ended the text (a JSON value, a forced tool call)
                text += row.text.finish() if row.text is not None else ""
            if reason is None and len(row.tokens) >= p.max_new_tokens:
                reason = "length"
                text += row.text.finish() if row.text is not None else ""
        row.finish_reason = reason
        return Event(row, token, text, finish_reason=reason)

    def _fail(self, rows: list[Row], e: Exception) -> list[Event]:
        message = f"the engine failed on this request: {type(e).__name__}: {e}"
        for row in rows:
            row.finish_reason = "error"
        return [Event(row, error=message, finish_reason="error", exception=e) for row in rows]

    def _leave(self, rows: Iterable[Row], reason: str | None) -> None:
        """These rows leave the batch; the last active row moves into each freed place."""
        gone = {id(r) for r in rows}
        i = 0
        while i < len(self.active):
            row = self.active[i]
            if id(row) not in gone:
                i += 1
                continue
            if reason is not None:
                row.finish_reason = reason
            last = len(self.active) - 1
            self.cache.move_row(last, i)
            self.active[i] = self.active[last]
            self.active.pop()
            self.cache.pop_row()


def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    tokenizer: Any = None,
    n: int = 1,
    on_event: Callable[[Event], None] | None = None,
    **engine_options: Any,
) -> list[list[int]]:
    """The new tokens of n samples of each prompt (row j * n + i: sample i of prompt j), run to
    the end on a fresh Engine; params resolved. An error in a row is raised."""
    engine = Engine(model, tokenizer, **engine_options)
    rows = engine.submit(prompts, params, n)
    engine.run(on_event)
    return [row.tokens for row in rows]
