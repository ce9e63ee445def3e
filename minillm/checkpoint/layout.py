"""The on-disk layout of a run and its checkpoints, and finding the checkpoint `--ckpt` means.

Offers the file names (`CKPT_DIR`, `MODEL_FILE`, `TRAINER_FILE`, `STATE_FILE`, `TOKENIZER_FILE`,
`POINTERS`, `LOCK_FILE`; a Hugging Face folder's `HF_CONFIG_FILE`, `HF_WEIGHTS_FILE`,
`HF_WEIGHTS_INDEX`, `HF_GENERATION_FILE`), `checkpoint_name`, `read_pointer`,
`list_checkpoints`, `step_of`, `read_state`, `verify_checkpoint` (every file against its
sha256 in state.json), `find_latest` (the newest intact checkpoint), `resolve_checkpoint` (a
run, a checkpoint or a pointer file) and `is_hf_folder`. Writing and loading checkpoints is
`minillm.checkpoint.store`.

    <run>/checkpoints/step_000500/  model.safetensors, trainer_state.pt, tokenizer.json, state.json
    <run>/checkpoints/LATEST         name of the newest complete checkpoint
    <run>/checkpoints/BEST           name of the checkpoint with the lowest validation loss
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from minillm.errors import CheckpointError, warn
from minillm.runtime.files import sha256_file

CKPT_DIR = "checkpoints"
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer_state.pt"
STATE_FILE = "state.json"
TOKENIZER_FILE = "tokenizer.json"
# A Hugging Face folder's files, written by minillm.checkpoint.hf_export and read by hf_import
# (its tokenizer file is TOKENIZER_FILE too).
HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
HF_GENERATION_FILE = "generation_config.json"
FORMAT_VERSION = 1
CONFIG_KEY = "minillm.model_config"  # safetensors metadata: the model config, JSON
STEP_RE = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def read_pointer(ckpt_root: Path, pointer: str) -> str | None:
    try:
        return (ckpt_root / pointer).read_text().strip() or None
    except OSError:
        return None


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete-looking checkpoint folders (renamed into place), oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if (m := STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def step_of(path: Path) -> int:
    return int(STEP_RE.match(path.name).group(1))


def read_state(ckpt: str | Path) -> dict[str, Any]:
    path = Path(ckpt) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {ckpt} is not a minillm checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(state, dict) or "files" not in state or "config" not in state:
        raise CheckpointError(f"{path}: not a minillm checkpoint state (no files/config)")
    return state


def verify_checkpoint(ckpt: str | Path) -> dict[str, Any]:
    """state.json of `ckpt` after checking every recorded file's sha256; CheckpointError if not."""
    ckpt = Path(ckpt)
    state = read_state(ckpt)
    for name, digest in state["files"].items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        if sha256_file(path) != digest:
            raise CheckpointError(f"{path}: sha256 does not match state.json (damaged file)")
    return state


def find_latest(run_dir: str | Path, verify: bool = True) -> Path | None:
    """The checkpoint LATEST names (else the newest), or None if the run has none.

    If it fails its integrity check, older ones are tried in turn and a warning names the damaged
    checkpoint and the one used instead.
    """
    ckpt_root = Path(run_dir) / CKPT_DIR
    candidates = list_checkpoints(ckpt_root)
    latest = read_pointer(ckpt_root, "LATEST")
    if latest in [p.name for p in candidates]:
        # LATEST decides; a folder newer than it is one whose LATEST update a crash cut short
        # (or one a user stepped back from), and will be replaced when that step is saved again.
        candidates = [p for p in candidates if step_of(p) <= step_of(ckpt_root / latest)]
    failures = []
    for candidate in reversed(candidates):
        try:
            verify_checkpoint(candidate) if verify else read_state(candidate)
        except CheckpointError as e:
            failures.append(f"{candidate.name} ({e})")
            continue
        if failures:
            warn(f"checkpoint {'; '.join(failures)} failed its integrity check; using {candidate}")
        return candidate
    if failures:
        raise CheckpointError(f"{ckpt_root}: no intact checkpoint: {'; '.join(failures)}")
    return None


