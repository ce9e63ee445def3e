"""Text in square brackets reaches the user whole: an error line or a progress line is printed as
text, never read as rich markup (which drops `[ab]` and fails on a stray closing tag `[/b]`)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from minillm.cli import app
from minillm.runtime.progress import Progress


@pytest.mark.parametrize("pattern", ["data/[ab].txt", "notes[/b].txt"])
def test_an_error_naming_a_bracketed_glob_prints_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("c.yaml").write_text(f'data:\n  source: "{pattern}"\n', encoding="utf-8")
    result = CliRunner().invoke(app, ["tokenize", "c.yaml"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {pattern}: data.source: "), lines


def test_a_line_above_the_progress_bar_prints_brackets_whole() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=200)
    bar = Progress("step [1]", 10, console)
    bar.update(1, info="loss [ab]")
    bar.print("step 1 sample: 'a [b] and [/b]'")
    bar.close()
    text = out.getvalue()
    assert "step 1 sample: 'a [b] and [/b]'" in text
    assert "step [1]" in text and "loss [ab]" in text
