"""`train.init_from` and the config loading around it, through the CLI (issue 27): fine-tuning
from an exported Hugging Face folder with no model section and no data.tokenizer, init_from errors
that name the key, the banner naming the checkpoint it loaded, `tokenize` without a model section,
`info` and `tokenize` seeing init_from's model without the training stage, the warmup warning of
`minillm train` and its refusal of shards made from another data.text_field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.model import Transformer
from minillm.tokenizer.bpe import tokenizer_sha256
from tests.helpers import ROOT, SHAKESPEARE, error_line, make_run

runner = CliRunner()

TRAIN = dict(batch_size=2, seq_len=16, max_steps=2, warmup_steps=1, eval_every=2, eval_steps=1,
             ckpt_every=2, log_every=1, device="cpu", precision="fp32")  # fmt: skip


def write_config(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def corpus(root: Path) -> Path:
    path = root / "corpus.txt"
    path.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny run (one checkpoint, step 10) and its export to a Hugging Face folder."""
    root = tmp_path_factory.mktemp("init-from")
    run_dir, _, _ = make_run(root)
    result = runner.invoke(app, ["export", "--ckpt", str(run_dir), "--out", str(root / "hf")])
    assert result.exit_code == 0, result.output
    return run_dir, root / "hf"


def test_fine_tuning_an_hf_folder_takes_its_tokenizer(exported, tmp_path: Path) -> None:
    """Only data.source and train.init_from: tokenize reuses the folder's tokenizer and train
    accepts the shards (before: a new BPE of data.vocab_size 4096, refused by the model)."""
    _, hf = exported
    cfg = write_config(tmp_path / "sft.yaml", {
        "data": {"source": str(corpus(tmp_path)), "out_dir": str(tmp_path / "tok")},
        "train": {"init_from": str(hf), "out_dir": str(tmp_path / "run"), **TRAIN},
    })  # fmt: skip
    result = runner.invoke(app, ["tokenize", str(cfg)])
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    assert meta["tokenizer_sha256"] == tokenizer_sha256(hf / "tokenizer.json")
    assert meta["vocab_size"] == 300  # the folder's tokenizer, not data.vocab_size's default
    assert not (tmp_path / "tok" / "tokenizer.json").exists()
    result = runner.invoke(app, ["train", str(cfg)])
    assert result.exit_code == 0, result.output
    assert f"weights from {hf}" in result.output
    assert (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()


def test_the_banner_names_the_checkpoint_it_loaded(exported, tmp_path: Path) -> None:
    run_dir, _ = exported
    cfg = write_config(tmp_path / "ft.yaml", {
        "data": {"source": str(corpus(tmp_path)), "out_dir": str(tmp_path / "tok")},
        "train": {"init_from": str(run_dir), "out_dir": str(tmp_path / "run"), **TRAIN},
    })  # fmt: skip
    assert runner.invoke(app, ["tokenize", str(cfg)]).exit_code == 0
    result = runner.invoke(app, ["train", str(cfg)])
    assert result.exit_code == 0, result.output
    assert f"weights from {run_dir} (step_000010)" in result.output


@pytest.mark.parametrize("case", ["no-checkpoint", "not-a-model", "missing"])
def test_init_from_errors_name_the_key(tmp_path: Path, case: str) -> None:
    target = tmp_path / case
    if case == "no-checkpoint":
        (target / "checkpoints").mkdir(parents=True)
    elif case == "not-a-model":
        target.mkdir()
        (target / "notes.txt").write_text("hello")
    cfg = write_config(tmp_path / "ft.yaml", {
        "data": {"source": str(corpus(tmp_path)), "out_dir": str(tmp_path / "tok")},
        "train": {"init_from": str(target), "out_dir": str(tmp_path / "run"), **TRAIN},
    })  # fmt: skip
    what = {"no-checkpoint": "no checkpoint yet", "not-a-model": "not a Hugging Face model folder",
            "missing": "no such folder"}[case]  # fmt: skip
    for command in ("tokenize", "train"):
        line = error_line(runner.invoke(app, [command, str(cfg)]))
        assert line.startswith(f"error: {cfg}: train.init_from: {target}: "), line
        assert what in line
    # Given on the command line, the error blames --set.
    line = error_line(runner.invoke(app, ["train", str(cfg), "--set", f"train.init_from={target}"]))
    assert line.startswith(f"error: --set: train.init_from: {target}: "), line


def test_tokenize_needs_no_model_section_but_train_does(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "data.yaml", {
        "data": {"source": str(corpus(tmp_path)), "vocab_size": 300,
                 "out_dir": str(tmp_path / "tok")},
        "train": {"out_dir": str(tmp_path / "run"), **TRAIN},
    })  # fmt: skip
    result = runner.invoke(app, ["tokenize", str(cfg)])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "tok" / "meta.json").read_text())["vocab_size"] == 300
    line = error_line(runner.invoke(app, ["train", str(cfg)]))
    assert f"{cfg}: model: section is required" in line


