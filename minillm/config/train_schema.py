"""The `train` section of the config: `TrainConfig` and its nested keys `LoRAConfig`
(`train.lora`), `DPOConfig` (`train.dpo`) and `GRPOConfig` (`train.grpo`), with `LORA_TARGETS`
and `GRPO_REWARDS`. Each field's help text documents its key (docs/config.md).
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field
from typing import Literal

from minillm.config.section import DEVICE_PATTERN, Section, setting

# The model's linear layers that `train.lora.targets` may name (minillm.model.lora).
LORA_TARGETS = ("wqkv", "wo", "w_gate_up", "w_down")
# peft's (Hugging Face Llama's) names of the same layers: a target named so points to ours.
PEFT_TARGETS = {
    "q_proj": "wqkv", "k_proj": "wqkv", "v_proj": "wqkv", "o_proj": "wo",
    "gate_proj": "w_gate_up", "up_proj": "w_gate_up", "down_proj": "w_down",
}  # fmt: skip


@dataclass
class LoRAConfig(Section):
    """LoRA adapters: train low-rank updates of the linear layers of a frozen train.init_from."""

    _section: typing.ClassVar[str] = "train.lora"

    rank: int = setting(
        0,
        help="Rank r of each adapter (W x + alpha/r B A x, B zero at the start, so step 0 is "
        "the base model exactly); 0 = full fine-tuning. Needs train.init_from, whose weights "
        "stay frozen: only the adapters train, and a checkpoint holds only them.",
    )
    alpha: float = setting(16.0, help="Scale of the adapters' product: alpha / rank.")
    dropout: float = setting(0.0, help="Dropout on the adapters' input (the base path has none).")
    targets: list[str] = setting(
        list(LORA_TARGETS),
        help="The linear layers that get an adapter, of wqkv, wo, w_gate_up, w_down. A fused "
        "layer (wqkv, w_gate_up) gets one adapter whose rows are the q/k/v (gate/up) adapters "
        "of Hugging Face peft (one A shared, B split by rows).",
    )
    train_tokens: list[str] = setting(
        [],
        help="Tokens (as the tokenizer spells them, e.g. ['<|user|>', '<|assistant|>', "
        "'<|end|>']) whose embedding rows train beside the adapters (a tied head's rows with "
        "them): the chat tokens of a base that never saw them, which the adapters alone cannot "
        "learn to emit. peft's trainable_token_indices.",
    )
    quantize: Literal["none", "nf4"] = setting(
        "none",
        help="nf4: QLoRA, the frozen base's linear layers held in 4-bit NF4 (bitsandbytes' "
        "codes, blocks of 64, double-quantized scales, as peft's QLoRA), about a quarter of "
        "their bf16 memory; the adapters train in full precision on top. Needs bitsandbytes "
        "(pip install 'minillm[qlora]'). Export merges the adapters into the dequantized base.",
    )

    def __post_init__(self) -> None:
        if self.rank < 0:
            self._fail("rank", f"must be >= 0 (0 = full fine-tuning), got {self.rank}")
        if not self.rank:
            if self.quantize != "none":
                self._fail(
                    "quantize",
                    f"{self.quantize} quantizes the frozen base of a LoRA run; set "
                    "train.lora.rank (e.g. 16)",
                )
            return
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            self._fail("alpha", f"must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            self._fail("dropout", f"must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown and unknown[0] in PEFT_TARGETS:
            ours = PEFT_TARGETS[unknown[0]]
            peft = "/".join(k for k, v in PEFT_TARGETS.items() if v == ours)
            self._fail(
                "targets",
                f"{unknown[0]!r} is peft's name; minillm's layer for {peft} is {ours!r} (one "
                "fused adapter, exported to peft as its separate ones): use targets: "
                f"[{ours}, ...] (valid: {', '.join(LORA_TARGETS)})",
            )
        if unknown:
            self._fail(
                "targets", f"unknown layer {unknown[0]!r} (valid: {', '.join(LORA_TARGETS)})"
            )
        if not self.targets:
            self._fail("targets", "must name at least one layer")
        if len(set(self.targets)) != len(self.targets):
            self._fail("targets", f"names a layer twice: {self.targets}")
        if not all(isinstance(t, str) and t for t in self.train_tokens):
            self._fail(
                "train_tokens", f"must be a list of tokens (strings), got {self.train_tokens}"
            )
        if len(set(self.train_tokens)) != len(self.train_tokens):
            self._fail("train_tokens", f"names a token twice: {self.train_tokens}")


# What train.grpo.reward names besides a user's python:module:function
# (minillm.train.objectives.rewards).
GRPO_REWARDS = ("exact", "number")


@dataclass
class DPOConfig(Section):
    """Direct preference optimisation (train.objective: dpo) on pairs of replies."""

    _section: typing.ClassVar[str] = "train.dpo"

    beta: float = setting(
        0.1,
        help="Strength of the pull towards the reference (train.init_from): the loss is "
        "-log sigmoid(beta ((log pi - log ref)(chosen) - (log pi - log ref)(rejected))); larger "
        "keeps the policy closer to the reference.",
    )
    sft_weight: float = setting(
        0.0,
        help="Weight of the chosen reply's cross-entropy (per token) added to the DPO loss "
        "(TRL's rpo_alpha); 0 = plain DPO. 1 keeps the chosen replies likely where plain DPO "
        'lowers both likelihoods (docs/training.md, "Preference tuning").',
    )

    def __post_init__(self) -> None:
        self._positive("beta")
        self._non_negative("sft_weight")


@dataclass
class GRPOConfig(Section):
    """Group relative policy optimisation (train.objective: grpo) against a checkable reward."""

    _section: typing.ClassVar[str] = "train.grpo"

    group_size: int = setting(
        8,
        help="Replies sampled per prompt; each reply's advantage is its reward against its "
        "group's (mean, std). At least 2.",
    )
    max_new_tokens: int = setting(
        64,
        help="Longest reply sampled (it stops earlier at the model's stop tokens: <|end|> or "
        "<|endoftext|>, a published model's eos and end of turn).",
    )
    temperature: float = setting(1.0, help="Sampling temperature of the replies; > 0.")
    clip: float = setting(
        0.2, help="Clip of the policy ratio, to [1 - clip, 1 + clip] (PPO's epsilon)."
    )
    kl: float = setting(
        0.0,
        help="Weight of the KL penalty to the reference (train.init_from; the k3 estimator, as "
        "DeepSeekMath and TRL); 0 = none, and no reference is held.",
    )
    reward: str = setting(
        "exact",
        help="exact: 1 if the reply equals the prompt's answer (as `eval --task` exact match), "
        "else 0; number: its last number equals the answer (as --extract-number); "
        "python:module:function: a function (prompt_messages, reply_text, answer) -> float "
        "from module.py in the config file's folder.",
    )

    def __post_init__(self) -> None:
        if self.group_size < 2:
            self._fail("group_size", f"must be >= 2 (advantages compare a group), got "
                       f"{self.group_size}")  # fmt: skip
        self._positive("max_new_tokens", "temperature")
        if not 0.0 < self.clip < 1.0:
            self._fail("clip", f"must be in (0, 1), got {self.clip}")
        self._non_negative("kl")
        python = re.fullmatch(r"python:([\w.]+):(\w+)", self.reward)
        if self.reward not in GRPO_REWARDS and python is None:
            self._fail(
                "reward",
                f"{self.reward!r} is not exact, number or python:module:function",
            )


@dataclass
class TrainConfig(Section):
    """The optimisation loop, its precision and devices, evaluation and checkpoints."""

    _section: typing.ClassVar[str] = "train"

    out_dir: str = setting("", help="Run directory; empty = runs/<name of the config file>.")
    seed: int = setting(1337, help="Seed of initialisation, batches and dropout.")
    device: str = setting("auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = setting(
        "auto",
        help="auto = bf16 on a CUDA GPU that supports it and on a CPU where a matmul probe finds "
        "bf16 faster (AMX, avx512_bf16), else fp32. fp16 uses a GradScaler. A LoRA run's "
        "frozen base is held in bf16/fp16 (its adapters in fp32).",
    )
    compile: bool = setting(False, help="Wrap the model in torch.compile.")
    parallel: Literal["ddp", "fsdp"] = setting(
        "ddp", help="Under torchrun: ddp replicates the model, fsdp shards it (FSDP2)."
    )
    batch_size: int | Literal["auto"] = setting(
        8,
        help="Sequences per micro-batch per device. auto = the largest that fits (on CUDA by "
        "trying, elsewhere by the memory estimate), grad_accum then set to reach "
        "batch_tokens; the run's config.yaml records the values chosen.",
    )
    grad_accum: int = setting(1, help="Micro-batches per optimizer step.")
    batch_tokens: int = setting(
        0,
        help="Tokens per optimizer step over all ranks (batch_size x grad_accum x seq_len x "
        "world size); 0 = whatever batch_size and grad_accum give. Needed by batch_size: auto.",
    )
    activation_checkpointing: bool = setting(
        False,
        help="Recompute each block in the backward pass instead of keeping its activations: "
        "the same gradients for about a third more compute and much less activation memory.",
    )
    seq_len: int = setting(256, help="Tokens per training sequence; at most model.max_seq_len.")
    max_steps: int = setting(1000, help="Optimizer steps in the whole run.")
    lr: float = setting(3e-4, help="Peak learning rate, reached after warmup.")
    min_lr: float = setting(3e-5, help="Learning rate at the end of the cosine decay.")
    warmup_steps: int = setting(100, help="Steps of linear warmup from 0 to lr.")
    optimizer: Literal["adamw", "muon"] = setting(
        "adamw",
        help="adamw: AdamW for every parameter. muon: torch.optim.Muon for the 2-D matrices inside "
        "the blocks (attention and SwiGLU projections), AdamW (lr, weight_decay, betas) for the "
        "embedding, the untied head and the norm gains. Not under parallel: fsdp.",
    )
    schedule: Literal["cosine", "wsd", "constant"] = setting(
        "cosine",
        help="After the linear warmup: cosine to min_lr at max_steps; wsd (warmup-stable-decay) "
        "holds lr, then falls as 1-sqrt to min_lr over the last decay_fraction of max_steps; "
        "constant holds lr.",
    )
    decay_fraction: float = setting(
        0.2, help="Share of max_steps spent decaying at the end of schedule: wsd, in (0, 1]."
    )
    muon_lr: float = setting(
        0.02,
        help="Peak learning rate of the Muon matrices (optimizer: muon), scheduled like lr. "
        "Muon's own scale (Keller Jordan's shape adjustment), typically 10x AdamW's.",
    )
    muon_weight_decay: float = setting(
        0.0, help="Decoupled weight decay of the Muon matrices (a shrink of muon_lr x this a step)."
    )
    muon_momentum: float = setting(0.95, help="Muon's (Nesterov) momentum.")
    weight_decay: float = setting(0.1, help="AdamW weight decay, applied to matrices only.")
    betas: tuple[float, float] = setting((0.9, 0.95), help="AdamW betas.")
    adam_eps: float = setting(1e-8, help="AdamW epsilon.")
    grad_clip: float = setting(1.0, help="Clip the global gradient norm to this (0 = no clipping).")
    moe_aux_loss: float = setting(
        0.0,
        help="Coefficient of the load-balancing loss added to the training loss of a mixture "
        "of experts (model.n_experts): Switch's E * sum_e f_e P_e of each layer, averaged over "
        "the layers (minimum k; Mixtral-8x7B's router_aux_loss_coef is 0.02, Switch's 0.01); "
        "0 = none. Logged as xray/moe/aux_loss beside each layer's expert load.",
    )
    moe_bias_update: float = setting(
        0.0,
        help="Auxiliary-loss-free balancing of a sigmoid router (model.moe_router sigmoid; "
        "DeepSeek-V3, 0.001 there): after each optimizer step every expert's routing bias "
        "moves by this rate, up if it received fewer tokens than its layer's mean over the "
        "step, down if more (torchtitan's update, centred); 0 = off. Logged as "
        "xray/moe/load_max_ratio, load_min_ratio and bias_spread.",
    )
    ema_decay: float = setting(
        0.0,
        help="Decay of an exponential moving average of the weights, updated after every "
        "optimizer step (a plain mean of the steps so far until that reaches the decay). The "
        "average is what the run evaluates and saves as the checkpoint's model (eval, sample, "
        "export read it); the raw weights stay in the trainer state. 0 = off.",
    )
    zero_init_residual: bool = setting(
        False,
        help="Start the projections into the residual stream (attn.wo, ffn.w_down) at zero, so "
        "every block starts as the identity and grows from its gradient (modded-nanogpt's init); "
        "false: normal(0, 0.02/sqrt(2 n_layer)). A fresh run's start only: init_from and a "
        "resume bring their own weights.",
    )
    eval_every: int = setting(250, help="Evaluate every this many steps (0 = only at the end).")
    eval_steps: int = setting(20, help="Validation batches per evaluation (0 = the whole split).")
    ckpt_every: int = setting(500, help="Checkpoint every this many steps (0 = only at the end).")
    keep_last: int = setting(3, help="Checkpoints kept besides the best one.")
    log_every: int = setting(10, help="Log scalars every this many steps.")
    log_to: list[Literal["tensorboard", "wandb"]] = setting(
        ["tensorboard"],
        help="Where rank 0 logs the scalars and texts: tensorboard (<out_dir>/tb), wandb "
        "(Weights & Biases: pip install 'minillm[wandb]'; the run named after out_dir; "
        "WANDB_MODE=offline writes <out_dir>/wandb), both, or [] (the console only).",
    )
    max_bad_steps: int = setting(5, help="Stop after this many non-finite steps in a row.")
    peak_flops: float = setting(
        0.0, help="Peak FLOP/s for MFU; 0 = a known GPU's, else a matmul probe cached per machine."
    )
    init_from: str = setting(
        "",
        help="A Hugging Face Llama folder, a minillm run directory or a checkpoint to start from "
        "(its model and tokenizer are used: the model section may then be left out, and an "
        "empty data.tokenizer becomes its tokenizer).",
    )
    lora: LoRAConfig = field(
        default_factory=LoRAConfig,
        metadata={
            "help": "LoRA fine-tuning of train.init_from: rank, alpha, dropout, targets (below); "
            "rank 0 (the default) trains every weight."
        },
    )
    objective: Literal["lm", "dpo", "grpo"] = setting(
        "lm",
        help="lm: next-token cross-entropy on the token shards. dpo: preference pairs "
        "(data.source, jsonl) against the frozen train.init_from (train.dpo). grpo: replies "
        "sampled to the prompts of data.source (exact-match task jsonl) and rewarded "
        "(train.grpo). dpo and grpo need train.init_from and no `minillm tokenize`.",
    )
    dpo: DPOConfig = field(
        default_factory=DPOConfig,
        metadata={"help": "The DPO objective's settings: beta, sft_weight (below)."},
    )
    grpo: GRPOConfig = field(
        default_factory=GRPOConfig,
        metadata={
            "help": "The GRPO objective's settings: group_size, max_new_tokens, temperature, "
            "clip, kl, reward (below)."
        },
    )
    doc_mask: bool | None = setting(
        None,
        help="Keep attention inside each document of a packed window (RoPE positions restart "
        "per document); chat windows then start at a conversation. null = on for chat data.",
    )
    eval_tasks: list[str] = setting(
        [],
        help="Task files (jsonl: multiple choice, or exact match for chat models) scored at every "
        "evaluation on rank 0 and logged as val/tasks/NAME/accuracy_norm, accuracy (or "
        "exact_match), NAME the file stem.",
    )
    sample_every: int = setting(
        0,
        help="Every this many steps (and at the last), print and log to TensorBoard's text tab a "
        "greedy and a sampled continuation of each sample_prompts entry (0 = never).",
    )
    sample_prompts: list[str] = setting(
        [], help="Prompts for sample_every; empty = one sample from a fresh document."
    )
    sample_max_new_tokens: int = setting(64, help="Tokens generated per prompt for sample_every.")

    @property
    def reads_shards(self) -> bool:
        """Whether train.objective trains on `minillm tokenize`'s token shards (lm); dpo and
        grpo read their jsonl (data.source) themselves when training starts."""
        return self.objective == "lm"

    def __post_init__(self) -> None:
        if self.batch_size != "auto":
            self._positive("batch_size")
        self._positive("grad_accum", "seq_len", "max_steps", "lr", "adam_eps")
        self._non_negative("batch_tokens")
        if self.batch_tokens % self.seq_len:
            self._fail("batch_tokens", f"{self.batch_tokens} is not a multiple of seq_len")
        if self.batch_size == "auto" and not self.batch_tokens:
            self._fail("batch_size", "auto needs train.batch_tokens (the tokens per step)")
        self._positive("muon_lr")
        self._non_negative("muon_weight_decay")
        if not 0.0 < self.decay_fraction <= 1.0:
            self._fail("decay_fraction", f"must be in (0, 1], got {self.decay_fraction}")
        if not 0.0 <= self.ema_decay < 1.0:
            self._fail("ema_decay", f"must be in [0, 1), got {self.ema_decay}")
        if not 0.0 <= self.muon_momentum < 1.0:
            self._fail("muon_momentum", f"must be in [0, 1), got {self.muon_momentum}")
        self._positive("keep_last", "log_every", "max_bad_steps")
        self._non_negative("min_lr", "warmup_steps", "weight_decay", "grad_clip", "eval_every")
        self._non_negative("moe_aux_loss", "moe_bias_update")
        self._non_negative("eval_steps", "ckpt_every", "peak_flops", "sample_every")
        self._positive("sample_max_new_tokens")
        if len(set(self.log_to)) != len(self.log_to):
            self._fail("log_to", f"names a logger twice: {self.log_to}")
        for i, path in enumerate(self.eval_tasks):
            if not path:
                self._fail("eval_tasks", f"entry {i} is empty")
        if self.min_lr > self.lr and self.schedule != "constant":  # constant never uses it
            self._fail("min_lr", f"{self.min_lr} is above lr={self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            self._fail("betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        if self.lora.rank and not self.init_from:
            self.lora._fail(
                "rank",
                f"{self.lora.rank} needs train.init_from (the model the adapters are trained "
                "on); rank 0 trains every weight",
            )
        if self.lora.quantize != "none" and self.parallel == "fsdp":
            self._fail(
                "parallel",
                f"fsdp cannot shard train.lora.quantize: {self.lora.quantize}'s 4-bit base; use "
                "parallel: ddp",
            )
        if self.objective == "grpo" and self.parallel == "fsdp":
            # GRPO's rollouts run the decoding core on the model's own parameters, which FSDP2
            # turns into shards (DTensors): each rank would decode with a part of each matrix.
            self._fail(
                "parallel",
                "fsdp cannot run train.objective: grpo (its rollouts decode with whole weight "
                "matrices, FSDP2 leaves each rank a shard); use parallel: ddp",
            )
        if self.objective != "lm" and not self.init_from:
            self._fail(
                "objective",
                f"{self.objective} needs train.init_from (the policy's start and the frozen "
                "reference), e.g. an SFT run",
            )
        if not DEVICE_PATTERN.fullmatch(self.device):
            self._fail("device", f"unknown device {self.device!r} (auto, cpu, cuda, cuda:N, mps)")
