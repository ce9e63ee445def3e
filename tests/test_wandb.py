"""`train.log_to: [tensorboard, wandb]`: the scalars and texts go to Weights & Biases too (issue
36). Run offline (WANDB_MODE=offline: no network, files under <out_dir>/wandb); without the
extra installed, one error line."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import ConfigError, config_from_dict, config_to_dict
from tests.helpers import error_line, run_config

runner = CliRunner()
needs_wandb = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None,
    reason="wandb is not installed (pip install -e '.[wandb]')",
)
MODEL = {"d_model": 32, "n_layer": 1, "n_head": 4}


def write_run_config(data_dir: Path, run: Path, **train: object) -> Path:
    cfg = run_config(data_dir, run, **train)
    path = run.parent / f"{run.name}.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    return path


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B without a network or an account, its own settings kept out of the home folder."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_NAME", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)


@pytest.mark.parametrize(
    "value, message",
    [
        (["tensorboard", "mlflow"], "expected one of 'tensorboard', 'wandb', got 'mlflow'"),
        ("wandb", "expected a list of values, each one of 'tensorboard', 'wandb', got 'wandb'"),
        (["wandb", "wandb"], "names a logger twice: ['wandb', 'wandb']"),
    ],
)
def test_log_to_values_are_checked(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": MODEL, "train": {"log_to": value}}, file="c.yaml")
    assert str(err.value).startswith(f"c.yaml: train.log_to: {message}")


def test_log_to_defaults_to_tensorboard() -> None:
    cfg = config_from_dict({"model": MODEL})
    assert cfg.train.log_to == ["tensorboard"]
    assert config_from_dict({"model": MODEL, "train": {"log_to": []}}).train.log_to == []


def test_without_the_extra_one_error_line_and_no_logger_files(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs whether or not wandb is installed: the import is made to fail."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    run = tmp_path / "run"
    cfg = write_run_config(data_dir, run, max_steps=2, log_to=["tensorboard", "wandb"])
    result = runner.invoke(app, ["train", str(cfg)])
    assert result.exit_code == 2, result.output
    assert error_line(result) == (
        "error: train.log_to: wandb is not installed: pip install wandb (the extra `wandb`), or "
        "leave wandb out of train.log_to"
    )
    assert not (run / "tb").exists() and not (run / "wandb").exists()
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


@needs_wandb
def test_a_run_wandb_refuses_is_one_error_line(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No account or no network: wandb.init raises, and the run stops at once with one line."""
    import wandb

    def refuse(**kwargs: object) -> None:
        raise wandb.errors.UsageError("api_key not configured (no-tty).\nMore lines.")

    monkeypatch.setattr(wandb, "init", refuse)
    run = tmp_path / "run"
    cfg = write_run_config(data_dir, run, max_steps=2, log_to=["wandb"])
    result = runner.invoke(app, ["train", str(cfg)])
    assert result.exit_code == 2, result.output
    assert error_line(result) == (
        "error: train.log_to: wandb could not start a run: api_key not configured (no-tty). "
        "(`wandb login`, or WANDB_MODE=offline)"
    )
    assert not (run / "wandb").exists()


