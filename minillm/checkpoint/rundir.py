"""The run directory: one trainer at a time (a lock), and what a resume may change.

Offers `RunLock`, `resume_point` (which checkpoint a `minillm train` continues from) and
`resume_differences(old, new) -> (refused, changed)`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from minillm.checkpoint import store as ckpt
from minillm.config import Config, config_from_dict, config_to_dict
from minillm.errors import ConfigError, UserError, warn

LOCK_FILE = "train.lock"

# Keys a resumed run may change without a word: they only move the end or the cadence.
REFUSED_KEYS = {"data.vocab_size", "train.optimizer"}
SCHEDULE_KEYS = {
    "train.max_steps",
    "train.eval_every",
    "train.eval_steps",
    "train.ckpt_every",
    "train.keep_last",
    "train.log_every",
    "train.max_bad_steps",
    "train.peak_flops",
    "train.device",
    "train.compile",
    "train.out_dir",
    "train.parallel",  # a change of world size or wrapping is reported on its own
}


class RunLock:
    """An exclusive `flock` on <run>/train.lock, so two trainers never write the same run.

    The kernel drops the lock when its process dies (even by SIGKILL), so a lock left by a dead
    process is simply taken over; the file keeps the holder's pid and host for the message.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(
                f"{self.path.parent}: another `minillm train` is using this run ({holder}); "
                "wait for it or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _flatten(cfg: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, section in cfg.items() for k, v in section.items()}


def resume_differences(old: dict[str, Any], new: Config) -> tuple[list[str], list[str]]:
    """Keys whose change refuses a resume (architecture, tokenizer) and keys that merely changed.

    `old` is the config dict saved with the checkpoint.
    """
    with contextlib.suppress(ConfigError):  # resolve nulls (n_kv_head, ...) as `new` has them
        old = config_to_dict(config_from_dict(old))
    before, after = _flatten(old), _flatten(config_to_dict(new))
    refused, changed = [], []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if isinstance(a, list):
            a = tuple(a)
        if isinstance(b, list):
            b = tuple(b)
        if a == b or key in SCHEDULE_KEYS:
            continue
        entry = f"{key} ({a!r} -> {b!r})"
        # The optimizer's state has another shape (Muon keeps one buffer, AdamW two moments).
        if (key.startswith("model.") and key != "model.dropout") or key in REFUSED_KEYS:
            refused.append(entry)
        else:
            changed.append(entry)
    return refused, changed


def resume_point(
    run_dir: Path,
    cfg: Config,
    tokenizer_file: str | Path,
    tokenizer_sha: str,
    world_size: int,
    *,
    resume: bool,
    force: bool,
    clear: bool,
    verbose: bool,
) -> Path | None:
    """The checkpoint a run continues from, or None to start afresh.

    Starting over a run that has checkpoints needs `resume=False` and `force`; then (where
    `clear`, i.e. on rank 0) its checkpoints and TensorBoard files are deleted. A checkpoint whose
    architecture or tokenizer differs from `cfg` is refused, naming the keys.
    """
    ckpt_root = run_dir / ckpt.CKPT_DIR
    if not ckpt.list_checkpoints(ckpt_root):
        return None
    if not resume:
        if not force:
            raise UserError(
                f"{run_dir}: has checkpoints; --no-resume starts over only with --force"
            )
        if clear:
            shutil.rmtree(ckpt_root)
            shutil.rmtree(run_dir / "tb", ignore_errors=True)
        return None
    found = ckpt.find_latest(run_dir)
    if found is None:
        return None
    state = ckpt.read_state(found)
    refused, changed = resume_differences(state["config"], cfg)
    if state.get("tokenizer_sha256") not in (None, tokenizer_sha):
        refused.append(f"tokenizer ({tokenizer_file} differs from the run's)")
    if refused:
        raise UserError(
            f"{found}: cannot resume with a different architecture, tokenizer or optimizer: "
            + "; ".join(refused)
        )
    if changed and verbose:
        warn(f"resuming with changed settings: {'; '.join(changed)}")
    old_world = state.get("world_size", 1)
    old_train = state["config"].get("train", {})
    old_global = old_train.get("batch_size", 0) * old_train.get("grad_accum", 0) * old_world
    new_global = cfg.train.batch_size * cfg.train.grad_accum * world_size
    if old_global != new_global and verbose:
        # The windows of a step depend on the global batch alone, not on how it is split.
        warn(
            f"resuming a run of global batch {old_global} sequences (world size {old_world}) "
            f"with {new_global} (world size {world_size}): the batches differ from here on"
        )
    return found
