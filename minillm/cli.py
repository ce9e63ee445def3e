"""The `minillm` command line: parse, call one function, turn user errors into one line + exit 2.

No logic lives here; every command imports its module lazily so that `minillm --help` is instant.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from minillm.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train a LLaMA-style language model from one YAML file: tokenize, train, eval, sample.",
)

SetOption = typer.Option(
    None, "--set", help="Override a config value: section.key=value (repeatable)."
)


@app.callback()
def _root() -> None:
    """Train a LLaMA-style language model from one YAML file: tokenize, train, eval, sample."""


def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call fn; a user error becomes `error: ...` on stderr and exit code 2, Ctrl-C exit 130."""
    try:
        return fn(*args, **kwargs)
    except UserError as e:
        from rich.console import Console

        message = str(e).replace("\n", " ")
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"[bold red]error:[/] {message}", markup=True
        )
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise typer.Exit(130) from None


def _config(path: Path, overrides: list[str] | None):  # noqa: ANN202
    from minillm.train.setup import load_train_config

    return _run(load_train_config, path, overrides or [])


@app.command()
def info(
    config: Path = typer.Argument(..., help="The YAML config."),
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


@app.command()
def train(
    config: Path = typer.Argument(..., help="The YAML config."),
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

    cfg = _config(config, set_)
    summary = _run(run_training, cfg, resume=resume, force=force)
    if summary.get("interrupted"):
        raise typer.Exit(130)


CkptOption = typer.Option(
    ..., "--ckpt", help="A run directory (its newest intact checkpoint) or one checkpoint folder."
)
DeviceOption = typer.Option("auto", "--device", help="auto (cuda, then mps, then cpu), cpu, cuda.")


def _load(ckpt: Path, device: str):  # noqa: ANN202
    from minillm.checkpoint.store import load_checkpoint
    from minillm.runtime.device import resolve_device

    return _run(load_checkpoint, ckpt, _run(resolve_device, device, "--device"))


EVAL_HELP = (
    "Loss (nats/token), perplexity and bits per byte of a checkpoint, over the run's validation "
    "shard (data.out_dir/val.bin) or over --data FILE, tokenized with the run's tokenizer as one "
    "document (no special tokens added).\n\n"
    "Every token after the first is predicted exactly once: windows of T = train.seq_len tokens "
    "start at 0, T, 2T, ...; a window's inputs are tokens i .. i+T-1 and its targets tokens "
    "i+1 .. i+T, and the last window is shorter. Bits per byte = total NLL / ln 2 / UTF-8 bytes "
    "of the text; with --max-tokens, the bytes are scaled by the share of tokens "
    "evaluated."
)


@app.command(
    "eval", help=EVAL_HELP, short_help="Loss, perplexity and bits per byte of a checkpoint."
)
def eval_(
    ckpt: Path = CkptOption,
    data: Path | None = typer.Option(
        None, "--data", help="A UTF-8 text file (one document) instead of the validation shard."
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", help="Predict at most N tokens (the first N+1 of the data)."
    ),
    batch_size: int | None = typer.Option(
        None, "--batch-size", help="Windows per forward pass; default: the run's train.batch_size."
    ),
    device: str = DeviceOption,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    from minillm.infer.evaluate import JSON_KEYS, evaluate_checkpoint, format_result

    loaded = _load(ckpt, device)
    result = _run(
        evaluate_checkpoint,
        loaded,
        data=data,
        max_tokens=max_tokens,
        batch_size=batch_size,
        progress=True,
    )
    if as_json:
        print(json.dumps({k: result[k] for k in JSON_KEYS}))
    else:
        print(format_result(result))


@app.command()
def sample(
    ckpt: Path = CkptOption,
    prompt: list[str] | None = typer.Option(
        None, "--prompt", help="Text to continue (repeatable: one batch). None: a fresh document."
    ),
    prompt_file: Path | None = typer.Option(
        None, "--prompt-file", help="A UTF-8 file whose whole text is one more prompt."
    ),
    max_new_tokens: int | None = typer.Option(
        None, "--max-new-tokens", help="Tokens to generate (default: sample.max_new_tokens)."
    ),
    temperature: float | None = typer.Option(
        None, "--temperature", help="0 = greedy (default: sample.temperature)."
    ),
    top_k: int | None = typer.Option(
        None, "--top-k", help="Keep the k most likely tokens, 0 = off (default: sample.top_k)."
    ),
    top_p: float | None = typer.Option(
        None, "--top-p", help="Nucleus mass in (0, 1], 1 = off (default: sample.top_p)."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Same seed, same text (default: random)."),
    num_samples: int = typer.Option(1, "--num-samples", help="Samples per prompt."),
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
    loaded = _load(ckpt, device)
    _run(sample_checkpoint, loaded, settings)


@app.command()
def chat(
    ckpt: Path = CkptOption,
    system: str | None = typer.Option(None, "--system", help="A system message to start with."),
    message: str | None = typer.Option(
        None, "--message", help="Print only the reply to this one user message, then exit."
    ),
    max_new_tokens: int | None = typer.Option(
        None, "--max-new-tokens", help="Longest reply in tokens (default: sample.max_new_tokens)."
    ),
    temperature: float | None = typer.Option(
        None, "--temperature", help="0 = greedy (default: sample.temperature)."
    ),
    top_k: int | None = typer.Option(
        None, "--top-k", help="Keep the k most likely tokens, 0 = off (default: sample.top_k)."
    ),
    top_p: float | None = typer.Option(
        None, "--top-p", help="Nucleus mass in (0, 1], 1 = off (default: sample.top_p)."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Same seed, same replies."),
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
    loaded = _load(ckpt, device)
    _run(chat_checkpoint, loaded, settings)


@app.command()
def export(
    ckpt: Path = CkptOption,
    out: Path = typer.Option(..., "--out", help="The folder to write."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out folder."),
) -> None:
    """Write a Hugging Face LlamaForCausalLM folder: config, safetensors weights, tokenizer.

    It loads with transformers' AutoModelForCausalLM and AutoTokenizer.from_pretrained(OUT).
    """
    from minillm.infer.hf_folder import check_export_target, export_checkpoint

    _run(check_export_target, out, force, ckpt)  # before the (slow) load
    loaded = _load(ckpt, "cpu")
    path = _run(export_checkpoint, loaded, out, force=force)
    print(f"wrote {path}")


@app.command()
def tokenize(
    config: Path = typer.Argument(..., help="The YAML config."),
    set_: list[str] | None = SetOption,
    retrain: bool = typer.Option(
        False, "--retrain", help="Train a new tokenizer even if data.tokenizer exists."
    ),
) -> None:
    """Train the tokenizer (if absent) and write the train/val token shards and meta.json."""
    from minillm.data.shards import print_summary, write_shards

    cfg = _config(config, set_)
    summary = _run(write_shards, cfg, retrain=retrain)
    print_summary(summary)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
