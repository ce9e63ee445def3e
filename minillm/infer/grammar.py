"""Constrained decoding: a grammar's token mask for a row of the decoding core.

Offers `GrammarError` (a schema or grammar the engine cannot compile, naming the keyword),
`read_schema` and `schema_grammar` (--json-schema FILE of `minillm sample` and `chat`),
`Grammar` (a compiled grammar for one tokenizer; `lazy_trigger` switches it on at a token, as
llama-server's lazy grammars do for tool calls), `json_schema_grammar`, `json_object_grammar`,
`lark_grammar`, `RowGrammar` (one row's matcher: its mask, the tokens it consumes),
`fill_masks` (the masks of a batch's rows) and `Masks` (the engine's: computed on a worker thread
while the forward runs on a GPU; after it on the CPU, whose cores the model's threads use).

The engine is llguidance (docs/design.md, "Serving", says why it and not xgrammar): it reads a
tokenizer.json as it is, so every tokenizer minillm loads is one it takes; a mask costs tens of
microseconds per token, on the CPU, at any vocabulary size measured, and a schema compiles in a
few milliseconds (scripts/bench_grammar.py).
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minillm.errors import UserError

# Compact JSON: what a client parses is the same either way, and a random model under a mask that
# allows free whitespace spends its tokens on it.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(UserError):
    """A schema or grammar the engine cannot compile; the message names what it refused."""


_TOKENIZERS: dict[tuple[int, tuple[int, ...]], tuple[Any, Any]] = {}


def grammar_tokenizer(tokenizer: Any, stop_ids: Iterable[int]) -> Any:
    """llguidance's view of a `tokenizers.Tokenizer`; the grammar's end admits `stop_ids`.
    Kept per tokenizer object: building it serializes and reads the whole vocabulary."""
    import llguidance

    key = (id(tokenizer), tuple(sorted(stop_ids)))
    if key not in _TOKENIZERS:
        if len(_TOKENIZERS) >= 8:
            _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
        built = llguidance.LLTokenizer(tokenizer.to_str(), eos_token=list(key[1]))
        _TOKENIZERS[key] = (tokenizer, built)  # the tokenizer kept alive: its id stays its own
    return _TOKENIZERS[key][1]


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of the JSON texts that validate against `schema`."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"not a JSON schema: {e}") from None


def read_schema(path: Path) -> dict[str, Any]:
    """A JSON schema file (`--json-schema FILE`), or a UserError naming the file."""
    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"--json-schema {path}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"--json-schema {path}: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise UserError(f"--json-schema {path}: a JSON schema is an object, got {type(schema)}")
    return schema


def schema_grammar(schema: dict[str, Any], tokenizer: Any, stop_ids: Iterable[int], where: str):
    """The compiled grammar of `schema` for a `tokenizers.Tokenizer` (`minillm sample` and `chat`
    with --json-schema); a schema the engine refuses is a UserError naming `where`."""
    try:
        return Grammar.compile(grammar_tokenizer(tokenizer, stop_ids), json_schema_grammar(schema))
    except GrammarError as e:
        raise UserError(f"{where}: the grammar engine cannot compile it: {e}") from None


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's `json_object` response format)."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(text: str) -> str:
    """A grammar written in llguidance's Lark (`%json {...}` embeds a schema)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


def schema_lark(schema: dict[str, Any]) -> str:
    """`schema` as a Lark rule's body: `%json {...}`."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


@dataclass(frozen=True, eq=False)
class Grammar:
    """A grammar compiled for one tokenizer. With `lazy_trigger` a row is free until it emits
    that token; the grammar then holds for what follows, and the row is free again once it
    ends (a tool call inside free text)."""

    tokenizer: Any  # llguidance.LLTokenizer (grammar_tokenizer)
    prototype: Any  # llguidance.LLMatcher at the grammar's start, copied for each row
    lazy_trigger: int | None = None

    @classmethod
    def compile(cls, tokenizer: Any, grammar: str, lazy_trigger: int | None = None) -> Grammar:
        """Compile `grammar` (json_schema_grammar, lark_grammar) or raise GrammarError with the
        engine's words (an unsupported keyword is named there)."""
        import llguidance

        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return cls(tokenizer, matcher, lazy_trigger)

    def start(self) -> RowGrammar:
        return RowGrammar(self)


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "the grammar engine refused it"


