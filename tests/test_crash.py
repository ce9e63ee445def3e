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


POST_TRAINING = {
    "dpo": {"data": {"source": "pairs.jsonl", "val_fraction": 0.2},
            "train": {"objective": "dpo"}},
    "grpo": {"data": {"source": "prompts.jsonl"},
             "train": {"objective": "grpo", "grpo": {"group_size": 4, "max_new_tokens": 6,
                                                     "reward": "python:rw_len:length"}}},
    "lora": {"data": {"source": "corpus.txt", "out_dir": "tokens"},
             "train": {"lora": {"rank": 4, "dropout": 0.1}}},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(POST_TRAINING))
def test_sigkills_lose_nothing_in_dpo_grpo_and_lora_runs(tmp_path: Path, kind: str) -> None:
    """scripts/crash_test.py --config: three kill -9s of a DPO, a GRPO (a varying reward: the
    rollouts matter) and a LoRA run (with dropout) end on the uninterrupted run's weights."""
    import yaml

    from tests.helpers import SHAKESPEARE, make_run, post_training_data

    make_run(tmp_path / "base")
    post_training_data(tmp_path)
    (tmp_path / "corpus.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000])
    spec = POST_TRAINING[kind]
    config = {
        "data": spec["data"],
        "train": {"init_from": "base/run", "batch_size": 2, "seq_len": 32, "lr": 1e-2,
                  "warmup_steps": 0, "eval_every": 10, "log_every": 1, "device": "cpu",
                  "precision": "fp32", **spec["train"]},
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "crash_test.py"), "--config", "run.yaml",
         "--kills", "3", "--seed", "2", "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("kill ") == 3
    assert "OK: 3 kills" in proc.stdout
