"""train.ema_decay: an average of the weights, evaluated and saved, resumed bit for bit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minillm.checkpoint import layout
from minillm.checkpoint import store as ckpt
from minillm.cli import app
from minillm.infer.evaluate import evaluate_checkpoint
from minillm.model import Transformer
from minillm.train.ema import WeightEMA
from tests.helpers import (
    assert_same_weights,
    error_line,
    make_trainer,
    resumed_runs,
    run_config,
    run_trainer,
    tiny_config,
)
from tests.test_trainer import nan_at


def latest(cfg) -> Path:  # noqa: ANN001
    return layout.find_latest(cfg.train.out_dir)


def test_average_warms_up_then_decays_and_swaps_back(data_dir: Path) -> None:
    model = Transformer(tiny_config(data_dir).model)
    w = model.tok_emb.weight
    start = w.detach().clone()
    ema = WeightEMA(model, decay=0.6)
    with torch.no_grad():
        w.add_(1.0)
    ema.update()  # decay min(0.6, 1/2): the mean of the start and the new weights
    torch.testing.assert_close(ema.average[0], start + 0.5)
    ema.update()  # then min(0.6, 2/3) = 0.6
    torch.testing.assert_close(ema.average[0], start + 0.5 * 0.6 + 0.4)
    with ema.swapped():
        torch.testing.assert_close(model.tok_emb.weight.detach(), start + 0.7)
    assert torch.equal(model.tok_emb.weight.detach(), start + 1.0)
    ema.reset(updates=5)
    assert torch.equal(ema.average[0], start + 1.0) and ema.updates == 5


def test_swapping_a_half_precision_model_keeps_the_fp32_average(data_dir: Path) -> None:
    model = Transformer(tiny_config(data_dir).model).to(torch.bfloat16)
    ema = WeightEMA(model, decay=0.9)
    ema.average[0].add_(1e-4)  # below bf16's resolution at these magnitudes
    before = [a.clone() for a in ema.average]
    raw = model.tok_emb.weight.detach().clone()
    with ema.swapped():
        pass
    assert all(torch.equal(a, b) for a, b in zip(ema.average, before, strict=True))
    assert torch.equal(model.tok_emb.weight.detach(), raw)


def test_the_average_changes_nothing_in_training_and_is_what_is_saved(
    data_dir: Path, tmp_path: Path
) -> None:
    plain_cfg = run_config(data_dir, tmp_path / "plain", max_steps=6, eval_every=3, eval_steps=0)
    plain = run_trainer(plain_cfg)
    ema_cfg = copy.deepcopy(plain_cfg)
    ema_cfg.train.out_dir, ema_cfg.train.ema_decay = str(tmp_path / "ema"), 0.8
    with_ema = run_trainer(ema_cfg)
    # The same training: the raw weights in the trainer state are the plain run's weights.
    raw = ckpt.load_trainer_state(latest(ema_cfg))["ema"]
    assert raw["updates"] == 6
    for name, tensor in ckpt.load_model_state(latest(plain_cfg)).items():
        assert torch.equal(raw["weights"][name], tensor), name
    # The model file is the average, what the trainer evaluated, what `minillm eval` scores.
    saved = ckpt.load_model_state(latest(ema_cfg))
    averaged = dict(zip([n for n, _ in with_ema.model.named_parameters()], with_ema.ema.average))
    assert all(torch.equal(saved[n], averaged[n]) for n in averaged)
    assert not torch.equal(saved["tok_emb.weight"], raw["weights"]["tok_emb.weight"])
    got = evaluate_checkpoint(ckpt.load_checkpoint(ema_cfg.train.out_dir))
    assert got["loss"] == pytest.approx(with_ema.last_eval["loss"], rel=1e-6)
    assert got["loss"] != pytest.approx(plain.last_eval["loss"], rel=1e-6)
    # The trainer's own model holds the raw weights after the evaluations and saves.
    assert torch.equal(with_ema.model.tok_emb.weight, raw["weights"]["tok_emb.weight"])


def test_resume_continues_the_weights_and_the_average_bit_for_bit(
    data_dir: Path, tmp_path: Path
) -> None:
    cfg = run_config(data_dir, tmp_path / "straight", ema_decay=0.7)
    straight, _, resumed = resumed_runs(cfg, tmp_path, stop_at=3)  # stops between checkpoints
    assert_same_weights(straight, resumed)  # the raw weights the trainers hold
    a, b = latest(straight.cfg), latest(resumed.cfg)  # the average the checkpoints hold
    for name, tensor in ckpt.load_model_state(a).items():
        assert torch.equal(ckpt.load_model_state(b)[name], tensor), name
    raw_a, raw_b = ckpt.load_trainer_state(a)["ema"], ckpt.load_trainer_state(b)["ema"]
    assert raw_a["updates"] == raw_b["updates"] == 8
    assert all(torch.equal(raw_b["weights"][n], t) for n, t in raw_a["weights"].items())


def test_turning_the_average_on_or_off_at_a_resume_trains_on_from_the_raw_weights(
    data_dir: Path, tmp_path: Path
) -> None:
    cfg = run_config(data_dir, tmp_path / "run", max_steps=8, ckpt_every=4)
    run_trainer(cfg, stop_at=4)
    at4 = ckpt.load_model_state(latest(cfg))
    on = copy.deepcopy(cfg)
    on.train.ema_decay = 0.9
    trainer = run_trainer(on, stop_at=5)
    state = ckpt.load_trainer_state(latest(on))["ema"]
    assert state["updates"] == 1  # begun at the resume, from the step-4 weights
    off = copy.deepcopy(cfg)  # and off again: training goes on from the raw weights
    run_trainer(off, stop_at=6)
    assert trainer.state.step == 5 and set(ckpt.load_model_state(latest(off))) == set(at4)
    plain = copy.deepcopy(cfg)
    plain.train.out_dir = str(tmp_path / "plain")
    run_trainer(plain, stop_at=6)
    for name, tensor in ckpt.load_model_state(latest(plain)).items():
        assert torch.equal(ckpt.load_model_state(latest(off))[name], tensor), name


def test_a_skipped_step_moves_neither_the_weights_nor_the_average(
    data_dir: Path, tmp_path: Path
) -> None:

    cfg = run_config(data_dir, tmp_path / "run", max_steps=4, ema_decay=0.5)
    trainer = nan_at(make_trainer(cfg, verbose=False), {2})
    try:
        trainer.fit(stop_at=2)
        before = [a.clone() for a in trainer.ema.average]
        out = trainer.train_step()
        assert not out.finite and trainer.ema.updates == 2
        assert all(torch.equal(a, b) for a, b in zip(trainer.ema.average, before, strict=True))
    finally:
        trainer.close()


@pytest.mark.parametrize("value", ["1.0", "-0.1"])
def test_a_decay_outside_zero_to_one_is_one_error_line(
    data_dir: Path, tmp_path: Path, value: str
) -> None:
    import yaml

    from minillm.config import config_to_dict

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(run_config(data_dir, tmp_path / "run"))))
    result = CliRunner().invoke(app, ["train", str(path), "--set", f"train.ema_decay={value}"])
    assert "train.ema_decay" in error_line(result)
    assert "[0, 1)" in error_line(result)
