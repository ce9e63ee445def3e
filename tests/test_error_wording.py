"""Error messages that a new user read wrong (issue 36): a list's expected type, and a damaged
best checkpoint that `--best` cannot load although the newest intact one can."""

from __future__ import annotations

from pathlib import Path

import pytest

from minillm.checkpoint.layout import find_latest, resolve_checkpoint
from minillm.checkpoint.store import save_checkpoint
from minillm.config import ConfigError, _type_name, config_from_dict
from minillm.errors import CheckpointError
from tests.helpers import make_run

MODEL = {"d_model": 32, "n_layer": 1, "n_head": 4}


@pytest.mark.parametrize(
    "tp, name",
    [
        (tuple[float, float], "a list of 2 numbers"),
        (tuple[int, int, int], "a list of 3 integers"),
        (tuple[int, str], "a list of 2 values: an integer, a string"),
        (list[str], "a list of strings"),
        (list[int], "a list of integers"),
        (list[bool], "a list of values, each true or false"),
        (list[int | None], "a list of values, each an integer or null"),
    ],
)
def test_list_type_names_read_as_english(tp: object, name: str) -> None:
    assert _type_name(tp) == name


@pytest.mark.parametrize("betas", [0.9, [0.9], [0.9, 0.95, 0.99]])
def test_betas_of_the_wrong_shape_say_two_numbers(betas: object) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": MODEL, "train": {"betas": betas}}, file="c.yaml")
    assert str(err.value) == f"c.yaml: train.betas: expected a list of 2 numbers, got {betas!r}"


@pytest.fixture
def run_with_damaged_best(tmp_path: Path) -> Path:
    """A run whose BEST (step 10) is damaged, with an intact newer checkpoint (step 20)."""
    run_dir, cfg, net = make_run(tmp_path)
    best = run_dir / "checkpoints" / "step_000010"
    (run_dir / "checkpoints" / "BEST").write_text(best.name + "\n")
    save_checkpoint(
        run_dir,
        step=20,
        model_state=net.state_dict(),
        trainer_state={"step": 20},
        state={"config": {}, "tokens_seen": 2000, "val_loss": 6.0},
        tokenizer_file=tmp_path / "tokenizer.json",
    )
    data = bytearray((best / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (best / "model.safetensors").write_bytes(bytes(data))
    return run_dir


def test_a_damaged_best_suggests_leaving_out_best(run_with_damaged_best: Path) -> None:
    run_dir = run_with_damaged_best
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(run_dir, best=True)
    message = str(err.value)
    assert message.startswith(f"{run_dir}/checkpoints/step_000010/model.safetensors: sha256 ")
    assert message.endswith("; or leave out --best to use the newest intact checkpoint")
    # What the suggestion promises: without --best the run loads.
    assert find_latest(run_dir) == run_dir / "checkpoints" / "step_000020"
    assert resolve_checkpoint(run_dir) == run_dir / "checkpoints" / "step_000020"


def test_a_best_naming_no_checkpoint_suggests_leaving_out_best(
    run_with_damaged_best: Path,
) -> None:
    run_dir = run_with_damaged_best
    (run_dir / "checkpoints" / "BEST").write_text("step_000003\n")
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(run_dir, best=True)
    assert str(err.value) == (
        f"{run_dir}/checkpoints/BEST: names 'step_000003', which is not a checkpoint; "
        "or leave out --best to use the newest intact checkpoint"
    )
