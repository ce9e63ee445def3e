"""The training loop: schedule, accumulation, exact resume, checkpoint safety, logging, NaNs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from minillm.checkpoint import layout
from minillm.checkpoint import store as ckpt
from minillm.config import config_from_dict, config_to_dict
from minillm.data.batches import MicroBatch
from minillm.errors import ConfigError, UserError
from minillm.train.schedule import lr_at
from minillm.train.trainer import Trainer, TrainingDiverged
from tests.helpers import (
    assert_same_function,
    assert_same_weights,
    make_trainer,
    resumed_runs,
    run_config,
    run_trainer,
    weights,
)


def test_lr_schedule_exact_table() -> None:
    got = [lr_at(s, lr=1.0, min_lr=0.1, warmup_steps=2, max_steps=6) for s in range(8)]
    half = 0.1 + 0.45 * (1 + math.cos(math.pi / 4))
    quarter = 0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4))
    want = [0.5, 1.0, 1.0, half, 0.55, quarter, 0.1, 0.1]
    assert got == pytest.approx(want, abs=1e-12)


make_cfg = run_config


def test_resume_is_bitwise_exact(data_dir: Path, tmp_path: Path) -> None:
    # Dropout draws random numbers: their state must resume too.
    cfg = make_cfg(data_dir, tmp_path / "straight", model=dict(dropout=0.1))
    straight, _, resumed = resumed_runs(cfg, tmp_path, stop_at=3)  # saves at 3, between ckpts
    assert resumed.state.step == 8
    assert_same_weights(straight, resumed)


def test_accumulation_equals_one_big_batch_with_uneven_masks(
    data_dir: Path, tmp_path: Path
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 300, (4, 32), generator=g)
    y = torch.randint(0, 300, (4, 32), generator=g)
    y[0, :25] = -100  # the first micro-batch predicts far fewer tokens than the second
    y[1, 3:9] = -100

    def grads_of(trainer: Trainer) -> dict[str, torch.Tensor]:
        captured = {}

        def capture(*a, **k):
            captured.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})

        trainer.optimizer.step = capture
        trainer.train_step()
        return captured

    split = [MicroBatch(x[:2], y[:2]), MicroBatch(x[2:], y[2:])]
    cfg = make_cfg(data_dir, tmp_path / "a", grad_accum=2, batch_size=2)
    t1 = make_trainer(cfg, verbose=False, batches=lambda step: split)
    accumulated = grads_of(t1)
    t1.close()
    cfg = make_cfg(data_dir, tmp_path / "b", grad_accum=1, batch_size=4)
    t2 = make_trainer(cfg, verbose=False, batches=lambda step: [MicroBatch(x, y)])
    big = grads_of(t2)
    t2.close()
    for name in big:
        assert_same_function(accumulated[name], big[name])


def test_failed_save_leaves_previous_checkpoint_and_latest(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    cfg = make_cfg(data_dir, tmp_path / "run")
    trainer = run_trainer(cfg, stop_at=4)
    ckpt_root = tmp_path / "run" / "checkpoints"
    assert (ckpt_root / "LATEST").read_text().strip() == "step_000004"

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    trainer = make_trainer(cfg, verbose=False)
    try:
        trainer.train_step()
        trainer.state.step += 1
        monkeypatch.setattr(ckpt.torch, "save", full_disk)
        with pytest.raises(ckpt.UserError, match="checkpoints: no space left on the device"):
            trainer.save()
    finally:
        trainer.close()
    assert (ckpt_root / "LATEST").read_text().strip() == "step_000004"
    assert sorted(p.name for p in ckpt_root.iterdir()) == ["BEST", "LATEST", "step_000004"]
    layout.verify_checkpoint(ckpt_root / "step_000004")
    loaded = ckpt.load_checkpoint(tmp_path / "run")
    assert loaded.state["step"] == 4


def test_tensorboard_has_the_scalars(data_dir: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(data_dir, tmp_path / "run", max_steps=20, log_every=2)
    run_trainer(cfg)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec",
                "train/mfu", "val/loss", "val/bits_per_byte", "val/perplexity"):  # fmt: skip
        assert tag in tags, tag
    assert any(t.startswith("xray/update_ratio/") for t in tags)
    assert any(t.startswith("xray/activation_rms/") for t in tags)
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert len(losses) == 10 and losses[-1] < losses[0]
    assert [e.step for e in acc.Scalars("val/loss")] == [4, 8, 12, 16, 20]


def nan_at(trainer: Trainer, bad_steps: set[int]) -> Trainer:
    """Poisons the training loss of the chosen steps, through the model's public forward."""
    forward = trainer.train_model.forward

    def poisoned(*args, **kwargs):
        logits, loss = forward(*args, **kwargs)
        if trainer.state.step in bad_steps and torch.is_grad_enabled():  # not the evaluations
            loss = loss * float("nan")
        return logits, loss

    trainer.train_model.forward = poisoned  # an instance attribute: this trainer only
    return trainer


