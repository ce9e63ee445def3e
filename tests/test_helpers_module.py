"""The tests' helpers are one module, `tests.helpers`: tests/ is a package, so no second copy
loads under a bare name (`helpers`, `tiny_run`, `test_model`) with state of its own."""

from __future__ import annotations

import importlib.util
import sys

import tests.helpers


def test_the_helpers_load_once_as_tests_helpers() -> None:
    assert sys.modules["tests.helpers"] is tests.helpers
    # tests/ is not on sys.path: a bare `import helpers` fails instead of loading a copy.
    assert importlib.util.find_spec("helpers") is None
    assert "helpers" not in sys.modules and "tiny_run" not in sys.modules
    # The test files load as tests.test_x, the same module another test file imports.
    assert __name__ == "tests.test_helpers_module"
    assert not [name for name in sys.modules if name.startswith("test_")]
