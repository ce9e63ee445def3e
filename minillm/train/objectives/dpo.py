"""Direct preference optimisation (`train.objective: dpo`, Rafailov et al. 2023) on pairs of
replies, against the frozen train.init_from.

Offers `read_pairs(path)` (TRL's preference formats, checked line by line), `encode_pair`,
`dpo_loss` (the sigmoid loss, TRL's `DPOTrainer` default) and `DPO` (the objective).

Data (`data.source`, jsonl), one pair a line, in TRL's formats:
- standard: `{"prompt": str, "chosen": str, "rejected": str}`: the prompt is a user turn, each
  reply an assistant turn;
- conversational: `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`, or
  without `prompt` (TRL's implicit prompt: the messages both replies start with).
Each side is rendered with the chat template of SFT (minillm.tokenizer.chat_template), and its
log-probability is the sum over the reply's assistant tokens and their `<|end|>`: the loss is on
the response only. The reference log-probabilities are computed on the fly, in the same step, by
the reference model (`objectives.Reference`: with LoRA, the policy with its adapters off), not
stored: nothing to precompute, and a resume needs nothing but the checkpoint.

A pair's log-ratio is h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)); the loss is
-log sigmoid(beta h), ln 2 when the policy is the reference (step 0). The rewards are
beta (log pi - log ref) of each reply; accuracy is the share of pairs whose chosen reward is
the higher, margin their mean difference. With `train.dpo.sft_weight` w the loss adds
w x the chosen replies' cross-entropy per token (TRL's rpo_alpha).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from minillm.data.corpus import val_mask
from minillm.errors import ConfigError, UserError
from minillm.model import Transformer
from minillm.runtime.device import sum_dtype
from minillm.runtime.files import user_jsonl
from minillm.tokenizer.chat_template import ROLES
from minillm.train.objectives.common import (
    MeanMeter,
    MicroLoss,
    Reference,
    Setup,
    pad_rows,
    step_rows,
    token_logps,
)
from minillm.train.parallel import reference_sharder

if TYPE_CHECKING:
    from minillm.tokenizer.conventions import Conventions

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Pair:
    """One preference: a prompt (messages) and two replies (messages); `line` in its file."""

    prompt: Messages
    chosen: Messages
    rejected: Messages
    line: int = 0


@dataclass(frozen=True)
class EncodedPair:
    """Token ids of prompt + reply for each side, and per token whether it is a target."""

    chosen: list[int]
    chosen_mask: list[bool]
    rejected: list[int]
    rejected_mask: list[bool]


def _messages(value: Any, where: str, key: str) -> Messages:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: {key}: expected a non-empty list of {{role, content}} "
                        f"messages, got {value!r:.60}")  # fmt: skip
    out = []
    for i, m in enumerate(value):
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if role not in ROLES:
            raise UserError(f"{where}: {key}[{i}].role: expected one of {', '.join(ROLES)}, "
                            f"got {role!r}")  # fmt: skip
        if not isinstance(content, str):
            raise UserError(f"{where}: {key}[{i}].content: expected a string, got {content!r}")
        out.append({"role": role, "content": content})
    return out


def parse_pair(obj: Any, where: str, line: int = 0) -> Pair:
    """A Pair from one jsonl row, or a UserError `where: key: what`."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("chosen", "rejected"):
        if key not in obj:
            raise UserError(f"{where}: {key}: missing (a pair is prompt, chosen, rejected)")
    prompt, chosen, rejected = obj.get("prompt"), obj["chosen"], obj["rejected"]
    if "prompt" not in obj and (isinstance(chosen, str) or isinstance(rejected, str)):
        raise UserError(f"{where}: prompt: missing (replies given as strings need the prompt "
                        "they answer; only lists of messages may leave it out)")  # fmt: skip
    if isinstance(prompt, str):  # standard: strings
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise UserError(f"{where}: {key}: expected a string like prompt, got {value!r:.60}")
        return Pair(
            [{"role": "user", "content": prompt}],
            [{"role": "assistant", "content": chosen}],
            [{"role": "assistant", "content": rejected}],
            line,
        )
    c, r = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
    if prompt is None:  # implicit prompt: the messages both replies start with
        if "prompt" in obj:
            raise UserError(f"{where}: prompt: expected a string or a list of messages, got null")
        n = 0
        while n < min(len(c), len(r)) - 1 and c[n] == r[n]:
            n += 1
        p, c, r = c[:n], c[n:], r[n:]
        if not p:
            raise UserError(f"{where}: prompt: missing, and chosen and rejected share no "
                            "first messages to take as the prompt")  # fmt: skip
    else:
        p = _messages(prompt, where, "prompt")
    for key, reply in (("chosen", c), ("rejected", r)):
        if not any(m["role"] == "assistant" for m in reply):
            raise UserError(f"{where}: {key}: no assistant turn, so nothing to score")
    return Pair(p, c, r, line)


