"""A full disk at each writer, through the CLI (issue 62): one `error:` line naming the folder and
the space needed, exit 2, and every file that was there before byte-identical.

The full disk is the error each writer really meets: safetensors' SafetensorError ("os error 28")
for the weights, OSError(ENOSPC) from torch.save, from an `open` of the file in
minillm.runtime.files' atomic writes (the config, the tokenizer, meta.json, the Modelfile) and
from the shard writer; and a real small filesystem where the test may mount one."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from minillm.checkpoint import store as ckpt
from minillm.cli import app
from minillm.data import shard_writer
from minillm.runtime import files
from tests.helpers import error_line, trained_run

runner = CliRunner()
pytestmark = pytest.mark.slow  # training and tokenizing through the CLI: seconds each
NEEDS = r"no space left on the device writing .*\(needs about [\d.]+ [KMG]?B, [\d.]+ \w+ free\)"


def one_error(result: Any) -> str:
    """The one `error:` line of a command that failed with exit 2 (a resume's lr warning may
    come before it), and no traceback."""
    assert result.exit_code == 2, result.output
    errors = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def failing_open(name: Callable[[str], bool]) -> Callable[..., Any]:
    """`open`, except that a file opened for writing whose name passes `name` is a full disk."""

    def fake(path: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        if any(c in mode for c in "wax") and name(Path(path).name):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return open(path, mode, *a, **k)

    return fake


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenized corpus and a 4-step run (checkpoints at 2 and 4), shared: each test leaves
    them as they were, which is what it asserts."""
    return trained_run(tmp_path_factory.mktemp("full-disk-cli"))


def _safetensors_full(*a: Any, **k: Any) -> None:
    from safetensors import SafetensorError

    raise SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )


def _torch_full(*a: Any, **k: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("writer", ["model", "optimizer", "config"])
def test_training_on_a_full_disk(base: Path, monkeypatch: pytest.MonkeyPatch, writer: str):
    run = base / "run"
    # The checkpoints (and, where its write fails, config.yaml): the run's logs do grow.
    before = files_under(run / "checkpoints"), (run / "config.yaml").read_bytes()
    if writer == "model":
        import safetensors.torch

        monkeypatch.setattr(safetensors.torch, "save_file", _safetensors_full)
    elif writer == "optimizer":
        monkeypatch.setattr(ckpt.torch, "save", _torch_full)
    else:  # the run's config.yaml, rewritten because max_steps changed
        monkeypatch.setattr(
            files, "open", failing_open(lambda n: "config.yaml" in n), raising=False
        )
    steps = {"model": 6, "optimizer": 7, "config": 8}[writer]  # a config.yaml unlike the last
    args = ["train", str(base / "cfg.yaml"), "--set", f"train.max_steps={steps}"]
    line = one_error(runner.invoke(app, args))
    folder = run if writer == "config" else run / "checkpoints"
    assert line.startswith(f"error: {folder}: "), line
    assert "no space left on the device writing" in line and "free" in line, line
    if writer != "config":
        assert "needs about" in line and "LATEST still names the previous checkpoint" in line
    else:
        assert "config.yaml is as it was" in line
    assert files_under(run / "checkpoints") == before[0]
    if writer == "config":
        assert (run / "config.yaml").read_bytes() == before[1]


@pytest.mark.parametrize("fmt", ["hf", "gguf Modelfile"])
def test_export_writers_on_a_full_disk(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
):
    out = tmp_path / ("m.gguf" if "gguf" in fmt else "hf")
    if fmt == "hf":
        import safetensors.torch

        monkeypatch.setattr(safetensors.torch, "save_file", _safetensors_full)
    else:
        monkeypatch.setattr(files, "open", failing_open(lambda n: "Modelfile" in n), raising=False)
    (tmp_path / "keep").write_text("mine")
    args = ["export", "--ckpt", str(base / "run"), "--out", str(out)]
    line = error_line(runner.invoke(app, [*args, "--format", "gguf" if "gguf" in fmt else "hf"]))
    assert line.startswith(f"error: {tmp_path}: no space left on the device writing"), line
    assert out.name in line and "nothing at --out was changed" in line
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]  # no temporary file or folder


@pytest.mark.parametrize("writer", ["tokenizer.json", "meta.json", "shards"])
def test_tokenize_on_a_full_disk(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
):
    before = files_under(base)
    out = tmp_path / "tokens"
    sets = ["--set", f"data.out_dir={out}"]
    if writer == "tokenizer.json":  # trained anew: written into the staging folder first
        sets += ["--set", f"data.tokenizer={tmp_path / 'tok.json'}"]
        monkeypatch.setattr(files, "open", failing_open(lambda n: writer in n), raising=False)
    elif writer == "meta.json":
        monkeypatch.setattr(files, "open", failing_open(lambda n: writer in n), raising=False)
    else:
        monkeypatch.setattr(shard_writer, "open", failing_open(lambda n: True), raising=False)
    line = error_line(runner.invoke(app, ["tokenize", str(base / "cfg.yaml"), *sets]))
    assert line.startswith(f"error: {out}: no space left on the device writing"), line
    assert "free some space and run `minillm tokenize` again" in line
    assert files_under(base) == before
    assert not (tmp_path / "tok.json").exists()


def test_a_real_small_filesystem(base: Path, tmp_path: Path) -> None:
    """Training onto a 3 MB tmpfs (as issue 62's user did): needs root to mount one."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)])
    if mounted.returncode != 0:
        pytest.skip("this machine lets no tmpfs be mounted here")
    try:
        run = small / "run"
        cmd = [sys.executable, "-m", "minillm", "train", str(base / "cfg.yaml")]
        cmd += ["--set", f"train.out_dir={run}", "--set", "train.max_steps=2"]
        cmd += ["--set", "model.d_model=384", "--set", "model.n_layer=6"]
        cmd += ["--set", "model.ffn_hidden=1024", "--set", "train.warmup_steps=1"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 2, result.stderr
        lines = [x for x in result.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and "no space left on the device writing" in lines[0], lines
        assert "Traceback" not in result.stderr
        assert not [p for p in (run / "checkpoints").glob(".tmp-*")]  # nothing half-written
    finally:
        subprocess.run(["umount", str(small)])
