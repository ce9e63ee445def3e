"""Config loading: types, overrides, errors that name file and key, and `minillm info`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import ModelConfig, config_to_dict, load_config
from minillm.errors import ConfigError

MINIMAL = """\
model:
  d_model: 64
  n_layer: 2
  n_head: 4
  max_seq_len: 256
data:
  vocab_size: 512
train:
  lr: 3e-4
  betas: [0.9, 0.99]
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_values_take_declared_types(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)  # PyYAML reads '3e-4' as str
    assert cfg.train.betas == (0.9, 0.99)
    assert cfg.model.vocab_size == 512  # defaults to data.vocab_size
    assert cfg.model.n_kv_head == 4 and cfg.model.ffn_hidden == 256
    assert cfg.train.out_dir == str(Path("runs") / "cfg")


def test_overrides_land_with_the_right_types(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, MINIMAL),
        [
            "train.lr=1e-3",
            "model.n_layer=6",
            "train.compile=true",
            "model.n_kv_head=2",
            "model.ffn_hidden=null",
            "train.out_dir=elsewhere",
            "train.max_steps=1e4",
        ],
    )
    assert cfg.train.lr == 1e-3 and cfg.model.n_layer == 6 and cfg.train.compile is True
    assert cfg.model.n_kv_head == 2 and cfg.model.ffn_hidden == 256  # null: 8/3 d rounded up
    assert cfg.train.out_dir == "elsewhere"
    assert cfg.train.max_steps == 10000 and isinstance(cfg.train.max_steps, int)


def test_round_trip_through_dict(tmp_path: Path) -> None:
    from minillm.config import config_from_dict

    cfg = load_config(write(tmp_path, MINIMAL))
    assert config_from_dict(config_to_dict(cfg)) == cfg


BAD = [
    ("model:\n  d_model: 64\n  n_layer: [2\n", "invalid YAML"),
    ("model: {d_model: 64, n_layer: 2, n_head: 4}\nmodle: {}\n", "modle: unknown section"),
    ("model: {d_model: 64, n_layer: 2, n_head: 4, widht: 3}\n", "model.widht: unknown key"),
    ("model: {d_model: 64, n_layer: two, n_head: 4}\n", "model.n_layer: expected an integer"),
    ("model: {d_model: 64, n_layer: 2.5, n_head: 4}\n", "model.n_layer: expected an integer"),
    ("model: {d_model: 64, n_layer: 2, n_head: 4, tie_embeddings: 3}\n", "model.tie_embeddings"),
    ("model: {d_model: 64, n_layer: 0, n_head: 4}\n", "model.n_layer: must be > 0"),
    ("model: {d_model: -64, n_layer: 2, n_head: 4}\n", "model.d_model: must be > 0"),
    ("model: {d_model: 64, n_layer: 2, n_head: 5}\n", "model.n_head: 5 does not divide"),
    ("model: {d_model: 64, n_layer: 2, n_head: 4, n_kv_head: 3}\n", "model.n_kv_head"),
    ("model: {d_model: 64, n_layer: 2, n_head: 4, n_kv_head: 8}\n", "model.n_kv_head"),
    ("model: {d_model: 36, n_layer: 2, n_head: 4}\n", "must be even for RoPE"),
    ("model: {d_model: 64, n_layer: 2}\n", "model.n_head: is required"),
    ("data: {}\n", "model: section is required"),
    (
        "model: {d_model: 64, n_layer: 2, n_head: 4, max_seq_len: 64}\ntrain: {seq_len: 128}\n",
        "train.seq_len: 128 exceeds model.max_seq_len=64",
    ),
    (
        "model: {d_model: 64, n_layer: 2, n_head: 4, vocab_size: 300}\ndata: {vocab_size: 512}\n",
        "model.vocab_size: 300 is smaller than data.vocab_size=512",
    ),
    ("model: {d_model: 64, n_layer: 2, n_head: 4}\ntrain: {precision: fp8}\n", "train.precision"),
    ("model: {d_model: 64, n_layer: 2, n_head: 4}\ntrain: {min_lr: 1, lr: 0.1}\n", "train.min_lr"),
    ("model: {d_model: 64, n_layer: 2, n_head: 4}\ndata: {val_fraction: 1.5}\n", "val_fraction"),
    ("model: {d_model: 64, n_layer: 2, n_head: 4}\nsample: {top_p: 0}\n", "sample.top_p"),
    ("model: {d_model: 64, n_layer: 2, n_head: 4}\ntrain: {betas: [0.9]}\n", "train.betas"),
    ("- just\n- a list\n", "top level must be a mapping"),
    (
        "model: {d_model: 64, n_layer: 2, n_head: 4}\ntrain:\n  lr: 1.0e-3\n  lr: 2.0e-3\n",
        "given twice",
    ),
    # nan slips through every range check (nan > 0 is False): refused by type
    (
        "model: {d_model: 64, n_layer: 2, n_head: 4}\ntrain: {lr: .nan}\n",
        "train.lr: expected a finite",
    ),
    ("model: {d_model: 64, n_layer: 2, n_head: 4}\ntrain: {grad_clip: .inf}\n", "train.grad_clip"),
    ("model: {d_model: 64, n_layer: 2, n_head: 4, rope_theta: nan}\n", "model.rope_theta"),
    (
        "model: {d_model: 64, n_layer: 2, n_head: 4}\nsample: {temperature: NaN}\n",
        "sample.temperature",
    ),
]


@pytest.mark.parametrize("text,expected", BAD, ids=[b[1][:30] for b in BAD])
def test_invalid_configs_raise_one_line_naming_file_and_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert expected in message
    assert message.startswith(str(path))
    assert "\n" not in message


@pytest.mark.parametrize(
    "override,expected",
    [
        ("train.lr=fast", "train.lr: expected a number"),
        ("train.nope=1", "train.nope: unknown key"),
        ("trian.lr=1", "unknown section"),
        ("train.lr", "section.key=value"),
        ("model.n_head=3", "model.n_head: 3 does not divide"),
    ],
)
def test_bad_overrides(tmp_path: Path, override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        load_config(write(tmp_path, MINIMAL), [override])


def test_model_config_checks_in_python_too() -> None:
    with pytest.raises(ConfigError, match="model.n_kv_head"):
        ModelConfig(vocab_size=10, d_model=64, n_layer=1, n_head=4, n_kv_head=3)


runner = CliRunner()


def test_cli_info_json_reports_llama2_7b() -> None:
    result = runner.invoke(app, ["info", "configs/llama2-7b.yaml", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["params"] == 6_738_415_616
    assert info["params_non_embedding"] == 6_738_415_616 - 2 * 32000 * 4096
    assert info["flops_per_token"] > 6 * 6_476_271_616


def test_cli_info_tinyllama_shape(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model: {vocab_size: 32000, d_model: 2048, n_layer: 22, n_head: 32, n_kv_head: 4,"
        " ffn_hidden: 5632, tie_embeddings: false}\ndata: {vocab_size: 32000}\n",
    )
    result = runner.invoke(app, ["info", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["params"] == 1_100_048_384


def test_cli_info_table_and_error_exit_code(tmp_path: Path) -> None:
    result = runner.invoke(app, ["info", "configs/tiny.yaml"])
    assert result.exit_code == 0 and "parameters" in result.stdout
    bad = runner.invoke(app, ["info", "configs/tiny.yaml", "--set", "model.n_head=7"])
    assert bad.exit_code == 2
    assert "model.n_head" in bad.stderr and "Traceback" not in bad.output
