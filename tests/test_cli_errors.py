"""Errors through the CLI are one line naming their source: config keys with a suggestion, the
parser, a column of the wrong type, a model's tokenizer kept, a folder of other files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.cli import app
from tests.helpers import SHAKESPEARE, error_line, two_checkpoint_run

runner = CliRunner()


CONF = "model: {d_model: 64, n_layer: 2, n_head: 4}\n"


def conf(tmp_path: Path, text: str = CONF) -> str:
    path = tmp_path / "grimm.yaml"
    path.write_text(text)
    return str(path)


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
        # A mistyped value gets its did-you-mean too (issue 44), the closest allowed one.
        (
            "train: {schedule: cosin}\n",
            [],
            "error: {conf}: train.schedule: expected one of 'cosine', 'wsd', 'constant', got "
            "'cosin'; did you mean 'cosine'?",
        ),
        (
            "",
            ["--set", "train.batch_size=atuo"],
            "error: --set: train.batch_size: expected an integer or one of 'auto', got 'atuo'; "
            "did you mean 'auto'?",
        ),
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
        (["info"], "error: CONFIG or --ckpt PATH: one is required (see `minillm info --help`)"),
        (["trian"], "error: No such command 'trian'. Did you mean 'train'? (see `minillm --help`)"),
        (
            ["train", "x.yaml", "--force"],
            "error: --force: only with --no-resume (it deletes the run's checkpoints)",
        ),
    ],
)
def test_parser_errors_are_one_line(args: list[str], expected: str) -> None:
    assert error_line(invoke(args)) == expected


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints at steps 10 and 20 (LATEST names 20)."""
    return two_checkpoint_run(tmp_path_factory.mktemp("two-checkpoints"))


HELLO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]


GOOD = {"messages": HELLO}


BAD_CONTENT = {"messages": [{"role": "user", "content": 5}, HELLO[1]]}


@pytest.mark.parametrize(
    "lines,field,expected",
    [
        # a text column with a number on line 3 (a blank line 2 counts)
        (['{"text": "abc def"}', "", '{"text": 7}'], "text", "line 3: text: holds a number"),
        # a text column with a list on line 2
        (['{"text": "abc def"}', '{"text": ["a"]}'], "text", "line 2: text: holds a list"),
        # chat rows whose line 4 has a content that is not text
        (
            [json.dumps(GOOD), "", json.dumps(GOOD), json.dumps(BAD_CONTENT)],
            "messages",
            "line 4: messages[0].content: expected a string, got int",
        ),
    ],
)
@pytest.mark.parametrize("command", ["eval", "tokenize"])
def test_a_wrong_type_in_a_jsonl_column_is_one_line_naming_file_line_and_field(
    run: Path, tmp_path: Path, command: str, lines: list[str], field: str, expected: str
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join([*lines, *[json.dumps(GOOD if field == "messages" else
                    {"text": "more text here"})] * 20]) + "\n")  # fmt: skip
    if command == "eval":
        args = ["eval", "--ckpt", str(run), "--data", str(data), "--text-field", field]
        key = "--text-field"
    else:
        conf = tmp_path / "c.yaml"
        conf.write_text(
            f"data: {{source: {data}, text_field: {field}, vocab_size: 270, "
            f"out_dir: {tmp_path / 'tok'}}}\nmodel: {{d_model: 32, n_layer: 1, n_head: 2}}\n"
        )
        args, key = ["tokenize", str(conf)], "data.text_field"
    line = error_line(runner.invoke(app, args))
    assert line.startswith(f"error: {data}: {key}: {expected}"), line


@pytest.mark.parametrize("owner", ["hf", "checkpoint", "run"])
def test_tokenize_retrain_never_overwrites_a_models_tokenizer(
    run: Path, tmp_path: Path, owner: str
) -> None:
    import shutil

    if owner == "hf":
        folder = tmp_path / "hf"
        result = runner.invoke(app, ["export", "--ckpt", str(run), "--out", str(folder)])
        assert result.exit_code == 0, result.output
    else:
        folder = tmp_path / "run"
        shutil.copytree(run, folder)
        shutil.copy(run.parent / "tokenizer.json", folder / "tokenizer.json")
        if owner == "checkpoint":
            folder = folder / "checkpoints" / "step_000010"
    tok = folder / "tokenizer.json"
    before = tok.read_bytes()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000])
    conf = tmp_path / "c.yaml"
    conf.write_text(
        f"data: {{source: {corpus}, tokenizer: {tok}, vocab_size: 300, "
        f"out_dir: {tmp_path / 'tok'}}}\nmodel: {{d_model: 32, n_layer: 1, n_head: 2}}\n"
    )
    line = error_line(runner.invoke(app, ["tokenize", str(conf), "--retrain"]))
    assert line.startswith(f"error: {tok}: data.tokenizer: belongs to the "), line
    assert "--retrain does not replace it" in line
    assert tok.read_bytes() == before


def test_a_folder_of_other_files_suggests_data_format_text(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("print('hello')\n" * 50)
    (src / "b.py").write_text("x = 1\n" * 50)
    conf = tmp_path / "c.yaml"
    conf.write_text(
        f"data: {{source: {src}, vocab_size: 300, out_dir: {tmp_path / 'tok'}}}\n"
        "model: {d_model: 32, n_layer: 1, n_head: 2}\n"
    )
    line = error_line(runner.invoke(app, ["tokenize", str(conf)]))
    assert line.startswith(f"error: {src}: data.source: no data files in this folder ("), line
    assert line.endswith("; its 2 other files (.py) are read as text with data.format: text")
