"""The `minillm` command line: parse, call one function, turn user errors into one line + exit 2.

No logic lives here; every command imports its module lazily so that `minillm --help` is instant.
Modules: `root` (the Typer `app`, `--version`, `main`), `command` (the Typer group and command
classes and the one-line errors: `print_error`, `run`), `options` (the options several commands
share), and the commands by stage: `data_train` (tokenize, train, info), `inference` (eval,
sample, chat), `deploy` (serve, export: the checkpoint handed to other programs).
"""

from __future__ import annotations

from minillm.cli import data_train, deploy, inference
from minillm.cli.root import app, main

# `minillm --help` lists the commands in the pipeline's order, not in the order the modules
# above define them; a new command must be placed here (else this import fails, loudly).
PIPELINE = ("tokenize", "train", "eval", "sample", "chat", "serve", "export", "info")
app.registered_commands.sort(key=lambda c: PIPELINE.index(c.name or c.callback.__name__))

__all__ = ["PIPELINE", "app", "data_train", "deploy", "inference", "main"]
