"""What `--ckpt` resolves to: a run, its checkpoints folder, the LATEST and BEST pointer files,
--best, and a run with no checkpoint yet (one error line, naming a training that holds its lock)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.cli import app
from tests.helpers import error_line, eval_json, trained_run

runner = CliRunner()


def invoke(args: list[str]):  # noqa: ANN201
    return runner.invoke(app, args, prog_name="minillm")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4 (BEST names one of them)."""
    return trained_run(tmp_path_factory.mktemp("run")) / "run"


def test_ckpt_takes_pointer_files_and_best(run: Path) -> None:
    ckpts = run / "checkpoints"
    best = (ckpts / "BEST").read_text().strip()
    by_folder = eval_json(["--ckpt", str(ckpts / best), "--max-tokens", "64"])
    assert eval_json(["--ckpt", str(ckpts / "BEST"), "--max-tokens", "64"]) == by_folder
    assert eval_json(["--ckpt", str(run), "--best", "--max-tokens", "64"]) == by_folder
    latest = eval_json(["--ckpt", str(ckpts / "LATEST"), "--max-tokens", "64"])
    assert latest == eval_json(["--ckpt", str(run), "--max-tokens", "64"])
    assert latest == eval_json(["--ckpt", str(ckpts), "--max-tokens", "64"])
    line = error_line(invoke(["eval", "--ckpt", str(ckpts / best), "--best"]))
    assert line == f"error: {ckpts / best}: --best takes a run directory, not a checkpoint"


def test_a_run_without_a_checkpoint_says_so_and_names_the_training(tmp_path: Path) -> None:
    from minillm.checkpoint.rundir import RunLock

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text("{}\n")
    for command in ("eval", "sample"):
        line = error_line(invoke([command, "--ckpt", str(fresh)]))
        assert line == f"error: {fresh}: no checkpoint yet"
    with RunLock(fresh):  # a training in progress holds the lock
        line = error_line(invoke(["sample", "--ckpt", str(fresh), "--best"]))
    import os
    import socket

    holder = f"pid {os.getpid()} on {socket.gethostname()}"
    assert line == (
        f"error: {fresh}: no checkpoint yet; a training holds its lock ({holder}): its first "
        "checkpoint is not written"
    )
    other = tmp_path / "other"
    other.mkdir()
    line = error_line(invoke(["eval", "--ckpt", str(other)]))
    assert "not a minillm run directory" in line
