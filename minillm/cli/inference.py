"""The commands that use a checkpoint in this process: `minillm eval` (loss, perplexity, bits
per byte, task scores), `minillm sample` (text) and `minillm chat` (a conversation)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from minillm.cli.command import Command, print_error, run
from minillm.cli.options import (
    CkptChoice,
    TemperatureOption,
    TopKOption,
    TopPOption,
    ckpt_options,
)
from minillm.cli.root import app
from minillm.errors import UserError

EVAL_HELP = (
    "Loss (nats/token), perplexity and bits per byte of a checkpoint, over the run's validation "
    "shards (data.out_dir/val_*.bin) or over --data FILE, tokenized with the run's tokenizer.\n\n"
    "A .txt file is one document (no special tokens added); a .jsonl, .json, .parquet or .csv "
    "file is read as `minillm tokenize` reads it (--text-field, default the run's "
    "data.text_field; chat rows through the chat template), documents joined by end-of-text.\n\n"
    "Every token after the first is predicted exactly once: windows of T tokens start at 0, "
    "T, 2T, ...; a window's inputs are tokens i .. i+T-1 and its targets tokens i+1 .. i+T, and "
    "the last window is shorter, read at its own length (no padding). T is --seq-len, default "
    "the run's train.seq_len (a Hugging Face folder's: its context, max_position_embeddings); "
    "a text shorter than T is one window of its own length. Bits per byte = total NLL / ln 2 / "
    "UTF-8 bytes of the text; with --max-tokens, the bytes are scaled by the share of tokens "
    "evaluated."
)


@app.command(
    "eval",
    cls=Command,
    help=EVAL_HELP,
    short_help="Loss, perplexity and bits per byte of a checkpoint.",
)
@ckpt_options
def eval_(
    ckpt: CkptChoice,
    data: Path | None = typer.Option(
        None,
        "--data",
        metavar="FILE",
        help="A text file (.txt: one document) or a dataset file (.jsonl, .json, .parquet, "
        ".csv) instead of the validation shard.",
    ),
    text_field: str | None = typer.Option(
        None,
        "--text-field",
        metavar="NAME",
        help="The text column of a --data dataset file (default: the run's data.text_field).",
    ),
    max_tokens: int | None = typer.Option(
        None,
        "--max-tokens",
        metavar="N",
        help="Predict at most N tokens (the first N+1 of the data).",
    ),
    seq_len: int | None = typer.Option(
        None,
        "--seq-len",
        metavar="N",
        help="Window length in tokens (default: the run's train.seq_len; a Hugging Face "
        "folder's context). Past model.max_seq_len the context is raised to N (plain RoPE "
        "extrapolates unless --set model.rope_scaling.*).",
    ),
    batch_size: int | None = typer.Option(
        None,
        "--batch-size",
        metavar="B",
        help="Windows per forward pass; default: the run's train.batch_size (with --seq-len: "
        "as many windows as hold its tokens).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    task: list[Path] | None = typer.Option(
        None,
        "--task",
        metavar="FILE",
        help="A jsonl task file to score (repeatable); with it, the loss only "
        "over --data. See docs/training.md, Task evaluation.",
    ),
    extract_number: bool = typer.Option(
        False, "--extract-number", help="Exact-match tasks: compare the reply's last number."
    ),
    temperature: float = typer.Option(
        0.0,
        "--temperature",
        metavar="T",
        help="Exact-match tasks: sample the replies at temperature T (0 = greedy).",
    ),
    samples: int = typer.Option(
        1,
        "--samples",
        metavar="N",
        help="Exact-match tasks, with --temperature: N replies per example; exact_match is "
        "their mean accuracy, pass_at_n the share of examples with one right.",
    ),
    seed: int = typer.Option(
        0, "--seed", metavar="S", help="Seed of the sampled replies (--temperature)."
    ),
    max_new_tokens: int | None = typer.Option(
        None,
        "--max-new-tokens",
        metavar="N",
        help="Exact-match tasks: the longest reply in tokens; a model that rambles stops "
        "sooner (default: the run's sample.max_new_tokens, 200 unless its config sets it).",
    ),
    show: int = typer.Option(
        0,
        "--show",
        metavar="N",
        help="Print the first N examples of each task: prompt, expected, the model's output "
        "(or chosen ending), right or wrong.",
    ),
    details: Path | None = typer.Option(
        None,
        "--details",
        metavar="FILE",
        help="Write every task example's result to FILE as jsonl (replaced atomically).",
    ),
) -> None:
    from minillm.infer.evaluate import evaluate_checkpoint
    from minillm.infer.task_format import read_tasks
    from minillm.infer.task_scoring import eval_report, evaluate_tasks, format_details

    if (show or details is not None) and not task:
        print_error(f"{'--show' if show else '--details'}: only with --task FILE")
        raise typer.Exit(2)
    if max_new_tokens is not None and not task:
        print_error("--max-new-tokens: only with --task FILE (the replies of exact-match tasks)")
        raise typer.Exit(2)
    if show < 0:
        print_error(f"--show: must be >= 0, got {show}")
        raise typer.Exit(2)
    if seq_len is not None and task and data is None:
        print_error("--seq-len: the loss's windows; with --task and no --data no loss is scored")
        raise typer.Exit(2)
    if seq_len is not None and seq_len < 1:  # before the slow load; the model's bound after it
        print_error(f"--seq-len: must be >= 1, got {seq_len}")
        raise typer.Exit(2)
    tasks = run(read_tasks, task or [], extract_number=extract_number)  # before the slow load
    loaded = ckpt.load(seq_len)
    result = {}
    if data is not None or not tasks:
        result = run(
            evaluate_checkpoint,
            loaded,
            data=data,
            text_field=text_field,
            max_tokens=max_tokens,
            batch_size=batch_size,
            progress=True,
            seq_len=seq_len,
        )
    if tasks:
        result["tasks"] = run(
            evaluate_tasks,
            loaded,
            tasks,
            batch_size=batch_size,
            extract_number=extract_number,
            progress=True,
            details=bool(show or details is not None),
            temperature=temperature,
            samples=samples,
            seed=seed,
            max_new_tokens=max_new_tokens,
        )
    records = [r for t in result.get("tasks", {}).values() for r in t.get("details", [])]
    if details is not None:
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        run(_write_details, details, lines)
    print(eval_report(result, as_json))
    if show and not as_json:
        shown = [r for t in result["tasks"].values() for r in t["details"][:show]]
        print(format_details(shown))


def _write_details(path: Path, text: str) -> None:
    """--details FILE written whole or not at all; a folder that cannot take it is one line."""
    from minillm.runtime.files import atomic_write_text

    try:
        atomic_write_text(path, text)
    except OSError as e:
        raise UserError(f"{path}: --details: cannot write ({e.strerror or e})") from None


@app.command(cls=Command, short_help="Generate text from a checkpoint, streamed as it comes.")
@ckpt_options
def sample(
    ckpt: CkptChoice,
    prompt: list[str] | None = typer.Option(
        None,
        "--prompt",
        metavar="TEXT",
        help="Text to continue (repeatable: one batch). None: a fresh document.",
    ),
    prompt_file: Path | None = typer.Option(
        None,
        "--prompt-file",
        metavar="FILE",
        help="A UTF-8 file whose whole text is one more prompt.",
    ),
    max_new_tokens: int | None = typer.Option(
        None,
        "--max-new-tokens",
        metavar="N",
        help="Tokens to generate for each row; past model.max_seq_len the context slides "
        "(default: sample.max_new_tokens).",
    ),
    temperature: float | None = TemperatureOption,
    top_k: int | None = TopKOption,
    top_p: float | None = TopPOption,
    seed: int | None = typer.Option(
        None,
        "--seed",
        metavar="S",
        help="Same seed, same text: sample k of a prompt is the same whatever other prompts "
        "run with it and in which order (default: random).",
    ),
    num_samples: int = typer.Option(1, "--num-samples", metavar="N", help="Samples per prompt."),
    ignore_eos: bool = typer.Option(
        False, "--ignore-eos", help="Do not stop at end-of-text (benchmarks)."
    ),
    json_schema: Path | None = typer.Option(
        None,
        "--json-schema",
        metavar="FILE",
        help="A JSON schema file: every generated text is JSON that it accepts, forced token by "
        "token by a grammar's mask (llguidance), as `minillm serve`'s response_format.",
    ),
) -> None:
    """Generate text from a checkpoint, streamed as it comes; stops at end-of-text.

    Each prompt starts a fresh document (after end-of-text). All rows run as one batch.
    """
    from minillm.infer.engine import SamplingParams
    from minillm.infer.sample import read_prompts, sample_checkpoint

    texts = run(read_prompts, prompt, prompt_file)
    params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed)
    schema = _schema(json_schema)  # before the slow load
    loaded = ckpt.load()
    run(sample_checkpoint, loaded, texts, params, num_samples, ignore_eos, json_schema=schema)


def _schema(path: Path | None) -> tuple[Path, dict] | None:
    """--json-schema FILE read (one error line naming the file if it is not a JSON object)."""
    from minillm.infer.grammar import read_schema

    return None if path is None else (path, run(read_schema, path))


@app.command(
    cls=Command, short_help="Talk to a chat model: one --message, a conversation or a pipe."
)
@ckpt_options
def chat(
    ckpt: CkptChoice,
    system: str | None = typer.Option(
        None, "--system", metavar="TEXT", help="A system message to start with."
    ),
    message: str | None = typer.Option(
        None,
        "--message",
        metavar="TEXT",
        help="Print only the reply to this one user message, then exit.",
    ),
    max_new_tokens: int | None = typer.Option(
        None,
        "--max-new-tokens",
        metavar="N",
        help="Longest reply in tokens (default: sample.max_new_tokens).",
    ),
    temperature: float | None = TemperatureOption,
    top_k: int | None = TopKOption,
    top_p: float | None = TopPOption,
    seed: int | None = typer.Option(None, "--seed", metavar="S", help="Same seed, same replies."),
    json_schema: Path | None = typer.Option(
        None,
        "--json-schema",
        metavar="FILE",
        help="A JSON schema file: every reply is JSON that it accepts, forced token by "
        "token by a grammar's mask (llguidance), as `minillm serve`'s response_format.",
    ),
) -> None:
    """Talk to a chat model: replies streamed, /reset and /exit; a reply stops at <|end|>
    (or <|endoftext|>; a published model's: its eos and end of turn), in the model's template.

    With --message, print the one reply and exit. From a pipe, each input line is the next user
    turn and each reply is printed on one line.
    """
    from minillm.infer.conversation import chat_checkpoint
    from minillm.infer.engine import SamplingParams

    params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed)
    schema = _schema(json_schema)  # before the slow load
    loaded = ckpt.load()
    run(chat_checkpoint, loaded, params, system, message, json_schema=schema)
