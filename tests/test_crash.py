"""kill -9 at random instants, checkpoint writes included: nothing lost, final weights exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_ten_sigkills_lose_nothing(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "crash_test.py"), "--kills", "10",
         "--seed", "1", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("kill ") == 10
    assert "OK: 10 kills" in proc.stdout
