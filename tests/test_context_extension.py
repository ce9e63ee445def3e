"""Reading and training a checkpoint at a longer context (issue 42, item 4): `minillm eval
--seq-len N --set model.rope_scaling.*` scores the same weights at N tokens with a RoPE scaling,
and `train.init_from` takes a config's own `model.max_seq_len` and `model.rope_scaling` (the keys
no weight depends on) over the source's, so a run can fine-tune at the new length."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from minillm.checkpoint.init_from import load_run_config
from minillm.cli import app
from minillm.infer.evaluate import evaluate_tokens
from minillm.model import Transformer
from tests.helpers import SHAKESPEARE, error_line, eval_json, make_run, tiny_tokenizer

runner = CliRunner()
YARN = [
    "--set",
    "model.rope_scaling.type=yarn",
    "--set",
    "model.rope_scaling.factor=4",
    "--set",
    "model.rope_scaling.original_max_position_embeddings=64",
]


@pytest.fixture(scope="module")
def run_and_text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random tiny run (max_seq_len 64, windows of 16) and a text of ~1,000 tokens."""
    root = tmp_path_factory.mktemp("context")
    run_dir, _, _ = make_run(root)
    text = root / "held_out.txt"
    text.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    return run_dir, text


def expected_loss(run_dir: Path, text: Path, seq_len: int, **model: object) -> float:
    """The mean loss of windows of seq_len tokens of a model built here with `model` changed and
    the run's weights: what eval must compute, found without at_context."""
    from minillm.checkpoint.store import load_checkpoint

    ckpt = load_checkpoint(run_dir)
    net = Transformer(dataclasses.replace(ckpt.config.model, **model))
    net.load_state_dict(ckpt.model.state_dict())
    ids = np.asarray(tiny_tokenizer().encode(text.read_text(encoding="utf-8")).ids)
    total, n = evaluate_tokens(net, ids, seq_len, batch_size=2)
    return total / n


def test_eval_scores_the_weights_at_a_longer_context_with_a_scaling(run_and_text) -> None:
    """--seq-len 256 past the run's 64 positions (plain RoPE extrapolates), and with YaRN x4 over
    the original 64: each equal to a model built with that config and the same weights, and
    different from each other and from the run's own 16-token windows."""
    from minillm.config import RopeScalingConfig

    run_dir, text = run_and_text
    base = ["--ckpt", str(run_dir), "--data", str(text)]
    own = eval_json(base)["loss"]
    plain = eval_json([*base, "--seq-len", "256"])["loss"]
    yarn = eval_json([*base, "--seq-len", "256", *YARN])["loss"]
    assert math.isclose(own, expected_loss(run_dir, text, 16), rel_tol=1e-6)
    assert math.isclose(plain, expected_loss(run_dir, text, 256, max_seq_len=256), rel_tol=1e-6)
    scaling = RopeScalingConfig(type="yarn", factor=4, original_max_position_embeddings=64)
    want = expected_loss(run_dir, text, 256, max_seq_len=256, rope_scaling=scaling)
    assert math.isclose(yarn, want, rel_tol=1e-6)
    assert len({round(own, 4), round(plain, 4), round(yarn, 4)}) == 3


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--set", "model.n_layer=1"], "--set model.n_layer=1: only model.max_seq_len and"),
        (["--set", "train.lr=1"], "--set train.lr=1: only model.max_seq_len and"),
        (["--set", "model.rope_scaling.type=yarn"], "--set: model.rope_scaling.original_max_"),
        (["--set", "model.rope_scaling.kind=yarn"], "--set: model.rope_scaling.kind: unknown"),
        (["--seq-len", "0"], "--seq-len: must be >= 1"),
        (["--seq-len", "128", "--set", "model.max_seq_len=100"], "--seq-len: 128 exceeds"),
    ],
)
def test_eval_refuses_what_would_change_the_weights_or_is_invalid(
    run_and_text, args: list[str], says: str
) -> None:
    run_dir, text = run_and_text
    result = runner.invoke(app, ["eval", "--ckpt", str(run_dir), "--data", str(text), *args])
    assert says in error_line(result)


