"""The one training step under every objective (minillm/train/objectives, Trainer.learn): mixed
precision (fp16 with its grad scaler, bf16), the MoE load-balancing loss and its charts, dropout
(off where the loss compares against a dropout-free side), and the seam itself (no objective
branch outside the registry, no objective reaching into the Trainer)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from minillm.checkpoint.init_from import load_run_config
from minillm.config import Config
from tests.helpers import (
    ROOT,
    make_run,
    make_trainer,
    post_training_data,
    prepared_config,
    weights,
)

MOE = dict(n_experts=4, n_experts_per_token=2)
LN2_F32 = float(torch.tensor(math.log(2), dtype=torch.float32))


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random tiny chat-token models (dense, dense with dropout 0.1, MoE) with preference pairs
    and exact-match prompts beside them."""
    root = tmp_path_factory.mktemp("objectives")
    make_run(root / "dense")
    make_run(root / "dropout", model={"dropout": 0.1})
    make_run(root / "moe", model=MOE)
    return post_training_data(root)


def post_config(bases: Path, out: Path, objective: str, base: str = "dense", **train: Any
                ) -> Config:  # fmt: skip
    """A dpo or grpo run of `base` (bases/<base>/run), as `minillm train` would read it."""
    source = bases / ("pairs.jsonl" if objective == "dpo" else "prompts.jsonl")
    raw = {
        "data": {"source": str(source)},
        "train": {
            "init_from": str(bases / base / "run"), "objective": objective, "out_dir": str(out),
            "batch_size": 2, "seq_len": 32, "max_steps": 4, "lr": 1e-2, "warmup_steps": 0,
            "device": "cpu", "precision": "fp32", "log_every": 1, "ckpt_every": 2,
            "grpo": {"group_size": 4, "max_new_tokens": 6, "reward": "python:rw_len:length"},
            **train,
        },
    }  # fmt: skip
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return load_run_config(path, [])


def trainer_of(
    bases: Path,
    tmp_path: Path,
    objective: str,
    base: str = "dense",
    model: dict | None = None,
    **train: Any,
) -> Any:
    """A quiet Trainer of `objective`: lm on the tiny corpus, tokenized, with `model`; else a
    post_config of `base`, whose model it is."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if objective == "lm":
        cfg = prepared_config(tmp_path, model=model or {}, train=dict(max_steps=4, **train))
        return make_trainer(cfg, verbose=False)
    cfg = post_config(bases, tmp_path / "run", objective, base, **train)
    return make_trainer(cfg, verbose=False, config_dir=bases)


# ----------------------------------------------------------------------------- mixed precision


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("objective", ["lm", "dpo", "grpo"])
def test_mixed_precision_steps_under_every_objective(
    bases: Path, tmp_path: Path, objective: str, precision: str
) -> None:
    """fp16 (GradScaler: scaled backward, unscaled clip) and bf16 autocast take the same one step
    under each objective: finite, the weights move, and they stay fp32."""
    trainer = trainer_of(bases, tmp_path, objective, precision=precision, weight_decay=0.0)
    try:
        assert (trainer.scaler is not None) == (precision == "fp16")
        before = weights(trainer)
        for _ in range(2):
            out = trainer.train_step()
            trainer.count_step(out)
            assert out.finite and math.isfinite(float(out.loss))
        after = weights(trainer)
        assert any(not torch.equal(before[k], v) for k, v in after.items())
        assert all(v.dtype == torch.float32 for v in after.values())
    finally:
        trainer.close()


# ----------------------------------------------------------------------------- mixture of experts


def router_grads(trainer: Any) -> dict[str, torch.Tensor]:
    """The gradients of one step, taken where the Trainer clips (before the optimizer)."""
    grads: dict[str, torch.Tensor] = {}

    def capture(loss: torch.Tensor) -> tuple[torch.Tensor, bool]:
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()
                      if p.grad is not None})  # fmt: skip
        trainer.optimizer.zero_grad(set_to_none=True)
        return torch.zeros(()), True

    trainer._clip_and_step = capture
    trainer.train_step()
    return grads


@pytest.mark.parametrize("objective", ["lm", "dpo", "grpo"])
def test_the_moe_aux_loss_moves_the_router_under_every_objective(
    bases: Path, tmp_path: Path, objective: str
) -> None:
    """train.moe_aux_loss adds to each objective's loss: the router's gradient differs from the
    one without it, the experts' do not, and the expert load is counted for the charts."""
    grads = {}
    for coef in (0.5, 0.0):
        trainer = trainer_of(bases, tmp_path / f"c{coef}", objective, base="moe",
                             model=MOE, moe_aux_loss=coef)  # fmt: skip
        try:
            assert trainer.expert_load is not None
            grads[coef] = router_grads(trainer)
            assert trainer.expert_load.micro_batches > 0  # the load of each layer, logged
            scalars = trainer.expert_load.scalars()
            assert "xray/moe/aux_loss" in scalars and "xray/moe/layer0/expert0" in scalars
        finally:
            trainer.close()
    router = "blocks.1.ffn.router.weight"
    assert not torch.allclose(grads[0.5][router], grads[0.0][router], atol=1e-7)
    assert torch.equal(grads[0.5]["blocks.1.ffn.w_down"], grads[0.0]["blocks.1.ffn.w_down"])


