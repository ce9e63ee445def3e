"""What a new user tripped over, round two (issue 27): a crash on a chat column, the newest
intact checkpoint for every command, a model's tokenizer kept, the task eval's details and the
messages around them. Every test goes through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minillm.checkpoint.store import save_checkpoint
from minillm.cli import app
from tests.helpers import error_line
from tests.tiny_run import SHAKESPEARE, make_run

runner = CliRunner()

HELLO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints at steps 10 and 20 (LATEST names 20)."""
    root = tmp_path_factory.mktemp("first-hour")
    run_dir, cfg, net = make_run(root)
    state = json.loads((run_dir / "checkpoints" / "step_000010" / "state.json").read_text())
    with torch.no_grad():
        next(net.parameters()).add_(0.01)
    save_checkpoint(
        run_dir,
        step=20,
        model_state=net.state_dict(),
        trainer_state={"step": 20},
        state={"config": state["config"], "tokens_seen": 2000, "val_loss": 4.0},
        tokenizer_file=root / "tokenizer.json",
    )
    return run_dir


# ------------------------------------------------------- defect 2: the newest intact checkpoint


@pytest.fixture(scope="module")
def damaged_run(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of `run` whose newest checkpoint's weights are cut short."""
    import shutil

    copy = tmp_path_factory.mktemp("damaged") / "run"
    shutil.copytree(run, copy)
    weights = copy / "checkpoints" / "step_000020" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return copy


def commands(ckpt: Path, tmp: Path) -> dict[str, list[str]]:
    text = tmp / "doc.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 4)
    return {
        "eval": ["eval", "--ckpt", str(ckpt), "--data", str(text)],
        "sample": ["sample", "--ckpt", str(ckpt), "--prompt", "To", "--max-new-tokens", "3"],
        "chat": ["chat", "--ckpt", str(ckpt), "--message", "hi", "--max-new-tokens", "3"],
        "export": ["export", "--ckpt", str(ckpt), "--out", str(tmp / "hf")],
    }


@pytest.mark.parametrize("command", ["eval", "sample", "chat", "export"])
def test_a_run_with_a_damaged_newest_checkpoint_uses_the_previous_one(
    damaged_run: Path, tmp_path: Path, command: str
) -> None:
    result = runner.invoke(app, commands(damaged_run, tmp_path)[command])
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1, result.stderr
    assert "checkpoint step_000020 (" in warning[0], warning
    assert "failed its integrity check; using " in warning[0]
    assert warning[0].endswith(str(damaged_run / "checkpoints" / "step_000010")), warning


@pytest.mark.parametrize("command", ["eval", "sample", "chat", "export"])
def test_a_damaged_checkpoint_folder_named_explicitly_is_an_error(
    damaged_run: Path, tmp_path: Path, command: str
) -> None:
    folder = damaged_run / "checkpoints" / "step_000020"
    line = error_line(runner.invoke(app, commands(folder, tmp_path)[command]))
    assert line == (
        f"error: {folder / 'model.safetensors'}: sha256 does not match state.json (damaged file)"
    )


# ------------------------------------------------------- defect 1: a column of the wrong type


def test_eval_scores_a_chat_column_named_by_text_field(run: Path, tmp_path: Path) -> None:
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"conversation": HELLO}] * 3)
    args = ["eval", "--ckpt", str(run), "--data", str(chats), "--text-field", "conversation"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "(3 conversations)" in result.stdout


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


def test_a_wrong_type_in_a_task_file_names_its_line_and_field(run: Path, tmp_path: Path) -> None:
    ok = {"messages": [{"role": "user", "content": "Copy: a"}], "answer": "a"}
    task = tmp_path / "t.jsonl"
    task.write_text(f"{json.dumps(ok)}\n\n{json.dumps({**ok, 'answer': 7})}\n")
    line = error_line(runner.invoke(app, ["eval", "--ckpt", str(run), "--task", str(task)]))
    assert line == f"error: {task}: line 3: answer: expected a string, got 7"


# ------------------------------------------------------- defect 4: a model's tokenizer is kept


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


# ------------------------------------------------------- messages


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


# ------------------------------------------------------- eval --task --show / --details


def exact_match_task(path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"Copy: {c}"}], "answer": c} for c in "abc"]
    return write_jsonl(path, rows)


