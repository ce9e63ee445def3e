"""Group relative policy optimisation (`train.objective: grpo`, DeepSeekMath 2024) against a
checkable reward.

Offers `group_advantages`, `clipped_objective`, `grpo_loss` (pure functions, tested as tables),
`Rollout` and `GRPO` (the objective the Trainer runs: `sample` then `learn`).

Each step takes train.batch_size x grad_accum prompts of `data.source` (an exact-match task
file, `{"messages": [...], "answer": "..."}`, as `eval --task` reads it) and samples
train.grpo.group_size replies to each through the decoding core (minillm.infer.engine: one
prefill per prompt, the whole step's rows in one batch, KV-cached), each prompt's rows seeded
from (train.seed, step, prompt), so a run is reproducible and resumes bit for bit. Each reply is
rewarded (minillm.train.rewards); its advantage is its reward against its group's,
(r - mean) / (std + 1e-4) (TRL's, std with Bessel's correction), 0 for a group of equal
rewards. The loss is PPO's clipped objective per reply token, -min(ratio A, clip(ratio) A),
plus kl x the k3 estimate of KL(policy || reference) when train.grpo.kl > 0, summed over every
reply token of the step and divided by their number (token-level normalisation, as DAPO and
TRL's default). One optimizer step per batch of rollouts: the old policy is the policy (ratio 1,
the gradient REINFORCE's with the group baseline); the clip acts only if a step were reused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minillm.data.chat_template import chat_ids
from minillm.data.tokenizer import eot_id
from minillm.errors import ConfigError
from minillm.infer.engine import Engine, SamplingParams
from minillm.infer.task_format import read_task
from minillm.infer.task_scoring import chat_prompt_ids
from minillm.model import Transformer
from minillm.train.distributed import all_reduce_sum
from minillm.train.objectives import (
    MeanMeter,
    Reference,
    StepResult,
    pad_rows,
    step_indices,
    token_logps,
)
from minillm.train.optim import set_lr
from minillm.train.parallel import no_sync
from minillm.train.rewards import load_reward, score

if TYPE_CHECKING:
    from minillm.train.run import Run

EPS = 1e-4  # TRL's GRPOTrainer: advantages / (std + 1e-4)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(r - group mean) / (group std + 1e-4) per row of rewards (B, G); exactly 0 for a group
    whose rewards are all equal (its mean may round away from them)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    adv = (rewards - mean) / (std + EPS)
    equal = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    return torch.where(equal, torch.zeros_like(adv), adv)


def clipped_objective(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip: float
) -> torch.Tensor:
    """PPO's per-token loss -min(ratio A, clip(ratio, 1 - clip, 1 + clip) A), ratio =
    exp(logp - old_logp); all three of one shape."""
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    kl: float,
    n_tokens: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed per-token loss of rows (N, T) over `mask`, divided by n_tokens (the reply
    tokens of the whole step), advantages (N,) per row; and the summed k3 KL (detached)."""
    per_token = clipped_objective(logp, old_logp, advantages[:, None], clip)
    k3 = torch.zeros_like(logp)
    if ref_logp is not None:
        diff = ref_logp - logp
        k3 = torch.exp(diff) - diff - 1.0  # >= 0, unbiased for KL(policy || reference)
        per_token = per_token + kl * k3
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / n_tokens, (k3 * m).sum().detach()


@dataclass(frozen=True)
class Rollout:
    """One sampled reply: its prompt's ids, the reply's ids (its stop token included), its
    reward and advantage."""

    prompt: list[int]
    reply: list[int]
    reward: float
    advantage: float


def rollout_seed(seed: int, step: int, prompt: int) -> int:
    """The sampling seed of the group of the step's `prompt`-th prompt (63 bits, well mixed)."""
    state = np.random.SeedSequence([seed % 2**63, step, prompt]).generate_state(2)
    return int((int(state[0]) << 32 | int(state[1])) & 0x7FFF_FFFF_FFFF_FFFF)


