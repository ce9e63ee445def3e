"""The one exception type for user errors: the CLI prints it as one red line and exits 2."""


class UserError(Exception):
    """Bad input from the user (a file, key or value); the message names what is at fault."""


def warn(message: str) -> None:
    """One line on stderr: something the user should know that does not stop the command."""
    import sys

    print(f"warning: {message}", file=sys.stderr, flush=True)
