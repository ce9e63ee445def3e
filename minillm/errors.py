"""User errors and warnings: the CLI prints an error as one line and exits 2.

Offers `UserError`, `ConfigError` (a bad config key or value), `CheckpointError` (a missing,
damaged, foreign or incompatible checkpoint) and `warn`. Every stage raises these, so they live
at the bottom of the layers.
"""

from __future__ import annotations

import sys


class UserError(Exception):
    """Bad input from the user (a file, key or value); the message names what is at fault."""


class ConfigError(UserError, ValueError):
    """A user error in a config: printed as one line `<file>: <key>: <what is wrong>`."""

    def __init__(self, key: str, message: str, file: str | None = None) -> None:
        self.key, self.message, self.file = key, message, file
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [p for p in (self.file, self.key, self.message) if p]
        return ": ".join(parts)


class CheckpointError(UserError):
    """A checkpoint that is missing, damaged, foreign or incompatible."""


def warn(message: str) -> None:
    """One line on stderr: something the user should know that does not stop the command."""
    print(f"warning: {message}", file=sys.stderr, flush=True)