class GRPO:
    """The GRPO objective of a run: its prompts, reward, optional reference, sampling and step."""

    def __init__(self, run: Run, model: Transformer) -> None:
        cfg = run.cfg
        self.cfg, self.dist, self.device = cfg, run.dist, run.device
        gc = cfg.train.grpo
        self.task = read_task(cfg.data.source)
        if self.task.kind != "exact_match":
            raise ConfigError(
                "data.source",
                f"{cfg.data.source}: GRPO needs exact-match prompts "
                '({"messages": [...], "answer": "..."}), not multiple choice',
            )
        self.reward = load_reward(gc.reward, run.config_dir)
        # A first call, on the first prompt with its answer for a reply, before anything is
        # written: a function that cannot run (signature, return type) stops the run here.
        first = self.task.examples[0]
        score(self.reward, [{"role": r, "content": c} for r, c in first.messages], first.answer,
              first.answer, f"{cfg.data.source}: line {first.line}")  # fmt: skip
        self.tok = run.tokenizer
        where = str(cfg.data.source)
        self.stops = frozenset([chat_ids(self.tok, where)["end"], eot_id(self.tok)])
        self.prompts = [chat_prompt_ids(self.tok, ex.messages, where) for ex in self.task.examples]
        context = cfg.model.max_seq_len
        for ex, p in zip(self.task.examples, self.prompts, strict=True):
            if len(p) + gc.max_new_tokens > context + 1:
                raise ConfigError(
                    "train.grpo.max_new_tokens",
                    f"{where}: line {ex.line}: a prompt of {len(p)} tokens and "
                    f"{gc.max_new_tokens} new ones exceed the model's context of {context}",
                )
        self.reference = Reference(model, bool(cfg.train.lora.rank)) if gc.kl > 0 else None
        self.meter = MeanMeter()

    def batches(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of prompt indices for step `step` (seed and step only)."""
        tc, d = self.cfg.train, self.dist
        per_rank = tc.batch_size * tc.grad_accum
        rows = step_indices(len(self.prompts), tc.seed, step, per_rank * d.world_size)
        mine = rows[d.rank * per_rank : (d.rank + 1) * per_rank]
        return [mine[i : i + tc.batch_size] for i in range(0, per_rank, tc.batch_size)]

    @torch.no_grad()
    def sample(self, model: Transformer, step: int, micro: list[list[int]]) -> list[list[Rollout]]:
        """group_size replies to each prompt of the step through the decoding core, rewarded,
        with their group's advantages: per micro-batch, its prompts' rollouts, group by group."""
        gc, tc, d = self.cfg.train.grpo, self.cfg.train, self.dist
        training = model.training
        model.eval()  # no dropout while sampling
        engine = Engine(model, self.tok)
        first = d.rank * tc.batch_size * tc.grad_accum  # the step's global prompt number
        groups = []
        for j, i in enumerate(i for m in micro for i in m):
            params = SamplingParams(gc.max_new_tokens, gc.temperature, 0, 1.0,
                                    seed=rollout_seed(tc.seed, step, first + j),
                                    stop_ids=self.stops)  # fmt: skip
            groups.append((i, engine.submit([self.prompts[i]], params, n=gc.group_size)))
        try:
            engine.run()
        finally:
            model.train(training)
        where = str(self.cfg.data.source)
        out, k = [], 0
        for m in micro:
            rollouts = []
            for i, rows in groups[k : k + len(m)]:
                ex = self.task.examples[i]
                messages = [{"role": r, "content": c} for r, c in ex.messages]
                texts = [self.tok.decode([t for t in r.tokens if t not in self.stops])
                         for r in rows]  # fmt: skip
                rewards = torch.tensor([score(self.reward, messages, t, ex.answer,
                                              f"{where}: line {ex.line}") for t in texts],
                                       dtype=torch.float64)  # fmt: skip
                adv = group_advantages(rewards[None])[0]
                rollouts += [Rollout(self.prompts[i], list(r.tokens), float(rw), float(a))
                             for r, rw, a in zip(rows, rewards, adv, strict=True)]  # fmt: skip
            out.append(rollouts)
            k += len(m)
        return out

    def train_step(self, trainer: Any, micro: list[list[int]]) -> StepResult:
        """Sample the step's rollouts, then one optimizer step on them."""
        t0 = time.perf_counter()
        rollouts = self.sample(trainer.model, trainer.state.step, micro)
        t1 = time.perf_counter()
        result = self.learn(trainer, rollouts)
        t2 = time.perf_counter()
        flat = [r for m in rollouts for r in m]
        G = self.cfg.train.grpo.group_size
        rewards = torch.tensor([r.reward for r in flat]).view(-1, G)
        correct = rewards > 0
        self.meter.add({
            "grpo/reward": float(rewards.mean()),
            "grpo/any_correct": float(correct.any(dim=1).double().mean()),
            "grpo/all_correct": float(correct.all(dim=1).double().mean()),
            "grpo/reply_tokens": sum(len(r.reply) for r in flat) / len(flat),
            "grpo/sample_seconds": t1 - t0,
            "grpo/learn_seconds": t2 - t1,
            "grpo/sample_share": (t1 - t0) / max(t2 - t0, 1e-9),
        })  # fmt: skip
        return result

    def learn(self, trainer: Any, rollouts: list[list[Rollout]]) -> StepResult:
        """One optimizer step on fixed rollouts (per micro-batch): the loss of `grpo_loss` over
        every reply token of the step."""
        tc, gc = self.cfg.train, self.cfg.train.grpo
        lr = set_lr(trainer.optimizer, trainer.state.step, tc)
        local = sum(len(r.reply) for m in rollouts for r in m)
        n_tokens = max(all_reduce_sum(torch.tensor(float(local), dtype=torch.float64)).item(), 1.0)
        world = self.dist.world_size  # DDP averages gradients over ranks: undo that
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        tokens = 0
        for i, m in enumerate(rollouts):
            rows = [r.prompt + r.reply for r in m]
            masks = [[False] * len(r.prompt) + [True] * len(r.reply) for r in m]
            idx, tgt = pad_rows(rows, masks)
            idx, tgt = idx.to(self.device), tgt.to(self.device)
            adv = torch.tensor([r.advantage for r in m], device=self.device)
            ref = None
            if self.reference is not None:
                with torch.no_grad(), self.reference.model() as ref_model, trainer.autocast:
                    ref = token_logps(ref_model, idx, tgt)
            with no_sync(trainer.train_model, trainer.model, sync=i == len(rollouts) - 1):
                with trainer.autocast:
                    logp = token_logps(trainer.train_model, idx, tgt)
                loss, k3 = grpo_loss(logp, logp.detach(), ref, adv, tgt != -100, gc.clip, gc.kl,
                                     n_tokens / world)  # fmt: skip
                loss.backward()
            total += torch.stack([loss.detach().double() / world, k3.double()])
            tokens += sum(len(r) for r in rows)
        total = all_reduce_sum(total)
        norm, finite = trainer._clip_and_step(total[0])
        if self.reference is not None:
            self.meter.add({"grpo/kl": float(total[1] / n_tokens)})
        return StepResult(total[0], norm, lr, tokens * world, n_tokens, finite)

    def scalars(self) -> dict[str, float]:
        return self.meter.scalars()

    def evaluate(self, trainer: Any) -> dict[str, float]:
        """No held-out measure of its own: train.eval_tasks (scored after this) is GRPO's."""
        return {}
