"""Why a .jsonl file's line is refused, named by its line number: `jsonl_problem`.

Arrow names a bad row of a json file by its index within a block (from 0, blank lines not
counted); the corpus reads the file again here, line by line, to name the line a user looks for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from minillm.data.corpus import corpus_error
from minillm.errors import ConfigError
from minillm.tokenizer.chat_template import check_messages


def is_chat_value(value: Any) -> bool | None:
    """Whether a row's value is text (False), chat messages (True) or neither (None): TableCorpus's
    column test for a row's value (a stream whose column types are known only once read)."""
    if value is None or isinstance(value, str):
        return False
    if isinstance(value, list) and all(
        isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value
    ):
        return True
    return None


def json_kind(value: Any) -> str:
    """How a JSON value reads in an error line: text, a number, a list, an object, ..."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        # Messages with a key missing are still messages: check_messages names the key.
        looks = value and all(isinstance(m, dict) and "role" in m for m in value)
        return "chat messages" if looks or (value and is_chat_value(value)) else "a list"
    return "an object" if isinstance(value, dict) else type(value).__name__


def jsonl_problem(files: list[Path], field: str, need_assistant: bool = True) -> ConfigError | None:
    """The first line of the .jsonl `files` that the arrow loader or the corpus refuses, as an
    error `file: data.text_field: line N: field: what` (None when all are .jsonl-clean, or a
    file is not .jsonl).

    Arrow names a bad row by its index within a block of the file (from 0, blank lines not
    counted), which is not where a user looks; so on a failure the files are read again here,
    line by line, counted from 1. A line is refused when it is not a JSON object, when its
    `field` is neither text nor {role, content} messages, when it holds another kind than the
    first line that has it, or when a key of it changes type (arrow keeps one type per column).
    """
    first: dict[str, tuple[str, int]] = {}  # key -> (kind, line) where it was first seen
    for path in files:
        if path.suffix.lower() != ".jsonl":
            return None
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"line {n}"
                try:
                    obj = json.loads(raw)
                except ValueError as e:
                    message = f"{where}: not JSON ({getattr(e, 'msg', e)})"
                    return corpus_error(path, "data.source", message)
                if not isinstance(obj, dict):
                    message = f"{where}: expected a JSON object, got {json_kind(obj)}"
                    return corpus_error(path, "data.source", message)
                for key, value in obj.items():
                    if value is None:
                        continue
                    kind = json_kind(value)
                    if key == field and kind not in ("text", "chat messages"):
                        message = (
                            f"{where}: {field}: holds {kind}, not text or a list of "
                            "{role, content} messages"
                        )
                        return corpus_error(path, "data.text_field", message)
                    seen = first.setdefault(key, (kind, n))
                    if seen[0] != kind:
                        message = f"{where}: {key}: holds {kind}, line {seen[1]} {seen[0]}"
                        at = "data.text_field" if key == field else "data.source"
                        return corpus_error(path, at, message)
                    if key == field and kind == "chat messages":
                        try:
                            check_messages(value, str(path), n, field, need_assistant, "line")
                        except ConfigError as e:
                            return e
    return None
