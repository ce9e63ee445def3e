"""`minillm sample`: continue prompts from a checkpoint on the decoding core.

Offers `read_prompts` (the --prompt and --prompt-file texts), `encode_prompts` (each the start
of a document, as the model's conventions write it) and `sample_checkpoint`, what the command
runs: one row streams its text as it comes; several rows run as one batch and are printed in turn.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from minillm.errors import UserError
from minillm.infer.engine import Engine, Event, Row, SamplingParams
from minillm.infer.grammar import schema_grammar
from minillm.infer.sampling import fresh_seed
from minillm.infer.text_stream import continuation

if TYPE_CHECKING:
    from minillm.tokenizer.conventions import Conventions


def read_prompts(prompts: list[str] | None, prompt_file: Path | None) -> list[str]:
    """The --prompt texts, then the --prompt-file text; an empty prompt is a UserError."""
    texts = list(prompts or [])
    for i, text in enumerate(texts):
        if text == "":
            raise UserError(f"--prompt number {i + 1} is empty (leave --prompt out to start fresh)")
    if prompt_file is not None:
        try:
            text = Path(prompt_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"{prompt_file}: no such prompt file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{prompt_file}: cannot read the prompt file ({e})") from None
        if text == "":
            raise UserError(f"{prompt_file}: the prompt file is empty")
        texts.append(text)
    return texts


def encode_prompts(conv: Conventions, texts: list[str], context: int) -> list[list[int]]:
    """Token ids of each prompt as the start of a document (minillm's own: after end-of-text;
    a published model's: `tokenizer(text)`, its BOS included: minillm.tokenizer.conventions).

    No texts means one prompt of just the document's start. A prompt that fills the context is
    refused.
    """
    if not texts:
        return [conv.empty_prompt()]
    encoded = []
    for i, text in enumerate(texts):
        ids = conv.prompt_ids(text)
        if len(ids) > context:
            raise UserError(
                f"prompt {i + 1} is {len(ids)} tokens (with the document's start); the model's "
                f"context is {context} tokens (model.max_seq_len)"
            )
        encoded.append(ids)
    return encoded


def sample_checkpoint(
    ckpt: Any,
    texts: list[str],
    params: SamplingParams,
    num_samples: int = 1,
    ignore_eos: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
    json_schema: tuple[Path, dict] | None = None,
) -> list[str]:
    """Generate from a LoadedCheckpoint (module docstring); unset settings from its `sample`
    section. Returns the texts without their prompts, row j * num_samples + k being sample k
    of prompt j, each the text its prompt gives alone with the same seed. Every row stops at
    the end of the document (a published model's eos set) unless ignore_eos, or after
    max_new_tokens; past the context it slides, with one note on `err`. Last, one line on `err`:
    the tokens generated, the seconds, tokens/s and the prefill's ms (until the first token)."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {num_samples}")
    tok, model, conv = ckpt.tokenizer, ckpt.model, ckpt.conventions
    params = params.resolve(ckpt.config.sample)
    context = model.cfg.max_seq_len
    prompts = encode_prompts(conv, texts, context)
    if params.seed is None and params.temperature > 0:
        params = dataclasses.replace(params, seed=fresh_seed())
        print(f"seed {params.seed} (pass --seed to repeat this text)", file=err)
    if not ignore_eos:
        params = dataclasses.replace(params, stop_ids=conv.text_stops)
    if json_schema is not None:  # (file, schema): each row's text is a JSON the schema accepts
        where, schema = f"--json-schema {json_schema[0]}", json_schema[1]
        grammar = schema_grammar(schema, tok, params.stop_ids, where)
        params = dataclasses.replace(params, grammar=grammar)
    texts = texts or [""]
    slid: list[Row] = []

    def note(row: Row) -> None:
        if not slid:
            print(
                f"note: the text outgrew the model's context of {context} tokens "
                f"(model.max_seq_len); from here each row sees its last {max(1, context // 2)} to "
                f"{context} tokens (a sliding window)",
                file=err,
            )
        slid.append(row)

    engine = Engine(model, tok, on_slide=note)
    rows = engine.submit(prompts, params, num_samples)
    stream = len(rows) == 1
    if stream:
        out.write(texts[0])
        out.flush()

    first: list[float] = []  # when the first token came: the prefill's end

    def show(event: Event) -> None:
        if not first:
            first.append(time.perf_counter())
        if stream and event.text:
            out.write(event.text)
            out.flush()

    start = time.perf_counter()
    engine.run(show)
    elapsed = time.perf_counter() - start
    results = [continuation(tok, row.prompt, row.tokens) for row in rows]
    if stream:
        out.write("\n")
    else:
        for r, text in enumerate(results):
            if r:
                out.write("\n" + "-" * 40 + "\n")
            out.write(texts[r // num_samples] + text + "\n")
    out.flush()
    n = sum(len(row.tokens) for row in rows)
    prefill_ms = ((first[0] if first else start + elapsed) - start) * 1000
    print(
        f"{n} tokens in {elapsed:.2f} s: {n / max(elapsed, 1e-9):.1f} tokens/s "
        f"(prefill {prefill_ms:.0f} ms)",
        file=err,
    )
    return results