def test_an_moe_dpo_run_logs_expert_load_to_tensorboard(bases: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.helpers import run_trainer

    # 10 steps: the per-layer diagnostics come every 10 x log_every steps, for DPO too.
    cfg = post_config(bases, tmp_path / "run", "dpo", base="moe", moe_aux_loss=0.05, max_steps=10)
    run_trainer(cfg)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "xray/moe/aux_loss" in tags and "xray/moe/layer1/expert3" in tags
    assert "dpo/loss" in tags and "xray/activation_rms/00" in tags  # the diagnostics too


# ----------------------------------------------------------------------------- dropout


@pytest.mark.parametrize(
    ("base", "lora"), [("dropout", {}), ("dense", {"rank": 4, "dropout": 0.5})]
)
def test_dpo_scores_the_policy_without_dropout(
    bases: Path, tmp_path: Path, base: str, lora: dict
) -> None:
    """DPO's policy forward runs without dropout (TRL's disable_dropout default), as its
    reference does: at step 0 the policy is the reference bit for bit, whatever model.dropout or
    train.lora.dropout say, so the loss is ln 2 (with dropout on, 0.28 nats of noise a reply)."""
    train = {"lora": lora} if lora else {}
    trainer = trainer_of(bases, tmp_path, "dpo", base=base, **train)
    try:
        drops = [m.p for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
        assert trainer.model.training and any(p > 0 for p in drops)
        assert float(trainer.train_step().loss) == LN2_F32
        assert trainer.model.training  # dropout_off does not leave eval mode behind
        after = [m.p for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
        assert after == drops  # and puts every dropout back
    finally:
        trainer.close()


def test_lm_keeps_its_dropout(bases: Path, tmp_path: Path) -> None:
    """Next-token training keeps model.dropout: two steps from one state with different RNG
    states give different losses."""
    trainer = trainer_of(bases, tmp_path, "lm", model={"dropout": 0.3})
    try:
        batch = trainer.batches(0)
        torch.manual_seed(1)
        a = trainer.objective.loss(trainer.model, batch[0], torch.tensor([1.0]))
        torch.manual_seed(2)
        b = trainer.objective.loss(trainer.model, batch[0], torch.tensor([1.0]))
        assert not torch.equal(a.loss, b.loss)
    finally:
        trainer.close()


# ----------------------------------------------------------------------------- batch 1


def chat_lm_trainer(tmp_path: Path, **train: Any) -> Any:
    """An lm Trainer on tokenized chat data (loss on the assistant turns, documents packed)."""
    from minillm.data.tokenize_pass import write_shards
    from tests.helpers import tiny_config

    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {a + 3}?"},
                          {"role": "assistant", "content": f"{a} + {a + 3} = {2 * a + 3}"}]}
            for a in range(60)]  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = dict(source=str(tmp_path / "chat.jsonl"), text_field="messages", loss_on="assistant")
    cfg = tiny_config(tmp_path, data=data, train=dict(max_steps=4, **train))
    write_shards(cfg)
    return make_trainer(cfg, verbose=False)


@pytest.mark.parametrize("objective", ["lm", "dpo", "grpo"])
def test_batch_size_one_trains_under_every_objective(
    bases: Path, tmp_path: Path, objective: str
) -> None:
    """train.batch_size: 1 takes finite steps that move the weights; with chat data (issue 60)
    the targets' -100 once leaked into the inputs and the embedding raised IndexError."""
    if objective == "lm":
        trainer = chat_lm_trainer(tmp_path, batch_size=1)
        assert trainer.objective.chat and trainer.objective.packing.doc_mask
    else:
        trainer = trainer_of(bases, tmp_path, objective, batch_size=1)
    try:
        before = weights(trainer)
        for _ in range(2):
            batch = trainer.batches(trainer.state.step)
            rows = [m.tokens.shape[0] if objective == "lm" else len(m) for m in batch]
            assert rows == [1] * len(batch)  # one row (pair, prompt) per micro-batch
            out = trainer.train_step(batch)
            trainer.count_step(out)
            assert out.finite and math.isfinite(float(out.loss))
        after = weights(trainer)
        assert any(not torch.equal(before[k], v) for k, v in after.items())
    finally:
        trainer.close()


# ----------------------------------------------------------------------------- the seam


def test_no_objective_branch_outside_the_registry_and_the_config() -> None:
    """`objective ==`-style branches live only in the registry (train/objectives/__init__.py)
    and config validation; no objective module reads the Trainer's private state."""
    branch = re.compile(r"objective\s*(==|!=|is None|is not None)")
    allowed = {"minillm/train/objectives/__init__.py", "minillm/config/train_schema.py"}
    found = []
    for path in sorted((ROOT / "minillm").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        if rel not in allowed and branch.search(text):
            found.append(rel)
        if rel.startswith("minillm/train/objectives/"):
            assert not re.search(r"trainer\._|\btrainer\b", text), rel
    assert found == []


def test_a_grpo_run_charts_its_quality_first_and_its_timings_as_diagnostics(
    bases: Path, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.helpers import run_trainer

    run_trainer(post_config(bases, tmp_path / "run", "grpo", max_steps=2), config_dir=bases)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    grpo = {t for t in tags if t.startswith("grpo/")}
    assert grpo == {"grpo/reward", "grpo/correct", "grpo/any_correct", "grpo/all_correct"}  # no kl
    assert {"xray/grpo/sample_share", "xray/grpo/reply_tokens", "train/loss"} <= tags
