"""How the `minillm` command line fails: every user error is one `error:` line and exit 2.

Offers `Group` and `Command` (Typer's own group and command classes, passed by `cls=`, that turn
a parser error into that line and print arguments by their metavars), `print_error` (the line)
and `run` (call a function; a `UserError` becomes the line and exit 2, Ctrl-C exit 130).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from minillm.errors import UserError


def print_error(message: str) -> None:
    """The one `error: ...` line on stderr that every user error becomes.

    Only the `error:` prefix is markup: the message is escaped, since it names paths, globs and
    values (`data/[ab].txt`, `'minillm[serve]'`) that rich would otherwise read as tags."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]error:[/] {escape(message.replace(chr(10), ' '))}", markup=True
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


class Group(TyperGroup):
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
            print_error(_usage_message(e) if usage else e.format_message())
            code = 2
        except typer.Abort:  # Ctrl-C or end of input at a prompt
            print("interrupted", file=sys.stderr)
            code = 130
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


class Command(TyperCommand):
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


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call fn; a user error becomes `error: ...` on stderr and exit code 2, Ctrl-C exit 130."""
    try:
        return fn(*args, **kwargs)
    except UserError as e:
        print_error(str(e))
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise typer.Exit(130) from None
