"""The CLI's help, version and command order, and the README's tables that list the commands."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.cli import app

runner = CliRunner()


PIPELINE = ["tokenize", "train", "eval", "sample", "chat", "serve", "export", "info"]


ROOT = Path(__file__).resolve().parent.parent


def invoke(args: list[str]):  # noqa: ANN201
    return runner.invoke(app, args, prog_name="minillm")


def test_help_reads_as_metavars_and_lists_commands_in_pipeline_order() -> None:
    top = invoke(["--help"])
    assert top.exit_code == 0
    assert "tokenize, train, eval, sample, chat, export, info." in " ".join(top.stdout.split())
    listed = [line.split()[0] for line in top.stdout.split("Commands:")[1].strip().splitlines()]
    assert listed == PIPELINE
    train = invoke(["train", "--help"]).stdout
    assert "Usage: minillm train [OPTIONS] CONFIG" in train
    assert "--set KEY=VALUE" in train
    sample = invoke(["sample", "--help"]).stdout
    assert "--ckpt PATH" in sample and "--temperature T" in sample
    for text in (top.stdout, train, sample):
        assert "<" not in text and "{" not in text, text


def test_version() -> None:
    from minillm import __version__

    result = invoke(["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"minillm {__version__}\n"


def test_eval_help_names_task_file() -> None:
    result = runner.invoke(app, ["eval", "--help"])
    assert "--task FILE" in result.stdout and "list[Path]" not in result.stdout
    assert "--show N" in result.stdout and "--details FILE" in result.stdout


def test_readme_lists_commands_in_pipeline_order() -> None:
    import re

    readme = (ROOT / "README.md").read_text()
    tour = readme.split("## A 5-minute tour")[1].split("```bash")[1].split("```")[0]
    # `serve` runs until stopped: the tour (which tests run) leaves it to its own section.
    assert re.findall(r"^minillm (\w+)", tour, re.M) == [c for c in PIPELINE if c != "serve"]
    table = re.findall(r"^\| `minillm (\w+)", readme, re.M)
    assert table == PIPELINE


@pytest.mark.skipif(__import__("shutil").which("make") is None, reason="needs make")
@pytest.mark.parametrize("target,config", [("demo", "configs/tiny.yaml"),
                                           ("chat-demo", "configs/tiny-chat.yaml"),
                                           ("rl-demo", "configs/rl-sft.yaml")])  # fmt: skip
def test_make_demo_passes_steps_and_args_to_tokenize_and_train(target: str, config: str) -> None:
    import subprocess

    root = Path(__file__).resolve().parent.parent
    args = ["make", "-n", "-C", str(root), target, "STEPS=200", "ARGS=--set train.lr=1e-3"]
    lines = subprocess.run(args, capture_output=True, text=True, check=True).stdout.splitlines()
    sets = "--set train.max_steps=200 --set train.lr=1e-3"
    for command in ("tokenize", "train"):
        assert any(line.endswith(f"minillm {command} {config} {sets}") for line in lines), lines
