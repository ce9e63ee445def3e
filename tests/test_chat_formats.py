"""ShareGPT and Alpaca rows for chat SFT (issue 53, `data.chat_format`): read as the same
conversations as `messages` rows, so the shards and masks are byte for byte those of the
messages file; a row without the layout's shape is one error naming the row and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from minillm.cli import app
from minillm.data.chat_formats import pick_chat_format, to_messages
from minillm.data.tokenize_pass import write_shards
from minillm.errors import ConfigError
from tests.helpers import error_line
from tests.test_chat import chat_config, chat_rows, write_jsonl

FROM = {"user": "human", "assistant": "gpt", "system": "system"}


def sharegpt(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    turns = [
        [{"from": FROM[m["role"]], "value": m["content"]} for m in r["messages"]] for r in rows
    ]
    return [{"id": i, "conversations": t} for i, t in enumerate(turns)]


def alpaca_and_messages(n: int) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """Alpaca rows, half with an input, and the messages rows they stand for."""
    rows, messages = [], []
    for i in range(n):
        extra = f"Numbers: {i}, {i + 3}." if i % 2 else ""
        rows.append({"instruction": "Add the numbers.", "input": extra, "output": f"{2 * i + 3}"})
        user = "Add the numbers." + (f"\n\n{extra}" if extra else "")
        messages.append(
            {
                "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": rows[-1]["output"]},
                ]
            }
        )
    return rows, messages


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".bin", ".mask")}


def tokenized(tmp_path: Path, name: str, rows: list[Any], **data: Any) -> dict[str, bytes]:
    folder = tmp_path / name
    folder.mkdir()
    cfg = chat_config(folder, rows, data=data)
    write_shards(cfg)
    return shard_bytes(folder / "tok")


def test_sharegpt_rows_make_the_messages_shards(tmp_path: Path) -> None:
    rows = chat_rows(60)
    want = tokenized(tmp_path, "messages", rows)
    # text_field left at its default: auto finds the conversations column
    got = tokenized(tmp_path, "sharegpt", sharegpt(rows), text_field="text")
    assert got == want and any(name.endswith(".mask") for name in got)
    named = tokenized(tmp_path, "named", sharegpt(rows), text_field="conversations")
    assert named == want


def test_alpaca_rows_make_the_messages_shards(tmp_path: Path) -> None:
    rows, messages = alpaca_and_messages(60)
    want = tokenized(tmp_path, "messages", messages)
    assert tokenized(tmp_path, "alpaca", rows, text_field="text") == want
    explicit = tokenized(tmp_path, "explicit", rows, text_field="text", chat_format="alpaca")
    assert explicit == want


@pytest.mark.parametrize(
    "row, what",
    [
        ({"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]},
         r"row 3: conversations\[1\]\.from: 'bot' is not one of human, gpt, system"),
        ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]},
         r"row 3: conversations\[1\]\.value: expected a string, missing"),
        ({"conversations": [{"from": "human", "value": "hi"}]},
         r"row 3: conversations: no assistant turn"),
    ],
)  # fmt: skip
def test_a_bad_sharegpt_row_names_row_and_field(tmp_path: Path, row: dict, what: str) -> None:
    rows = sharegpt(chat_rows(10))
    rows[2] = {"id": 2, **row}
    with pytest.raises(ConfigError, match=f"chat.jsonl: data.text_field: {what}"):
        write_shards(chat_config(tmp_path, rows, data={"text_field": "text"}))
    assert not (tmp_path / "tok" / "meta.json").exists()


def test_a_bad_alpaca_row_names_row_and_field() -> None:
    with pytest.raises(ConfigError, match=r"^a.json: data.text_field: row 4: output: expected"):
        to_messages("alpaca", {"instruction": "Say hi.", "output": " "}, "a.json", 4, "instruction")
    with pytest.raises(ConfigError, match=r"row 4: input: expected text, got int"):
        to_messages("alpaca", {"instruction": "x", "input": 3, "output": "y"}, "a.json", 4, "x")
    assert pick_chat_format("auto", "text", ["instruction", "input", "output"])[0] == "alpaca"
    assert pick_chat_format("auto", "messages", ["messages"]) == ("auto", "messages")


def test_tokenize_cli_reads_sharegpt(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt(chat_rows(40)))
    cfg = {"data": {"source": str(src), "vocab_size": 300, "out_dir": str(tmp_path / "tok")}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["tokenize", str(path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tok" / "train_000000.mask").is_file()  # chat: loss on the assistant
    bad = {"data": {**cfg["data"], "chat_format": "alpaca"}}
    path.write_text(yaml.safe_dump(bad))
    line = error_line(CliRunner().invoke(app, ["tokenize", str(path)]))
    assert "data.chat_format: no column 'output' for data.chat_format alpaca" in line
