"""`minillm info`'s "fits: run" row at the dtype sampling loads the weights in: `--dtype auto`
is a bf16 folder's bf16 (not train.precision's fp32 on a CPU, 2x the bytes), a run's checkpoint
its stored fp32; `info --dtype` sizes the row as `sample --dtype` loads. The training rows keep
train.precision's dtype, and every row says which dtype it assumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from minillm.checkpoint.store import auto_dtype, load_checkpoint
from minillm.cli import app
from tests.helpers import error_line, make_run
from tests.test_info_fits import MODEL
from tests.test_lazy_load import bf16_folder

runner = CliRunner()
FP32 = ["--set", "train.precision=fp32"]  # the training rows in fp32 on any machine


def fits_of(args: list[str]) -> dict:
    result = runner.invoke(app, ["info", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["fits"]


def test_a_bf16_folder_runs_in_bf16_its_training_rows_in_train_precision(tmp_path: Path) -> None:
    folder, hf = bf16_folder(tmp_path)
    params = sum(p.numel() for p in hf.parameters())
    fits = fits_of(["--ckpt", str(folder), *FP32])
    assert fits["run_dtype"] == "bf16" and fits["dtype"] == "fp32"
    assert fits["run"]["weights"] == 2 * params  # what sample's --dtype auto holds
    assert fits["lora"]["weights"] == 4 * params  # the frozen base in train.precision's fp32
    # `sample --dtype auto` loads it in the dtype the row assumes.
    assert loaded_dtypes(folder) == {torch.bfloat16}
    table = runner.invoke(app, ["info", "--ckpt", str(folder), *FP32], env={"COLUMNS": "80"})
    assert table.exit_code == 0, table.output
    assert all(len(line) <= 80 for line in table.output.splitlines())
    for label in ("fits: run (bf16)", "fits: LoRA r16 (fp32 base)", "fits: QLoRA r16 (NF4 base)",
                  "fits: full fine-tune (fp32)", "fits: run (bf16, "):  # fmt: skip
        assert label in table.stdout, label


DTYPES = [("float32", "fp32", 4), ("bfloat16", "bf16", 2), ("float16", "fp16", 2)]


def loaded_dtypes(path: Path, dtype: str = "auto") -> set[torch.dtype]:
    """The dtypes `sample --dtype` holds `path`'s weights in."""
    return {p.dtype for p in load_checkpoint(path, dtype=dtype).model.parameters()}


@pytest.mark.parametrize(("dtype", "name", "size"), DTYPES)
def test_dtype_sizes_the_run_row_as_sample_loads(
    tmp_path: Path, dtype: str, name: str, size: int
) -> None:
    folder, hf = bf16_folder(tmp_path)
    params = sum(p.numel() for p in hf.parameters())
    fits = fits_of(["--ckpt", str(folder), "--dtype", dtype, *FP32])
    assert fits["run_dtype"] == name and fits["run"]["weights"] == size * params
    assert fits["lora"]["weights"] == 4 * params  # --dtype is the run row's alone
    assert loaded_dtypes(folder, dtype) == {getattr(torch, dtype)}


def test_without_a_config_dtype_the_weights_or_float32_say(tmp_path: Path) -> None:
    """config.json without `dtype`: the weights' stored dtype; config.json alone (a hub name's
    fetch, no weights) without one: float32, with `torch_dtype` (transformers < 5) its value."""
    folder, _ = bf16_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["dtype"]
    (folder / "config.json").write_text(json.dumps(config))
    assert fits_of(["--ckpt", str(folder)])["run_dtype"] == "bf16"
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "config.json").write_text(json.dumps(config))
    assert fits_of(["--ckpt", str(alone)])["run_dtype"] == "fp32"
    (alone / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    assert fits_of(["--ckpt", str(alone)])["run_dtype"] == "fp16"


def test_a_runs_checkpoint_runs_in_its_stored_fp32_whatever_train_precision(
    tmp_path: Path,
) -> None:
    run_dir, _, model = make_run(tmp_path)
    params = model.param_count()
    fits = fits_of(["--ckpt", str(run_dir), "--set", "train.precision=bf16"])
    assert fits["dtype"] == "bf16" and fits["run_dtype"] == "fp32"
    assert fits["run"]["weights"] == 4 * params and fits["lora"]["weights"] == 2 * params
    assert fits_of(["--ckpt", str(run_dir), "--dtype", "bfloat16"])["run"]["weights"] == 2 * params
    ckpt = next((run_dir / "checkpoints").glob("step_*"))
    assert auto_dtype(ckpt) == torch.float32
    assert loaded_dtypes(run_dir) == {torch.float32}
    # A LoRA run's: the dtype its base was frozen in, state.json's lora_base.dtype.
    lora = {"lora_base": {"sha256": "0" * 64, "dtype": "bfloat16"}}
    assert auto_dtype(ckpt, lora) == torch.bfloat16


def test_a_config_runs_at_train_precision_or_dtype(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL, "data": {"vocab_size": 300},
                                    "train": {"precision": "fp32", "seq_len": 32}}))  # fmt: skip
    assert fits_of([str(path)])["run_dtype"] == "fp32"
    fits = fits_of([str(path), "--dtype", "bfloat16"])
    assert fits["run_dtype"] == "bf16" and fits["dtype"] == "fp32"
    assert fits["run"]["kv_cache"] == 32 * 2 * (2 * 2 * 16) * 2  # the KV cache in bf16 too


def test_a_bad_dtype_is_one_line(tmp_path: Path) -> None:
    folder, _ = bf16_folder(tmp_path)
    bad = runner.invoke(app, ["info", "--ckpt", str(folder), "--dtype", "bf16"])
    assert error_line(bad) == (
        "error: --dtype: 'bf16' is not one of auto, float32, bfloat16, float16"
    )
