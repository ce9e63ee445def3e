"""What a new user tripped over (issue 18): messages, help, resolving --ckpt, eval on jsonl,
interrupts, silent flags and leftovers. Every test goes through the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.cli import app

runner = CliRunner()

CONF = "model: {d_model: 64, n_layer: 2, n_head: 4}\n"


def conf(tmp_path: Path, text: str = CONF) -> str:
    path = tmp_path / "grimm.yaml"
    path.write_text(text)
    return str(path)


def error_line(result) -> str:  # noqa: ANN001
    """The one `error:` line of a failed command (exit 2, nothing else on stderr)."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# ----------------------------------------------------------------------------- 3: --set typos


@pytest.mark.parametrize(
    "yaml_extra,overrides,expected",
    [
        (
            "train: {lerning_rate: 1e-3}\n",
            [],
            "error: {conf}: train.lerning_rate: unknown key; did you mean train.lr?",
        ),
        (
            "",
            ["--set", "train.lerning_rate=1e-3"],
            "error: --set: train.lerning_rate: unknown key; did you mean train.lr?",
        ),
        (
            "",
            ["--set", "train.max_step=5"],
            "error: --set: train.max_step: unknown key; did you mean train.max_steps?",
        ),
        ("", ["--set", "train.lr=-1"], "error: --set: train.lr: must be > 0, got -1.0"),
        (
            "",
            ["--set", "trian.lr=1"],
            "error: --set: trian.lr: unknown section; did you mean train?",
        ),
        ("trian: {}\n", [], "error: {conf}: trian: unknown section; did you mean train?"),
    ],
)
def test_config_errors_name_their_source_and_suggest_a_key(
    tmp_path: Path, yaml_extra: str, overrides: list[str], expected: str
) -> None:
    path = conf(tmp_path, CONF + yaml_extra)
    line = error_line(runner.invoke(app, ["info", path, *overrides]))
    assert line.startswith(expected.format(conf=path)), line


def test_unknown_key_without_a_close_one_suggests_nothing(tmp_path: Path) -> None:
    line = error_line(runner.invoke(app, ["info", conf(tmp_path), "--set", "train.zzz=1"]))
    assert line.startswith("error: --set: train.zzz: unknown key (valid keys: ")
