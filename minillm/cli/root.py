"""The `minillm` Typer app itself: `app` (the group the command modules add to), its root
callback (`--version`, bare `minillm` prints the help) and `main`, the console script."""

from __future__ import annotations

import typer

from minillm.cli.command import Group

SUMMARY = (
    "Train a LLaMA-style language model from one YAML file: tokenize, train, eval, sample, "
    "chat, export, info."
)

app = typer.Typer(
    cls=Group,
    add_completion=False,
    # Bare `minillm` prints the help (see `_root`) and exits 2, as click's no_args_is_help does.
    no_args_is_help=False,
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    # Plain click help: metavars a user reads (CONFIG, PATH, KEY=VALUE), not boxes of types.
    rich_markup_mode=None,
    help=SUMMARY,
)


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


def main() -> None:
    app(prog_name="minillm")
