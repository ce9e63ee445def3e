"""`minillm train` through the CLI: what it says (nothing to train, --force, warmup, init_from),
no lock or empty folder left behind, Ctrl-C during a checkpoint, and the MFU peak it probes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minillm.cli import app
from minillm.runtime.device import StopSignal
from tests.helpers import error_line, trained_run

runner = CliRunner()


def invoke(args: list[str]):  # noqa: ANN201
    return runner.invoke(app, args, prog_name="minillm")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4 (BEST names one of them)."""
    return trained_run(tmp_path_factory.mktemp("run")) / "run"


@pytest.mark.slow
def test_train_says_what_it_does_and_leaves_no_lock(run: Path, tmp_path: Path) -> None:
    config = str(run.parent / "cfg.yaml")
    # A rerun with nothing to train: no new TensorBoard file, and no train.lock after the exit.
    tb_before = sorted(p.name for p in (run / "tb").iterdir())
    result = invoke(["train", config])
    assert result.exit_code == 0, result.output
    assert "nothing to train" in result.stdout
    assert sorted(p.name for p in (run / "tb").iterdir()) == tb_before
    assert not (run / "train.lock").exists()

    # Starting over says what it deletes; a run ending in its warmup is warned about; the
    # banner names the weights a run starts from (train.init_from, an export of `run`).
    hf = tmp_path / "hf"
    assert invoke(["export", "--ckpt", str(run), "--out", str(hf)]).exit_code == 0
    other = tmp_path / "other"
    args = ["--set", f"train.out_dir={other}", "--set", "train.max_steps=2"]
    assert invoke(["train", config, *args]).exit_code == 0
    more = ["--set", "train.warmup_steps=2", "--set", f"train.init_from={hf}"]
    result = invoke(["train", config, *args, *more, "--no-resume", "--force"])
    assert result.exit_code == 0, result.output
    assert (
        f"warning: {other}: --no-resume --force: deleting 1 checkpoint(s) (step_000002) and "
        "the TensorBoard logs (tb/)" in result.stderr
    )
    assert (
        "warning: train.warmup_steps=2 >= train.max_steps=2: the run ends while the lr still "
        "rises, before any decay; lower warmup_steps (e.g. 1)" in result.stderr
    )
    assert f"; weights from {hf}" in result.stdout
    assert not (other / "train.lock").exists()


def test_failed_commands_leave_no_empty_folders(run: Path, tmp_path: Path) -> None:
    config = str(run.parent / "cfg.yaml")
    new_run = tmp_path / "runs" / "new"
    result = invoke(["train", config, "--set", f"train.out_dir={new_run}",
                     "--set", f"data.out_dir={tmp_path / 'no-shards'}"])  # fmt: skip
    assert "no token shards here" in error_line(result)
    assert not (tmp_path / "runs").exists()

    bad_tokenizer = tmp_path / "tok.json"
    bad_tokenizer.write_text("not a tokenizer")
    shards = tmp_path / "data" / "tokens"
    result = invoke(["tokenize", config, "--set", f"data.out_dir={shards}",
                     "--set", f"data.tokenizer={bad_tokenizer}"])  # fmt: skip
    assert str(bad_tokenizer) in error_line(result)
    assert not (tmp_path / "data").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok.json"]


