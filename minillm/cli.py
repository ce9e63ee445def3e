"""The `minillm` command line: parse, call one function, turn user errors into one line + exit 2.

No logic lives here; every command imports its module lazily so that `minillm --help` is instant.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from minillm.errors import UserError

SUMMARY = (
    "Train a LLaMA-style language model from one YAML file: tokenize, train, eval, sample, "
    "chat, export, info."
)


def _print_error(message: str) -> None:
    """The one `error: ...` line on stderr that every user error becomes."""
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]error:[/] {message.replace(chr(10), ' ')}", markup=True
    )


def _usage_message(e: typer.TyperException) -> str:
    """A parser error as `<option>: <what>` (see `<command> --help`), like the config errors.

    Typer's parser errors are `typer.TyperException`s; the usage errors among them carry the
    context (`ctx`) and, for a bad or missing value, the parameter (`param`)."""
    ctx = getattr(e, "ctx", None)
    command = ctx.command_path if ctx is not None else "minillm"
    param = getattr(e, "param", None)
    if param is None:
        what = e.format_message().rstrip(".")
    else:
        longs = [o for o in param.opts if o.startswith("--")]
        name = longs[0] if longs and param.param_type_name == "option" else param.metavar
        name = name or param.name.upper()
        # A missing parameter is the one bad parameter without a message of its own.
        if isinstance(e, typer.BadParameter) and not e.message:
            what = f"{name}: is required"
        else:
            what = f"{name}: {e.message[:1].lower()}{e.message[1:].rstrip('.')}"
    return f"{what} (see `{command} --help`)"


class _Group(TyperGroup):
    """Typer's group, except that a parser error (a bad value, a missing option, an unknown
    command) is one `error:` line and exit 2 like every other user error, not a boxed usage.

    `main` is click's entry point (also what `typer.testing.CliRunner` calls); run in
    non-standalone mode, it raises the parser's errors instead of printing them, and they are
    printed here."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as e:
            # exit code 2 is click's mark of a usage error (UsageError and its subclasses)
            usage = getattr(e, "exit_code", 1) == 2
            _print_error(_usage_message(e) if usage else e.format_message())
            code = 2
        except typer.Abort:  # Ctrl-C or end of input at a prompt
            print("interrupted", file=sys.stderr)
            code = 130
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


class _Command(TyperCommand):
    """A command whose arguments read as their metavars: `CONFIG` in the usage line and the
    Arguments list, not Typer's `{CONFIG}` and `CONFIG <path>`.

    Both classes are Typer's own, passed by `cls=`; they override only click's public Command
    methods (`main`, `collect_usage_pieces`, `format_options`) and read public attributes."""

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = param.metavar or param.name.upper()
                pieces.append(name if param.required else f"[{name}]")
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces

    def format_options(self, ctx: typer.Context, formatter: Any) -> None:
        arguments, options = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append((param.metavar or record[0], record[1]))
            else:
                options.append(record)
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    # Bare `minillm` prints the help (see `_root`) and exits 2, as click's no_args_is_help does.
    no_args_is_help=False,
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    # Plain click help: metavars a user reads (CONFIG, PATH, KEY=VALUE), not boxes of types.
    rich_markup_mode=None,
    help=SUMMARY,
)

SetOption = typer.Option(
    None,
    "--set",
    metavar="KEY=VALUE",
    help="Override a config value: section.key=value (repeatable).",
)
ConfigArgument = typer.Argument(..., metavar="CONFIG", help="The YAML config.", show_default=False)


