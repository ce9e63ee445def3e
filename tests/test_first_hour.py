"""What a new user tripped over, round two (issue 27): a crash on a chat column, the newest
intact checkpoint for every command, a model's tokenizer kept, the task eval's details and the
messages around them. Every test goes through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minillm.checkpoint.store import save_checkpoint
from minillm.cli import app
from tests.tiny_run import make_run

runner = CliRunner()

HELLO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]


def error_line(result) -> str:  # noqa: ANN001
    """The one `error:` line of a failed command (exit 2, nothing else on stderr)."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints at steps 10 and 20 (LATEST names 20)."""
    root = tmp_path_factory.mktemp("first-hour")
    run_dir, cfg, net = make_run(root)
    state = json.loads((run_dir / "checkpoints" / "step_000010" / "state.json").read_text())
    with torch.no_grad():
        next(net.parameters()).add_(0.01)
    save_checkpoint(
        run_dir,
        step=20,
        model_state=net.state_dict(),
        trainer_state={"step": 20},
        state={"config": state["config"], "tokens_seen": 2000, "val_loss": 4.0},
        tokenizer_file=root / "tokenizer.json",
    )
    return run_dir


# ------------------------------------------------------- defect 2: the newest intact checkpoint


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