@pytest.mark.slow
@pytest.mark.parametrize("signals", [2, 3])
def test_ctrl_c_is_acknowledged_and_a_second_one_loses_no_checkpoint_silently(
    run: Path, tmp_path: Path, signals: int
) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(root))
    # Each step of a checkpoint save stretched by 2 s, so that the second Ctrl-C, sent more than
    # StopSignal.SAME_REQUEST_S after the first (sooner would be the same request), lands inside.
    argv = [sys.executable, str(root / "scripts" / "slow_saves.py"), "2", "train",
            str(run.parent / "cfg.yaml"),
            "--set", f"train.out_dir={out}", "--set", "train.max_steps=100000",
            "--set", "train.log_every=1", "--set", "train.eval_every=0",
            "--set", "train.ckpt_every=0"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path)  # fmt: skip
    lines = []
    try:
        for line in proc.stdout:  # the loop runs (and the handler is in place) at "step 2/"
            lines.append(line)
            if line.startswith("step 2/"):
                break
        proc.send_signal(signal.SIGINT)
        first = time.monotonic()
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("stopping after this step"):
                break
        while not list((out / "checkpoints").glob(".tmp-step_*")):  # the checkpoint write began
            time.sleep(0.05)
        time.sleep(max(0.0, first + StopSignal.SAME_REQUEST_S + 0.2 - time.monotonic()))
        proc.send_signal(signal.SIGINT)
        for line in proc.stdout:
            lines.append(line)
            if "finishing it first" in line:
                break
        if signals == 3:  # still inside the write (stretched to 6 s)
            proc.send_signal(signal.SIGINT)
        lines += proc.stdout.read().splitlines(keepends=True)
        assert proc.wait(timeout=60) == 130, "".join(lines)
    finally:
        proc.kill()
    text = "".join(lines)
    assert "stopping after this step; checkpointing it (interrupt again to stop at once)" in text
    step = int(text.split("writing the checkpoint of step ")[1].split(":")[0])
    assert (
        f"writing the checkpoint of step {step}: finishing it first (interrupt once more to "
        "abandon it)" in text
    )
    latest = out / "checkpoints" / "LATEST"
    if signals == 2:  # the checkpoint was finished
        assert latest.read_text().strip() == f"step_{step:06d}"
    else:  # abandoned: the message says where the next run resumes
        assert (
            f"warning: stopped at once after step {step}, which is not checkpointed; "
            "`minillm train` resumes from the start (no checkpoint yet)" in text
        )
        assert not latest.exists()


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_two_signals_in_a_moment_are_one_request(run: Path, tmp_path: Path, signame: str):
    """`timeout 60 make demo` signals the process group, so minillm hears SIGTERM twice within
    milliseconds (issue 62): that is one request, the step is checkpointed, exit 130."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "minillm", "train", str(run.parent / "cfg.yaml"),
            "--set", f"train.out_dir={out}", "--set", "train.max_steps=100000",
            "--set", "train.log_every=1", "--set", "train.eval_every=0",
            "--set", "train.ckpt_every=0"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path)  # fmt: skip
    lines = []
    try:
        for line in proc.stdout:  # the loop runs (and the handler is in place) at "step 2/"
            lines.append(line)
            if line.startswith("step 2/"):
                break
        proc.send_signal(getattr(signal, signame))
        time.sleep(0.1)
        proc.send_signal(getattr(signal, signame))
        lines += proc.stdout.read().splitlines(keepends=True)
        assert proc.wait(timeout=60) == 130, "".join(lines)
    finally:
        proc.kill()
    text = "".join(lines)
    assert "stopped at once" not in text, text
    step = int(text.split(f"stopped by {signame} at step ")[1].split(" ")[0])
    assert (out / "checkpoints" / "LATEST").read_text().strip() == f"step_{step:06d}"


@pytest.mark.slow
def test_the_mfu_peak_is_probed_once_per_machine_and_shown(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import re

    monkeypatch.setenv("MINILLM_CACHE_DIR", str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "peak_flops.json"
    config = str(run.parent / "cfg.yaml")
    banners = []
    for name in ("a", "b"):
        args = ["--set", f"train.out_dir={tmp_path / name}", "--set", "train.max_steps=1"]
        result = invoke(["train", config, *args])
        assert result.exit_code == 0, result.output
        banners.append(next(ln for ln in result.stdout.splitlines() if ln.startswith("training")))
    assert f"GFLOP/s for MFU (probed 3 s, cached in {cache});" in banners[0]
    assert f"GFLOP/s for MFU (probed once, cached in {cache});" in banners[1]
    peaks = [re.search(r"peak (\d+) GFLOP/s", b).group(1) for b in banners]
    assert peaks[0] == peaks[1]
    result = invoke(["train", config, "--set", f"train.out_dir={tmp_path / 'c'}",
                     "--set", "train.max_steps=1", "--set", "train.peak_flops=1e12"])  # fmt: skip
    assert "peak 1000 GFLOP/s for MFU (train.peak_flops);" in result.stdout


def test_a_peak_probed_on_a_busy_machine_is_probed_again_when_a_run_beats_it(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minillm.runtime import perf

    monkeypatch.setenv("MINILLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(perf, "PROBE_SECONDS", 0.2)
    cache = tmp_path / "cache" / "peak_flops.json"
    key = perf._machine_key(torch.device("cpu"), torch.float32)
    cache.parent.mkdir()
    cache.write_text(json.dumps({key: 1e6, "another machine": 5.0}))  # 1 MFLOP/s: far too low
    config = str(run.parent / "cfg.yaml")
    outputs = []
    for name in ("a", "b"):
        args = ["--set", f"train.out_dir={tmp_path / name}", "--set", "train.max_steps=2"]
        result = invoke(["train", config, *args, "--set", "train.log_every=1"])
        assert result.exit_code == 0, result.output
        outputs.append(result.stdout)
    note = "against the cached peak of 0 GFLOP/s, probed on a busy machine: probed again"
    assert note in outputs[0]
    assert outputs[0].count("probed again") == 1  # once a run, not at every log line
    assert "probed again" not in outputs[1]  # the new peak was cached
    saved = json.loads(cache.read_text())
    assert saved[key] > 1e9 and saved["another machine"] == 5.0
