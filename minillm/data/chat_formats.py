"""Chat rows in the ShareGPT and Alpaca layouts, read as minillm's `[{role, content}, ...]`.

Offers `CHAT_FORMATS`, `pick_chat_format` (the layout `data.chat_format` names, or the one the
columns show under `auto`) and `to_messages` (one row as messages, or a ConfigError naming the row
and the field at fault). The mapping happens as rows are read, so the files stay as published:

- ShareGPT: a column (`conversations` unless `data.text_field` names another) of
  `[{"from": "human"|"gpt"|"system", "value": ...}, ...]`; human -> user, gpt -> assistant.
- Alpaca: columns `instruction`, `input` (optional, may be empty) and `output`: the user turn is
  the instruction, then a blank line and the input when there is one; the assistant's the output.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from minillm.errors import ConfigError

CHAT_FORMATS = ("auto", "messages", "sharegpt", "alpaca")
SHAREGPT_FIELD = "conversations"
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
ALPACA_FIELDS = ("instruction", "input", "output")


def pick_chat_format(chat_format: str, field: str, columns: list[str]) -> tuple[str, str]:
    """(layout, column to read) for `data.chat_format` and the table's columns.

    `auto` keeps `data.text_field` when the table has it (text, or messages or ShareGPT turns,
    told apart by what the column holds: the layout returned is then "auto"); otherwise it takes
    a `conversations` column as ShareGPT, or `instruction` and `output` columns as Alpaca.
    """
    if chat_format == "alpaca" or (
        chat_format == "auto" and field not in columns and {"instruction", "output"} <= set(columns)
    ):
        return "alpaca", "instruction"
    if chat_format == "sharegpt" and field == "text" and "text" not in columns:
        return "sharegpt", SHAREGPT_FIELD  # text_field left at its default
    if chat_format == "auto" and field == "text" and field not in columns:
        if SHAREGPT_FIELD in columns:
            return "sharegpt", SHAREGPT_FIELD
    return chat_format, field


def is_sharegpt_value(value: Any) -> bool:
    """Whether a row's value is a non-empty list of {from, value} turns."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, dict) and {"from", "value"} <= t.keys() for t in value)
    )


def to_messages(layout: str, value: Any, file: str, row: int, field: str) -> Any:
    """A ShareGPT or Alpaca row as `[{role, content}, ...]` (other layouts: `value` as it is,
    for check_messages); a ConfigError `file: data.text_field: row N: field: what` when the row
    does not have the layout's shape."""

    def fail(what: str) -> ConfigError:
        return ConfigError("data.text_field", f"row {row}: {what}", file)

    if layout == "sharegpt":
        if not isinstance(value, list) or not value:
            raise fail(f"{field}: expected a non-empty list of {{from, value}} turns (ShareGPT)")
        messages = []
        for i, turn in enumerate(value):
            if isinstance(turn, str):  # arrow keeps turns with differing keys as JSON text
                with contextlib.suppress(ValueError):
                    turn = json.loads(turn)
            if not isinstance(turn, dict):
                raise fail(f"{field}[{i}]: expected {{from, value}}, got {type(turn).__name__}")
            who = turn.get("from")
            if who not in SHAREGPT_ROLES:
                raise fail(f"{field}[{i}].from: {who!r} is not one of {', '.join(SHAREGPT_ROLES)}")
            text = turn.get("value")
            if not isinstance(text, str):
                got = "missing" if text is None else f"got {type(text).__name__}"
                raise fail(f"{field}[{i}].value: expected a string, {got}")
            messages.append({"role": SHAREGPT_ROLES[who], "content": text})
        return messages
    if layout == "alpaca":
        if not isinstance(value, dict):
            raise fail(f"expected the columns {', '.join(ALPACA_FIELDS)} (Alpaca)")
        for key in ("instruction", "output"):
            if not isinstance(value.get(key), str) or not value[key].strip():
                raise fail(f"{key}: expected non-empty text (Alpaca)")
        extra = value.get("input")
        if extra is not None and not isinstance(extra, str):
            raise fail(f"input: expected text, got {type(extra).__name__} (Alpaca)")
        prompt = value["instruction"] + (f"\n\n{extra}" if extra and extra.strip() else "")
        return [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": value["output"]},
        ]
    return value
