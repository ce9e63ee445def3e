"""`minillm sample`: continue prompts from a checkpoint on the decoding core.

Offers `read_prompts` (the --prompt and --prompt-file texts), `encode_prompts` (each a fresh
document, after end-of-text) and `sample_checkpoint`, what the command runs: one row streams its
text as it comes; several rows run as one batch and are printed in turn.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, TextIO

from minillm.data.tokenizer import eot_id
from minillm.errors import UserError
from minillm.infer.engine import Engine, Event, Row, SamplingParams
from minillm.infer.sampling import fresh_seed


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


def encode_prompts(tokenizer: Any, texts: list[str], eot: int, context: int) -> list[list[int]]:
    """Token ids of each prompt after an end-of-text token: every sample is a fresh document.

    No texts means one prompt of just end-of-text. A prompt that fills the context is refused.
    """
    if not texts:
        return [[eot]]
    encoded = []
    for i, text in enumerate(texts):
        ids = [eot, *tokenizer.encode(text, add_special_tokens=False).ids]
        if len(ids) > context:
            raise UserError(
                f"prompt {i + 1} is {len(ids)} tokens (with the leading end-of-text); the model's "
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
) -> list[str]:
    """Generate from a LoadedCheckpoint (module docstring); unset settings from its `sample`
    section. Returns the texts without their prompts, row j * num_samples + k being sample k
    of prompt j, each the text its prompt gives alone with the same seed. Every row stops at
    end-of-text (unless ignore_eos) or after max_new_tokens; past the context it slides, with
    one note on `err`."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {num_samples}")
    tok, model = ckpt.tokenizer, ckpt.model
    # A prompt quoting "<|endoftext|>" means the text, not a document boundary (as in the shards).
    tok.encode_special_tokens = True
    eot = eot_id(tok)
    params = params.resolve(ckpt.config.sample)
    context = model.cfg.max_seq_len
    prompts = encode_prompts(tok, texts, eot, context)
    if params.seed is None and params.temperature > 0:
        params = dataclasses.replace(params, seed=fresh_seed())
        print(f"seed {params.seed} (pass --seed to repeat this text)", file=err)
    if not ignore_eos:
        params = dataclasses.replace(params, stop_ids=frozenset([eot]))
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

    def show(event: Event) -> None:
        if stream and event.text:
            out.write(event.text)
            out.flush()

    engine.run(show)
    results = [tok.decode(row.tokens) for row in rows]
    if stream:
        out.write("\n")
    else:
        for r, text in enumerate(results):
            if r:
                out.write("\n" + "-" * 40 + "\n")
            out.write(texts[r // num_samples] + text + "\n")
    out.flush()
    return results
