"""OpenMP's wait policy: minillm sets PASSIVE before torch loads (README, "On a busy machine"),
and a value the user set wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = (
    "import sys, os, minillm; "
    "assert 'torch' not in sys.modules, 'minillm imported torch before setting the policy'; "
    "import minillm.cli; "
    "print(repr(os.environ.get('OMP_WAIT_POLICY')))"
)


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE"),
                                                 ("", "")])  # fmt: skip
def test_the_policy_is_passive_unless_the_user_set_one(given: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(expected)
