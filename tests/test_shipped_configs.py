"""Every shipped config, and every `minillm tokenize|train|info` line of the Makefile with its
`--set`s, reads without a warning about itself (issue 44: `make lora-demo` warned twice that its
config's model keys were not used, a warning the user could do nothing about).

The Makefile's lines are read with `make -n` (a dry run: its variables expanded, nothing run), so
the test follows the Makefile. A `train.init_from` (the demo's runs/tiny, runs/rl-sft, which a
test does not train) is pointed at a tiny run made here: the warnings are about the config."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from minillm.checkpoint.init_from import load_run_config
from tests.helpers import ROOT, make_run

COMMAND = re.compile(r"\bminillm (tokenize|train|info) (\S+\.yaml)(.*)$")


def makefile_commands() -> list[tuple[str, str, list[str]]]:
    """(command, config, overrides) of every minillm line of every target of the Makefile."""
    phony = re.search(r"^\.PHONY:((?:.*\\\n)*.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert phony, "no .PHONY line in the Makefile"
    found = []
    for target in phony.group(1).replace("\\\n", " ").split():
        dry = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        for line in dry.stdout.splitlines():
            if m := COMMAND.search(line):
                rest = re.split(r"&&|\|\||;|\)", m.group(3))[0]  # this command's words only
                words = shlex.split(rest)
                sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
                if (m.group(1), m.group(2), sets) not in found:  # a target another runs
                    found.append((m.group(1), m.group(2), sets))
    return found


SHIPPED = [("info", f"configs/{p.name}", []) for p in sorted((ROOT / "configs").glob("*.yaml"))]
MAKE = makefile_commands() if shutil.which("make") else []


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny minillm run to stand in for the runs the demos fine-tune (runs/tiny, ...)."""
    run_dir, _, _ = make_run(tmp_path_factory.mktemp("base"))
    return run_dir


def test_the_makefile_lines_are_found() -> None:
    if not shutil.which("make"):
        pytest.skip("no make on this machine")
    configs = {config for _, config, _ in MAKE}
    assert {"configs/tiny.yaml", "configs/tiny-chat.yaml", "configs/tiny-lora.yaml"} <= configs
    assert ("train", "configs/tiny-lora.yaml") in {(c, f) for c, f, _ in MAKE}


@pytest.mark.parametrize(
    "command, config, sets",
    SHIPPED + MAKE,
    ids=[f"{c} {f} {' '.join(s)}" for c, f, s in SHIPPED + MAKE],
)
def test_a_shipped_config_reads_without_a_warning(
    base: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    config: str,
    sets: list[str],
) -> None:
    monkeypatch.chdir(ROOT)  # the shipped paths are relative to the project's root
    text = (ROOT / config).read_text(encoding="utf-8")
    if "init_from" in text or any(s.startswith("train.init_from=") for s in sets):
        sets = [*sets, f"train.init_from={base}"]
    load_run_config(config, sets, require_model=command != "tokenize")
    assert "warning" not in capsys.readouterr().err
