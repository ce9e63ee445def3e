"""A damaged newest checkpoint: every command falls back to the previous intact one with one
warning, and the damaged folder named explicitly is one error line."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.cli import app
from tests.helpers import error_line, two_checkpoint_run

runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints at steps 10 and 20 (LATEST names 20)."""
    return two_checkpoint_run(tmp_path_factory.mktemp("two-checkpoints"))


@pytest.fixture(scope="module")
def damaged_run(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of `run` whose newest checkpoint's weights are cut short."""
    import shutil

    copy = tmp_path_factory.mktemp("damaged") / "run"
    shutil.copytree(run, copy)
    weights = copy / "checkpoints" / "step_000020" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return copy


def commands(ckpt: Path, tmp: Path) -> dict[str, list[str]]:
    text = tmp / "doc.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 4)
    return {
        "eval": ["eval", "--ckpt", str(ckpt), "--data", str(text)],
        "sample": ["sample", "--ckpt", str(ckpt), "--prompt", "To", "--max-new-tokens", "3"],
        "chat": ["chat", "--ckpt", str(ckpt), "--message", "hi", "--max-new-tokens", "3"],
        "export": ["export", "--ckpt", str(ckpt), "--out", str(tmp / "hf")],
    }


@pytest.mark.parametrize("command", ["eval", "sample", "chat", "export"])
def test_a_run_with_a_damaged_newest_checkpoint_uses_the_previous_one(
    damaged_run: Path, tmp_path: Path, command: str
) -> None:
    result = runner.invoke(app, commands(damaged_run, tmp_path)[command])
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1, result.stderr
    assert "checkpoint step_000020 (" in warning[0], warning
    assert "failed its integrity check; using " in warning[0]
    assert warning[0].endswith(str(damaged_run / "checkpoints" / "step_000010")), warning


@pytest.mark.parametrize("command", ["eval", "sample", "chat", "export"])
def test_a_damaged_checkpoint_folder_named_explicitly_is_an_error(
    damaged_run: Path, tmp_path: Path, command: str
) -> None:
    folder = damaged_run / "checkpoints" / "step_000020"
    line = error_line(runner.invoke(app, commands(folder, tmp_path)[command]))
    assert line == (
        f"error: {folder / 'model.safetensors'}: sha256 does not match state.json (damaged file)"
    )
