"""A resume that redraws the learning rate of steps already taken says so, naming the keys."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from helpers import prepared_config, tiny_config
from tiny_run import make_run

from minillm.config import config_from_dict, config_to_dict
from minillm.train.resume import resume_point, schedule_change
from minillm.train.trainer import Trainer

KW = dict(resume=True, force=False, clear=False, verbose=True)


def resume_with(tmp_path: Path, capsys: pytest.CaptureFixture, **train: object) -> str:
    """stderr of resuming a step-10 run (warmup 2, max_steps 20) with `train` changed."""
    run_dir, cfg, _ = make_run(tmp_path, train=dict(warmup_steps=2, max_steps=20))
    raw = config_to_dict(cfg)
    raw["train"].update(train)
    capsys.readouterr()
    resume_point(run_dir, config_from_dict(raw), cfg.data.tokenizer, "sha", 1, **KW)
    return capsys.readouterr().err


def test_raising_max_steps_after_the_cosine_began_is_warned(tmp_path, capsys) -> None:
    err = resume_with(tmp_path, capsys, max_steps=40)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "train.max_steps (20 -> 40)" in lines[0], err
    assert "steps already taken" in lines[0] and "at step 10" in lines[0]


def test_lr_change_is_named_once(tmp_path, capsys) -> None:
    err = resume_with(tmp_path, capsys, lr=1e-3, weight_decay=0.05)
    lines = err.strip().splitlines()
    assert "train.lr (0.0003 -> 0.001)" in lines[0] and "steps already taken" in lines[0]
    assert len(lines) == 2 and "train.weight_decay" in lines[1] and "train.lr" not in lines[1]


@pytest.mark.parametrize(
    "train", [dict(max_steps=20), dict(eval_every=7)], ids=["same", "cadence-only"]
)
def test_schedule_kept_is_not_warned(tmp_path, capsys, train) -> None:
    assert "learning rate" not in resume_with(tmp_path, capsys, **train)


def test_schedule_change_only_counts_steps_already_taken(tmp_path) -> None:
    _, cfg, _ = make_run(tmp_path, train=dict(warmup_steps=5, max_steps=20))
    old = config_to_dict(cfg)
    longer = copy.deepcopy(cfg)
    longer.train.max_steps = 40
    # Steps 0-5 (warmup, then the peak) have the same lr either way: extending is seamless there.
    assert schedule_change(old, longer, 6) is None
    assert "train.max_steps (20 -> 40)" in schedule_change(old, longer, 7)


def test_trainer_warns_when_a_finished_run_is_extended(tmp_path, capsys) -> None:
    prepared_config(tmp_path)
    cfg = tiny_config(tmp_path)  # max_steps 8, warmup 2
    trainer = Trainer.from_config(cfg, verbose=False)
    try:
        trainer.fit(stop_at=4)
    finally:
        trainer.close()
    raw = config_to_dict(cfg)
    raw["train"]["max_steps"] = 16
    capsys.readouterr()
    Trainer.from_config(config_from_dict(raw), verbose=True).close()
    assert "train.max_steps (8 -> 16)" in capsys.readouterr().err
