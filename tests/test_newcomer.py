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
    assert "tokenize, train, eval, sample, export, info." in " ".join(top.stdout.split())
    listed = [line.split()[0] for line in top.stdout.split("Commands:")[1].strip().splitlines()]
    assert listed == ["tokenize", "train", "eval", "sample", "export", "info"]
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
    from minillm.train.trainer import Trainer
    from tests.helpers import prepared_config

    base = tmp_path_factory.mktemp("run")
    cfg = prepared_config(base, train=dict(max_steps=4, ckpt_every=2, eval_every=2))
    trainer = Trainer(cfg, verbose=False)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return base / "run"


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


def test_eval_data_renders_chat_rows(run: Path, tmp_path: Path) -> None:
    import json

    from minillm.data.corpus import render_chat

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": messages}) + "\n")
    result = eval_json(["--ckpt", str(run), "--data", str(chat), "--text-field", "messages"])
    assert result["bytes"] == len(render_chat(messages).encode())
