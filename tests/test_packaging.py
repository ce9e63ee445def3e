"""The project's own files: the export target ignored by git and removed by `make clean`, and the
license in pyproject.toml."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

runner = CliRunner()


ROOT = Path(__file__).resolve().parent.parent


def project_license(pyproject: str) -> str:
    """The `license = ...` line of pyproject.toml's [project] table, as written (no TOML reader:
    tomllib is Python 3.11+, and the project supports 3.10)."""
    table = pyproject.split("\n[project]\n")[1].split("\n[")[0]
    (line,) = [ln for ln in table.splitlines() if ln.split("=")[0].strip() == "license"]
    return line.split("=", 1)[1].strip()


def test_export_target_is_ignored_and_cleaned_and_the_license_is_spdx() -> None:
    assert "hf/" in (ROOT / ".gitignore").read_text().splitlines()
    clean = (ROOT / "Makefile").read_text().split("\nclean:\n")[1].splitlines()[0]
    assert " hf " in f"{clean} "
    license_ = project_license((ROOT / "pyproject.toml").read_text())
    assert license_ == '"MIT"'  # an SPDX string, not the deprecated table
