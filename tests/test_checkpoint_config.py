"""The model config travels with the weights: an edited state.json is refused everywhere it loads,
and checkpoints written before the config was stored with the weights keep loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from minillm.checkpoint.layout import CONFIG_KEY, MODEL_FILE, STATE_FILE, find_latest
from minillm.checkpoint.store import CheckpointError, load_checkpoint
from minillm.cli import app
from minillm.config import config_from_dict
from minillm.runtime.files import sha256_file
from minillm.train.resume import resume_point
from tests.helpers import make_run

runner = CliRunner()

# Edits that keep every weight's shape, so the weights alone cannot tell.
EDITS = [
    {"n_head": 2, "n_kv_head": 1},
    {"rope_theta": 500000.0},
    {"norm_eps": 1e-3},
]


def edit_state(ckpt: Path, **model: object) -> dict:
    state = json.loads((ckpt / STATE_FILE).read_text())
    state["config"]["model"].update(model)
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    return state


@pytest.mark.parametrize("edit", EDITS, ids=lambda e: ",".join(e))
def test_edited_model_config_is_one_line_for_eval_sample_export(tmp_path: Path, edit: dict) -> None:
    run_dir, _, _ = make_run(tmp_path)
    edit_state(find_latest(run_dir), **edit)
    text = tmp_path / "text.txt"
    text.write_text("to be or not to be, that is the question " * 20)
    commands = [
        ["sample", "--ckpt", str(run_dir), "--prompt", "x", "--max-new-tokens", "2"],
        ["eval", "--ckpt", str(run_dir), "--data", str(text)],
        ["export", "--ckpt", str(run_dir), "--out", str(tmp_path / "hf")],
    ]
    for args in commands:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args[0], result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.output, result.output
        assert STATE_FILE in lines[0] and "with the weights" in lines[0]
        assert all(f"model.{key}" in lines[0] for key in edit), lines[0]
    assert not (tmp_path / "hf").exists()


def test_edited_model_config_refuses_a_resume(tmp_path: Path) -> None:
    run_dir, cfg, _ = make_run(tmp_path)
    state = edit_state(find_latest(run_dir), n_head=2, n_kv_head=1)
    edited = config_from_dict(state["config"])  # config.yaml edited to match: no key differs
    kw = dict(resume=True, force=False, clear=False, verbose=False)
    with pytest.raises(CheckpointError, match=r"model\.n_head 2 here, 4 with the weights"):
        resume_point(run_dir, edited, cfg.data.tokenizer, "sha", 1, **kw)


def test_checkpoint_without_stored_config_keeps_loading(tmp_path: Path) -> None:
    run_dir, cfg, net = make_run(tmp_path)
    ckpt = find_latest(run_dir)
    weights = ckpt / MODEL_FILE
    save_file(load_file(str(weights)), str(weights), metadata={"format": "pt"})  # as before
    state = json.loads((ckpt / STATE_FILE).read_text())
    state["files"][MODEL_FILE] = sha256_file(weights)
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    loaded = load_checkpoint(run_dir)
    assert loaded.config.model == cfg.model
    kw = dict(resume=True, force=False, clear=False, verbose=False)
    assert resume_point(run_dir, cfg, cfg.data.tokenizer, "sha", 1, **kw) == ckpt


def test_saved_weights_carry_the_model_config(tmp_path: Path) -> None:
    from safetensors import safe_open

    run_dir, cfg, _ = make_run(tmp_path)
    with safe_open(str(find_latest(run_dir) / MODEL_FILE), framework="pt") as f:
        stored = json.loads(f.metadata()[CONFIG_KEY])
    assert stored["n_head"] == 4 and stored["rope_theta"] == cfg.model.rope_theta