class RowGrammar:
    """One row's place in its grammar: `active` while the mask applies (always, unless lazy and
    not yet triggered), `advance(token)` after each token, `finished` once a grammar that is not
    lazy has ended (the row stops there), `error` if a token broke it."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.matcher = grammar.prototype.deep_copy()
        self.active = grammar.lazy_trigger is None
        self.finished = False
        self.error: str | None = None

    def advance(self, token: int) -> None:
        if not self.active:
            if token == self.grammar.lazy_trigger:
                self.active = True
            return
        if not self.matcher.consume_token(token):
            why = _first_line(self.matcher.get_error())
            self.error = f"the grammar refused token {token}: {why}"
            return
        if self.matcher.is_stopped():
            if self.grammar.lazy_trigger is None:
                self.finished = True
            else:  # the call ended: free text again, until the next trigger
                self.matcher = self.grammar.prototype.deep_copy()
                self.active = False


def fill_masks(rows: list[RowGrammar], vocab: int) -> torch.Tensor:
    """Allowed tokens (len(rows), vocab) as booleans. One row at a time on the calling thread:
    the engine's parallel executor measured slower here, its threads taking the cores that the
    model's threads wait for (docs/benchmarks.md, constrained decoding)."""
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    bits = allocate_token_bitmask(len(rows), vocab)
    for i, r in enumerate(rows):
        fill_next_token_bitmask(r.matcher, bits, i)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(rows), -1)  # (n, 32 * W)
    return allowed[:, :vocab]


class Masks:
    """The token masks of a batch's grammar rows: `start` them on a worker thread before the
    forward, `apply` them to its logits after (rows admitted meanwhile computed then). With
    `overlap` off (a model on the CPU, whose threads the worker would take) all at `apply`."""

    def __init__(self, overlap: bool = True) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.overlap = overlap

    def start(self, grammars: list[RowGrammar | None]) -> Any:
        """The masks of the rows whose grammar is active, begun; None if none is."""
        ruled = [g for g in grammars if g is not None and g.active]
        if not ruled or not self.overlap:
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "minillm-grammar")
        return ruled, self._pool.submit(fill_masks, ruled, ruled[0].grammar.tokenizer.vocab_size)

    def apply(
        self, grammars: list[RowGrammar | None], logits: torch.Tensor, started: Any, vocab: int
    ) -> None:
        """Tokens below `vocab` that row i's grammar refuses get -inf in logits (n, V)."""
        done: dict[int, torch.Tensor] = {}
        if started is not None:
            ruled, future = started
            done = {id(g): m for g, m in zip(ruled, future.result(), strict=True)}
        late = [g for g in grammars if g is not None and g.active and id(g) not in done]
        if late:
            masks = fill_masks(late, late[0].grammar.tokenizer.vocab_size)
            done |= {id(g): m for g, m in zip(late, masks, strict=True)}
        if not done:
            return
        # One mask over the whole batch and one masked_fill: a list index into logits (advanced
        # indexing) measured 20 ms at 8 rows on a busy 2-core CPU, a whole-tensor op 0.02 ms.
        keep = torch.ones(logits.shape, dtype=torch.bool)
        for i, g in enumerate(grammars):
            if g is not None and id(g) in done:
                allowed = done[id(g)]
                width = min(vocab, allowed.shape[0], logits.shape[1])
                keep[i, :width] = allowed[:width]
                keep[i, width:] = False  # past the grammar's vocabulary: no tokens
        logits.masked_fill_(~keep.to(logits.device), float("-inf"))
