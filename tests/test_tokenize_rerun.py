"""`minillm tokenize` run again: "nothing to do" on shards that are up to date, a new pass when
an input, a key or a shard changed or with --force; and a pass started with SIGINT ignored
(`nohup`, `&` in a script) still stops cleanly on `kill -INT`, as `train` does.

The corpus and configs are tests/test_shards.py's (a slice of the shipped Grimm stories, a
300-token BPE).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.cli import app
from tests.test_shards import ROOT, corpus, files, write_config

UP_TO_DATE = "nothing to do:"


def tokenize(config: Path, *args: str) -> str:
    result = CliRunner().invoke(app, ["tokenize", str(config), *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def stamps(folder: Path) -> dict[str, int]:
    """Each top-level file's inode and mtime: any rewrite (even of equal bytes) changes one."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}


@pytest.fixture(autouse=True)
def _hf_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.getbasetemp() / "hf")


def test_a_rerun_on_up_to_date_shards_has_nothing_to_do(tmp_path: Path) -> None:
    config, out = write_config(tmp_path, "tokens"), tmp_path / "tokens"
    first = tokenize(config)  # trains the tokenizer; the rerun reuses it: still up to date
    assert UP_TO_DATE not in first
    before = stamps(out)
    again = tokenize(config)
    assert again.strip() == (
        f"{UP_TO_DATE} {out} is up to date (its meta.json records these data settings, source "
        "files and tokenizer); --force encodes it again"
    )
    assert stamps(out) == before  # not one file written
    assert UP_TO_DATE not in tokenize(config, "--force")  # encoded again, to the same bytes
    assert stamps(out) != before
    assert UP_TO_DATE in tokenize(config)


@pytest.mark.parametrize(
    "change",
    ["key", "source", "shard gone", "shard short", "tokenizer", "old meta"],
)
def test_a_changed_input_or_a_damaged_folder_encodes_again(tmp_path: Path, change: str) -> None:
    config, out = write_config(tmp_path, "tokens"), tmp_path / "tokens"
    tokenize(config)
    args: list[str] = []
    if change == "key":
        args = ["--set", "data.val_fraction=0.2"]
    elif change == "source":  # same size, other text: its mtime tells
        src = corpus(tmp_path)
        text = src.read_text(encoding="utf-8")
        time.sleep(0.01)
        src.write_text(text.replace("king", "kong", 1), encoding="utf-8")
    elif change == "shard gone":
        (out / "val_000000.bin").unlink()
    elif change == "shard short":
        with open(out / "train_000000.bin", "r+b") as f:
            f.truncate(10)
    elif change == "tokenizer":  # another tokenizer at data.tokenizer: other ids
        from minillm.tokenizer.bpe import train_tokenizer

        tok = train_tokenizer([corpus(tmp_path).read_text(encoding="utf-8")[::-1]], 300)
        tok.save(str(out / "tokenizer.json"))
    elif change == "old meta":  # shards from before meta.json recorded its inputs
        import json

        meta = json.loads((out / "meta.json").read_text())
        del meta["inputs"]
        (out / "meta.json").write_text(json.dumps(meta))
    output = tokenize(config, *args)
    assert UP_TO_DATE not in output and "tokens" in output  # the summary table of a new pass
    assert UP_TO_DATE in tokenize(config, *args)  # and now that one is up to date


def test_retrain_is_never_nothing_to_do(tmp_path: Path) -> None:
    config, out = write_config(tmp_path, "tokens"), tmp_path / "tokens"
    tokenize(config)
    before = stamps(out)
    assert UP_TO_DATE not in tokenize(config, "--retrain")
    assert stamps(out)["tokenizer.json"] != before["tokenizer.json"]


# ----------------------------------------------------------------------------- SIGINT ignored

SLOW_PASS = """
import signal, sys, time
sys.path.insert(0, {root!r})
assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "started with SIGINT ignored"
import datasets.config
datasets.config.HF_DATASETS_CACHE = {hf!r}
from minillm.cli import app
from minillm.data import encode_batches, shard_staging
from minillm.data.shard_writer import ShardWriter
encode_batches.BATCH_CHARS, shard_staging.CHECKPOINT_BYTES = 4000, 20_000
real, n = ShardWriter.write, [0]
def write(self, ids):  # slow after a few checkpoints, so that the signal lands mid-pass
    n[0] += 1
    if n[0] == 12:
        print("mid-pass", flush=True)
    if n[0] >= 12:
        time.sleep(0.5)
    real(self, ids)
ShardWriter.write = write
app(["tokenize", {config!r}, "--set", "data.shard_tokens=1500"])
"""


def test_kill_int_stops_a_tokenize_started_with_sigint_ignored(tmp_path: Path) -> None:
    """Like `nohup minillm tokenize ... &`: the process inherits SIG_IGN for SIGINT. `kill -INT`
    stops it (exit 130) with the previous shards as they were, and a rerun resumes."""
    config, out = write_config(tmp_path, "tokens"), tmp_path / "tokens"
    tokenize(config)  # the shards a user already has (data.shard_tokens as the default)
    previous = files(out)
    script = SLOW_PASS.format(root=str(ROOT), hf=str(tmp_path / "hf"), config=str(config))
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "mid-pass", proc.communicate()[1][-2000:]
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]  # unhandled, the pass would finish: exit 0
    assert "tokenize interrupted; run it again to resume" in err
    assert "Traceback" not in err
    assert files(out) == previous  # the old shards, tokenizer and meta.json untouched
    assert (out / ".partial" / "state.json").is_file()
    output = tokenize(config, "--set", "data.shard_tokens=1500")
    assert "resumed after" in output
    assert not (out / ".partial").exists()
