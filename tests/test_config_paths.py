"""Paths in a config are relative to the current folder, not to the config file: a path missing
there is an error that names the folder it was looked for in, and the path from the config file's
folder (or a project root above it) when that exists (issue 36). Run through the CLI from a
folder other than the config's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from minillm.cli import app
from tests.helpers import ROOT, error_line

runner = CliRunner()
RULE = "paths in a config are relative to the current folder, not to the config file"


def project(tmp_path: Path, data: dict, train: dict | None = None) -> Path:
    """tmp/proj/configs/c.yaml with a corpus at tmp/proj/configs/corpus.txt; returns the config."""
    configs = tmp_path / "proj" / "configs"
    configs.mkdir(parents=True)
    (configs / "corpus.txt").write_text("To be, or not to be, that is the question.\n" * 50)
    (configs / "tasks").mkdir()
    (configs / "tasks" / "qa.jsonl").write_text("")
    raw = {
        "model": {"d_model": 32, "n_layer": 1, "n_head": 4},
        "data": {
            "source": str(configs / "corpus.txt"),
            "vocab_size": 300,
            "out_dir": str(tmp_path / "tok"),
            **data,
        },
        "train": {"out_dir": str(tmp_path / "run"), **(train or {})},
    }
    (configs / "c.yaml").write_text(yaml.safe_dump(raw))
    return configs / "c.yaml"


@pytest.mark.parametrize(
    "command, data, train, key, value",
    [
        ("tokenize", {"source": "corpus.txt"}, None, "data.source", "corpus.txt"),
        ("tokenize", {"source": "*.txt"}, None, "data.source", "*.txt"),
        ("info", {"tokenizer": "corpus.txt"}, None, "data.tokenizer", "corpus.txt"),
        ("info", {}, {"init_from": "tasks"}, "train.init_from", "tasks"),
        ("tokenize", {}, {"eval_tasks": ["tasks/qa.jsonl"]}, "train.eval_tasks", "tasks/qa.jsonl"),
    ],
)
def test_a_path_next_to_the_config_file_is_named(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    data: dict,
    train: dict | None,
    key: str,
    value: str,
) -> None:
    cfg = project(tmp_path, data, train)
    monkeypatch.chdir(tmp_path)  # the config's parent's parent
    line = error_line(runner.invoke(app, [command, "proj/configs/c.yaml"]))
    assert line.startswith(f"error: proj/configs/c.yaml: {key}: {value}: no such file or folder")
    assert f"in {tmp_path} (the current folder: {RULE})" in line
    there = os.path.join("proj", "configs", value)
    assert line.endswith(f"; {there} exists: run from proj/configs, or use that path")
    # From the config's own folder the two readings agree: the path is found.
    monkeypatch.chdir(cfg.parent)
    assert "no such file or folder" not in runner.invoke(app, [command, "c.yaml"]).output


@pytest.mark.parametrize("key", ["init_from", "eval_tasks"])
def test_a_missing_path_names_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    value = ["nowhere.jsonl"] if key == "eval_tasks" else "nowhere"
    project(tmp_path, {}, {key: value})
    monkeypatch.chdir(tmp_path)
    line = error_line(runner.invoke(app, ["info", "proj/configs/c.yaml"]))
    shown = value[0] if isinstance(value, list) else value
    assert line == (
        f"error: proj/configs/c.yaml: train.{key}: {shown}: no such file or folder in "
        f"{tmp_path} (the current folder: {RULE})"
    )


def test_a_missing_source_names_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Missing in both folders: a hub name or a typo, told apart when the source is read."""
    project(tmp_path, {"source": "texts/corpus.txt"})
    monkeypatch.chdir(tmp_path)
    line = error_line(runner.invoke(app, ["tokenize", "proj/configs/c.yaml"]))
    assert line == (
        f"error: texts/corpus.txt: data.source: no such file or folder in {tmp_path} "
        f"(the current folder: {RULE})"
    )


def test_set_and_absolute_paths_are_not_looked_up_next_to_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = project(tmp_path, {"source": "corpus.txt"})
    monkeypatch.chdir(tmp_path)
    # --set: typed on the command line, relative to the current folder like any argument.
    line = error_line(runner.invoke(app, ["tokenize", str(cfg), "--set", "data.source=corpus.txt"]))
    assert line.startswith("error: corpus.txt: data.source: no such file or folder in ")
    assert "exists: run from" not in line
    absolute = str(tmp_path / "missing.txt")
    line = error_line(
        runner.invoke(app, ["tokenize", str(cfg), "--set", f"data.source={absolute}"])
    )
    assert line == f"error: {absolute}: data.source: no such file or folder"


@pytest.mark.slow
def test_the_issue_walk_from_the_parent_folder(tmp_path: Path) -> None:
    """`minillm tokenize minillm/configs/tiny.yaml` run from the project's parent folder."""
    configs = tmp_path / "minillm" / "configs"
    data = tmp_path / "minillm" / "data"
    configs.mkdir(parents=True)
    data.mkdir()
    (data / "tinyshakespeare.txt").write_text("First Citizen:\nBefore we proceed any further.\n")
    (configs / "tiny.yaml").write_text((ROOT / "configs" / "tiny.yaml").read_text())
    # The shipped config names data/tinyshakespeare.txt, relative to the project's root.
    assert "source: data/tinyshakespeare.txt" in (configs / "tiny.yaml").read_text()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "minillm", "tokenize", "minillm/configs/tiny.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "error: minillm/configs/tiny.yaml: data.source: data/tinyshakespeare.txt: no such file "
        f"or folder in {tmp_path} (the current folder: {RULE}); "
        "minillm/data/tinyshakespeare.txt exists: run from minillm, or use that path"
    )
    assert not (tmp_path / "data").exists()  # nothing written


def test_from_inside_the_config_folder_the_root_above_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cd configs && minillm tokenize tiny.yaml` (issue 44): the path exists from the project's
    root above, which the error names (before: only the current folder, no hint)."""
    configs = tmp_path / "proj" / "configs"
    configs.mkdir(parents=True)
    (tmp_path / "proj" / "data").mkdir()
    (tmp_path / "proj" / "data" / "corpus.txt").write_text("To be, or not to be.\n" * 50)
    (configs / "c.yaml").write_text(
        "model: {d_model: 32, n_layer: 1, n_head: 4}\n"
        f"data: {{source: data/corpus.txt, out_dir: {tmp_path / 'tok'}}}\n"
    )
    monkeypatch.chdir(configs)
    line = error_line(runner.invoke(app, ["tokenize", "c.yaml"]))
    assert line == (
        f"error: c.yaml: data.source: data/corpus.txt: no such file or folder in {configs} (the "
        f"current folder: {RULE}); ../data/corpus.txt exists: run from .., or use that path"
    )
    assert not (tmp_path / "tok").exists()