def _version(value: bool) -> None:
    if value:
        from minillm import __version__

        print(f"minillm {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Train a LLaMA-style language model from one YAML file: tokenize, train, eval, sample,
    chat, export, info."""
    if ctx.invoked_subcommand is None:  # bare `minillm`
        print(ctx.get_help())
        raise typer.Exit(2)


def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call fn; a user error becomes `error: ...` on stderr and exit code 2, Ctrl-C exit 130."""
    try:
        return fn(*args, **kwargs)
    except UserError as e:
        _print_error(str(e))
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise typer.Exit(130) from None


def _config(path: Path, overrides: list[str] | None, require_model: bool = True):  # noqa: ANN202
    from minillm.train.run import load_train_config

    return _run(load_train_config, path, overrides or [], require_model=require_model)


# Commands are listed in `--help` in the order they are defined here: the pipeline's order.


@app.command(cls=_Command, short_help="Train the tokenizer (if absent) and write the token shards.")
def tokenize(
    config: Path = ConfigArgument,
    set_: list[str] | None = SetOption,
    retrain: bool = typer.Option(
        False,
        "--retrain",
        help="Train a new tokenizer even if data.tokenizer exists, and start over instead of "
        "resuming an interrupted run.",
    ),
) -> None:
    """Train the tokenizer (if absent) and write the train/val token shards and meta.json."""
    from minillm.data.shard_writer import write_shards
    from minillm.data.summary import print_summary

    cfg = _config(config, set_, require_model=False)  # tokenize reads the data section only
    summary = _run(write_shards, cfg, retrain=retrain)
    print_summary(summary)


@app.command(cls=_Command, short_help="Train the model; Ctrl-C checkpoints, rerunning resumes.")
def train(
    config: Path = ConfigArgument,
    set_: list[str] | None = SetOption,
    resume: bool = typer.Option(
        True, "--resume/--no-resume", help="Continue from the run's latest checkpoint if any."
    ),
    force: bool = typer.Option(
        False, "--force", help="With --no-resume: delete the run's checkpoints and start over."
    ),
) -> None:
    """Train the model of CONFIG; Ctrl-C checkpoints and stops, running it again resumes.

    Under `torchrun --nproc_per_node N -m minillm train CONFIG` it trains with DDP or FSDP.
    """
    from minillm.train.trainer import train as run_training

    if force and resume:
        _print_error("--force: only with --no-resume (it deletes the run's checkpoints)")
        raise typer.Exit(2)
    cfg = _config(config, set_)
    summary = _run(run_training, cfg, resume=resume, force=force)
    if summary.get("interrupted"):
        raise typer.Exit(130)


CkptOption = typer.Option(
    ...,
    "--ckpt",
    metavar="PATH",
    help="A run directory (its newest intact checkpoint), one checkpoint folder, or a run's "
    "checkpoints/LATEST or checkpoints/BEST.",
)
BestOption = typer.Option(
    False, "--best", help="With a run directory: its best checkpoint (lowest val loss)."
)
DeviceOption = typer.Option(
    "auto", "--device", metavar="DEVICE", help="auto (cuda, then mps, then cpu), cpu, cuda."
)


# Sampling options shared by `sample` and `chat` (defaults: the run's sample section).
TemperatureOption = typer.Option(
    None, "--temperature", metavar="T", help="0 = greedy (default: sample.temperature)."
)
TopKOption = typer.Option(
    None,
    "--top-k",
    metavar="K",
    help="Keep the k most likely tokens, 0 = off (default: sample.top_k).",
)
TopPOption = typer.Option(
    None, "--top-p", metavar="P", help="Nucleus mass in (0, 1], 1 = off (default: sample.top_p)."
)


def _load(ckpt: Path, device: str, best: bool = False):  # noqa: ANN202
    from minillm.checkpoint.store import load_checkpoint
    from minillm.runtime.device import resolve_device

    return _run(load_checkpoint, ckpt, _run(resolve_device, device, "--device"), best=best)


EVAL_HELP = (
    "Loss (nats/token), perplexity and bits per byte of a checkpoint, over the run's validation "
    "shards (data.out_dir/val_*.bin) or over --data FILE, tokenized with the run's tokenizer.\n\n"
    "A .txt file is one document (no special tokens added); a .jsonl, .json, .parquet or .csv "
    "file is read as `minillm tokenize` reads it (--text-field, default the run's "
    "data.text_field; chat rows through the chat template), documents joined by end-of-text.\n\n"
    "Every token after the first is predicted exactly once: windows of T = train.seq_len tokens "
    "start at 0, T, 2T, ...; a window's inputs are tokens i .. i+T-1 and its targets tokens "
    "i+1 .. i+T, and the last window is shorter. Bits per byte = total NLL / ln 2 / UTF-8 bytes "
    "of the text; with --max-tokens, the bytes are scaled by the share of tokens "
    "evaluated."
)


@app.command(
    "eval",
    cls=_Command,
    help=EVAL_HELP,
    short_help="Loss, perplexity and bits per byte of a checkpoint.",
)
def eval_(
    ckpt: Path = CkptOption,
    best: bool = BestOption,
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
    batch_size: int | None = typer.Option(
        None,
        "--batch-size",
        metavar="B",
        help="Windows per forward pass; default: the run's train.batch_size.",
    ),
    device: str = DeviceOption,
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
        _print_error(f"{'--show' if show else '--details'}: only with --task FILE")
        raise typer.Exit(2)
    if show < 0:
        _print_error(f"--show: must be >= 0, got {show}")
        raise typer.Exit(2)
    tasks = _run(read_tasks, task or [], extract_number=extract_number)  # before the slow load
    loaded = _load(ckpt, device, best)
    result = {}
    if data is not None or not tasks:
        result = _run(
            evaluate_checkpoint,
            loaded,
            data=data,
            text_field=text_field,
            max_tokens=max_tokens,
            batch_size=batch_size,
            progress=True,
        )
    if tasks:
        result["tasks"] = _run(
            evaluate_tasks,
            loaded,
            tasks,
            batch_size=batch_size,
            extract_number=extract_number,
            progress=True,
            details=bool(show or details is not None),
        )
    records = [r for t in result.get("tasks", {}).values() for r in t.get("details", [])]
    if details is not None:
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        _run(_write_details, details, lines)
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


@app.command(cls=_Command, short_help="Generate text from a checkpoint, streamed as it comes.")
def sample(
    ckpt: Path = CkptOption,
    best: bool = BestOption,
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
    device: str = DeviceOption,
) -> None:
    """Generate text from a checkpoint, streamed as it comes; stops at end-of-text.

    Each prompt starts a fresh document (after end-of-text). All rows run as one batch.
    """
    from minillm.infer.generate import SampleSettings, read_prompts, sample_checkpoint

    texts = _run(read_prompts, prompt, prompt_file)
    settings = SampleSettings(
        prompts=texts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        num_samples=num_samples,
        ignore_eos=ignore_eos,
    )
    loaded = _load(ckpt, device, best)
    _run(sample_checkpoint, loaded, settings)


@app.command(
    cls=_Command, short_help="Talk to a chat model: one --message, a conversation or a pipe."
)
def chat(
    ckpt: Path = CkptOption,
    best: bool = BestOption,
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
    device: str = DeviceOption,
) -> None:
    """Talk to a chat model: replies streamed, /reset and /exit; stops each reply at <|end|>.

    With --message, print the one reply and exit. From a pipe, each input line is the next user
    turn and each reply is printed on one line.
    """
    from minillm.infer.chat import ChatSettings, chat_checkpoint

    settings = ChatSettings(
        system=system,
        message=message,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
    )
    loaded = _load(ckpt, device, best)
    _run(chat_checkpoint, loaded, settings)


@app.command(cls=_Command, short_help="Write a Hugging Face Llama folder (transformers loads it).")
def export(
    ckpt: Path = CkptOption,
    best: bool = BestOption,
    out: Path = typer.Option(..., "--out", metavar="DIR", help="The folder to write."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out folder."),
) -> None:
    """Write a Hugging Face LlamaForCausalLM folder: config, safetensors weights, tokenizer.

    It loads with transformers' AutoModelForCausalLM and AutoTokenizer.from_pretrained(OUT).
    """
    from minillm.checkpoint.hf_folder import check_export_target, export_checkpoint

    _run(check_export_target, out, force, ckpt)  # before the (slow) load
    loaded = _load(ckpt, "cpu", best)
    path = _run(export_checkpoint, loaded, out, force=force)
    print(f"wrote {path}")


@app.command(cls=_Command, short_help="Parameters, FLOPs per token and a memory estimate.")
def info(
    config: Path = ConfigArgument,
    set_: list[str] | None = SetOption,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Parameters, FLOPs per token and a training-memory estimate (nothing is allocated)."""
    from minillm.info import model_info, print_info

    cfg = _config(config, set_)
    result = _run(model_info, cfg)
    if as_json:
        print(json.dumps(result))
    else:
        print_info(result, title=str(config))


def main() -> None:
    app(prog_name="minillm")


if __name__ == "__main__":
    main()
