"""Typed configuration: one YAML file, four sections (model, data, train, sample).

Offers `ModelConfig`, `DataConfig`, `TrainConfig`, `SampleConfig`, `Config`, `ConfigError` (from
minillm.errors),
`load_config(path, overrides)`, `config_from_dict`, `config_to_dict` and `dump_config`.

Precedence is dataclass defaults < YAML < `--set key=value`. Every YAML value is converted to the
field's declared type (PyYAML reads `3e-4` as a string) and every check names the key at fault.
Each field's `help` metadata is its documentation: `scripts/gen_config_docs.py` turns it into
`docs/config.md`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

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

    def __post_init__(self) -> None:
        self._positive("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "ffn_hidden")
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

    @property
    def tokenizer_path(self) -> Path:
        return Path(self.tokenizer) if self.tokenizer else Path(self.out_dir) / "tokenizer.json"


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
    eval_every: int = _f(250, help="Evaluate every this many steps (0 = only at the end).")
    eval_steps: int = _f(20, help="Validation batches per evaluation (0 = the whole split).")
    ckpt_every: int = _f(500, help="Checkpoint every this many steps (0 = only at the end).")
    keep_last: int = _f(3, help="Checkpoints kept besides the best one.")
    log_every: int = _f(10, help="Log scalars every this many steps.")
    max_bad_steps: int = _f(5, help="Stop after this many non-finite steps in a row.")
    peak_flops: float = _f(
        0.0, help="Peak FLOP/s for MFU; 0 = a known GPU's, else a matmul probe cached per machine."
    )
    init_from: str = _f(
        "",
        help="A Hugging Face Llama folder, a minillm run directory or a checkpoint to start from "
        "(its model and tokenizer are used; the model section may then be left out).",
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
        if not 0.0 <= self.muon_momentum < 1.0:
            self._fail("muon_momentum", f"must be in [0, 1), got {self.muon_momentum}")
        self._positive("keep_last", "log_every", "max_bad_steps")
        self._non_negative("min_lr", "warmup_steps", "weight_decay", "grad_clip", "eval_every")
        self._non_negative("eval_steps", "ckpt_every", "peak_flops", "sample_every")
        self._positive("sample_max_new_tokens")
        for i, path in enumerate(self.eval_tasks):
            if not path:
                self._fail("eval_tasks", f"entry {i} is empty")
        if self.min_lr > self.lr:
            self._fail("min_lr", f"{self.min_lr} is above lr={self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            self._fail("betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
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


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "sample": SampleConfig,
}

# ----------------------------------------------------------------------------- conversion


_UNIONS = (typing.Union, types.UnionType)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in _UNIONS:
        args = typing.get_args(tp)
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        return names + (" or null" if type(None) in args else "")
    if origin is tuple:
        return "a list of " + ", ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list of " + _type_name(typing.get_args(tp)[0]).removeprefix("a ") + "s"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp)
    )


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML value to the declared type `tp`, or raise ConfigError naming `key`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin in _UNIONS:  # X | None, or X | Literal[...]: the first member that takes it
        nullable = type(None) in args
        if nullable and (
            value is None or (isinstance(value, str) and value.lower() in ("null", "none"))
        ):
            return None
        for inner in (a for a in args if a is not type(None)):
            try:
                return _convert(value, inner, key)
            except ConfigError:
                pass
        raise bad
    if origin is Literal:
        if value not in args:
            raise bad
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad
        return tuple(_convert(v, a, key) for v, a in zip(value, args))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise bad
        return [_convert(v, args[0], key) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad
    if isinstance(value, bool):  # YAML's `yes`/`true` must not become 1 or 1.0
        raise bad
    if tp is int:
        if isinstance(value, int):
            return value
        try:
            number = float(value) if isinstance(value, str) else value
        except ValueError:
            raise bad from None
        if isinstance(number, float) and number.is_integer():
            return int(number)
        raise bad
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise bad from None
        if not isinstance(value, (int, float)):
            raise bad
        if not math.isfinite(value):  # nan passes every range check (nan < 0 is False)
            raise ConfigError(key, f"expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise bad


def _build_section(cls: type, raw: Any, name: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(name, f"must be a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(
                f"{name}.{key}",
                f"unknown key{did_you_mean(str(key), fields, name + '.')} "
                f"(valid keys: {', '.join(sorted(fields))})",
            )
        kwargs[key] = _convert(value, hints[key], f"{name}.{key}")
    missing = [
        k
        for k, f in fields.items()
        if k not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{name}.{missing[0]}", "is required")
    return cls(**kwargs)


# Names other trainers give our keys (HF, nanoGPT), so that a typo of one of them finds ours.
_ALIASES = {
    "learning_rate": "lr",
    "max_lr": "lr",
    "min_learning_rate": "min_lr",
    "max_iters": "max_steps",
    "num_steps": "max_steps",
    "warmup_iters": "warmup_steps",
    "micro_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "n_embd": "d_model",
    "hidden_size": "d_model",
    "n_layers": "n_layer",
    "num_layers": "n_layer",
    "n_heads": "n_head",
    "num_heads": "n_head",
    "block_size": "max_seq_len",
}


def did_you_mean(key: str, valid: typing.Iterable[str], prefix: str = "") -> str:
    """`; did you mean <prefix><closest>?` for a mistyped key, or "" when nothing is close."""
    valid = list(valid)
    names = valid + [alias for alias, ours in _ALIASES.items() if ours in valid]
    match = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    return f"; did you mean {prefix}{_ALIASES.get(match[0], match[0])}?" if match else ""


def override_keys(overrides: typing.Iterable[str]) -> set[str]:
    """The `section.key`s (and bare sections) that `--set` overrides give, for error messages."""
    keys = set()
    for override in overrides:
        dotted = override.split("=", 1)[0].strip()
        keys.update({dotted, dotted.split(".", 1)[0]})
    return keys


def config_from_dict(
    raw: Any, file: str | None = None, overridden: typing.Collection[str] = ()
) -> Config:
    """Build and validate a Config from plain data (the parsed YAML); errors name `file`.

    An error about a key in `overridden` (see `override_keys`) names `--set` instead of `file`:
    the user typed that value on the command line, not in the file.
    """
    try:
        if not isinstance(raw, dict):
            raise ConfigError("", "the top level must be a mapping with model, data, train, sample")
        for key in raw:
            if key not in SECTIONS:
                hint = did_you_mean(str(key), SECTIONS)
                raise ConfigError(key, f"unknown section{hint} (valid: {', '.join(SECTIONS)})")
        raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
        if "model" not in raw:
            raise ConfigError("model", "section is required (or train.init_from to take a model's)")
        # The embedding table defaults to the tokenizer's size.
        model_raw, data_raw = raw.get("model"), raw.get("data") or {}
        if isinstance(model_raw, dict) and "vocab_size" not in model_raw:
            model_raw["vocab_size"] = (
                data_raw.get("vocab_size", DataConfig.vocab_size)
                if isinstance(data_raw, dict)
                else DataConfig.vocab_size
            )
        sections = {
            name: _build_section(cls, raw.get(name), name) for name, cls in SECTIONS.items()
        }
        return Config(**sections)
    except ConfigError as e:
        e.file = e.file or ("--set" if e.key in overridden else file)
        raise
    except TypeError as e:  # a dataclass compared values of incompatible types
        raise ConfigError("", str(e), file) from None


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain data for YAML/JSON: tuples become lists."""
    out = {}
    for name in SECTIONS:
        section = dataclasses.asdict(getattr(cfg, name))
        out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
    return out


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def apply_override(raw: dict, override: str) -> None:
    """Apply one `section.key=value` to the raw dict; the value is parsed as YAML."""
    if "=" not in override:
        raise ConfigError(override, "an override must look like section.key=value", "--set")
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(dotted, "an override key must be section.key, e.g. train.lr", "--set")
    section, key = parts
    if section not in SECTIONS:
        hint = did_you_mean(section, SECTIONS)
        raise ConfigError(dotted, f"unknown section{hint} (valid: {', '.join(SECTIONS)})", "--set")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    target = raw.setdefault(section, {})
    if target is None:
        target = raw[section] = {}
    if not isinstance(target, dict):
        raise ConfigError(section, "is not a mapping", "--set")
    target[key] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error, not "last wins"."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an odd key (a list, ...): the schema check names it later
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply `section.key=value` overrides, convert types and validate.

    An empty `train.out_dir` becomes `runs/<config file stem>`. A config whose model comes from
    `train.init_from` is read with `minillm.train.setup.load_train_config` instead.
    """
    raw = read_raw_config(path, overrides)
    return config_from_dict(raw, str(path), override_keys(overrides or []))


def read_raw_config(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The YAML file as plain data with the overrides applied, before types and checks."""
    path = Path(path)
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", "no such config file", file) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("", f"cannot read: {e}", file) from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f"line {where.line + 1}: " if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError("", f"invalid YAML: {line}{problem}", file) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            "", "the top level must be a mapping with model, data, train, sample", file
        )
    for override in overrides or []:
        apply_override(raw, override)
    train = raw.get("train")
    if train is None or (isinstance(train, dict) and not train.get("out_dir")):
        raw["train"] = dict(train or {}, out_dir=str(Path("runs") / path.stem))
    return raw