def read_pairs(path: str | Path) -> list[Pair]:
    """The pairs of a jsonl file (blank lines skipped); a malformed line is one UserError
    `<file>: line N: <key>: <what>`, raised before any model runs."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise ConfigError("data.source", f"{path}: DPO reads a .jsonl file of preference pairs")
    pairs = []
    for n, where, obj in user_jsonl(path, "data.source"):
        pairs.append(parse_pair(obj, where, n))
    if not pairs:
        raise ConfigError("data.source", f"{path}: no preference pairs")
    return pairs


def encode_pair(conv: Conventions, pair: Pair) -> EncodedPair:
    """Each side as prompt + reply through the model's chat template; targets: the reply's
    assistant turns and the end-of-turn token after each (minillm.tokenizer.conventions)."""
    sides = []
    for reply in (pair.chosen, pair.rejected):
        ids, mask = conv.reply_targets(pair.prompt, reply)
        sides += [ids, mask]
    return EncodedPair(*sides)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair sigmoid DPO loss and the chosen and rejected rewards (detached), from each
    reply's summed log-probability (N,) under the policy and the reference."""
    chosen = policy_chosen - ref_chosen
    rejected = policy_rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen - rejected))
    return losses, beta * chosen.detach(), beta * rejected.detach()


class DPO:
    """The DPO objective of a run: its pairs (train and held-out), reference and loss.

    Dropout is off in the policy's forward (TRL's DPOConfig.disable_dropout, its default): the
    reference runs without it, so with dropout on the log-ratios would carry its noise (0.28
    nats per reply at lora.dropout 0.1) and step 0 would not start at ln 2.
    """

    dropout = False
    chat = True
    console = {"dpo/reward_accuracy": "acc"}
    # The held-out pairs' loss is the DPO loss alone, without sft_weight's term.
    val_labels = {"loss": "dpo loss"}
    needs_start_weights = True  # the reference is train.init_from, on a resume too

    def loss_parts(self, own: dict[str, float]) -> dict[str, float]:
        """DPO's loss and sft_weight x the chosen replies' cross-entropy, where that is on."""
        w = self.cfg.train.dpo.sft_weight
        if not w or "dpo/loss" not in own:
            return {}
        return {"dpo": own["dpo/loss"], "sft": w * own["dpo/nll"]}

    def __init__(self, setup: Setup) -> None:
        cfg = setup.cfg
        self.cfg, self.dist, self.device = cfg, setup.dist, setup.device
        conv = setup.conventions
        conv.check_chat(str(setup.tokenizer_file))
        pairs = read_pairs(cfg.data.source)
        limit = cfg.train.seq_len + 1  # inputs are all tokens but the last
        encoded = []
        for p in pairs:
            e = encode_pair(conv, p)
            longest = max(len(e.chosen), len(e.rejected))
            if longest > limit:
                raise ConfigError(
                    "train.seq_len",
                    f"{cfg.data.source}: line {p.line}: a side of {longest} tokens does not fit "
                    f"train.seq_len={cfg.train.seq_len} (+1)",
                )
            encoded.append(e)
        held = val_mask(len(encoded), cfg.data.val_fraction, cfg.data.seed) if len(encoded) > 1 \
            else [False] * len(encoded)  # fmt: skip
        self.train_pairs = [e for e, v in zip(encoded, held, strict=True) if not v]
        self.val_pairs = [e for e, v in zip(encoded, held, strict=True) if v]
        self.reference: Reference | None = None
        self.meter = MeanMeter()

    def attach(self, model: Transformer) -> None:
        # Under FSDP the reference copy is sharded as the policy is (train.parallel).
        shard = reference_sharder(self.cfg, self.device, self.dist)
        self.reference = Reference(model, lora=bool(self.cfg.train.lora.rank), shard=shard)

    def batches(self, step: int) -> list[list[EncodedPair]]:
        """This rank's micro-batches of pairs for optimizer step `step` (seed and step only)."""
        micro = step_rows(len(self.train_pairs), self.cfg, self.dist, step)
        return [[self.train_pairs[i] for i in m] for m in micro]

    def prepare(self, model: Transformer, step: int, batch: list) -> list[list[EncodedPair]]:
        return batch

    def normalisers(self, batch: list[list[EncodedPair]]) -> torch.Tensor:
        """Pairs, and the chosen replies' target tokens (for sft_weight's mean)."""
        return torch.tensor(
            [sum(len(m) for m in batch),
             sum(sum(p.chosen_mask[1:]) for m in batch for p in m)], dtype=torch.float64,
        )  # fmt: skip

    def _logps(self, model: torch.nn.Module, micro: list[EncodedPair]) -> tuple[torch.Tensor, int]:
        """Per-token log-probabilities (2N, T) of chosen then rejected, and the input tokens."""
        rows = [p.chosen for p in micro] + [p.rejected for p in micro]
        masks = [p.chosen_mask for p in micro] + [p.rejected_mask for p in micro]
        idx, tgt = pad_rows(rows, masks)
        return token_logps(model, idx.to(self.device), tgt.to(self.device)), sum(map(len, rows))

    def _reference_logps(self, micro: list[EncodedPair]) -> torch.Tensor:
        with torch.no_grad(), self.reference.model() as ref:
            return self._logps(ref, micro)[0].sum(-1)

    def loss(self, model: torch.nn.Module, micro: list[EncodedPair], norms: torch.Tensor
             ) -> MicroLoss:  # fmt: skip
        """The pairs' DPO loss over the global pairs (plus sft_weight x the chosen tokens'
        cross-entropy over the global chosen tokens); the reference first, the policy last."""
        dc = self.cfg.train.dpo
        n_pairs, n_chosen = norms.tolist()
        ref = self._reference_logps(micro)
        lp_tok, inputs = self._logps(model, micro)
        lp = lp_tok.sum(-1)
        k = len(micro)
        losses, r_c, r_r = dpo_loss(lp[:k], lp[k:], ref[:k], ref[k:], dc.beta)
        nll = -lp_tok[:k].sum()
        loss = losses.sum() / n_pairs + dc.sft_weight * nll / n_chosen
        totals = torch.stack([losses.sum(), r_c.sum(), r_r.sum(), (r_c > r_r).sum(), nll])
        return MicroLoss(loss, totals.detach().to(sum_dtype(totals.device)), inputs)

    def step_loss(self, totals: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        n_pairs, n_chosen = norms.tolist()
        dpo, nll = totals[0] / n_pairs, totals[4] / n_chosen
        self.meter.add({
            "dpo/loss": dpo, "dpo/nll": nll,
            "dpo/rewards_chosen": totals[1] / n_pairs, "dpo/rewards_rejected": totals[2] / n_pairs,
            "dpo/reward_accuracy": totals[3] / n_pairs,
            "dpo/margin": (totals[1] - totals[2]) / n_pairs,
        })  # fmt: skip
        return dpo + self.cfg.train.dpo.sft_weight * nll

    def scalars(self) -> dict[str, float]:
        return self.meter.scalars()

    @torch.no_grad()
    def evaluate(self, model: Transformer, autocast: Any) -> dict[str, float]:
        """The held-out pairs (data.val_fraction of the file): DPO loss, reward accuracy and
        margin; {} without held-out pairs. Every rank scores them all."""
        if not self.val_pairs:
            return {}
        tc, beta = self.cfg.train, self.cfg.train.dpo.beta
        training = model.training
        model.eval()
        sums = [0.0, 0.0, 0.0]
        try:
            for s in range(0, len(self.val_pairs), tc.batch_size):
                m = self.val_pairs[s : s + tc.batch_size]
                with autocast:
                    ref = self._reference_logps(m)
                    lp = self._logps(model, m)[0].sum(-1)
                k = len(m)
                losses, r_c, r_r = dpo_loss(lp[:k], lp[k:], ref[:k], ref[k:], beta)
                sums[0] += float(losses.sum())
                sums[1] += float((r_c > r_r).sum())
                sums[2] += float((r_c - r_r).sum())
        finally:
            model.train(training)
        n = len(self.val_pairs)
        return {"loss": sums[0] / n, "reward_accuracy": sums[1] / n, "margin": sums[2] / n}

    def probe_input(self) -> torch.Tensor:
        return torch.tensor([self.train_pairs[0].chosen[:-1]], dtype=torch.long)
