"""The options several `minillm` commands share, and the two loads they feed.

`ConfigArgument` and `SetOption` (a YAML config and its `--set` overrides, read by
`load_config`); `CkptOption`, `BestOption` and `DeviceOption` (a checkpoint on a device, read by
`load_ckpt`); `TemperatureOption`, `TopKOption` and `TopPOption` (`sample` and `chat`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from minillm.cli.group import run

SetOption = typer.Option(
    None,
    "--set",
    metavar="KEY=VALUE",
    help="Override a config value: section.key=value (repeatable).",
)
ConfigArgument = typer.Argument(..., metavar="CONFIG", help="The YAML config.", show_default=False)

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


def load_config(path: Path, overrides: list[str] | None, require_model: bool = True) -> Any:
    """CONFIG with its --set overrides, resolved as training resolves it (a user error: exit 2).
    require_model=False: a config without a model section is accepted (tokenize reads data)."""
    from minillm.train.run import load_train_config

    return run(load_train_config, path, overrides or [], require_model=require_model)


def load_ckpt(ckpt: Path, device: str, best: bool = False) -> Any:
    """--ckpt (with --best) loaded on --device (a user error: exit 2)."""
    from minillm.checkpoint.store import load_checkpoint
    from minillm.runtime.device import resolve_device

    return run(load_checkpoint, ckpt, run(resolve_device, device, "--device"), best=best)
