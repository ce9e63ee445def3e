"""The project's own files: the export target ignored by git and removed by `make clean`, and the
license in pyproject.toml."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

runner = CliRunner()


ROOT = Path(__file__).resolve().parent.parent


def test_export_target_is_ignored_and_cleaned_and_the_license_is_spdx() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    assert "hf/" in (ROOT / ".gitignore").read_text().splitlines()
    clean = (ROOT / "Makefile").read_text().split("\nclean:\n")[1].splitlines()[0]
    assert " hf " in f"{clean} "
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["license"] == "MIT"  # a string, not the deprecated table