def multiple_choice_task(path: Path) -> Path:
    rows = [{"context": "To be, or", "endings": [" not to be", " xyzzy"], "label": 0}] * 2
    return write_jsonl(path, rows)


def test_eval_task_show_and_details(run: Path, tmp_path: Path) -> None:
    em, mc = exact_match_task(tmp_path / "em.jsonl"), multiple_choice_task(tmp_path / "mc.jsonl")
    out = tmp_path / "details.jsonl"
    args = ["eval", "--ckpt", str(run), "--task", str(em), "--task", str(mc)]
    result = runner.invoke(app, [*args, "--show", "1", "--details", str(out)])
    assert result.exit_code == 0, result.output
    assert "em line 1: " in result.stdout and "mc line 1: " in result.stdout
    assert "em line 2: " not in result.stdout  # --show 1: one example a task
    assert "  expected: 'a'" in result.stdout and "  expected: ' not to be'" in result.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["task"], r["line"]) for r in rows] == [
        ("em", 1), ("em", 2), ("em", 3), ("mc", 1), ("mc", 2)
    ]  # fmt: skip
    assert {"prompt", "expected", "output", "correct"} <= rows[0].keys()
    assert rows[0]["prompt"] == "Copy: a" and rows[3]["expected"] == " not to be"
    # the scores printed are the share of the records marked correct
    em_score = sum(r["correct"] for r in rows[:3]) / 3
    assert f"em: exact_match {em_score:.4f}" in result.stdout


def test_show_without_task_is_refused(run: Path) -> None:
    line = error_line(runner.invoke(app, ["eval", "--ckpt", str(run), "--show", "3"]))
    assert line == "error: --show: only with --task FILE"


def test_eval_help_names_task_file() -> None:
    result = runner.invoke(app, ["eval", "--help"])
    assert "--task FILE" in result.stdout and "list[Path]" not in result.stdout
    assert "--show N" in result.stdout and "--details FILE" in result.stdout


def test_exact_match_on_a_model_trained_on_text_warns_once(tmp_path: Path) -> None:
    from tests.tiny_run import write_shards

    run_dir, cfg, _ = make_run(tmp_path)
    write_shards(cfg, ["To be, or not to be, that is the question. " * 3] * 20)
    em = exact_match_task(tmp_path / "em.jsonl")
    em2 = exact_match_task(tmp_path / "em2.jsonl")
    args = ["eval", "--ckpt", str(run_dir), "--task", str(em), "--task", str(em2)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "trained on text, not chat" in warnings[0], result.stderr


def test_chat_on_a_model_trained_on_text_warns_once(tmp_path: Path) -> None:
    # The README's tour chats with runs/tiny: say that its replies are likely nonsense, once
    # per session (not per reply), as eval --task does.
    from tests.tiny_run import write_shards

    run_dir, cfg, _ = make_run(tmp_path)
    write_shards(cfg, ["To be, or not to be, that is the question. " * 3] * 20)
    args = ["chat", "--ckpt", str(run_dir), "--temperature", "0", "--max-new-tokens", "4"]
    result = runner.invoke(app, args, input="hello\nagain\n")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "trained on text, not chat" in warnings[0], result.stderr
    assert len(result.stdout.splitlines()) == 2  # both replies still come


# ------------------------------------------------------- make demo takes overrides


@pytest.mark.skipif(__import__("shutil").which("make") is None, reason="needs make")
@pytest.mark.parametrize("target,config", [("demo", "configs/tiny.yaml"),
                                           ("chat-demo", "configs/tiny-chat.yaml")])  # fmt: skip
def test_make_demo_passes_steps_and_args_to_tokenize_and_train(target: str, config: str) -> None:
    import subprocess

    root = Path(__file__).resolve().parent.parent
    args = ["make", "-n", "-C", str(root), target, "STEPS=200", "ARGS=--set train.lr=1e-3"]
    lines = subprocess.run(args, capture_output=True, text=True, check=True).stdout.splitlines()
    sets = "--set train.max_steps=200 --set train.lr=1e-3"
    for command in ("tokenize", "train"):
        assert any(line.endswith(f"minillm {command} {config} {sets}") for line in lines), lines
