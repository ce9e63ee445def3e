"""train.zero_init_residual: a fresh run's blocks start as the identity; resumes and init_from keep
their own weights."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import (
    assert_same_weights,
    make_trainer,
    resumed_runs,
    run_config,
    run_trainer,
    weights,
)


def started(cfg) -> dict[str, torch.Tensor]:  # noqa: ANN001
    trainer = make_trainer(cfg, verbose=False)
    trainer.close()
    return weights(trainer)


def test_the_projections_into_the_residual_stream_start_at_zero(
    data_dir: Path, tmp_path: Path
) -> None:
    plain = started(run_config(data_dir, tmp_path / "plain"))
    zero = started(run_config(data_dir, tmp_path / "zero", zero_init_residual=True))
    residual = [k for k in plain if k.endswith(("attn.wo.weight", "ffn.w_down.weight"))]
    assert len(residual) == 2 * 2  # two blocks
    for name, tensor in plain.items():
        if name in residual:
            assert not zero[name].any() and tensor.abs().sum() > 0, name
        else:  # the same seed, the same draws for every other weight
            assert torch.equal(zero[name], tensor), name


def test_they_grow_from_the_gradient_and_a_run_resumes_bit_for_bit(
    data_dir: Path, tmp_path: Path
) -> None:
    straight = run_trainer(run_config(data_dir, tmp_path / "a", zero_init_residual=True))
    for w in straight.model.residual_projections():
        assert w.abs().sum() > 0
    cfg = run_config(data_dir, tmp_path / "b", zero_init_residual=True, ckpt_every=4)
    again, _, resumed = resumed_runs(cfg, tmp_path, stop_at=4)
    assert_same_weights(straight, again)  # the same run wherever it goes
    assert_same_weights(straight, resumed)


def test_init_from_brings_its_own_projections(data_dir: Path, tmp_path: Path) -> None:
    source = run_trainer(run_config(data_dir, tmp_path / "src", max_steps=2))
    cfg = run_config(
        data_dir, tmp_path / "ft", zero_init_residual=True, init_from=str(tmp_path / "src")
    )
    got = started(cfg)
    for name, tensor in weights(source).items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
