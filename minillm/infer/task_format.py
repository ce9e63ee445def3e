"""Task files: jsonl examples of multiple choice or exact match, read and checked line by line.

Offers `MultipleChoice`, `ExactMatch`, `Task`, `read_task(path)` and `read_tasks(paths)`.

A file holds one kind of example (docs/design.md, "Task files"):
- multiple choice: `{"context": str, "endings": [str, ...], "label": int}` (HellaSwag's
  preprocessed form; other keys, such as HellaSwag's `ind`, are ignored);
- exact match: `{"messages": [{"role", "content"}, ...], "answer": str}`, the last message a user
  turn (a chat model's question, GSM8K style).
A malformed line is one UserError `<file>: line N: <field>: <what>`, raised before any model runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from minillm.errors import UserError
from minillm.runtime.files import user_jsonl

ROLES = ("system", "user", "assistant")
KINDS = {"multiple_choice": "multiple-choice", "exact_match": "exact-match"}


@dataclass(frozen=True)
class MultipleChoice:
    """One question: which ending follows the context. `line` is its line in the file (1-based)."""

    context: str
    endings: tuple[str, ...]
    label: int
    line: int = 0


@dataclass(frozen=True)
class ExactMatch:
    """A conversation ending in a user turn and the reply expected (compared after stripping)."""

    messages: tuple[tuple[str, str], ...]  # (role, content)
    answer: str
    line: int = 0


@dataclass
class Task:
    """The examples of one file; `name` is the file's stem, the key of its results."""

    name: str
    path: Path
    kind: Literal["multiple_choice", "exact_match"]
    examples: list[Any] = field(default_factory=list)


def _multiple_choice(obj: dict[str, Any], where: str, line: int) -> MultipleChoice:
    context, endings, label = obj.get("context"), obj.get("endings"), obj.get("label")
    if not isinstance(context, str):
        raise UserError(f"{where}: context: expected a string, got {context!r}")
    if context == "":
        # The first ending token needs one token before it to be predicted from.
        raise UserError(f"{where}: context: empty (the ending needs a context to follow)")
    if not isinstance(endings, list) or len(endings) < 2:
        raise UserError(f"{where}: endings: expected a list of at least 2 strings, got {endings!r}")
    for i, ending in enumerate(endings):
        if not isinstance(ending, str):
            raise UserError(f"{where}: endings[{i}]: expected a string, got {ending!r}")
        if ending == "":
            raise UserError(f"{where}: endings[{i}]: empty (it would have no tokens to score)")
    if isinstance(label, bool) or not isinstance(label, int):
        raise UserError(f"{where}: label: expected an integer, got {label!r}")
    if not 0 <= label < len(endings):
        raise UserError(f"{where}: label: {label} is not an index of the {len(endings)} endings")
    return MultipleChoice(context, tuple(endings), label, line)


def _exact_match(obj: dict[str, Any], where: str, line: int) -> ExactMatch:
    messages, answer = obj.get("messages"), obj.get("answer")
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: messages: expected a non-empty list, got {messages!r}")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UserError(f"{where}: messages[{i}]: expected an object, got {message!r}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise UserError(
                f"{where}: messages[{i}].role: expected one of {', '.join(ROLES)}, got {role!r}"
            )
        if not isinstance(content, str):
            raise UserError(f"{where}: messages[{i}].content: expected a string, got {content!r}")
        turns.append((role, content))
    if turns[-1][0] != "user":
        raise UserError(
            f"{where}: messages: the last message must be a user turn, not {turns[-1][0]}"
        )
    if "answer" not in obj:  # a key left out, not a value of the wrong type: say so
        raise UserError(f"{where}: answer: missing (an exact-match row is messages and answer)")
    if not isinstance(answer, str):
        raise UserError(f"{where}: answer: expected a string, got {answer!r}")
    return ExactMatch(tuple(turns), answer, line)


def read_task(path: str | Path) -> Task:
    """Read and check a jsonl task file (blank lines are skipped)."""
    path = Path(path)
    task: Task | None = None
    for n, where, obj in user_jsonl(path, "task file"):
        if not isinstance(obj, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        kind = "exact_match" if "messages" in obj else "multiple_choice" if "context" in obj else ""
        if not kind:
            raise UserError(
                f"{where}: neither multiple choice (context, endings, label) nor "
                "exact match (messages, answer)"
            )
        if task is None:
            task = Task(path.stem, path, kind)
        elif kind != task.kind:
            article = "an" if kind == "exact_match" else "a"
            raise UserError(
                f"{where}: {article} {KINDS[kind]} example in a {KINDS[task.kind]} file"
            )
        parse = _exact_match if kind == "exact_match" else _multiple_choice
        task.examples.append(parse(obj, where, n))
    if task is None:
        raise UserError(f"{path}: no examples")
    return task


def read_tasks(
    paths: list[str] | list[Path], key: str = "--task", extract_number: bool = False
) -> list[Task]:
    """Read several task files; two with the same stem would share a name, so they are refused.

    extract_number (`--extract-number`) is refused without an exact-match file to apply to.
    """
    tasks = [read_task(p) for p in paths]
    if extract_number and not any(t.kind == "exact_match" for t in tasks):
        raise UserError("--extract-number: applies to exact-match task files, and none is given")
    seen: dict[str, Path] = {}
    for task in tasks:
        if task.name in seen:
            raise UserError(
                f"{key}: {seen[task.name]} and {task.path} have the same name "
                f"{task.name!r} (the file's stem names its results)"
            )
        seen[task.name] = task.path
    return tasks