POINTERS = ("LATEST", "BEST")
LOCK_FILE = "train.lock"  # the run lock's file (minillm.checkpoint.rundir.RunLock)


def resolve_checkpoint(path: str | Path, verify: bool = True, best: bool = False) -> Path:
    """The checkpoint for `--ckpt`: a run directory (its newest intact one, or with `best` the
    one BEST names), a checkpoint, or a run's checkpoints/LATEST or checkpoints/BEST file."""
    path = Path(path)
    if path.name == CKPT_DIR and path.is_dir() and not (path / STATE_FILE).exists():
        path = path.parent  # runs/x/checkpoints means the run
    if path.name in POINTERS and path.is_file():
        # A pointer file names a checkpoint folder next to it.
        if best:
            raise CheckpointError(f"{path}: --best takes a run directory, not a pointer file")
        name = read_pointer(path.parent, path.name)
        if name is None or not (path.parent / name / STATE_FILE).is_file():
            raise CheckpointError(f"{path}: names {name!r}, which is not a checkpoint here")
        return resolve_checkpoint(path.parent / name, verify)
    if not path.exists():
        raise CheckpointError(f"{path}: no such run or checkpoint directory")
    if (path / STATE_FILE).is_file():
        if best:
            raise CheckpointError(f"{path}: --best takes a run directory, not a checkpoint")
        if verify:
            verify_checkpoint(path)
        return path
    if best:
        return _best_checkpoint(path, verify)
    if (path / CKPT_DIR).is_dir():
        found = find_latest(path, verify=verify)
        if found is not None:
            return found
    if (path / CKPT_DIR).is_dir() or (path / LOCK_FILE).exists() or (path / "config.yaml").exists():
        raise CheckpointError(f"{path}: no checkpoint yet{_training_note(path)}")
    raise CheckpointError(
        f"{path}: not a minillm run directory (no {CKPT_DIR}/) nor a checkpoint (no {STATE_FILE})"
        f" nor a Hugging Face model folder (no {HF_CONFIG_FILE})"
    )


def is_hf_folder(path: str | Path) -> bool:
    """Whether `--ckpt` names a Hugging Face model folder: a config.json, and neither a run's
    checkpoints/ nor a checkpoint's state.json (a minillm run or checkpoint is read as one)."""
    p = Path(path)
    return (
        (p / HF_CONFIG_FILE).is_file()
        and not (p / CKPT_DIR).is_dir()
        and not (p / STATE_FILE).is_file()
    )


def _best_checkpoint(run_dir: Path, verify: bool) -> Path:
    """The checkpoint BEST names in a run (the lowest validation loss so far)."""
    ckpt_root = run_dir / CKPT_DIR
    name = read_pointer(ckpt_root, "BEST")
    if name is None:
        if list_checkpoints(ckpt_root):
            raise CheckpointError(
                f"{run_dir}: no best checkpoint yet (none saved after a validation); "
                "drop --best for the latest"
            )
        raise CheckpointError(f"{run_dir}: no checkpoint yet{_training_note(run_dir)}")
    # A damaged best checkpoint is no reason to stop: the newest intact one is a flag away.
    instead = "; or leave out --best to use the newest intact checkpoint"
    if not (ckpt_root / name / STATE_FILE).is_file():
        raise CheckpointError(
            f"{ckpt_root / 'BEST'}: names {name!r}, which is not a checkpoint{instead}"
        )
    if verify:
        try:
            verify_checkpoint(ckpt_root / name)
        except CheckpointError as e:
            raise CheckpointError(f"{e}{instead}") from None
    return ckpt_root / name


def _training_note(run_dir: Path) -> str:
    """`; a training holds its lock (pid N on host)` when a live `minillm train` holds the run."""
    import fcntl

    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return ""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # free: nobody trains this run now
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            return f"; a training holds its lock ({holder}): its first checkpoint is not written"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return ""
    finally:
        os.close(fd)