@needs_wandb
def test_a_run_wandb_refuses_leaves_nothing_behind(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44: after the error, runs/<name>/{config.yaml,tokenizer.json} were left behind, a
    run folder that `eval --ckpt` and a second `train` then found."""
    import wandb

    def refuse(**kwargs: object) -> None:
        raise wandb.errors.UsageError("api_key not configured (no-tty).")

    monkeypatch.setattr(wandb, "init", refuse)
    run = tmp_path / "run"
    cfg = write_run_config(data_dir, run, max_steps=2, log_to=["wandb"])
    assert runner.invoke(app, ["train", str(cfg)]).exit_code == 2
    assert not run.exists(), sorted(p.name for p in run.iterdir())


def offline_runs(run: Path) -> list[Path]:
    return sorted((run / "wandb").glob("offline-run-*"))


def read_offline_run(run_folder: Path) -> tuple[dict, list[dict]]:
    """The run record (name, config) and the logged rows of an offline run, read from its .wandb
    file: LevelDB-log framing (32 KiB blocks, 7-byte chunk headers) of wandb's protobuf records,
    after a 7-byte `:W&B` header. wandb has no Python reader of it any more (its core is Go)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_folder.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail: zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # padding up to the next block
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    run: dict = {}
    rows = []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {c.key: json.loads(c.value_json) for c in record.run.config.update}
            run = {"name": record.run.display_name, "id": record.run.run_id, "config": config}
        elif kind == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return run, rows


@needs_wandb
@pytest.mark.slow
def test_an_offline_run_logs_the_scalars_texts_and_config(
    data_dir: Path, tmp_path: Path, offline: None
) -> None:
    run = tmp_path / "tiny-wandb"
    cfg = write_run_config(
        data_dir,
        run,
        max_steps=4,
        log_every=2,
        eval_every=2,
        ckpt_every=2,
        sample_every=4,
        sample_max_new_tokens=4,
        log_to=["tensorboard", "wandb"],
    )
    result = runner.invoke(app, ["train", str(cfg)])
    assert result.exit_code == 0, result.output
    (folder,) = offline_runs(run)
    meta, rows = read_offline_run(folder)
    assert meta["name"] == "tiny-wandb"  # the run directory's name
    assert meta["config"]["train"]["log_to"] == ["tensorboard", "wandb"]
    assert meta["config"]["model"]["d_model"] == 32
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step.setdefault(row["step"], {}).update(row)
    assert sorted(by_step) == [0, 2, 4]
    for step in (2, 4):
        assert {"train/loss", "train/lr", "train/grad_norm", "val/loss"} <= set(by_step[step])
        assert by_step[step]["train/loss"] > 0
    # The texts, as HTML files: the resolved config at step 0, the samples at the last step.
    logged = (by_step[0] | by_step[4]).items()
    texts = {k.removesuffix("/path"): v for k, v in logged if k.endswith("/path")}
    assert sorted(texts) == ["config", "samples/greedy", "samples/sampled"]
    assert "log_to:" in (folder / "files" / texts["config"]).read_text()
    # TensorBoard still gets the same scalars.
    assert any((run / "tb").glob("events.out.tfevents.*"))


@needs_wandb
@pytest.mark.slow
def test_a_resumed_run_goes_on_in_the_same_wandb_run(
    data_dir: Path, tmp_path: Path, offline: None
) -> None:
    run = tmp_path / "resumed"
    cfg = write_run_config(
        data_dir, run, max_steps=2, log_every=2, eval_every=2, ckpt_every=2, log_to=["wandb"]
    )
    assert runner.invoke(app, ["train", str(cfg)]).exit_code == 0
    result = runner.invoke(app, ["train", str(cfg), "--set", "train.max_steps=4"])
    assert result.exit_code == 0, result.output
    first, second = offline_runs(run)
    (meta, rows), (meta2, rows2) = read_offline_run(first), read_offline_run(second)
    assert meta["id"] == meta2["id"]  # one W&B run, gone on with
    assert [r["step"] for r in rows if "train/loss" in r] == [2]
    assert [r["step"] for r in rows2 if "train/loss" in r] == [4]
    assert not (run / "tb").exists()  # log_to without tensorboard


@needs_wandb
@pytest.mark.slow
def test_wandb_dir_when_set_holds_the_runs_files(
    data_dir: Path, tmp_path: Path, offline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WANDB_DIR, wandb's own convention for keeping every run's files in one place, is
    followed (issue 44: they always went to <out_dir>/wandb); the run keeps only the id that a
    resume goes on with."""
    elsewhere = tmp_path / "all-wandb-runs"
    elsewhere.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(elsewhere))
    run = tmp_path / "run"
    cfg = write_run_config(data_dir, run, max_steps=2, log_every=2, eval_every=2, ckpt_every=2,
                           log_to=["wandb"])  # fmt: skip
    result = runner.invoke(app, ["train", str(cfg)])
    assert result.exit_code == 0, result.output
    (folder,) = sorted((elsewhere / "wandb").glob("offline-run-*"))
    meta, rows = read_offline_run(folder)
    assert meta["name"] == "run" and [r["step"] for r in rows if "train/loss" in r] == [2]
    assert offline_runs(run) == []
    assert sorted(p.name for p in (run / "wandb").iterdir()) == ["minillm_run_id"]
    assert (run / "wandb" / "minillm_run_id").read_text().strip() == meta["id"]
