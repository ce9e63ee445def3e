"""Writing a checkpoint: `save_checkpoint` (atomic: a hidden folder, every file fsynced, renamed
into place, then LATEST) and `prune_checkpoints` (the oldest beyond train.keep_last). Reading
them back is minillm.checkpoint.store; the layout on disk, minillm.checkpoint.layout."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from minillm.checkpoint.layout import (
    CKPT_DIR,
    CONFIG_KEY,
    FORMAT_VERSION,
    MODEL_FILE,
    STATE_FILE,
    TOKENIZER_FILE,
    TRAINER_FILE,
    checkpoint_name,
    list_checkpoints,
    read_pointer,
)
from minillm.errors import CheckpointError
from minillm.runtime.disk_space import full_disk_error, is_disk_full
from minillm.runtime.files import (
    atomic_write_json,
    atomic_write_text,
    commit_dir,
    save_safetensors,
    sha256_file,
)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    state: dict[str, Any],
    tokenizer_file: str | Path | None = None,
    keep_last: int = 3,
    is_best: bool = False,
) -> Path:
    """Write checkpoint `step` atomically, point LATEST (and BEST) at it, then prune old ones.

    `state` is the JSON-able summary (step, tokens, losses, config); file hashes are added here.
    """

    ckpt_root = Path(run_dir) / CKPT_DIR
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
        metadata = {"format": "pt", "step": str(step)}
        if isinstance(state.get("config"), dict) and "model" in state["config"]:
            # The architecture rides in the weights file, which state.json hashes: an edit of
            # state.json's model section no longer rebuilds a different forward unnoticed.
            metadata[CONFIG_KEY] = json.dumps(state["config"]["model"], sort_keys=True)
        save_safetensors(tensors, tmp / MODEL_FILE, metadata=metadata)
        torch.save(trainer_state, tmp / TRAINER_FILE)
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / TOKENIZER_FILE)
            from minillm.tokenizer.conventions import copy_companions

            # A published model's chat template, special tokens and eos ids travel with it.
            copy_companions(Path(tokenizer_file).parent, tmp)
        files = sorted(p.name for p in tmp.iterdir())
        full_state = dict(state, step=step, version=FORMAT_VERSION, saved_at=time.time())
        full_state["files"] = {f: sha256_file(tmp / f) for f in files}
        atomic_write_json(tmp / STATE_FILE, full_state)
        # An existing `final` is a leftover from a run that crashed before LATEST named it.
        commit_dir(tmp, final)
        atomic_write_text(ckpt_root / "LATEST", name + "\n")
        if is_best:
            atomic_write_text(ckpt_root / "BEST", name + "\n")
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):  # OSError ENOSPC, or torch.save's RuntimeError on a short write
            need = _nbytes(model_state) + _nbytes(trainer_state)
            raise full_disk_error(
                ckpt_root,
                f"checkpoint {name}",
                need,
                "LATEST still names the previous checkpoint, which is intact; free some space "
                "and run again (it resumes from there)",
            ) from None
        if isinstance(e, OSError):  # a quota, an I/O error: say so in one line
            raise CheckpointError(
                f"{ckpt_root}: writing checkpoint {name} failed ({e.strerror or e}); "
                f"LATEST still names the previous one, which is intact"
            ) from None
        raise
    prune_checkpoints(ckpt_root, keep_last)
    return final


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors in `obj` (nested dicts, lists): what saving it needs, about."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def prune_checkpoints(ckpt_root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (not LATEST, BEST) and dead temp dirs."""
    keep = {read_pointer(ckpt_root, "LATEST"), read_pointer(ckpt_root, "BEST")}
    ckpts = list_checkpoints(ckpt_root)
    keep.update(p.name for p in ckpts[-keep_last:])
    for p in ckpts:
        if p.name not in keep:
            # Renamed out of sight first: a kill inside rmtree must not leave a half-deleted
            # folder under a checkpoint's name.
            trash = ckpt_root / f".trash-{p.name}-{os.getpid()}"
            os.rename(p, trash)
            shutil.rmtree(trash, ignore_errors=True)
    # Leftovers of dead processes: unfinished writes, half-deleted or replaced checkpoints.
    for p in [*ckpt_root.glob(".tmp-*"), *ckpt_root.glob(".trash-*"), *ckpt_root.glob(".*.old-*")]:
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
