"""Group relative policy optimisation (`train.objective: grpo`, DeepSeekMath 2024) against a
checkable reward.

Offers `group_advantages`, `clipped_objective`, `grpo_loss` (pure functions, tested as tables),
`Rollout` and `GRPO` (the objective: `prepare` samples the step's rollouts, `loss` learns).

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
Every log-probability (policy, old policy, reference) is of softmax(logits / T), T =
train.grpo.temperature, the distribution the rollouts were drawn from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minillm.errors import ConfigError
from minillm.infer.engine import Engine, SamplingParams
from minillm.infer.task_format import read_task
from minillm.model import Transformer
from minillm.runtime.device import sum_dtype
from minillm.train.objectives.common import (
    MeanMeter,
    MicroLoss,
    Reference,
    Setup,
    pad_rows,
    step_rows,
    token_logps,
)
from minillm.train.objectives.rewards import load_reward, score

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
    """The GRPO objective of a run: its prompts, reward, optional reference, rollouts and loss.

    The policy, the old policy and the reference are scored at train.grpo.temperature, the
    distribution the rollouts are sampled from (TRL divides the logits by it in both forwards),
    and without dropout (sampling runs without it): at the first inner step the importance ratio
    is exactly 1 and the gradient is the on-policy one.
    """

    dropout = False
    chat = True
    console = {"grpo/reward": "reward", "grpo/correct": "correct"}
    val_labels: dict[str, str] = {}

    def loss_parts(self, own: dict[str, float]) -> dict[str, float]:
        return {}

    def __init__(self, setup: Setup) -> None:
        cfg = setup.cfg
        self.cfg, self.dist, self.device = cfg, setup.dist, setup.device
        gc = cfg.train.grpo
        self.task = read_task(cfg.data.source)
        if self.task.kind != "exact_match":
            raise ConfigError(
                "data.source",
                f"{cfg.data.source}: GRPO needs exact-match prompts "
                '({"messages": [...], "answer": "..."}), not multiple choice',
            )
        self.reward = load_reward(gc.reward, setup.config_dir)
        # A first call, on the first prompt with its answer for a reply, before anything is
        # written: a function that cannot run (signature, return type) stops the run here.
        first = self.task.examples[0]
        score(self.reward, [{"role": r, "content": c} for r, c in first.messages], first.answer,
              first.answer, f"{cfg.data.source}: line {first.line}")  # fmt: skip
        self.tok, conv = setup.tokenizer, setup.conventions
        where = str(cfg.data.source)
        conv.check_chat(where)
        self.stops = conv.stop_ids
        self.prompts = [conv.chat_prompt(ex.messages) for ex in self.task.examples]
        context = cfg.model.max_seq_len
        for ex, p in zip(self.task.examples, self.prompts, strict=True):
            if len(p) + gc.max_new_tokens > context + 1:
                raise ConfigError(
                    "train.grpo.max_new_tokens",
                    f"{where}: line {ex.line}: a prompt of {len(p)} tokens and "
                    f"{gc.max_new_tokens} new ones exceed the model's context of {context}",
                )
        self.reference: Reference | None = None
        self.meter = MeanMeter()
        self.clock: list[float] = []  # this step's start, end of sampling

    @property
    def needs_start_weights(self) -> bool:
        return self.cfg.train.grpo.kl > 0  # the KL term's reference is train.init_from

    def attach(self, model: Transformer) -> None:
        if self.needs_start_weights:
            self.reference = Reference(model, bool(self.cfg.train.lora.rank))

    def batches(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of prompt indices for step `step` (seed and step only)."""
        return step_rows(len(self.prompts), self.cfg, self.dist, step)

    def prepare(self, model: Transformer, step: int, batch: list[list[int]]) -> list[list[Rollout]]:
        """The step's rollouts (`sample`), timed."""
        t0 = time.perf_counter()
        rollouts = self.sample(model, step, batch)
        self.clock = [t0, time.perf_counter()]
        return rollouts

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
        self._rollout_scalars([r for m in out for r in m])
        return out

    def _rollout_scalars(self, flat: list[Rollout]) -> None:
        rewards = torch.tensor([r.reward for r in flat]).view(-1, self.cfg.train.grpo.group_size)
        correct = rewards > 0
        self.meter.add({
            "grpo/reward": float(rewards.mean()),
            "grpo/correct": float(correct.double().mean()),
            "grpo/any_correct": float(correct.any(dim=1).double().mean()),
            "grpo/all_correct": float(correct.all(dim=1).double().mean()),
            "xray/grpo/reply_tokens": sum(len(r.reply) for r in flat) / len(flat),
        })  # fmt: skip

    def normalisers(self, batch: list[list[Rollout]]) -> torch.Tensor:
        """The reply tokens (token-level normalisation)."""
        return torch.tensor([float(sum(len(r.reply) for m in batch for r in m))],
                            dtype=torch.float64)  # fmt: skip

    def loss(self, model: torch.nn.Module, micro: list[Rollout], norms: torch.Tensor
             ) -> MicroLoss:  # fmt: skip
        """`grpo_loss` of one micro-batch's rollouts over the step's reply tokens, every
        log-probability at the sampling temperature; the reference first, the policy last."""
        gc = self.cfg.train.grpo
        rows = [r.prompt + r.reply for r in micro]
        masks = [[False] * len(r.prompt) + [True] * len(r.reply) for r in micro]
        idx, tgt = pad_rows(rows, masks)
        idx, tgt = idx.to(self.device), tgt.to(self.device)
        adv = torch.tensor([r.advantage for r in micro], device=self.device)
        ref = None
        if self.reference is not None:
            with torch.no_grad(), self.reference.model() as ref_model:
                ref = token_logps(ref_model, idx, tgt, gc.temperature)
        logp = token_logps(model, idx, tgt, gc.temperature)
        loss, k3 = grpo_loss(logp, logp.detach(), ref, adv, tgt != -100, gc.clip, gc.kl,
                             float(norms[0]))  # fmt: skip
        totals = torch.stack([loss.detach(), k3]).to(sum_dtype(loss.device))
        return MicroLoss(loss, totals, sum(len(r) for r in rows))

    def step_loss(self, totals: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        if self.reference is not None:
            # Python floats, as lm and dpo divide: a float32 device sum over the float64 count
            # is a float64 device tensor, which MPS does not have.
            self.meter.add({"grpo/kl": float(totals[1]) / float(norms[0])})
        if self.clock:  # sampling, then learning: the share a step spends on each
            t0, t1 = self.clock
            t2 = time.perf_counter()
            self.meter.add({"xray/grpo/sample_seconds": t1 - t0,
                            "xray/grpo/learn_seconds": t2 - t1,
                            "xray/grpo/sample_share": (t1 - t0) / max(t2 - t0, 1e-9)})  # fmt: skip
            self.clock = []
        return totals[0]

    def scalars(self) -> dict[str, float]:
        return self.meter.scalars()

    def evaluate(self, model: Transformer, autocast: Any) -> dict[str, float]:
        """No held-out measure of its own: train.eval_tasks (scored after this) is GRPO's."""
        return {}

    def probe_input(self) -> torch.Tensor:
        return torch.tensor([self.prompts[0]], dtype=torch.long)
