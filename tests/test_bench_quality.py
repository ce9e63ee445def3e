"""scripts/bench_quality.py: its prototyped knob (attention dropout), EMA rows, curves, --plot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from minillm.config import config_to_dict
from minillm.model import Transformer
from tests.helpers import tiny_config


def load_bench():
    path = Path(__file__).parent.parent / "scripts" / "bench_quality.py"
    spec = importlib.util.spec_from_file_location("bench_quality", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_split_knobs_separates_config_keys_from_bench_knobs() -> None:
    bench = load_bench()
    sets, knobs = bench.split_knobs(["train.lr=1e-3", "bench.attn_dropout=0"])
    assert sets == ["train.lr=1e-3"]
    assert knobs == {"attn_dropout": 0.0}
    with pytest.raises(SystemExit, match="bench.nope=1: unknown knob"):
        bench.split_knobs(["bench.nope=1"])


def test_attn_dropout_drops_the_attention_weights_only(data_dir: Path) -> None:
    bench = load_bench()
    model = Transformer(tiny_config(data_dir, model={"dropout": 0.2}).model)
    bench.apply_knobs(model, {"attn_dropout": -1.0})  # the default: model.dropout everywhere
    assert [b.attn.dropout for b in model.blocks] == [0.2, 0.2]
    bench.apply_knobs(model, {"attn_dropout": 0.0})
    assert [b.attn.dropout for b in model.blocks] == [0.0, 0.0]
    assert [b.ffn.drop.p for b in model.blocks] == [0.2, 0.2]
    assert [b.attn.resid_drop.p for b in model.blocks] == [0.2, 0.2]


@pytest.mark.slow
def test_bench_quality_curves_knobs_and_plot(data_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    bench = load_bench()
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(config_to_dict(tiny_config(data_dir))))
    out_json, png = tmp_path / "rows.json", tmp_path / "curves.png"
    bench.main([str(config), "--steps", "4", "--variants", "adamw-cosine", "--curve-every", "2",
                "--variant", "ema:train.ema_decay=0.9", "--json", str(out_json)])  # fmt: skip
    rows = {r["variant"]: r for r in json.loads(out_json.read_text())}
    assert [p["step"] for p in rows["adamw-cosine"]["curve"]] == [2, 4]
    # Same seed and batches: the EMA run's raw weights are the plain run's; its average differs.
    assert rows["ema"]["raw_val_bpb"] == pytest.approx(rows["adamw-cosine"]["val_bpb"])
    assert rows["ema"]["val_bpb"] != rows["ema"]["raw_val_bpb"]
    assert rows["ema"]["curve"][-1]["val_bpb"] == rows["ema"]["val_bpb"]
    bench.main(["--plot", str(png), "--records", str(out_json)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_curve_point_scores_the_whole_validation_split(data_dir: Path, tmp_path: Path) -> None:
    bench = load_bench()
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(config_to_dict(tiny_config(data_dir))))
    rows = {}
    for steps in (2, 4):  # a constant lr: the first two steps do not depend on max_steps
        out_json = tmp_path / f"rows{steps}.json"
        args = ["--steps", str(steps), "--variants", "", "--curve-every", "2", "--json"]
        bench.main([str(config), *args, str(out_json), "--variant", "c:train.schedule=constant"])
        rows[steps] = json.loads(out_json.read_text())[0]
    # Step 2 of the longer run, scored in the loop = the 2-step run's checkpoint scored by eval.
    assert rows[4]["curve"][0]["step"] == 2
    assert rows[4]["curve"][0]["val_bpb"] == pytest.approx(rows[2]["val_bpb"], rel=1e-6)


@pytest.mark.slow
def test_pace_times_each_config_and_prints_ratios(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_bench()
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(config_to_dict(tiny_config(data_dir))))
    bench.main([str(config), "--steps", "10", "--pace", "2", "--variants", "adamw-cosine",
                "--variant", "muon:train.optimizer=muon"])  # fmt: skip
    out = capsys.readouterr().out
    assert "adamw-cosine: " in out and "(1.000x the first)" in out and "muon: " in out