def test_train_warns_of_a_warmup_as_long_as_the_run(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "warm.yaml", {
        "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 16},
        "data": {"source": str(corpus(tmp_path)), "vocab_size": 300,
                 "out_dir": str(tmp_path / "tok")},
        "train": {"out_dir": str(tmp_path / "run"), **TRAIN, "warmup_steps": 2},
    })  # fmt: skip
    assert runner.invoke(app, ["tokenize", str(cfg)]).exit_code == 0
    result = runner.invoke(app, ["train", str(cfg)])
    assert result.exit_code == 0, result.output
    assert "warning: train.warmup_steps=2 >= train.max_steps=2" in result.stderr


def test_info_reports_init_froms_model_over_a_model_section(exported, tmp_path: Path) -> None:
    """init_from is applied where the config is read, so `info` sees the model the run trains
    (before: `info` reported the unused model section; only `train` replaced it)."""
    run_dir, _ = exported
    cfg = write_config(tmp_path / "ft.yaml", {
        "model": {"d_model": 96, "n_layer": 3, "n_head": 4},  # not what init_from holds
        "data": {"source": str(corpus(tmp_path)), "out_dir": str(tmp_path / "tok")},
        "train": {"init_from": str(run_dir), "out_dir": str(tmp_path / "run"), **TRAIN},
    })  # fmt: skip
    result = runner.invoke(app, ["info", str(cfg), "--json"])
    assert result.exit_code == 0, result.output
    params = json.loads(result.stdout)["params"]
    assert params == Transformer(load_checkpoint(run_dir).config.model).param_count()
    assert "model.d_model, model.n_layer" in result.stderr and "not used" in result.stderr


@pytest.mark.slow
def test_tokenize_and_info_read_their_config_without_the_training_stage(
    exported, tmp_path: Path
) -> None:
    """`minillm tokenize` and `info` load their config (init_from applied) without importing
    minillm.train (the layers: the config loading lives below it)."""
    run_dir, _ = exported
    cfg = write_config(tmp_path / "ft.yaml", {
        "data": {"source": str(corpus(tmp_path)), "out_dir": str(tmp_path / "tok")},
        "train": {"init_from": str(run_dir), "out_dir": str(tmp_path / "run"), **TRAIN},
    })  # fmt: skip
    script = f"""
import sys
from typer.testing import CliRunner
from minillm.cli import app
for command in ("info", "tokenize"):
    result = CliRunner().invoke(app, [command, {str(cfg)!r}])
    assert result.exit_code == 0, result.output
print(sorted(m for m in sys.modules if m.startswith("minillm.train")))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "tok" / "meta.json").is_file()


def test_train_refuses_a_text_field_other_than_the_shards(tmp_path: Path) -> None:
    """Shards made from one column and a run that names another: one error naming the key and
    both values, and no run folder (before: a warning, and config.yaml recorded the wrong one)."""
    rows = SHAKESPEARE.read_text(encoding="utf-8")[:20_000].split("\n\n")
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"body": r, "title": r[:20]}) + "\n" for r in rows))
    cfg = write_config(tmp_path / "rows.yaml", {
        "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 16},
        "data": {"source": str(source), "text_field": "body", "vocab_size": 300,
                 "out_dir": str(tmp_path / "tok")},
        "train": {"out_dir": str(tmp_path / "run"), **TRAIN},
    })  # fmt: skip
    assert runner.invoke(app, ["tokenize", str(cfg)]).exit_code == 0
    line = error_line(runner.invoke(app, ["train", str(cfg), "--set", "data.text_field=title"]))
    meta = tmp_path / "tok" / "meta.json"
    assert line.startswith(f"error: {meta}: data.text_field: "), line
    assert "'body'" in line and "'title'" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("given", ["file", "set"])
def test_a_vocab_size_init_froms_tokenizer_lacks_names_the_fix(
    exported, tmp_path: Path, given: str
) -> None:
    """A chat config's data.vocab_size over a base with another vocabulary (issue 44): the
    error names init_from's tokenizer, its size and the fix. Before: `pass --retrain`, which
    then refused to replace a model's tokenizer, and round again."""
    run_dir, _ = exported
    data = {"source": str(corpus(tmp_path)), "out_dir": str(tmp_path / "tok")}
    if given == "file":
        data["vocab_size"] = 2048
    cfg = write_config(tmp_path / "ft.yaml", {
        "data": data, "train": {"init_from": str(run_dir), "out_dir": str(tmp_path / "run")},
    })  # fmt: skip
    sets = ["--set", "data.vocab_size=2048"] if given == "set" else []
    for command in ("tokenize", "info"):
        line = error_line(runner.invoke(app, [command, str(cfg), *sets]))
        source = str(cfg) if given == "file" else "--set"
        assert line.startswith(f"error: {source}: data.vocab_size: 2048, but the tokenizer of "
                               f"train.init_from ({run_dir}: "), line  # fmt: skip
        assert line.endswith(" has 300 tokens, the ids its model was trained on: leave "
                             "data.vocab_size out (with train.init_from it is that tokenizer's "
                             "size) or set it to 300"), line  # fmt: skip
    assert not (tmp_path / "tok").exists()


