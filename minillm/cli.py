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
    from minillm.config import load_config

    return _run(load_config, path, overrides or [])


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
def tokenize(
    config: Path = typer.Argument(..., help="The YAML config."),
    set_: list[str] | None = SetOption,
    retrain: bool = typer.Option(
        False, "--retrain", help="Train a new tokenizer even if data.tokenizer exists."
    ),
) -> None:
    """Train the tokenizer (if absent) and write the train/val token shards and meta.json."""
    from minillm.data import prepare_data, print_summary

    cfg = _config(config, set_)
    summary = _run(prepare_data, cfg, retrain=retrain)
    print_summary(summary)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
