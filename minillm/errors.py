"""The one exception type for user errors: the CLI prints it as one red line and exits 2."""


class UserError(Exception):
    """Bad input from the user (a file, key or value); the message names what is at fault."""