def test_nan_step_is_skipped_and_counted(data_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(data_dir, tmp_path / "run", max_steps=6)
    trainer = nan_at(make_trainer(cfg, verbose=False), {2})
    try:
        trainer.fit(stop_at=2)
        before = weights(trainer)
        out = trainer.train_step()  # step 2 is poisoned
        assert not out.finite
        after = weights(trainer)
        assert all(torch.equal(before[k], after[k]) for k in before)
        trainer.count_step(out)
        trainer.fit()
        assert trainer.state.skipped_steps == 1 and trainer.state.step == 6
        assert all(torch.isfinite(v).all() for v in weights(trainer).values())
    finally:
        trainer.close()


def test_too_many_bad_steps_stop_with_the_last_good_checkpoint(
    data_dir: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(data_dir, tmp_path / "run", max_steps=20, max_bad_steps=3)
    trainer = nan_at(make_trainer(cfg, verbose=False), set(range(5, 20)))
    try:
        with pytest.raises(TrainingDiverged, match="step 8: 3 non-finite steps in a row") as err:
            trainer.fit()
    finally:
        trainer.close()
    assert "step_000004" in str(err.value)


def test_resume_with_other_architecture_is_refused_naming_keys(
    data_dir: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(data_dir, tmp_path / "run")
    run_trainer(cfg, stop_at=4)
    raw = config_to_dict(cfg)
    raw["model"]["n_layer"] = 3
    raw["model"]["d_model"] = 64
    with pytest.raises(UserError, match=r"model\.d_model.*model\.n_layer"):
        make_trainer(config_from_dict(raw), verbose=False)
    raw = config_to_dict(cfg)
    raw["train"]["max_steps"] = 12  # a schedule-only change is fine
    trainer = run_trainer(config_from_dict(raw))
    assert trainer.state.step == 12


def test_running_a_finished_run_again_rewrites_none_of_its_files(
    data_dir: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(data_dir, tmp_path / "run", max_steps=4, ckpt_every=2)
    run_trainer(cfg)
    run = Path(cfg.train.out_dir)
    kept = [p for p in run.rglob("*") if p.is_file() and "tb" not in p.parts]
    before = {p: p.stat().st_mtime_ns for p in kept}
    assert run / "config.yaml" in before and len(before) > 5
    again = run_trainer(cfg)
    assert again.resumed and again.state.step == 4
    assert {p: p.stat().st_mtime_ns for p in kept} == before
    assert sorted(p for p in run.rglob("*") if p.is_file() and "tb" not in p.parts) == sorted(kept)


def test_no_resume_needs_force(data_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(data_dir, tmp_path / "run")
    run_trainer(cfg, stop_at=4)
    with pytest.raises(UserError, match="--force"):
        make_trainer(cfg, resume=False, verbose=False)
    trainer = run_trainer(cfg, resume=False, force=True, stop_at=2)
    assert trainer.state.step == 2


def test_second_trainer_on_the_same_run_is_refused(data_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(data_dir, tmp_path / "run")
    first = make_trainer(cfg, verbose=False)
    try:
        with pytest.raises(UserError, match="another `minillm train`"):
            make_trainer(cfg, verbose=False)
    finally:
        first.close()
    make_trainer(cfg, verbose=False).close()  # released: the next one may start


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_keeps_fp32_weights_and_resumes(
    data_dir: Path, tmp_path: Path, precision: str
) -> None:
    # bf16 is slow on this CPU (no native support), hence the tiny model and few steps.
    cfg = make_cfg(data_dir, tmp_path / "run", precision=precision, max_steps=4, ckpt_every=2)
    trainer = make_trainer(cfg, verbose=False)
    try:
        assert trainer.precision == precision
        assert (trainer.scaler is not None) == (precision == "fp16")
        losses = []
        for _ in range(2):
            out = trainer.train_step()
            trainer.state.step += 1
            losses.append(float(out.loss))
        assert all(math.isfinite(x) for x in losses) and out.finite
        # Autocast runs the matmuls in low precision; the weights and AdamW moments stay fp32.
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        trainer.save()
    finally:
        trainer.close()
    state = ckpt.load_trainer_state(layout.find_latest(cfg.train.out_dir))
    if precision == "fp16":
        assert state["scaler"]["scale"] > 0  # the loss scale resumes with the run
    resumed = run_trainer(cfg)
    assert resumed.state.step == 4
    assert all(torch.isfinite(v).all() for v in weights(resumed).values())


def test_overflowed_weights_are_never_checkpointed(data_dir: Path, tmp_path: Path) -> None:
    # With a huge lr the first steps have finite gradients but blow the weights up: those
    # weights must not become a checkpoint, nor LATEST, nor "the last good checkpoint".
    from safetensors.torch import load_file

    cfg = make_cfg(data_dir, tmp_path / "run", max_steps=20, lr=1e20, min_lr=0.0, warmup_steps=1,
                   ckpt_every=1, eval_every=0, max_bad_steps=3)  # fmt: skip
    with pytest.raises(TrainingDiverged) as err:
        run_trainer(cfg)
    latest = layout.find_latest(cfg.train.out_dir)
    saved = sorted((Path(cfg.train.out_dir) / "checkpoints").glob("step_*"))
    for folder in saved:
        assert all(
            torch.isfinite(t).all() for t in load_file(folder / "model.safetensors").values()
        )
    assert str(latest or "none") in str(err.value)


def test_shards_from_another_source_are_warned_about(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = make_cfg(data_dir, tmp_path / "same", max_steps=1)
    make_trainer(cfg, verbose=False).close()
    assert "warning" not in capsys.readouterr().err
    other = make_cfg(data_dir, tmp_path / "other", max_steps=1)
    other.data.source = str(tmp_path / "another.jsonl")
    make_trainer(other, verbose=False).close()
    err = capsys.readouterr().err
    assert "meta.json: the shards were made with other data.source than this config's" in err
    # Another column is an error, not a warning: the run would record the wrong one.
    other.data.text_field = "body"
    with pytest.raises(ConfigError, match="data.text_field: .*'text'.*'body'"):
        make_trainer(other, verbose=False)
    assert not (tmp_path / "other" / "checkpoints").exists()


def test_val_bits_per_byte_equals_minillm_eval_over_the_whole_split(
    data_dir: Path, tmp_path: Path
) -> None:
    from minillm.infer.evaluate import evaluate_checkpoint

    cfg = make_cfg(data_dir, tmp_path / "run", max_steps=2, eval_every=2, eval_steps=0)
    val = run_trainer(cfg).evaluate()
    got = evaluate_checkpoint(ckpt.load_checkpoint(cfg.train.out_dir))
    assert got["loss"] == pytest.approx(val["loss"], rel=1e-6)
    assert got["bits_per_byte"] == pytest.approx(val["bits_per_byte"], rel=1e-6)


def test_tensorboard_steps_only_go_forward_after_a_crash(data_dir: Path, tmp_path: Path) -> None:
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(data_dir, tmp_path / "run", max_steps=8, log_every=1, eval_every=4)
    run_trainer(cfg, stop_at=7)  # checkpoints at 4 and 7, steps 1..7 logged
    # A crash after step 7 was logged but before its checkpoint: only step 4 is on disk.
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.rmtree(ckpts / "step_000007")
    (ckpts / "LATEST").write_text("step_000004")
    run_trainer(cfg)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 9))
    assert [e.step for e in acc.Scalars("val/loss")] == [4, 8]
