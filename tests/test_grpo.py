"""train.objective: grpo (minillm/train/objectives/grpo.py): advantages and the clipped objective
as exact tables, one step on fixed rollouts against a hand-computed AdamW update, exact resume,
and one error line for an answer-less prompt or a bad reward function."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from minillm.checkpoint.init_from import load_run_config
from minillm.checkpoint.store import load_model_state
from minillm.cli import app
from minillm.infer.sampling import apply_temperature
from minillm.train.objectives.common import pad_rows, token_logps
from minillm.train.objectives.grpo import Rollout, clipped_objective, group_advantages, grpo_loss
from tests.helpers import (
    assert_same_function,
    assert_same_weights,
    error_line,
    make_run,
    make_trainer,
    resumed_runs,
)

runner = CliRunner()
WORDS = ["a", "b", "c", "d", "e", "f"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny chat-token model at root/base/run and exact-match prompts."""
    root = tmp_path_factory.mktemp("grpo")
    make_run(root / "base")
    rows = [{"messages": [{"role": "user", "content": f"say {w}"}], "answer": w} for w in WORDS]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def grpo_yaml(base: Path, out: Path, source: Path | None = None, **train) -> Path:  # noqa: ANN003
    raw = {
        "data": {"source": str(source or base / "prompts.jsonl")},
        "train": {
            "init_from": str(base / "base" / "run"), "objective": "grpo", "out_dir": str(out),
            "batch_size": 2, "seq_len": 32, "max_steps": 4, "lr": 1e-2, "warmup_steps": 0,
            "device": "cpu", "precision": "fp32", "log_every": 1, "ckpt_every": 2,
            "grpo": {"group_size": 4, "max_new_tokens": 6}, **train,
        },
    }  # fmt: skip
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_advantages_as_a_table() -> None:
    rewards = torch.tensor(
        [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1],
         [2.0, 0.0, 1.0, 1.0]], dtype=torch.float64,
    )  # fmt: skip
    s1 = math.sqrt(1 / 3)  # the Bessel-corrected std of 1, 0, 0, 1
    s2 = math.sqrt(2 / 3)  # of 2, 0, 1, 1
    expected = torch.tensor(
        [[0.5 / (s1 + 1e-4), -0.5 / (s1 + 1e-4), -0.5 / (s1 + 1e-4), 0.5 / (s1 + 1e-4)],
         [0.0] * 4, [0.0] * 4, [0.0] * 4,  # equal rewards: no advantage, even where 0.1 rounds
         [1 / (s2 + 1e-4), -1 / (s2 + 1e-4), 0.0, 0.0]], dtype=torch.float64,
    )  # fmt: skip
    got = group_advantages(rewards)
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)
    assert torch.equal(got[1:4], torch.zeros(3, 4, dtype=torch.float64))


def test_the_clipped_objective_as_a_table() -> None:
    # (ratio, advantage) -> -min(ratio A, clip(ratio, 0.8, 1.2) A)
    table = [
        (1.5, 1.0, -1.2),  # above the clip, A > 0: the clipped term, no gradient
        (1.5, -1.0, 1.5),  # above the clip, A < 0: the unclipped (pessimistic) term
        (0.5, 1.0, -0.5),
        (0.5, -1.0, 0.8),
        (1.0, 2.0, -2.0),  # on-policy: -A
        (1.1, 0.0, 0.0),
    ]
    ratio = torch.tensor([r for r, _, _ in table], dtype=torch.float64)
    adv = torch.tensor([a for _, a, _ in table], dtype=torch.float64)
    got = clipped_objective(ratio.log(), torch.zeros_like(ratio), adv, 0.2)
    assert torch.allclose(got, torch.tensor([e for _, _, e in table], dtype=torch.float64))


