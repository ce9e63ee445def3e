"""Optimizers and schedules: the Muon/AdamW split, the schedule tables, resume and extension."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from minillm.config import ModelConfig, TrainConfig, config_to_dict, load_config
from minillm.errors import ConfigError, UserError
from minillm.info import model_info
from minillm.model import Transformer
from minillm.model.param_groups import optimizer_split
from minillm.train.optim import build_optimizer, newton_schulz_flops, set_lr
from minillm.train.schedule import lr_at
from tests.helpers import assert_same_weights, make_trainer, resumed_runs, tiny_config

CPU = torch.device("cpu")


def table(**kw) -> list[float]:
    return [lr_at(s, lr=1.0, min_lr=0.1, warmup_steps=2, **kw) for s in range(12)]


def test_wsd_schedule_exact_table() -> None:
    # max_steps 10, decay_fraction 0.4: steps 6..9 decay as 1-sqrt, min_lr from step 10.
    got = table(max_steps=10, schedule="wsd", decay_fraction=0.4)
    d = [0.1 + 0.9 * (1 - math.sqrt(k / 4)) for k in range(4)]
    want = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, d[0], d[1], d[2], d[3], 0.1, 0.1]
    assert d[1] == pytest.approx(0.55)
    assert got == pytest.approx(want, abs=1e-12)


def test_constant_schedule_exact_table() -> None:
    assert table(max_steps=6, schedule="constant") == [0.5] + [1.0] * 11


def test_wsd_decay_inside_the_warmup_never_jumps_up() -> None:
    got = [lr_at(s, lr=1.0, min_lr=0.0, warmup_steps=4, max_steps=4, schedule="wsd",
                 decay_fraction=1.0) for s in range(5)]  # fmt: skip
    want = [0.25, 0.5, 1 - math.sqrt(0.5), 1 - math.sqrt(0.75), 0.0]
    assert got == pytest.approx(want, abs=1e-12)


def test_cosine_is_unchanged_by_the_new_keys() -> None:
    assert table(max_steps=6, schedule="cosine", decay_fraction=0.5) == table(max_steps=6)


@pytest.mark.parametrize("tie", [True, False])
def test_muon_adamw_split_takes_every_parameter_once(tie: bool) -> None:
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4,
                                    tie_embeddings=tie))  # fmt: skip
    split = optimizer_split(model, "muon")
    muon, adamw = dict(split["muon"]), dict(split["adamw"])
    assert sorted(muon) == sorted(
        f"blocks.{i}.{w}.weight" for i in range(2)
        for w in ("attn.wqkv", "attn.wo", "ffn.w_gate_up", "ffn.w_down")
    )  # fmt: skip
    want_adamw = {"tok_emb.weight", "norm.weight"} | ({"lm_head.weight"} if not tie else set())
    want_adamw |= {f"blocks.{i}.{n}_norm.weight" for i in range(2) for n in ("attn", "ffn")}
    assert set(adamw) == want_adamw
    # The built optimizers hold every parameter of the model exactly once.
    opt = build_optimizer(model, TrainConfig(optimizer="muon"), CPU)
    held = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(held) == len(set(held))
    assert set(held) == {id(p) for p in model.parameters()}
    assert {type(o).__name__ for o in opt} == {"Muon", "AdamW"}
    assert all(id(p) in {id(q) for q in opt.parts["muon"].param_groups[0]["params"]}
               for p in muon.values())  # fmt: skip


def test_each_optimizer_follows_the_schedule_at_its_own_peak() -> None:
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layer=1, n_head=4))
    cfg = TrainConfig(optimizer="muon", lr=1e-3, min_lr=1e-4, muon_lr=0.02, warmup_steps=4)
    opt = build_optimizer(model, cfg, CPU)
    assert set_lr(opt, 1, cfg) == pytest.approx(0.5e-3)
    assert opt.parts["muon"].param_groups[0]["lr"] == pytest.approx(0.01)
    assert all(g["lr"] == pytest.approx(0.5e-3) for g in opt.parts["adamw"].param_groups)


def test_newton_schulz_flops_count_each_matrix() -> None:
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layer=1, n_head=4,
                                    ffn_hidden=64))  # fmt: skip
    assert newton_schulz_flops(build_optimizer(model, TrainConfig(), CPU)) == 0
    opt = build_optimizer(model, TrainConfig(optimizer="muon"), CPU)
    # wqkv (96x32), wo (32x32), w_gate_up (128x32), w_down (32x64): m = 32 for all.
    want = sum(5 * (4 * 32 * 32 * n + 2 * 32**3) for n in (96, 32, 128, 64))
    assert newton_schulz_flops(opt) == want


def test_muon_is_refused_on_sharded_parameters() -> None:
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layer=1, n_head=4))
    model.blocks[0].attn.wo.weight.to_local = lambda: None  # what an FSDP2 DTensor has
    with pytest.raises(ConfigError, match="train.optimizer: muon cannot run under"):
        build_optimizer(model, TrainConfig(optimizer="muon"), CPU)
    build_optimizer(model, TrainConfig(optimizer="adamw"), CPU)


@pytest.mark.parametrize(
    "override,expected",
    [
        ("train.optimizer=sgd", "train.optimizer: expected one of 'adamw', 'muon'"),
        ("train.schedule=linear", "train.schedule: expected one of"),
        ("train.decay_fraction=0", "train.decay_fraction: must be in (0, 1], got 0.0"),
        ("train.decay_fraction=1.5", "train.decay_fraction: must be in (0, 1], got 1.5"),
        ("train.muon_lr=0", "train.muon_lr: must be > 0"),
        ("train.muon_momentum=1", "train.muon_momentum: must be in [0, 1)"),
    ],
)
def test_bad_optimizer_keys_are_one_line(tmp_path: Path, override: str, expected: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("model: {d_model: 64, n_layer: 2, n_head: 4, vocab_size: 300}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, [override])
    message = str(err.value)
    assert expected in message and "\n" not in message
    assert message.startswith("--set: ")  # the value came from an override, not the file


def test_info_says_which_optimizer_trains_what(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, train=dict(optimizer="muon"))
    info = model_info(cfg)
    rows = {o["optimizer"]: o for o in info["optimizers"]}
    assert rows["muon"]["params"] + rows["adamw"]["params"] == info["params"]
    assert rows["muon"]["tensors"] == 4 * cfg.model.n_layer
    adamw_only = model_info(tiny_config(tmp_path))["memory_bytes"]["optimizer_state"]
    assert info["memory_bytes"]["optimizer_state"] == adamw_only - 4 * rows["muon"]["params"]


# ----------------------------------------------------------------------------- through the Trainer


def run(cfg, stop_at: int | None = None) -> dict[str, torch.Tensor]:
    trainer = make_trainer(cfg, verbose=False)
    try:
        trainer.fit(stop_at=stop_at)
    finally:
        trainer.close()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resume_with_muon_is_bitwise_exact(data_dir: Path, tmp_path: Path) -> None:
    train = dict(optimizer="muon", muon_weight_decay=0.1)
    cfg = tiny_config(data_dir, model=dict(dropout=0.1), train=train)
    # Stopped between checkpoints: Muon's momentum must travel in the save.
    straight, _, resumed = resumed_runs(cfg, tmp_path, stop_at=3)
    assert_same_weights(straight, resumed)


def test_wsd_run_extended_before_its_decay_equals_the_longer_run(
    data_dir: Path, tmp_path: Path
) -> None:
    # AdamW keeps it fast; Muon's lr follows the same schedule (test above) and resumes bitwise.
    optimizer = "adamw"

    def cfg(name: str, max_steps: int):
        train = dict(optimizer=optimizer, schedule="wsd", decay_fraction=0.25,
                     max_steps=max_steps, out_dir=str(tmp_path / name))  # fmt: skip
        return tiny_config(data_dir, train=train)

    longer = run(cfg("long", 12))  # decays over steps 9..11
    short = cfg("short", 8)  # would decay over steps 6..7
    run(short, stop_at=5)
    extended = copy.deepcopy(short)
    extended.train.max_steps = 12
    assert_same(longer, run(extended))


def test_changing_the_optimizer_on_resume_is_refused(data_dir: Path, tmp_path: Path) -> None:
    cfg = tiny_config(data_dir, train=dict(out_dir=str(tmp_path / "run")))
    run(cfg, stop_at=2)
    cfg.train.optimizer = "muon"
    with pytest.raises(UserError, match=r"train\.optimizer \('adamw' -> 'muon'\)"):
        run(cfg)


@pytest.mark.slow
def test_bench_quality_trains_and_evaluates_each_variant(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = Path(__file__).parent.parent / "scripts" / "bench_quality.py"
    spec = importlib.util.spec_from_file_location("bench_quality", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(config_to_dict(tiny_config(data_dir))))
    out_json = tmp_path / "rows.json"
    bench.main([str(config), "--steps", "2", "--variants", "adamw-cosine,muon-wsd",
                "--variant", "fast:train.muon_lr=0.05,train.optimizer=muon",
                "--json", str(out_json)])  # fmt: skip
    table = capsys.readouterr().out
    assert "| adamw-cosine | " in table and "| muon-wsd | " in table and "| fast | " in table
    rows = {r["variant"]: r for r in json.loads(out_json.read_text())}
    # The same seed and data: the variants differ only by what they were told to change.
    assert rows["adamw-cosine"]["val_bpb"] != rows["muon-wsd"]["val_bpb"]
    assert rows["muon-wsd"]["val_bpb"] != rows["fast"]["val_bpb"]
    assert all(0 < r["optim_share"] < 1 and r["tokens_per_s"] > 0 for r in rows.values())
