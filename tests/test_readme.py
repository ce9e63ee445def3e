"""README's "A 5-minute tour" runs as written: every command of its bash block exits 0.

The commands are read from README.md (the first ```bash block after the heading "## A 5-minute
tour"), never listed here, so the test follows the tour when README changes. The text of each
command is left as it is; what is tiny is the environment it runs in: a tmp folder whose
configs/*.yaml are the repository's configs with `--set`-style edits (a 32-wide, 2-layer model,
4 steps of 4 x 32 tokens) and whose data/tinyshakespeare.txt is a 20 kB slice of the real one.

Three kinds of line are adapted, not run as written:
- `source .venv/bin/activate`: a shell builtin. Activating a venv puts its bin/ first on PATH, so
  every command runs with the bin/ of the Python running this test (.venv/bin) first on PATH.
- `tensorboard --logdir DIR`: a server that never exits. It runs as `tensorboard --logdir DIR
  --inspect`, which reads the event files, prints what they hold and exits; and DIR must hold
  event files (`--inspect` also exits 0 on an empty folder).
- a line whose comment says it needs a GPU (or that runs `torchrun`) is skipped without CUDA, and
  one that needs a network is always skipped (tests run offline), each with a warning.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from minillm.config import apply_override, load_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent  # not resolved: .venv/bin/python is a link out of the venv
CORPUS = "data/tinyshakespeare.txt"
CORPUS_CHARS = 20_000  # enough for a 300-token BPE and a val split longer than one window

# Applied to every config the tour names, the way `--set` applies them.
SHRINK = [
    "model.d_model=32",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_kv_head=null",
    "model.ffn_hidden=64",
    "model.max_seq_len=128",  # room for the tour's `--max-new-tokens 100` after the prompt
    "model.vocab_size=300",
    f"data.source={CORPUS}",
    "data.vocab_size=300",
    "train.device=cpu",
    "train.compile=false",
    "train.max_steps=4",
    "train.seq_len=32",
    "train.batch_size=4",
    "train.grad_accum=1",
    "train.warmup_steps=2",
    "train.eval_every=2",
    "train.eval_steps=2",
    "train.ckpt_every=2",
    "train.log_every=2",
    "train.peak_flops=1e11",  # MFU against a given peak: no one-second matmul probe
]

NEEDS_GPU = re.compile(r"\b(needs?|requires?)\b[^#]*\bGPUs?\b|\bGPUs? only\b", re.I)
NEEDS_NETWORK = re.compile(r"\b(needs?|requires?)\b[^#]*\b(network|internet|download)", re.I)
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "<", "&"}


def tour_block(readme: str) -> str:
    """The body of the first ```bash block after the heading "## A 5-minute tour"."""
    parts = re.split(r"^## A 5-minute tour[ \t]*$", readme, maxsplit=1, flags=re.M)
    assert len(parts) == 2, "README.md has no '## A 5-minute tour' heading"
    match = re.search(r"^```bash[ \t]*\n(.*?)^```", parts[1], flags=re.S | re.M)
    assert match, "no ```bash block after '## A 5-minute tour' in README.md"
    return match.group(1)


def split_comment(line: str) -> tuple[str, str]:
    """(command, comment): the comment starts at the first `#` outside quotes after a blank."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def tour_commands(readme: str) -> list[tuple[str, list[str], str]]:
    """(text, argv, comment) of each command line; `\\` continuations are joined."""
    commands, pending = [], ""
    for raw in tour_block(readme).splitlines():
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        text, comment = split_comment(line)
        if text.strip():
            commands.append((text.strip(), shlex.split(text), comment))
    return commands


def shrink_config(src: Path, dst: Path) -> None:
    raw = yaml.safe_load(src.read_text(encoding="utf-8")) or {}
    for edit in SHRINK:
        apply_override(raw, edit)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    load_config(dst)  # the shrunk config must still be valid


def make_world(tmp: Path, commands: list[tuple[str, list[str], str]]) -> None:
    """A tmp folder with shrunk copies of every config the tour names and the corpus slice."""
    for _, argv, _ in commands:
        for arg in argv:
            if re.fullmatch(r"configs/[\w.-]+\.ya?ml", arg) and (ROOT / arg).is_file():
                shrink_config(ROOT / arg, tmp / arg)
    text = (ROOT / CORPUS).read_text(encoding="utf-8")[:CORPUS_CHARS]
    (tmp / CORPUS).parent.mkdir(parents=True, exist_ok=True)
    (tmp / CORPUS).write_text(text[: text.rfind("\n") + 1], encoding="utf-8")


def skip_reason(argv: list[str], comment: str) -> str | None:
    """Why a line cannot run here (a GPU or a network it needs), or None."""
    if (argv[0] == "torchrun" or NEEDS_GPU.search(comment)) and not _cuda():
        return "needs a GPU"
    if argv[0] == "lm_eval" or NEEDS_NETWORK.search(comment):
        return "needs a network"
    return None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_readme_tour_block_is_found_and_parsed() -> None:
    commands = tour_commands(README.read_text(encoding="utf-8"))
    assert any(argv[:2] == ["minillm", "train"] for _, argv, _ in commands), commands
    for text, argv, _ in commands:
        assert not SHELL_OPERATORS & set(argv), f"{text!r}: this test runs commands without a shell"


def test_readme_tour_runs(tmp_path: Path) -> None:
    commands = tour_commands(README.read_text(encoding="utf-8"))
    make_world(tmp_path, commands)
    assert (BIN / "minillm").exists(), f"no minillm in {BIN}: run the tests with .venv/bin/pytest"
    env = dict(
        os.environ,
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(BIN.parent),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",  # a command that quietly needs the network fails here
        HF_DATASETS_OFFLINE="1",
    )
    ran, skipped = [], []
    for text, argv, comment in commands:
        if argv[0] in ("source", ".") and argv[-1].endswith("bin/activate"):
            continue  # done above: the venv's bin/ is first on PATH
        reason = skip_reason(argv, comment)
        if reason:
            skipped.append(f"{text} ({reason})")
            continue
        logdir = None
        if argv[0] == "tensorboard" and "--logdir" in argv and "--inspect" not in argv:
            logdir = tmp_path / argv[argv.index("--logdir") + 1]
            argv = [*argv, "--inspect"]  # read the event files and exit instead of serving
        exe = shutil.which(argv[0], path=env["PATH"])
        assert exe, f"{text!r}: {argv[0]} is not on PATH"
        proc = subprocess.run(
            [exe, *argv[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, (
            f"{text!r} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
        if logdir is not None:
            assert list(logdir.rglob("events.out.tfevents.*")), f"{text!r}: no event files"
        ran.append(text)
    assert ran, "no command of the tour ran"
    for line in skipped:
        warnings.warn(f"README tour: not run here: {line}", stacklevel=1)
