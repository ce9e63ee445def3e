"""`minillm info --ckpt PATH` (issue 41, item 6): a run, a checkpoint or a Hugging Face folder,
read without its weights; a folder's parameter count is transformers' (published shapes, from
config.json alone), a run's is what `info` of its config reports; what is wrong is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import config_to_dict
from minillm.info import model_info
from tests.helpers import error_line, make_run
from tests.test_hf_ckpt import CONTEXT, llama_folder
from tests.test_hf_families import PUBLISHED

runner = CliRunner()


def info_json(args: list[str]) -> dict:
    result = runner.invoke(app, ["info", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_a_folders_config_json_alone_gives_transformers_count(tmp_path: Path, name: str) -> None:
    """No weights on disk, none allocated: config.json is all `info --ckpt` reads."""
    published, values = PUBLISHED[name]
    (tmp_path / "config.json").write_text(json.dumps(values))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**values)
        )
    got = info_json(["--ckpt", str(tmp_path)])
    assert got["params"] == sum(p.numel() for p in hf.parameters()) == published
    assert got["vocab_size"] == values["vocab_size"]
    assert got["seq_len"] == 256  # train.seq_len's default: what a fine-tune would train at


def test_a_folder_with_weights_and_its_train_overrides(tmp_path: Path) -> None:
    folder, hf = llama_folder(tmp_path)
    got = info_json(["--ckpt", str(folder)])
    assert got["params"] == sum(p.numel() for p in hf.parameters())
    assert got["seq_len"] == CONTEXT  # the default 256, capped at the model's context
    lora = info_json(["--ckpt", str(folder), "--set", "train.lora.rank=4", "--set",
                      "train.seq_len=32"])  # fmt: skip
    assert lora["params_frozen"] == got["params"] and lora["params_trainable"] > 0
    assert lora["seq_len"] == 32
    human = runner.invoke(app, ["info", "--ckpt", str(folder)])
    assert human.exit_code == 0 and str(folder) in human.stdout, human.output


def test_a_run_and_a_checkpoint_report_their_config(tmp_path: Path) -> None:
    run_dir, cfg, model = make_run(tmp_path)
    want = model_info(cfg)
    ckpt = next((run_dir / "checkpoints").glob("step_*"))
    for path in (run_dir, ckpt, run_dir / "checkpoints" / "LATEST"):
        got = info_json(["--ckpt", str(path)])
        assert got == json.loads(json.dumps(want))
        assert got["params"] == model.param_count()
    # The run's own config file gives the same numbers.
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
    assert info_json([str(tmp_path / "run.yaml")])["params"] == want["params"]
    got = info_json(["--ckpt", str(run_dir), "--set", "train.batch_size=1"])
    assert got["batch_size"] == 1 and got["params"] == want["params"]


def test_info_ckpt_errors_are_one_line(tmp_path: Path) -> None:
    run_dir, _, _ = make_run(tmp_path / "r")
    folder, _ = llama_folder(tmp_path)
    cases = [
        (["info"], "error: CONFIG or --ckpt PATH: one is required (see `minillm info --help`)"),
        (["info", "x.yaml", "--ckpt", str(run_dir)],
         "error: CONFIG or --ckpt PATH: not both (see `minillm info --help`)"),
        (["info", "x.yaml", "--best"], "error: --best: only with --ckpt (a run directory)"),
        (["info", "--ckpt", str(folder), "--best"],
         f"error: {folder}: --best takes a run directory, not a Hugging Face folder"),
        (["info", "--ckpt", str(run_dir), "--set", "model.n_layer=3"],
         "error: --set: model.n_layer: the model is the checkpoint's (--ckpt)"),
        (["info", "--ckpt", str(tmp_path / "nope")],
         f"error: {tmp_path / 'nope'}: no such run or checkpoint directory"),
    ]  # fmt: skip
    for args, want in cases:
        assert error_line(runner.invoke(app, args)) == want, args
    line = error_line(runner.invoke(app, ["info", "--ckpt", str(run_dir), "--set", "train.lr=x"]))
    assert line.startswith("error: --set: train.lr: "), line