def write(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_init_from_takes_the_configs_context_and_scaling(
    run_and_text, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model is the source's but for max_seq_len and rope_scaling, which the config sets
    (before: a warning that they were not used, and train.seq_len 256 refused as past the
    source's 64); the keys that shape weights are still the source's, with the warning."""
    run_dir, _ = run_and_text
    raw = {
        "model": {
            "d_model": 96,  # not the source's: not used, and named
            "max_seq_len": 256,
            "rope_scaling": {"type": "linear", "factor": 4},
        },
        "data": {"source": str(SHAKESPEARE)},
        "train": {"init_from": str(run_dir), "seq_len": 256, "out_dir": str(tmp_path / "x")},
    }
    cfg = load_run_config(write(tmp_path / "ext.yaml", raw))
    warned = capsys.readouterr().err
    assert cfg.model.d_model == 64 and cfg.model.n_layer == 2  # the source's
    assert cfg.model.max_seq_len == 256 and cfg.train.seq_len == 256
    assert (cfg.model.rope_scaling.type, cfg.model.rope_scaling.factor) == ("linear", 4.0)
    assert "model.d_model are not used" in warned
    assert "max_seq_len" not in warned and "rope_scaling" not in warned


def test_init_from_merges_rope_scaling_key_by_key(tmp_path: Path) -> None:
    """`--set model.rope_scaling.factor=8` over a source trained with YaRN x4 changes the factor
    alone, as --set over a YAML does; the source's type and original length stay."""
    yarn = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64}
    run_dir, _, _ = make_run(tmp_path / "src", model={"max_seq_len": 256, "rope_scaling": yarn})
    cfg_file = write(tmp_path / "a.yaml", {
        "data": {"source": str(SHAKESPEARE)},
        "train": {"init_from": str(run_dir), "out_dir": str(tmp_path / "a")},
    })  # fmt: skip
    cfg = load_run_config(cfg_file, ["model.rope_scaling.factor=8", "model.max_seq_len=512"])
    s = cfg.model.rope_scaling
    assert (s.type, s.factor, s.original_max_position_embeddings) == ("yarn", 8.0, 64)
    assert cfg.model.max_seq_len == 512
    assert load_run_config(cfg_file).model.rope_scaling.factor == 4.0  # the source's, untouched


def test_the_script_sets_each_scaling_and_tables_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/context_extension.py: the overrides of each scaling (linear needs no original
    length; none sets nothing) and its table, FT columns left "-" under --no-finetune."""
    from tests.helpers import load_script

    script = load_script("context_extension", monkeypatch)
    assert script.scaling_sets("none", 4, 256) == []
    assert script.scaling_sets("linear", 4, 256) == [
        "model.rope_scaling.type=linear",
        "model.rope_scaling.factor=4",
    ]
    assert script.scaling_sets("yarn", 8, 256)[2] == (
        "model.rope_scaling.original_max_position_embeddings=256"
    )
    result = {
        "original": 256,
        "bpb_trained": 2.0,
        "pretrained_tokens": 1000,
        "rows": {"yarn": {"1024": {"no_ft": 2.5, "ft": 1.9, "ft_at_trained": 2.1}},
                 "none": {"1024": {"no_ft": 4.0}}},
    }  # fmt: skip
    table = script.format_table({**result, "control": 2.01}).splitlines()
    head = "| RoPE scaling | 256 (trained) | 1,024 no FT | 1,024 FT | FT at 1,024, read at 256 |"
    assert table[0] == head
    assert table[2] == "| YaRN | 2.0000 | 2.5000 | 1.9000 | 2.1000 |"
    assert table[3] == "| no scaling (extrapolation) | 2.0000 | 4.0000 | - | - |"
    assert table[4] == "| control: the same fine-tune at 256, no scaling | 2.0100 | - | - | - |"


@pytest.mark.parametrize(
    ("command", "target"),
    [
        (["sample", "--prompt", "ROMEO:"], "minillm.infer.sample.sample_checkpoint"),
        (["chat", "--message", "hi"], "minillm.infer.conversation.chat_checkpoint"),
        (["serve"], "minillm.serve.server.serve"),
    ],
)
def test_sample_chat_and_serve_read_the_weights_at_a_longer_context(
    run_and_text, monkeypatch: pytest.MonkeyPatch, command: list[str], target: str
) -> None:
    """`--set model.max_seq_len=256` and YaRN over the run's 64 positions: the command gets the
    same weights in a model of that context and scaling (eval's at_context, above); a key a
    weight depends on is one error line."""
    run_dir, _ = run_and_text
    seen = []
    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(module + "." + name, lambda loaded, *a, **k: seen.append(loaded))
    args = [command[0], "--ckpt", str(run_dir), *command[1:]]
    result = runner.invoke(app, [*args, *YARN, "--set", "model.max_seq_len=256"])
    assert result.exit_code == 0, result.output
    (loaded,) = seen
    cfg = loaded.model.cfg
    assert (cfg.max_seq_len, cfg.rope_scaling.type, cfg.rope_scaling.factor) == (256, "yarn", 4)
    assert loaded.config.model == cfg and loaded.model.rope_cos.shape[0] == 256
    from minillm.checkpoint.store import load_checkpoint

    own = load_checkpoint(run_dir).model.state_dict()
    assert all((own[k] == v).all() for k, v in loaded.model.state_dict().items())
    refused = runner.invoke(app, [*args, "--set", "train.lr=1"])
    assert "--set train.lr=1: only model.max_seq_len and" in error_line(refused)
