"""minillm as it was at an earlier commit, importable beside today's in one process.

A benchmark that compares today's code with a pinned commit in the same process (alternating
runs, same weights, same threads) measures the code, not the machine: timings on a shared
2-core machine drift by 15-30% between processes, more than the regressions worth catching.

    pkg = pinned_minillm("8b9e546")              # the module minillm_8b9e546
    old = pkg.model.Transformer(pkg.config.ModelConfig(...))

The commit's `minillm/` is taken from this checkout's git history (`git archive`) into
build/pinned/<commit>/, as the package `minillm_<commit>`: every `minillm` import in it is
renamed, so it imports itself, never today's code. It needs a checkout with that commit (a
shallow clone lacks it: `git fetch --unshallow`).
"""

from __future__ import annotations

import importlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
# `minillm` as a module name in code and strings (`from minillm.x`, "minillm.model"), not the
# word inside other names (minillm_, .minillm) or prose without a dot.
_NAME = re.compile(r"(?<![\w.])minillm(?=[.\s])")


class PinnedUnavailable(RuntimeError):
    """The commit is not in this checkout's history (or this is no git checkout)."""


def pinned_minillm(commit: str, root: Path = ROOT) -> ModuleType:
    """Import the package `minillm_<commit>`: minillm/ at `commit`, beside today's minillm."""
    name = f"minillm_{commit}"
    if name in sys.modules:
        return sys.modules[name]
    home = root / "build" / "pinned" / commit
    if not (home / name / "__init__.py").exists():
        _extract(commit, root, home, name)
    sys.path.insert(0, str(home))
    try:
        package = importlib.import_module(name)
        for sub in ("config", "model", "infer.engine"):
            importlib.import_module(f"{name}.{sub}")
    finally:
        sys.path.remove(str(home))
    return package


def _extract(commit: str, root: Path, home: Path, name: str) -> None:
    try:
        tar = subprocess.run(
            ["git", "-C", str(root), "archive", "--format=tar", commit, "minillm"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace").strip() if hasattr(e, "stderr") else str(e)
        raise PinnedUnavailable(
            f"commit {commit} is not in {root}'s git history ({detail})"
        ) from None
    staging = home.with_name(home.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(staging, filter="data")
    for path in (staging / "minillm").rglob("*.py"):
        path.write_text(_NAME.sub(name, path.read_text(encoding="utf-8")), encoding="utf-8")
    (staging / "minillm").rename(staging / name)
    staging.rename(home)  # whole or absent: a failed extraction leaves only .partial
