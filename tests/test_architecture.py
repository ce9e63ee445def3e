"""The package's shape: stages import only the stages below them, and nothing imports in a circle.

The layers are pyproject.toml's import-linter contract (`make lint` runs `lint-imports`); the
cycle check covers what a layers contract does not: modules of one stage importing each other.
Both read every import, lazy ones inside functions included (grimp parses the source).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent


def find_cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One import cycle among the package's modules (a list that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(graph.find_modules_directly_imported_by(module)):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph.modules):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycle_in_the_package() -> None:
    graph = grimp.build_graph("minillm", cache_dir=None)
    # A package's __init__ importing its own submodule is no cycle of code: leave those edges out.
    for module in list(graph.modules):
        for imported in list(graph.find_modules_directly_imported_by(module)):
            if imported.startswith(module + "."):
                graph.remove_import(importer=module, imported=imported)
    assert find_cycle(graph) is None


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("p.a", "p.b", "p.c"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    assert find_cycle(graph) is None
    graph.add_import(importer="p.c", imported="p.a")
    assert find_cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]


def test_the_import_contracts_hold() -> None:
    """`lint-imports` with pyproject.toml's contracts: the layers cli > train > infer >
    checkpoint > ... > tokenizer > runtime, and checkpoints and the server reading text through
    the tokenizer stage, never the data stage."""
    exe = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(exe), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout
