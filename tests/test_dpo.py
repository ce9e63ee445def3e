"""train.objective: dpo (minillm/train/objectives/dpo.py): the loss at step 0, parity with TRL's
DPOTrainer, the reference (a frozen copy, or the LoRA base with its adapters off), exact resume,
and one error line for a malformed preference row."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from typer.testing import CliRunner

from minillm.checkpoint.init_from import load_run_config
from minillm.cli import app
from minillm.tokenizer.bpe import load_tokenizer
from minillm.tokenizer.conventions import Conventions
from minillm.train.objectives.common import pad_rows, token_logps
from minillm.train.objectives.dpo import encode_pair, parse_pair
from tests.helpers import assert_same_weights, error_line, make_run, make_trainer, resumed_runs

runner = CliRunner()
WORDS = ["abc", "hello", "moon", "star", "tree", "rock", "sun", "sea", "sky", "rain"]
LN2_F32 = float(torch.tensor(math.log(2), dtype=torch.float32))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny chat-token model at root/base/run and preference pairs at root/pairs.jsonl."""
    root = tmp_path_factory.mktemp("dpo")
    make_run(root / "base")
    rows = [{"prompt": f"say {w}", "chosen": w, "rejected": w[::-1]} for w in WORDS]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def dpo_yaml(base: Path, out: Path, source: Path | None = None, **train) -> Path:  # noqa: ANN003
    raw = {
        "data": {"source": str(source or base / "pairs.jsonl"), "val_fraction": 0.2},
        "train": {
            "init_from": str(base / "base" / "run"), "objective": "dpo", "out_dir": str(out),
            "batch_size": 2, "seq_len": 32, "max_steps": 6, "lr": 1e-2, "warmup_steps": 1,
            "device": "cpu", "precision": "fp32", "eval_every": 3, "log_every": 1,
            "ckpt_every": 3, **train,
        },
    }  # fmt: skip
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def dpo_trainer(base: Path, out: Path, **train):  # noqa: ANN003, ANN201
    return make_trainer(load_run_config(dpo_yaml(base, out, **train), []), verbose=False)


@pytest.mark.parametrize("lora", [0, 4])
def test_step_zero_loss_is_ln2_and_the_rewards_zero(base: Path, tmp_path: Path, lora: int) -> None:
    trainer = dpo_trainer(base, tmp_path / "run", lora={"rank": lora})
    try:
        result = trainer.train_step()
        stats = trainer.objective.scalars()
    finally:
        trainer.close()
    # The policy is the reference bit for bit: every log-ratio is 0, the loss -log sigmoid(0).
    assert float(result.loss) == LN2_F32
    assert stats["dpo/rewards_chosen"] == stats["dpo/rewards_rejected"] == 0.0
    assert stats["dpo/margin"] == 0.0 and stats["dpo/reward_accuracy"] == 0.0
    # LoRA: the reference is the base with its adapters off, not a second copy.
    assert (trainer.objective.reference.copy is None) == bool(lora)


def trl_loss(batch, policy_tok, ref_sums, beta: float, sft_weight: float) -> float:  # noqa: ANN001
    """TRL's own DPOTrainer._compute_loss (trl 1.16) on our per-token log-probabilities: its
    model is a stand-in returning them, its reference log-probs precomputed."""
    from trl import DPOTrainer

    rows = [p.chosen for p in batch] + [p.rejected for p in batch]
    masks = [p.chosen_mask for p in batch] + [p.rejected_mask for p in batch]
    T = max(len(r) for r in rows)
    completion = torch.zeros(len(rows), T, dtype=torch.long)
    for b, m in enumerate(masks):
        completion[b, : len(m)] = torch.tensor(m, dtype=torch.long)
    zeros = torch.zeros_like(policy_tok)
    outputs = SimpleNamespace(log_probs=policy_tok, entropy=zeros, mean_logits=zeros,
                              is_top1=zeros.bool())  # fmt: skip
    model = SimpleNamespace(training=True)
    fake = SimpleNamespace(
        model=model, accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x,
                                                 gather=lambda x: x),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", beta=beta, use_weighting=False,
        loss_types=["sigmoid", "sft"], loss_weights=[1.0, sft_weight],
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    n = len(batch)
    inputs = {"input_ids": torch.zeros(len(rows), T, dtype=torch.long),
              "attention_mask": torch.ones(len(rows), T, dtype=torch.long),
              "completion_mask": completion,
              "ref_chosen_logps": ref_sums[:n], "ref_rejected_logps": ref_sums[n:]}  # fmt: skip
    stand_in = lambda **kw: outputs  # noqa: E731
    return float(DPOTrainer._compute_loss(fake, stand_in, inputs, False))


