"""`minillm eval` through the CLI: a chat column named by --text-field, task files (--show,
--details, a row of the wrong type) and the warning for a model trained on text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.cli import app
from tests.helpers import error_line, make_run, two_checkpoint_run

runner = CliRunner()


HELLO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints at steps 10 and 20 (LATEST names 20)."""
    return two_checkpoint_run(tmp_path_factory.mktemp("two-checkpoints"))


def test_eval_scores_a_chat_column_named_by_text_field(run: Path, tmp_path: Path) -> None:
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"conversation": HELLO}] * 3)
    args = ["eval", "--ckpt", str(run), "--data", str(chats), "--text-field", "conversation"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "(3 conversations)" in result.stdout


def test_a_wrong_type_in_a_task_file_names_its_line_and_field(run: Path, tmp_path: Path) -> None:
    ok = {"messages": [{"role": "user", "content": "Copy: a"}], "answer": "a"}
    task = tmp_path / "t.jsonl"
    task.write_text(f"{json.dumps(ok)}\n\n{json.dumps({**ok, 'answer': 7})}\n")
    line = error_line(runner.invoke(app, ["eval", "--ckpt", str(run), "--task", str(task)]))
    assert line == f"error: {task}: line 3: answer: expected a string, got 7"


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


def test_exact_match_on_a_model_trained_on_text_warns_once(tmp_path: Path) -> None:
    from tests.helpers import write_shards

    run_dir, cfg, _ = make_run(tmp_path)
    write_shards(cfg, ["To be, or not to be, that is the question. " * 3] * 20)
    em = exact_match_task(tmp_path / "em.jsonl")
    em2 = exact_match_task(tmp_path / "em2.jsonl")
    args = ["eval", "--ckpt", str(run_dir), "--task", str(em), "--task", str(em2)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "trained on text, not chat" in warnings[0], result.stderr


def test_eval_task_max_new_tokens_cuts_the_replies(run: Path, tmp_path: Path) -> None:
    em = exact_match_task(tmp_path / "em.jsonl")
    replies = {}
    for limit in ([], ["--max-new-tokens", "2"]):
        out = tmp_path / f"details{len(limit)}.jsonl"
        args = ["eval", "--ckpt", str(run), "--task", str(em), "--details", str(out), *limit]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        replies[len(limit)] = [json.loads(line)["output"] for line in out.read_text().splitlines()]
    # Greedy: 2 tokens are the start of the longer reply (sample.max_new_tokens), and shorter.
    assert all(long.startswith(short) for short, long in zip(replies[2], replies[0]))
    assert sum(map(len, replies[2])) < sum(map(len, replies[0]))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "0", "--task", "t.jsonl"], "--max-new-tokens: must be >= 1, got 0"),
        (["--max-new-tokens", "5"], "--max-new-tokens: only with --task FILE"),
    ],
)
def test_eval_max_new_tokens_refusals(
    run: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    exact_match_task(tmp_path / "t.jsonl")
    args = [str(tmp_path / a) if a == "t.jsonl" else a for a in args]
    line = error_line(runner.invoke(app, ["eval", "--ckpt", str(run), *args]))
    assert line.startswith(f"error: {message}")


def test_eval_help_says_the_max_new_tokens_default() -> None:
    text = " ".join(runner.invoke(app, ["eval", "--help"]).output.split())  # unwrapped
    assert "--max-new-tokens N Exact-match tasks" in text
    assert "(default: the run's sample.max_new_tokens, 200 unless its config sets it)" in text
