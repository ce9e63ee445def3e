"""The real CLI in subprocesses: tokenize, train, Ctrl-C, resume, eval, sample, export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import SHAKESPEARE

pytestmark = pytest.mark.slow

CONFIG = """\
model: {d_model: 64, n_layer: 2, n_head: 4, ffn_hidden: 128, max_seq_len: 64}
data: {source: corpus.txt, vocab_size: 320, out_dir: tokens}
train: {out_dir: run, batch_size: 8, seq_len: 64, max_steps: 400, lr: 3.0e-3, min_lr: 3.0e-4,
        warmup_steps: 10, eval_every: 100, eval_steps: 4, ckpt_every: 1000, log_every: 5,
        device: cpu, precision: fp32}
sample: {max_new_tokens: 20, temperature: 0.0}
"""


def cli(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "minillm", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def start_training(tmp_path: Path) -> subprocess.Popen:
    """Tokenize a Shakespeare slice with CONFIG in tmp_path and start `minillm train` on it."""
    (tmp_path / "corpus.txt").write_text(SHAKESPEARE.read_text()[:80_000])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    cli(tmp_path, "tokenize", "cfg.yaml")
    return subprocess.Popen(
        [sys.executable, "-m", "minillm", "train", "cfg.yaml"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def test_ctrl_c_checkpoints_and_the_next_run_resumes(tmp_path: Path) -> None:
    proc = start_training(tmp_path)
    for line in proc.stdout:  # wait until some steps are done, then press Ctrl-C
        if line.startswith("step 15/"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "stopped by SIGINT" in out
    latest = (tmp_path / "run" / "checkpoints" / "LATEST").read_text().strip()
    stopped_at = int(latest.split("_")[1])
    assert 15 <= stopped_at < 400  # not a cadence checkpoint: ckpt_every is 1000

    resumed = cli(tmp_path, "train", "cfg.yaml", "--set", "train.max_steps=40")
    assert f"resuming from run/checkpoints/{latest}" in resumed.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_000040").is_dir()

    result = json.loads(cli(tmp_path, "eval", "--ckpt", "run", "--json").stdout)
    assert set(result) >= {"loss", "perplexity", "bits_per_byte", "tokens", "bytes"}
    assert 0 < result["loss"] < 6.0 and result["tokens"] > 1000

    sample = cli(tmp_path, "sample", "--ckpt", "run", "--prompt", "ROMEO:", "--seed", "1")
    assert sample.stdout.startswith("ROMEO:") and len(sample.stdout) > len("ROMEO:")
    again = cli(tmp_path, "sample", "--ckpt", "run", "--prompt", "ROMEO:", "--seed", "1")
    assert again.stdout == sample.stdout

    cli(tmp_path, "export", "--ckpt", "run", "--out", "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()
    }


def test_second_trainer_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    first = start_training(tmp_path)
    try:
        for line in first.stdout:
            if line.startswith("training "):
                break
        second = cli(tmp_path, "train", "cfg.yaml", check=False)
        assert second.returncode == 2
        assert "another `minillm train` is using this run" in second.stderr
        assert f"pid {first.pid}" in second.stderr
    finally:
        first.kill()
        first.communicate()
    time.sleep(0.1)
    # The kernel dropped the dead holder's lock: a new run takes over.
    again = cli(tmp_path, "train", "cfg.yaml", "--set", "train.max_steps=2")
    assert "done at step" in again.stdout
