"""The docs stay true: every config key documented, docs/config.md regenerated from the code."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from minillm.config import SECTIONS

ROOT = Path(__file__).resolve().parent.parent


def test_every_config_field_has_a_doc() -> None:
    missing = [
        f"{name}.{f.name}"
        for name, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if len(f.metadata.get("help", "")) < 10
    ]
    assert not missing, f"config fields without a help text: {missing}"


def test_config_reference_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
