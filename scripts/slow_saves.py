"""Run the `minillm` CLI with every checkpoint write stretched, for the kill tests.

    python scripts/slow_saves.py SECONDS train CONFIG [--set KEY=VALUE]...

A checkpoint of a tiny model is written in milliseconds, too fast for a test's signal to land
inside it. scripts/crash_test.py (kill -9) and tests/test_train_cli.py (Ctrl-C during a save) run
training through this script instead of `python -m minillm`: it wraps the public file operations
a save is made of (`minillm.runtime.files.save_safetensors` and `commit_dir`, and `torch.save`)
so that each is followed by a pause of SECONDS, the same three points inside a save as before:
after the weights, after the trainer state, after the folder is renamed into place and before
LATEST names it. Production code carries no test hook.

The wrapping must happen before `minillm.checkpoint` binds those functions (`from ... import`),
so this script patches them first and only then imports the CLI.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def paused(fn: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    """`fn`, followed by a sleep of `seconds` (a window for the signal)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        time.sleep(seconds)
        return result

    return wrapper


def stretch_saves(seconds: float) -> None:
    """Make each step of a checkpoint save take `seconds` longer; call before the CLI's import."""
    import torch

    from minillm.runtime import files

    if "minillm.checkpoint.store" in sys.modules:
        raise RuntimeError("stretch_saves must run before minillm.checkpoint.store is imported")
    files.save_safetensors = paused(files.save_safetensors, seconds)
    files.commit_dir = paused(files.commit_dir, seconds)
    torch.save = paused(torch.save, seconds)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(f"usage: {Path(__file__).name} SECONDS COMMAND [ARGS]...")
    sys.path.insert(0, str(ROOT))  # this checkout's minillm
    stretch_saves(float(argv[0]))
    from minillm.cli import main as minillm

    sys.argv = ["minillm", *argv[1:]]  # as `python -m minillm COMMAND [ARGS]...` sees them
    minillm()


if __name__ == "__main__":
    main(sys.argv[1:])
