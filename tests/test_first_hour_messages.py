"""Messages a new user met in the first hour (issue 53, item 5): each says what is at fault and
what to do, and none waits for a slow step first."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import (
    ConfigError,
    LoRAConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    load_config,
)
from minillm.data.jsonl_check import jsonl_problem
from minillm.errors import UserError
from minillm.train.resume import resume_point
from tests.helpers import error_line, make_run

runner = CliRunner()


def test_a_message_missing_content_is_named(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problem = jsonl_problem([path], "messages")
    assert problem is not None
    assert str(problem) == (
        f"{path}: data.text_field: line 2: messages[1].content: expected a string, missing"
    )


def test_a_refused_resume_says_what_to_do(tmp_path: Path) -> None:
    run_dir, cfg, _ = make_run(tmp_path)
    raw = config_to_dict(cfg)
    raw["model"]["n_layer"] += 1
    kw = dict(resume=True, force=False, clear=False, verbose=False)
    with pytest.raises(UserError) as info:
        resume_point(run_dir, config_from_dict(raw), cfg.data.tokenizer, "sha", 1, **kw)
    line = str(info.value)
    assert "model.n_layer" in line and "give it a new train.out_dir" in line
    assert f"start over in {run_dir} with --no-resume --force" in line


def test_a_missing_yml_points_to_the_yaml(tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text("train: {max_steps: 2}\n")
    with pytest.raises(ConfigError, match=r"no such config file; did you mean .*tiny\.yaml\?$"):
        load_config(tmp_path / "tiny.yml")
    with pytest.raises(ConfigError, match=r"no such config file$"):
        load_config(tmp_path / "other.yml")


def test_peft_target_names_point_to_ours() -> None:
    with pytest.raises(ConfigError) as info:
        LoRAConfig(rank=4, targets=["q_proj"])
    line = str(info.value)
    assert line.startswith("train.lora.targets: 'q_proj' is peft's name; minillm's layer for ")
    assert "q_proj/k_proj/v_proj is 'wqkv'" in line
    with pytest.raises(ConfigError, match="'down_proj' is peft's name.* is 'w_down'"):
        LoRAConfig(rank=4, targets=["wqkv", "down_proj"])


def test_constant_schedule_ignores_min_lr() -> None:
    assert TrainConfig(lr=1e-5, schedule="constant").lr == 1e-5
    with pytest.raises(ConfigError, match="min_lr: 3e-05 is above lr=1e-05"):
        TrainConfig(lr=1e-5, schedule="cosine")


def test_a_busy_port_is_reported_before_the_model_loads(tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        # The checkpoint does not even exist: the port is what the line must name.
        args = ["serve", "--ckpt", str(tmp_path / "no-run"), "--port", str(port)]
        line = error_line(runner.invoke(app, args))
    finally:
        busy.close()
    assert line.startswith(f"error: --port {port}: cannot listen on 127.0.0.1:{port}"), line
