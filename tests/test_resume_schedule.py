"""A resume whose new schedule makes the learning rate jump says so, naming the keys and the lr
before and after; one that leaves the resume step's lr where the run had it says nothing."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import config_from_dict, config_to_dict
from minillm.train.resume import resume_point, schedule_change
from tests.helpers import SHAKESPEARE, make_run, make_trainer, prepared_config, tiny_config

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
    assert "learning rate jump" in lines[0] and "at step 10" in lines[0]


def test_lr_change_is_named_once(tmp_path, capsys) -> None:
    err = resume_with(tmp_path, capsys, lr=1e-3, weight_decay=0.05)
    lines = err.strip().splitlines()
    assert "train.lr (0.0003 -> 0.001)" in lines[0] and "learning rate jump" in lines[0]
    assert len(lines) == 2 and "train.weight_decay" in lines[1] and "train.lr" not in lines[1]


@pytest.mark.parametrize(
    "train", [dict(max_steps=20), dict(eval_every=7)], ids=["same", "cadence-only"]
)
def test_schedule_kept_is_not_warned(tmp_path, capsys, train) -> None:
    assert "learning rate" not in resume_with(tmp_path, capsys, **train)


def test_schedule_change_only_counts_the_resume_step(tmp_path) -> None:
    _, cfg, _ = make_run(tmp_path, train=dict(warmup_steps=5, max_steps=20, min_lr=1e-5))
    old = config_to_dict(cfg)
    longer = copy.deepcopy(cfg)
    longer.train.max_steps = 40
    # Steps 0-5 (warmup, then the peak) have the same lr either way: extending is seamless there,
    # and one step into the cosine the two curves are still within 1% of each other.
    assert schedule_change(old, longer, 5) is None
    assert schedule_change(old, longer, 6) is None
    assert "train.max_steps (20 -> 40)" in schedule_change(old, longer, 10)
    # A warmup redrawn over steps long past moves nothing at the resume step of a constant lr.
    constant = copy.deepcopy(cfg)
    constant.train.schedule = "constant"
    old_constant = config_to_dict(constant)
    constant.train.warmup_steps, constant.train.max_steps = 8, 40
    assert schedule_change(old_constant, constant, 10) is None


def test_the_jump_is_printed_with_digits_that_differ(tmp_path) -> None:
    _, cfg, _ = make_run(tmp_path, train=dict(warmup_steps=2, max_steps=20, schedule="constant"))
    old = config_to_dict(cfg)
    new = copy.deepcopy(cfg)
    new.train.lr = cfg.train.lr * 1.02  # 0.0003 -> 0.000306: equal at 2 significant digits
    text = schedule_change(old, new, 10)
    assert "from 0.0003 at step 9 to 0.000306 at step 10, where the run's schedule has 0.0003" in (
        text
    ), text


def test_trainer_warns_when_a_finished_run_is_extended(tmp_path, capsys) -> None:
    prepared_config(tmp_path)
    cfg = tiny_config(tmp_path)  # max_steps 8, warmup 2
    trainer = make_trainer(cfg, verbose=False)
    try:
        trainer.fit(stop_at=4)
    finally:
        trainer.close()
    raw = config_to_dict(cfg)
    raw["train"]["max_steps"] = 16
    capsys.readouterr()
    make_trainer(config_from_dict(raw), verbose=True).close()
    assert "train.max_steps (8 -> 16)" in capsys.readouterr().err


@pytest.mark.slow
def test_train_warns_only_when_the_lr_jumps_at_the_resume_step(tmp_path) -> None:
    """Through the CLI: a finished 4-step constant run extended with another warmup (steps long
    past redrawn, step 4's lr unchanged) is not warned about; a finished cosine extended is, with
    lr values that differ as printed (before: `from 0.01 at step 3 to 0.01 at step 4`)."""
    runner = CliRunner()
    (tmp_path / "corpus.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000])
    raw = {
        "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 16},
        "data": {"source": str(tmp_path / "corpus.txt"), "vocab_size": 300,
                 "out_dir": str(tmp_path / "tok")},
        "train": dict(out_dir=str(tmp_path / "run"), batch_size=2, seq_len=16, max_steps=4,
                      lr=1e-2, min_lr=1e-3, warmup_steps=2, schedule="constant", eval_every=4,
                      eval_steps=1, ckpt_every=4, log_every=2, device="cpu", precision="fp32"),
    }  # fmt: skip
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert runner.invoke(app, ["tokenize", str(cfg)]).exit_code == 0
    assert runner.invoke(app, ["train", str(cfg)]).exit_code == 0
    sets = ["--set", "train.max_steps=6", "--set", "train.warmup_steps=3"]
    result = runner.invoke(app, ["train", str(cfg), *sets])
    assert result.exit_code == 0, result.output
    assert "learning rate" not in result.stderr, result.stderr
    assert "resuming with changed settings: train.warmup_steps (2 -> 3)" in result.stderr
    raw["train"].update(schedule="cosine", out_dir=str(tmp_path / "cosine"))
    cfg.write_text(yaml.safe_dump(raw))
    assert runner.invoke(app, ["train", str(cfg)]).exit_code == 0
    result = runner.invoke(app, ["train", str(cfg), "--set", "train.max_steps=8"])
    assert result.exit_code == 0, result.output
    # The cosine reached min_lr 0.001 at step 4; with max_steps 8 step 4 is back up its curve.
    assert (
        "the lr goes from 0.0055 at step 3 to 0.00775 at step 4, where the run's schedule "
        "has 0.001" in result.stderr
    ), result.stderr