def test_a_model_value_from_init_from_is_named_as_such(exported, tmp_path: Path) -> None:
    """model.vocab_size came from init_from, not the file: the error says where each value came
    from (before: `ft.yaml: model.vocab_size: 320 is smaller ...`, a key the file lacks)."""
    run_dir, _ = exported
    tok = run_dir / "checkpoints" / "step_000010" / "tokenizer.json"
    cfg = write_config(tmp_path / "ft.yaml", {
        "data": {"source": str(corpus(tmp_path)), "tokenizer": str(tok)},
        "train": {"init_from": str(run_dir), "out_dir": str(tmp_path / "run"), "seq_len": 256},
    })  # fmt: skip
    line = error_line(runner.invoke(app, ["info", str(cfg)]))
    assert line == (
        f"error: {cfg}: train.seq_len: 256 exceeds model.max_seq_len=64 (model.* from "
        f"train.init_from {run_dir})"
    )
    cfg.write_text(cfg.read_text().replace("seq_len: 256", "seq_len: 16"))
    line = error_line(runner.invoke(app, ["info", str(cfg), "--set", "data.vocab_size=4096"]))
    # data.tokenizer is init_from's own: the size is checked against it, the --set named.
    assert line == (
        f"error: --set: data.vocab_size: 4096, but the tokenizer of train.init_from ({run_dir}: "
        f"{tok}) has 300 tokens, the ids its model was trained on: leave data.vocab_size out "
        "(with train.init_from it is that tokenizer's size) or set it to 300"
    )


def test_a_models_tokenizer_of_another_size_names_the_size_not_retrain(
    exported, tmp_path: Path
) -> None:
    run_dir, _ = exported
    tok = run_dir / "checkpoints" / "step_000010" / "tokenizer.json"
    cfg = write_config(tmp_path / "c.yaml", {
        "data": {"source": str(corpus(tmp_path)), "tokenizer": str(tok), "vocab_size": 2048,
                 "out_dir": str(tmp_path / "tok")},
    })  # fmt: skip
    line = error_line(runner.invoke(app, ["tokenize", str(cfg)]))
    assert line == (
        f"error: {tok}: data.vocab_size: the existing tokenizer has 300 tokens but "
        f"data.vocab_size is 2048; it belongs to the checkpoint in {tok.parent}: set "
        "data.vocab_size to 300 (or leave it out with train.init_from)"
    )


def test_naming_the_init_from_folders_own_tokenizer_needs_no_vocab_size(
    exported, tmp_path: Path
) -> None:
    """Issue 50, defect 8: data.tokenizer naming train.init_from's own tokenizer.json is the same
    as leaving it out: data.vocab_size is its size (it asked for data.vocab_size, then said
    "leave it out with train.init_from", which the user had done); a wrong size is named."""
    _, hf = exported
    data = {"source": str(corpus(tmp_path)), "out_dir": str(tmp_path / "tok"),
            "tokenizer": str(hf / "tokenizer.json")}  # fmt: skip
    cfg = write_config(tmp_path / "sft.yaml", {
        "data": data, "train": {"init_from": str(hf), "out_dir": str(tmp_path / "run"), **TRAIN},
    })  # fmt: skip
    result = runner.invoke(app, ["tokenize", str(cfg)])
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    assert meta["vocab_size"] == 300
    result = runner.invoke(app, ["tokenize", str(cfg), "--set", "data.vocab_size=512"])
    assert result.exit_code == 2
    assert "data.vocab_size: 512, but the tokenizer of train.init_from" in error_line(result)