def test_equal_rewards_give_zero_gradient() -> None:
    logp = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    adv = group_advantages(torch.full((1, 4), 0.7, dtype=torch.float64))[0]
    loss, _ = grpo_loss(logp, logp.detach(), None, adv, torch.ones(4, 5, dtype=torch.bool),
                        0.2, 0.0, 20.0)  # fmt: skip
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_step_on_fixed_rollouts_is_the_hand_computed_update(
    base: Path, tmp_path: Path, temperature: float
) -> None:
    grpo = {"group_size": 4, "max_new_tokens": 6, "temperature": temperature}
    path = grpo_yaml(base, tmp_path / "run", weight_decay=0.0, grad_clip=0.0, lr=1e-3, grpo=grpo)
    trainer = make_trainer(load_run_config(path, []), verbose=False)
    try:
        prompt = trainer.objective.prompts[0]
        replies = [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]]
        rewards = [1.0, 0.0, 0.0, 1.0]
        adv = group_advantages(torch.tensor([rewards], dtype=torch.float64))[0].tolist()
        rollouts = [[Rollout(prompt, r, w, a) for r, w, a in zip(replies, rewards, adv)]]
        # By hand, TRL's formula: the gradient of -(1/N) sum_i A_i sum_t log p_T(reply_i,t),
        # p_T = softmax(logits / T) (what the rollouts were sampled from), N = 10 reply tokens;
        # then AdamW's first step: p - lr g / (|g| + eps) (bias-corrected m and v are g, g^2).
        model = trainer.model
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        rows = [prompt + r for r in replies]
        masks = [[False] * len(prompt) + [True] * len(r) for r in replies]
        idx, tgt = pad_rows(rows, masks)
        logits, _ = model(idx)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        logp = logp.gather(-1, tgt.clamp(min=0)[..., None])[..., 0] * (tgt != -100)
        hand = -(torch.tensor(adv, dtype=torch.float32)[:, None] * logp).sum() / 10
        grads = torch.autograd.grad(hand, list(model.parameters()))
        model.zero_grad(set_to_none=True)
        trainer.learn(rollouts)
        for (name, p), g in zip(model.named_parameters(), grads, strict=True):
            expected = before[name] - 1e-3 * g / (g.abs() + 1e-8)
            assert torch.allclose(p.detach(), expected, rtol=0, atol=2e-6), name
        assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    finally:
        trainer.close()


def test_log_probs_are_the_sampling_distributions_at_its_temperature(
    base: Path, tmp_path: Path
) -> None:
    """At train.grpo.temperature 0.7 the learner scores each sampled reply token under
    softmax(logits / 0.7), the distribution the decoding core drew it from: the importance
    ratio against it is 1 (at T = 1 it would be off by far more)."""
    grpo = {"group_size": 4, "max_new_tokens": 6, "temperature": 0.7, "kl": 0.1}
    trainer = make_trainer(load_run_config(grpo_yaml(base, tmp_path / "run", grpo=grpo), []),
                           verbose=False)  # fmt: skip
    try:
        obj, model = trainer.objective, trainer.model
        (micro,) = obj.prepare(model, 0, trainer.batches(0))[:1]
        rows = [r.prompt + r.reply for r in micro]
        masks = [[False] * len(r.prompt) + [True] * len(r.reply) for r in micro]
        idx, tgt = pad_rows(rows, masks)
        sampled = torch.zeros(tgt.shape)
        with torch.no_grad():
            for b, r in enumerate(micro):  # the decoding core's own distribution, step by step
                for t in range(len(r.reply)):
                    pos = len(r.prompt) + t - 1
                    logits = model.eval()(idx[b : b + 1, : pos + 1])[0][0, -1]
                    probs = torch.log_softmax(apply_temperature(logits.float(), 0.7), -1)
                    sampled[b, pos] = probs[r.reply[t]]
            model.train()
            learner = token_logps(model, idx, tgt, 0.7)
            at_one = token_logps(model, idx, tgt)
        mask = tgt != -100
        assert mask.sum() > 4
        assert_same_function(learner[mask], sampled[mask])
        assert (at_one[mask] - sampled[mask]).abs().max() > 0.05  # T matters on this model
        # The reference is scored at T too: with the policy still at its start, KL is 0.
        loss = obj.loss(model, micro, obj.normalisers([micro]))
        assert float(loss.totals[1]) == pytest.approx(0.0, abs=1e-6)
    finally:
        trainer.close()


def test_resume_of_a_grpo_run_is_bitwise(base: Path, tmp_path: Path) -> None:
    # A reward that varies within a group (the reply's length), and no weight decay: only the
    # policy gradient can move the weights, so a broken rollout seed would show.
    (base / "rw_len.py").write_text("def length(m, reply, answer):\n    return len(reply)\n")
    train = dict(weight_decay=0.0, grpo={"group_size": 4, "max_new_tokens": 6,
                                         "reward": "python:rw_len:length"})  # fmt: skip
    straight, first, second = resumed_runs(
        lambda out: load_run_config(grpo_yaml(base, out, **train), []), tmp_path, stop_at=3,
        config_dir=base,
    )  # fmt: skip
    start = load_model_state(next((base / "base" / "run" / "checkpoints").iterdir()))
    moved = [k for k, v in straight.model.state_dict().items() if not torch.equal(v, start[k])]
    assert moved  # the policy gradient moved the weights
    assert_same_weights(straight, second)


