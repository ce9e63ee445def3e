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


def test_a_kill_while_pruning_leaves_no_half_deleted_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 inside the rmtree of an old checkpoint: every step_* folder left is whole."""
    import shutil

    import torch

    from minillm.checkpoint import layout, store

    weights = {"w": torch.ones(2)}
    for step in (1, 2):
        store.save_checkpoint(tmp_path, step, weights, {"step": step}, {"config": {}}, keep_last=5)
    real_rmtree = shutil.rmtree

    def killed_midway(path, ignore_errors=False):  # deletes one file, then the process "dies"
        next(p for p in Path(path).iterdir() if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        store.save_checkpoint(tmp_path, 3, weights, {"step": 3}, {"config": {}}, keep_last=2)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    root = tmp_path / "checkpoints"
    names = [p.name for p in layout.list_checkpoints(root)]
    assert names == ["step_000002", "step_000003"]
    for ckpt in layout.list_checkpoints(root):
        layout.verify_checkpoint(ckpt)  # whole
    (trash,) = root.glob(".trash-step_000001-*")  # out of sight; a later run clears it
    trash.rename(root / ".trash-step_000001-999999999")  # as left by a process now dead
    store.prune_checkpoints(root, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step_000002", "step_000003"]
