"""What a new user tripped over (issue 18): messages, help, resolving --ckpt, eval on jsonl,
interrupts, silent flags and leftovers. Every test goes through the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.cli import app
from tests.helpers import error_line

runner = CliRunner()

CONF = "model: {d_model: 64, n_layer: 2, n_head: 4}\n"


PIPELINE = ["tokenize", "train", "eval", "sample", "chat", "serve", "export", "info"]


def conf(tmp_path: Path, text: str = CONF) -> str:
    path = tmp_path / "grimm.yaml"
    path.write_text(text)
    return str(path)


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


# ----------------------------------------------------------------------------- 5: the parser


def invoke(args: list[str]):  # noqa: ANN201
    return runner.invoke(app, args, prog_name="minillm")


@pytest.mark.parametrize(
    "args,expected",
    [
        (
            ["sample", "--ckpt", "x", "--temperature", "abc"],
            "error: --temperature: input should be a valid number, unable to parse string as a "
            "number (see `minillm sample --help`)",
        ),
        (["sample"], "error: --ckpt: is required (see `minillm sample --help`)"),
        (["info"], "error: CONFIG: is required (see `minillm info --help`)"),
        (["trian"], "error: No such command 'trian'. Did you mean 'train'? (see `minillm --help`)"),
        (
            ["train", "x.yaml", "--force"],
            "error: --force: only with --no-resume (it deletes the run's checkpoints)",
        ),
    ],
)
def test_parser_errors_are_one_line(args: list[str], expected: str) -> None:
    assert error_line(invoke(args)) == expected


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


# ----------------------------------------------------------------------------- a trained run


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4 (BEST names one of them)."""
    from tests.helpers import trained_run

    return trained_run(tmp_path_factory.mktemp("run")) / "run"


def eval_json(args: list[str]) -> dict:
    import json

    result = invoke(["eval", *args, "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ----------------------------------------------------------------------------- 1: --ckpt


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


# ----------------------------------------------------------------------------- 2: eval --data


def test_eval_data_reads_tables_as_tokenize_does(run: Path, tmp_path: Path) -> None:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["The king had three sons.", "The youngest went into the forest."]
    jsonl = tmp_path / "stories.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"body": texts}), tmp_path / "stories.parquet")
    plain = tmp_path / "stories.txt"
    plain.write_text("\n".join(texts))

    from_jsonl = eval_json(["--ckpt", str(run), "--data", str(jsonl)])
    # The texts' bytes, not the JSON's: the rows were read, not the file's raw text.
    assert from_jsonl["bytes"] == sum(len(t.encode()) for t in texts)
    parquet = eval_json(["--ckpt", str(run), "--data", str(tmp_path / "stories.parquet"),
                         "--text-field", "body"])  # fmt: skip
    assert parquet == from_jsonl
    raw = eval_json(["--ckpt", str(run), "--data", str(plain)])
    assert raw["bytes"] == len(plain.read_bytes()) and raw != from_jsonl

    line = error_line(invoke(["eval", "--ckpt", str(run), "--data", str(jsonl),
                              "--text-field", "body"]))  # fmt: skip
    assert line == f"error: {jsonl}: --text-field: no column 'body' (columns found: text, n)"


def test_eval_data_scores_chat_rows_over_the_answers(run: Path, tmp_path: Path) -> None:
    """Chat rows go through the chat template: the loss is over the assistant's tokens and its
    <|end|>, bits per byte over the assistant's bytes (as a chat run's val/loss)."""
    import json

    from minillm.data.chat_template import assistant_bytes

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": messages}) + "\n")
    result = eval_json(["--ckpt", str(run), "--data", str(chat), "--text-field", "messages"])
    assert result["bytes"] == assistant_bytes(messages) == 6
    assert 2 <= result["tokens"] <= 7  # "Hello." in 1-6 tokens, then <|end|>


# ----------------------------------------------------------------------------- 7: surprises


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


# ----------------------------------------------------------------------------- issue 14: leftovers


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


# ----------------------------------------------------------------------------- 6: Ctrl-C


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
    # Each step of a checkpoint save stretched by 1 s, so that the second Ctrl-C lands inside it.
    argv = [sys.executable, str(root / "scripts" / "slow_saves.py"), "1", "train",
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
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("stopping after this step"):
                break
        while not list((out / "checkpoints").glob(".tmp-step_*")):  # the checkpoint write began
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        for line in proc.stdout:
            lines.append(line)
            if "finishing it first" in line:
                break
        if signals == 3:  # still inside the write (stretched to 3 s)
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


# ----------------------------------------------------------------------------- 8: the MFU peak


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
    import json

    import torch

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


# ----------------------------------------------------------------------------- 9: housekeeping

ROOT = Path(__file__).resolve().parent.parent


def test_readme_lists_commands_in_pipeline_order() -> None:
    import re

    readme = (ROOT / "README.md").read_text()
    tour = readme.split("## A 5-minute tour")[1].split("```bash")[1].split("```")[0]
    # `serve` runs until stopped: the tour (which tests run) leaves it to its own section.
    assert re.findall(r"^minillm (\w+)", tour, re.M) == [c for c in PIPELINE if c != "serve"]
    table = re.findall(r"^\| `minillm (\w+)", readme, re.M)
    assert table == PIPELINE


def test_export_target_is_ignored_and_cleaned_and_the_license_is_spdx() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    assert "hf/" in (ROOT / ".gitignore").read_text().splitlines()
    clean = (ROOT / "Makefile").read_text().split("\nclean:\n")[1].splitlines()[0]
    assert " hf " in f"{clean} "
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["license"] == "MIT"  # a string, not the deprecated table