def test_the_loss_equals_trls_dpo_loss_with_its_sft_term(base: Path, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    trainer = dpo_trainer(base, tmp_path / "run", dpo={"beta": 0.3, "sft_weight": 0.5})
    try:
        for _ in range(2):  # move the policy away from the reference
            trainer.count_step(trainer.train_step())
        (batch,) = trainer.batches(trainer.state.step)
        rows = [p.chosen for p in batch] + [p.rejected for p in batch]
        masks = [p.chosen_mask for p in batch] + [p.rejected_mask for p in batch]
        idx, tgt = pad_rows(rows, masks)
        with torch.no_grad():
            policy = token_logps(trainer.model, idx, tgt)
            with trainer.objective.reference.model() as ref:
                ref_sums = token_logps(ref, idx, tgt).sum(-1)
        assert not torch.equal(policy.sum(-1), ref_sums)
        expected = trl_loss(batch, policy, ref_sums, 0.3, 0.5)
        got = float(trainer.train_step().loss)
    finally:
        trainer.close()
    assert got == pytest.approx(expected, rel=1e-6)


def test_resume_of_a_dpo_run_is_bitwise(base: Path, tmp_path: Path) -> None:
    straight, _, second = resumed_runs(  # stopped between checkpoints: saves at 2
        lambda out: load_run_config(dpo_yaml(base, out), []), tmp_path, stop_at=2
    )
    assert second.state.step == 6
    assert_same_weights(straight, second)
    assert straight.last_eval == second.last_eval and "reward_accuracy" in second.last_eval


def test_standard_and_conversational_rows_encode_alike(base: Path) -> None:
    tok = load_tokenizer(base / "base" / "tokenizer.json")
    user = [{"role": "user", "content": "say hi"}]
    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    rows = [
        {"prompt": "say hi", "chosen": "hi", "rejected": "ih"},
        {"prompt": user, "chosen": reply("hi"), "rejected": reply("ih")},
        {"chosen": user + reply("hi"), "rejected": user + reply("ih")},  # implicit prompt
    ]
    conv = Conventions.of(tok, base / "base")
    encoded = [encode_pair(conv, parse_pair(r, "x")) for r in rows]
    assert encoded[0] == encoded[1] == encoded[2]
    e = encoded[0]
    # Targets: the reply's content and its <|end|>, never the prompt or <|assistant|>.
    targets = [t for t, m in zip(e.chosen, e.chosen_mask, strict=True) if m]
    assert tok.decode(targets[:-1]) == "hi" and targets[-1] == tok.token_to_id("<|end|>")


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ('{"prompt": "a", "chosen": "b"}', "line 2: rejected: missing"),
        ('{"chosen": "b", "rejected": "c"}', "line 2: prompt: missing (replies given as strings"),
        ('{"prompt": "a", "chosen": "b", "rejected": 3}', "line 2: rejected: expected a string"),
        ('{"prompt": [{"role": "bot", "content": "a"}], "chosen": [], "rejected": []}',
         "line 2: chosen: expected a non-empty list"),
        ('{"prompt": [{"role": "user", "content": "a"}], '
         '"chosen": [{"role": "user", "content": "b"}], '
         '"rejected": [{"role": "assistant", "content": "c"}]}',
         "line 2: chosen: no assistant turn"),
        ('{"prompt": "a", "chosen": "b", "rejected": "c"', "line 2: not JSON"),
    ],
)  # fmt: skip
def test_a_malformed_pair_is_one_error_line_and_nothing_written(
    base: Path, tmp_path: Path, row: str, expected: str
) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' + row + "\n")
    path = dpo_yaml(base, tmp_path / "run", source=source)
    line = error_line(runner.invoke(app, ["train", str(path)]))
    assert line == f"error: {source}: {expected}" or line.startswith(f"error: {source}: {expected}")
    assert not (tmp_path / "run").exists()


def test_tokenize_has_nothing_to_do_and_an_unknown_objective_is_one_line(
    base: Path, tmp_path: Path
) -> None:
    path = dpo_yaml(base, tmp_path / "run")
    result = runner.invoke(app, ["tokenize", str(path)])
    assert result.exit_code == 0, result.output
    assert "nothing to tokenize: train.objective dpo reads" in result.output
    line = error_line(runner.invoke(app, ["train", str(path), "--set", "train.objective=ppo"]))
    assert line.startswith("error: --set: train.objective: expected one of 'lm', 'dpo', 'grpo'")
    raw = yaml.safe_load(path.read_text())
    del raw["train"]["init_from"]
    raw["model"] = {"d_model": 32, "n_layer": 2, "n_head": 4}
    path.write_text(yaml.safe_dump(raw))
    line = error_line(runner.invoke(app, ["train", str(path)]))
    assert line.startswith(f"error: {path}: train.objective: dpo needs train.init_from")
    assert not (tmp_path / "run").exists()


def test_sft_weight_adds_the_chosen_replies_cross_entropy(base: Path, tmp_path: Path) -> None:
    losses = {}
    for w in (0.0, 2.0):
        trainer = dpo_trainer(base, tmp_path / f"run{w}", dpo={"sft_weight": w})
        try:
            losses[w] = float(trainer.train_step().loss)
            nll = trainer.objective.scalars()["dpo/nll"]
        finally:
            trainer.close()
    assert losses[0.0] == LN2_F32
    assert losses[2.0] == pytest.approx(LN2_F32 + 2.0 * nll, rel=1e-6)


@pytest.mark.slow
def test_the_console_labels_the_loss_parts_and_the_val_loss(base: Path, tmp_path: Path) -> None:
    """The train line's loss is DPO's plus sft_weight's term, each labelled; the val line says
    its loss is DPO's alone (issue 62: `loss 0.3036` beside `val loss 0.0002` read as one)."""
    import re

    sets = ["--set", "train.dpo.sft_weight=0.5", "--set", "train.max_steps=3"]
    result = runner.invoke(app, ["train", str(dpo_yaml(base, tmp_path / "run")), *sets])
    assert result.exit_code == 0, result.output
    parts = re.findall(r"loss (\d\.\d{4}) \(dpo (\d\.\d{4}) \+ sft (\d\.\d{4})\)", result.stdout)
    assert len(parts) == 3, result.stdout  # log_every 1
    for total, dpo, sft in parts:
        assert float(total) == pytest.approx(float(dpo) + float(sft), abs=2e-4)
        assert float(sft) > 0
    assert re.search(r"step 3: val dpo loss \d\.\d{4}, reward accuracy", result.stdout)