def test_an_answerless_prompt_is_one_error_line_and_nothing_written(
    base: Path, tmp_path: Path
) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text('{"messages": [{"role": "user", "content": "x"}], "answer": "x"}\n'
                      '{"messages": [{"role": "user", "content": "y"}]}\n')  # fmt: skip
    path = grpo_yaml(base, tmp_path / "run", source=source)
    line = error_line(runner.invoke(app, ["train", str(path)]))
    assert (
        line
        == f"error: {source}: line 2: answer: missing (an exact-match row is messages and answer)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("body", "spec", "expected"),
    [
        ("def f(m, r, a):\n    raise ValueError('boom')\n", "python:rw:f",
         "line 1: train.grpo.reward: the function raised ValueError: boom"),
        ("def f(m, r, a):\n    return 'yes'\n", "python:rw:f",
         "line 1: train.grpo.reward: the function returned 'yes', not a finite number"),
        ("def g(m, r, a):\n    return 1.0\n", "python:rw:f", "train.grpo.reward: python:rw:f: "),
        (None, "python:nothere:f", "train.grpo.reward: python:nothere:f: no "),
        (None, "rouge", "train.grpo.reward: 'rouge' is not exact, number or python:"),
    ],
)  # fmt: skip
def test_a_bad_reward_function_is_one_error_line_and_nothing_written(
    base: Path, tmp_path: Path, body: str | None, spec: str, expected: str
) -> None:
    if body is not None:
        (tmp_path / "rw.py").write_text(body)
    path = grpo_yaml(base, tmp_path / "run", grpo={"group_size": 2, "max_new_tokens": 3,
                                                   "reward": spec})  # fmt: skip
    line = error_line(runner.invoke(app, ["train", str(path)]))
    assert line.startswith("error: ") and expected in line, line
    assert not (tmp_path / "run").exists()


def test_a_python_reward_is_loaded_from_the_config_folder_and_used(
    base: Path, tmp_path: Path
) -> None:
    (tmp_path / "rw.py").write_text("def length(m, reply, answer):\n    return len(reply)\n")
    grpo = {"group_size": 2, "max_new_tokens": 3, "reward": "python:rw:length"}
    path = grpo_yaml(base, tmp_path / "run", max_steps=1, grpo=grpo)
    cfg = load_run_config(path, [])
    trainer = make_trainer(cfg, verbose=False, config_dir=path.parent)  # as `train` does
    try:
        rollouts = trainer.objective.sample(trainer.model, 0, trainer.batches(0))
        tok = trainer.objective.tok
        for r in (r for m in rollouts for r in m):
            text = tok.decode([t for t in r.reply if t not in trainer.objective.stops])
            assert r.reward == len(text)
    finally:
        trainer.close()


def test_grpo_under_fsdp_is_refused_in_one_line(base: Path, tmp_path: Path) -> None:
    # GRPO decodes its rollouts with the model's own parameters; FSDP2 would hand the decoder
    # DTensor shards. Refused when the config is read, naming the key.
    path = grpo_yaml(base, tmp_path / "run", parallel="fsdp")
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2
    assert "train.parallel: fsdp cannot run train.objective: grpo" in error_line(result)
    assert not (tmp_path / "run").exists()


def test_the_progress_line_shows_reward_and_share_correct(base: Path, tmp_path: Path) -> None:
    # A GRPO loss is about 0 whatever the rewards: the line shows them beside it (issue 53).
    (tmp_path / "rw.py").write_text("def half(m, reply, answer):\n    return 0.5\n")
    grpo = {"group_size": 2, "max_new_tokens": 3, "reward": "python:rw:half"}
    path = grpo_yaml(base, tmp_path / "run", max_steps=1, grpo=grpo)
    result = runner.invoke(app, ["train", str(path)])
    assert result.exit_code == 0, result.output
    step = next(line for line in result.stdout.splitlines() if line.startswith("step 1/1 "))
    assert "  loss " in step and "  reward 0.500  correct 1.000  lr " in step, step


def test_beside_loss_puts_the_objectives_scalars_after_the_loss() -> None:
    from minillm.train.trainer import _beside_loss

    shown = {"loss": "0.0001", "lr": "1e-3", "tok/s": "10"}
    got = _beside_loss(shown, {"grpo/reward": 0.25, "x": 1.0}, {"grpo/reward": "reward"})
    assert list(got.items()) == [("loss", "0.0001"), ("reward", "0.250"), ("lr", "1e-3"),
                                 ("tok/s", "10")]  # fmt: skip
