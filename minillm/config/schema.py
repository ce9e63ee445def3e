"""The config schema: four typed sections (model, data, train, sample) and their checks.

Offers `ModelConfig`, `DataConfig`, `TrainConfig` (with `LoRAConfig`, `DPOConfig` and
`GRPOConfig`, its `lora`, `dpo` and `grpo` keys),
`SampleConfig`, `Config`, `SECTIONS`, `LORA_TARGETS` and `DEVICE_PATTERN`. Each field's `help`
metadata is its documentation (`scripts/gen_config_docs.py` turns it into docs/config.md);
`__post_init__` checks name the key at fault.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from minillm.errors import ConfigError

# What train.device and `--device` accept (runtime.resolve_device checks availability).
DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def _f(default: Any = dataclasses.MISSING, help: str = "", **kw: Any) -> Any:
    """A dataclass field whose help text documents the config key."""
    if isinstance(default, (list, dict, tuple)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


class _Section:
    """Shared behaviour of the config sections: checks that name the key at fault."""

    _section: typing.ClassVar[str] = ""

    def _fail(self, key: str, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self._section}.{key}" if self._section else key, message)

    def _positive(self, *keys: str) -> None:
        for key in keys:
            value = getattr(self, key)
            if value is not None and value <= 0:
                self._fail(key, f"must be > 0, got {value}")

    def _non_negative(self, *keys: str) -> None:
        for key in keys:
            value = getattr(self, key)
            if value < 0:
                self._fail(key, f"must be >= 0, got {value}")


@dataclass
class ModelConfig(_Section):
    """The architecture: a LLaMA-style decoder-only Transformer."""

    _section: typing.ClassVar[str] = "model"

    vocab_size: int = _f(
        help="Rows of the embedding table, at least the tokenizer's vocabulary. "
        "In a YAML file it defaults to data.vocab_size."
    )
    d_model: int = _f(help="Width of the residual stream (C).")
    n_layer: int = _f(help="Number of Transformer blocks.")
    n_head: int = _f(help="Query heads per attention layer; must divide d_model.")
    n_kv_head: int | None = _f(
        None, help="Key/value heads (grouped-query attention); must divide n_head. null = n_head."
    )
    ffn_hidden: int | None = _f(
        None, help="SwiGLU hidden width. null = 8/3 * d_model rounded up to multiple_of."
    )
    multiple_of: int = _f(256, help="Rounding of the derived SwiGLU width (LLaMA uses 256).")
    max_seq_len: int = _f(2048, help="Longest context; RoPE tables are precomputed to this length.")
    rope_theta: float = _f(10000.0, help="RoPE base frequency.")
    norm_eps: float = _f(1e-5, help="Epsilon inside RMSNorm.")
    tie_embeddings: bool = _f(True, help="Share the output head with the token embedding.")
    dropout: float = _f(
        0.0, help="Dropout on the embedding output, attention weights and residual branches."
    )
    n_experts: int = _f(
        0,
        help="Experts in each block's FFN (a mixture of experts, as Mixtral): a linear router "
        "sends each token to n_experts_per_token of these SwiGLUs. 0 = the dense SwiGLU.",
    )
    n_experts_per_token: int = _f(
        2,
        help="Experts each token goes through (top-k of the router's softmax, their weights "
        "renormalised to sum to 1); at most n_experts.",
    )
    moe_ffn_hidden: int | None = _f(
        None, help="Each expert's SwiGLU hidden width. null = ffn_hidden (the dense width)."
    )

    def __post_init__(self) -> None:
        self._positive("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "ffn_hidden")
        self._positive("moe_ffn_hidden", "n_experts_per_token")
        self._non_negative("n_experts")
        if self.n_experts == 1:
            self._fail(
                "n_experts", "1 expert is the dense FFN behind a router: use 0 (dense) or >= 2"
            )
        if self.n_experts and self.n_experts_per_token > self.n_experts:
            self._fail(
                "n_experts_per_token",
                f"{self.n_experts_per_token} is more than n_experts={self.n_experts}",
            )
        self._positive("multiple_of", "max_seq_len", "rope_theta", "norm_eps")
        if self.d_model % self.n_head:
            self._fail("n_head", f"{self.n_head} does not divide d_model={self.d_model}")
        if self.head_dim % 2:
            self._fail("n_head", f"head dim d_model/n_head = {self.head_dim} must be even for RoPE")
        if self.n_kv_head is not None and (
            self.n_kv_head > self.n_head or self.n_head % self.n_kv_head
        ):
            self._fail("n_kv_head", f"{self.n_kv_head} does not divide n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            self._fail("dropout", f"must be in [0, 1), got {self.dropout}")
        # One name per concept: null resolves here, so code reads n_kv_head and ffn_hidden only.
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.ffn_hidden is None:  # LLaMA's int(8/3 d) rounded up to multiple_of
            hidden = int(2 * (4 * self.d_model) / 3)
            self.ffn_hidden = self.multiple_of * math.ceil(hidden / self.multiple_of)
        if self.n_experts and self.moe_ffn_hidden is None:
            self.moe_ffn_hidden = self.ffn_hidden

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


@dataclass
class DataConfig(_Section):
    """Where the text comes from and where the tokenizer and token shards go."""

    _section: typing.ClassVar[str] = "data"

    source: str = _f(
        "data/tinyshakespeare.txt",
        help="A file, a glob, a folder, or a Hugging Face hub dataset name (needs a network).",
    )
    format: Literal["auto", "text", "json", "parquet", "csv"] = _f(
        "auto", help="File format; auto picks it from the extension (.txt, .json/.jsonl, ...)."
    )
    text_field: str = _f(
        "text",
        help="Column holding the text. A column of [{role, content}, ...] messages (roles "
        "system, user, assistant) is chat: each message becomes <|role|> + content + <|end|>.",
    )
    loss_on: Literal["auto", "all", "assistant"] = _f(
        "auto",
        help="Which tokens are training targets: all, or (chat data) the assistant turns' tokens "
        "and their <|end|>. auto = assistant for chat data, all otherwise.",
    )
    val_fraction: float = _f(
        0.1, help="Share of documents held out for validation (the tail of a single document)."
    )
    seed: int = _f(1337, help="Seed of the train/validation split of documents.")
    vocab_size: int = _f(4096, help="Vocabulary of the byte-level BPE tokenizer to train.")
    tokenizer: str = _f("", help="Path of tokenizer.json; empty = <out_dir>/tokenizer.json.")
    out_dir: str = _f(
        "data/tokens",
        help="Folder for the shards (train_000000.bin, ..., val_000000.bin, ...) and meta.json.",
    )
    tokenizer_sample_bytes: int = _f(
        256_000_000,
        help="Train the BPE on about this many bytes of the train split, a deterministic sample "
        "spread evenly over it, instead of all of it (a smaller corpus is used whole); 0 = all.",
    )
    shard_tokens: int = _f(
        100_000_000,
        help="Most tokens per shard file; a corpus smaller than this gives one shard per split. "
        "An interrupted tokenize resumes after its last checkpoint when run again.",
    )
    num_proc: int = _f(
        0,
        help="Worker processes that encode the text in `minillm tokenize`; 0 = one per CPU (at "
        "most the container's CPU quota), 1 = none (encode in the main process). The shards "
        "are the same for every value.",
    )
    streaming: bool = _f(
        False,
        help="Read json/jsonl/parquet/csv files and hub datasets as a stream, with nothing "
        "converted into the datasets cache; needs val_documents. Plain text is always streamed.",
    )
    max_documents: int = _f(
        0,
        help="Use only the first this many documents of the source (rows or files as read, "
        "empty ones included); 0 = all.",
    )
    max_bytes: int = _f(
        0,
        help="Use only the first documents whose text totals at least this many bytes (the last "
        "one whole; a text file cut at a safe cut just after it); 0 = all.",
    )
    val_documents: int = _f(
        0,
        help="When > 0, the first this many documents go to validation instead of a random "
        "val_fraction of them (a single text file keeps its val_fraction tail). Needed by "
        "streaming.",
    )
    decode_errors: Literal["strict", "replace", "skip_document"] = _f(
        "strict",
        help="Text that is not valid UTF-8 (text files, json/jsonl and parquet rows): strict = "
        "one error naming the file and byte; replace = each invalid sequence becomes U+FFFD; "
        "skip_document = the document is left out. tokenize counts the documents replaced or "
        "skipped. Not for csv or data.streaming, whose rows the datasets library decodes.",
    )

    def __post_init__(self) -> None:
        if not self.source:
            self._fail("source", "must not be empty")
        if not 0.0 < self.val_fraction < 1.0:
            self._fail("val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        # 256 byte tokens, end-of-text and the 4 chat tokens (minillm.data.tokenizer.MIN_VOCAB).
        if self.vocab_size < 261:
            self._fail(
                "vocab_size",
                f"{self.vocab_size} is too small: the 256 byte tokens plus the 5 special tokens "
                "(<|endoftext|> and the chat tokens) need 261",
            )
        if not self.text_field:
            self._fail("text_field", "must not be empty")
        if not self.out_dir:
            self._fail("out_dir", "must not be empty")
        if self.tokenizer_sample_bytes < 0:
            self._fail("tokenizer_sample_bytes", f"must be >= 0, got {self.tokenizer_sample_bytes}")
        if self.shard_tokens < 1:
            self._fail("shard_tokens", f"must be at least 1, got {self.shard_tokens}")
        if self.num_proc < 0:
            self._fail("num_proc", f"must be >= 0 (0 = one per CPU), got {self.num_proc}")
        for key in ("max_documents", "max_bytes", "val_documents"):
            if getattr(self, key) < 0:
                self._fail(key, f"must be >= 0, got {getattr(self, key)}")

    @property
    def tokenizer_path(self) -> Path:
        return Path(self.tokenizer) if self.tokenizer else Path(self.out_dir) / "tokenizer.json"


# The model's linear layers that `train.lora.targets` may name (minillm.model.lora).
LORA_TARGETS = ("wqkv", "wo", "w_gate_up", "w_down")


@dataclass
class LoRAConfig(_Section):
    """LoRA adapters: train low-rank updates of the linear layers of a frozen train.init_from."""

    _section: typing.ClassVar[str] = "train.lora"

    rank: int = _f(
        0,
        help="Rank r of each adapter (W x + alpha/r B A x, B zero at the start, so step 0 is "
        "the base model exactly); 0 = full fine-tuning. Needs train.init_from, whose weights "
        "stay frozen: only the adapters train, and a checkpoint holds only them.",
    )
    alpha: float = _f(16.0, help="Scale of the adapters' product: alpha / rank.")
    dropout: float = _f(0.0, help="Dropout on the adapters' input (the base path has none).")
    targets: list[str] = _f(
        list(LORA_TARGETS),
        help="The linear layers that get an adapter, of wqkv, wo, w_gate_up, w_down. A fused "
        "layer (wqkv, w_gate_up) gets one adapter whose rows are the q/k/v (gate/up) adapters "
        "of Hugging Face peft (one A shared, B split by rows).",
    )

    def __post_init__(self) -> None:
        if self.rank < 0:
            self._fail("rank", f"must be >= 0 (0 = full fine-tuning), got {self.rank}")
        if not self.rank:
            return
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            self._fail("alpha", f"must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            self._fail("dropout", f"must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown:
            self._fail(
                "targets", f"unknown layer {unknown[0]!r} (valid: {', '.join(LORA_TARGETS)})"
            )
        if not self.targets:
            self._fail("targets", "must name at least one layer")
        if len(set(self.targets)) != len(self.targets):
            self._fail("targets", f"names a layer twice: {self.targets}")


# What train.grpo.reward names besides a user's python:module:function (minillm.train.rewards).
GRPO_REWARDS = ("exact", "number")


@dataclass
class DPOConfig(_Section):
    """Direct preference optimisation (train.objective: dpo) on pairs of replies."""

    _section: typing.ClassVar[str] = "train.dpo"

    beta: float = _f(
        0.1,
        help="Strength of the pull towards the reference (train.init_from): the loss is "
        "-log sigmoid(beta ((log pi - log ref)(chosen) - (log pi - log ref)(rejected))); larger "
        "keeps the policy closer to the reference.",
    )
    sft_weight: float = _f(
        0.0,
        help="Weight of the chosen reply's cross-entropy (per token) added to the DPO loss "
        "(TRL's rpo_alpha); 0 = plain DPO. 1 keeps the chosen replies likely where plain DPO "
        'lowers both likelihoods (docs/training.md, "Preference tuning").',
    )

    def __post_init__(self) -> None:
        self._positive("beta")
        self._non_negative("sft_weight")


@dataclass
class GRPOConfig(_Section):
    """Group relative policy optimisation (train.objective: grpo) against a checkable reward."""

    _section: typing.ClassVar[str] = "train.grpo"

    group_size: int = _f(
        8,
        help="Replies sampled per prompt; each reply's advantage is its reward against its "
        "group's (mean, std). At least 2.",
    )
    max_new_tokens: int = _f(64, help="Longest reply sampled (it stops earlier at <|end|>).")
    temperature: float = _f(1.0, help="Sampling temperature of the replies; > 0.")
    clip: float = _f(0.2, help="Clip of the policy ratio, to [1 - clip, 1 + clip] (PPO's epsilon).")
    kl: float = _f(
        0.0,
        help="Weight of the KL penalty to the reference (train.init_from; the k3 estimator, as "
        "DeepSeekMath and TRL); 0 = none, and no reference is held.",
    )
    reward: str = _f(
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
class TrainConfig(_Section):
    """The optimisation loop, its precision and devices, evaluation and checkpoints."""

    _section: typing.ClassVar[str] = "train"

    out_dir: str = _f("", help="Run directory; empty = runs/<name of the config file>.")
    seed: int = _f(1337, help="Seed of initialisation, batches and dropout.")
    device: str = _f("auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = _f(
        "auto",
        help="auto = bf16 on a CUDA GPU that supports it, else fp32. fp16 uses a GradScaler.",
    )
    compile: bool = _f(False, help="Wrap the model in torch.compile.")
    parallel: Literal["ddp", "fsdp"] = _f(
        "ddp", help="Under torchrun: ddp replicates the model, fsdp shards it (FSDP2)."
    )
    batch_size: int | Literal["auto"] = _f(
        8,
        help="Sequences per micro-batch per device. auto = the largest that fits (on CUDA by "
        "trying, elsewhere by the memory estimate), grad_accum then set to reach "
        "batch_tokens; the run's config.yaml records the values chosen.",
    )
    grad_accum: int = _f(1, help="Micro-batches per optimizer step.")
    batch_tokens: int = _f(
        0,
        help="Tokens per optimizer step over all ranks (batch_size x grad_accum x seq_len x "
        "world size); 0 = whatever batch_size and grad_accum give. Needed by batch_size: auto.",
    )
    activation_checkpointing: bool = _f(
        False,
        help="Recompute each block in the backward pass instead of keeping its activations: "
        "the same gradients for about a third more compute and much less activation memory.",
    )
    seq_len: int = _f(256, help="Tokens per training sequence; at most model.max_seq_len.")
    max_steps: int = _f(1000, help="Optimizer steps in the whole run.")
    lr: float = _f(3e-4, help="Peak learning rate, reached after warmup.")
    min_lr: float = _f(3e-5, help="Learning rate at the end of the cosine decay.")
    warmup_steps: int = _f(100, help="Steps of linear warmup from 0 to lr.")
    optimizer: Literal["adamw", "muon"] = _f(
        "adamw",
        help="adamw: AdamW for every parameter. muon: torch.optim.Muon for the 2-D matrices inside "
        "the blocks (attention and SwiGLU projections), AdamW (lr, weight_decay, betas) for the "
        "embedding, the untied head and the norm gains. Not under parallel: fsdp.",
    )
    schedule: Literal["cosine", "wsd", "constant"] = _f(
        "cosine",
        help="After the linear warmup: cosine to min_lr at max_steps; wsd (warmup-stable-decay) "
        "holds lr, then falls as 1-sqrt to min_lr over the last decay_fraction of max_steps; "
        "constant holds lr.",
    )
    decay_fraction: float = _f(
        0.2, help="Share of max_steps spent decaying at the end of schedule: wsd, in (0, 1]."
    )
    muon_lr: float = _f(
        0.02,
        help="Peak learning rate of the Muon matrices (optimizer: muon), scheduled like lr. "
        "Muon's own scale (Keller Jordan's shape adjustment), typically 10x AdamW's.",
    )
    muon_weight_decay: float = _f(
        0.0, help="Decoupled weight decay of the Muon matrices (a shrink of muon_lr x this a step)."
    )
    muon_momentum: float = _f(0.95, help="Muon's (Nesterov) momentum.")
    weight_decay: float = _f(0.1, help="AdamW weight decay, applied to matrices only.")
    betas: tuple[float, float] = _f((0.9, 0.95), help="AdamW betas.")
    adam_eps: float = _f(1e-8, help="AdamW epsilon.")
    grad_clip: float = _f(1.0, help="Clip the global gradient norm to this (0 = no clipping).")
    moe_aux_loss: float = _f(
        0.0,
        help="Coefficient of the load-balancing loss added to the training loss of a mixture "
        "of experts (model.n_experts): Switch/Mixtral's E * sum_e f_e P_e, as transformers' "
        "load_balancing_loss_func (Mixtral-8x7B's router_aux_loss_coef is 0.02, Switch's "
        "0.01); 0 = none. Logged as moe/aux_loss beside each layer's expert load.",
    )
    ema_decay: float = _f(
        0.0,
        help="Decay of an exponential moving average of the weights, updated after every "
        "optimizer step (a plain mean of the steps so far until that reaches the decay). The "
        "average is what the run evaluates and saves as the checkpoint's model (eval, sample, "
        "export read it); the raw weights stay in the trainer state. 0 = off.",
    )
    zero_init_residual: bool = _f(
        False,
        help="Start the projections into the residual stream (attn.wo, ffn.w_down) at zero, so "
        "every block starts as the identity and grows from its gradient (modded-nanogpt's init); "
        "false: normal(0, 0.02/sqrt(2 n_layer)). A fresh run's start only: init_from and a "
        "resume bring their own weights.",
    )
    eval_every: int = _f(250, help="Evaluate every this many steps (0 = only at the end).")
    eval_steps: int = _f(20, help="Validation batches per evaluation (0 = the whole split).")
    ckpt_every: int = _f(500, help="Checkpoint every this many steps (0 = only at the end).")
    keep_last: int = _f(3, help="Checkpoints kept besides the best one.")
    log_every: int = _f(10, help="Log scalars every this many steps.")
    log_to: list[Literal["tensorboard", "wandb"]] = _f(
        ["tensorboard"],
        help="Where rank 0 logs the scalars and texts: tensorboard (<out_dir>/tb), wandb "
        "(Weights & Biases: pip install 'minillm[wandb]'; the run named after out_dir; "
        "WANDB_MODE=offline writes <out_dir>/wandb), both, or [] (the console only).",
    )
    max_bad_steps: int = _f(5, help="Stop after this many non-finite steps in a row.")
    peak_flops: float = _f(
        0.0, help="Peak FLOP/s for MFU; 0 = a known GPU's, else a matmul probe cached per machine."
    )
    init_from: str = _f(
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
    objective: Literal["lm", "dpo", "grpo"] = _f(
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
    doc_mask: bool | None = _f(
        None,
        help="Keep attention inside each document of a packed window (RoPE positions restart "
        "per document); chat windows then start at a conversation. null = on for chat data.",
    )
    eval_tasks: list[str] = _f(
        [],
        help="Task files (jsonl: multiple choice, or exact match for chat models) scored at every "
        "evaluation on rank 0 and logged as tasks/NAME/accuracy_norm, accuracy (or exact_match), "
        "NAME the file stem.",
    )
    sample_every: int = _f(
        0,
        help="Every this many steps (and at the last), print and log to TensorBoard's text tab a "
        "greedy and a sampled continuation of each sample_prompts entry (0 = never).",
    )
    sample_prompts: list[str] = _f(
        [], help="Prompts for sample_every; empty = one sample from a fresh document."
    )
    sample_max_new_tokens: int = _f(64, help="Tokens generated per prompt for sample_every.")

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
        self._non_negative("moe_aux_loss")
        self._non_negative("eval_steps", "ckpt_every", "peak_flops", "sample_every")
        self._positive("sample_max_new_tokens")
        if len(set(self.log_to)) != len(self.log_to):
            self._fail("log_to", f"names a logger twice: {self.log_to}")
        for i, path in enumerate(self.eval_tasks):
            if not path:
                self._fail("eval_tasks", f"entry {i} is empty")
        if self.min_lr > self.lr:
            self._fail("min_lr", f"{self.min_lr} is above lr={self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            self._fail("betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        if self.lora.rank and not self.init_from:
            self.lora._fail(
                "rank",
                f"{self.lora.rank} needs train.init_from (the model the adapters are trained "
                "on); rank 0 trains every weight",
            )
        if self.objective != "lm" and not self.init_from:
            self._fail(
                "objective",
                f"{self.objective} needs train.init_from (the policy's start and the frozen "
                "reference), e.g. an SFT run",
            )
        if not DEVICE_PATTERN.fullmatch(self.device):
            self._fail("device", f"unknown device {self.device!r} (auto, cpu, cuda, cuda:N, mps)")


@dataclass
class SampleConfig(_Section):
    """Defaults of `minillm sample`."""

    _section: typing.ClassVar[str] = "sample"

    max_new_tokens: int = _f(200, help="Tokens to generate after the prompt.")
    temperature: float = _f(0.8, help="Softmax temperature; 0 = greedy.")
    top_k: int = _f(0, help="Keep the k most likely tokens (0 = off).")
    top_p: float = _f(1.0, help="Keep the smallest set of tokens whose mass reaches p (1 = off).")

    def __post_init__(self) -> None:
        self._positive("max_new_tokens")
        self._non_negative("temperature", "top_k")
        if not 0.0 < self.top_p <= 1.0:
            self._fail("top_p", f"must be in (0, 1], got {self.top_p}")


@dataclass
class Config:
    """The whole of one run: model, data, train and sample sections."""

    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)

    def __post_init__(self) -> None:
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                "train.seq_len",
                f"{self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}",
            )
        if self.model.vocab_size < self.data.vocab_size:
            raise ConfigError(
                "model.vocab_size",
                f"{self.model.vocab_size} is smaller than data.vocab_size={self.data.vocab_size}",
            )
        if self.train.moe_aux_loss and not self.model.n_experts:
            raise ConfigError(
                "train.moe_aux_loss",
                f"{self.train.moe_aux_loss} needs a mixture of experts (model.n_experts >= 2): "
                "the dense model has no router to balance",
            )
        ffn_targets = [t for t in self.train.lora.targets if t in ("w_gate_up", "w_down")]
        if self.model.n_experts and self.train.lora.rank and ffn_targets:
            raise ConfigError(
                "train.lora.targets",
                f"{', '.join(ffn_targets)} on a mixture of experts (model.n_experts): its experts "
                "are stacked weights, not linear layers, and get no adapters; use targets: "
                "[wqkv, wo]",
            )


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "sample": SampleConfig,
}
