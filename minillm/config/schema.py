"""The config schema: four typed sections (model, data, train, sample) and their checks.

Offers `ModelConfig`, `DataConfig`, `SampleConfig`, `Config` and `SECTIONS`. The model keys of a
mixture of experts are `minillm.config.moe`, those of latent attention `minillm.config.mla`, the
nested `model.rope_scaling` section `minillm.config.rope_scaling`; the train section (`TrainConfig`
and its nested `lora`, `dpo` and `grpo` keys) is `minillm.config.train_schema`, what every section
shares `minillm.config.section`. Each field's `help` metadata is its
documentation (`scripts/gen_config_docs.py` turns it into docs/config.md); `__post_init__`
checks name the key at fault.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from minillm.config.mla import MLAKeys
from minillm.config.moe import MoEKeys
from minillm.config.rope_scaling import RopeScalingConfig
from minillm.config.section import Section, setting
from minillm.config.train_schema import TrainConfig
from minillm.errors import ConfigError

# The model keys no weight depends on: how positions are read. Extending a trained model's context
# changes them alone, so `train.init_from` takes a config's own values of these over the source's
# and `minillm eval --set` may change them on a checkpoint (docs/design.md, "Config").
POSITION_KEYS = ("max_seq_len", "rope_scaling")


# ModelConfig's keys are its bases' fields. A dataclass puts a base's fields before its own, the
# bases' in reverse order (the MRO reversed), so the bases below are listed last key first: this
# keeps the keys' order (docs/config.md, a run's config.yaml) as the YAML reference has it.
@dataclass
class _KeysBeforeMLA(Section):
    """The sizes and the attention options (the model keys before model.attention)."""

    vocab_size: int = setting(
        help="Rows of the embedding table, at least the tokenizer's vocabulary. "
        "In a YAML file it defaults to data.vocab_size."
    )
    d_model: int = setting(help="Width of the residual stream (C).")
    n_layer: int = setting(help="Number of Transformer blocks.")
    n_head: int = setting(
        help="Query heads per attention layer; must divide d_model unless head_dim is set."
    )
    n_kv_head: int | None = setting(
        None, help="Key/value heads (grouped-query attention); must divide n_head. null = n_head."
    )
    ffn_hidden: int | None = setting(
        None, help="SwiGLU hidden width. null = 8/3 * d_model rounded up to multiple_of."
    )
    head_dim: int | None = setting(
        None,
        help="Width of each attention head (D), even for RoPE; q/k/v project d_model to heads * "
        "head_dim and the output back. null = d_model / n_head (Qwen3 sets its own).",
    )
    attention_bias: bool = setting(
        False, help="Biases on the q, k and v projections (Qwen2); the output projection has none."
    )
    qk_norm: bool = setting(
        False,
        help="A learned RMSNorm over head_dim on every query and key head before RoPE (Qwen3; "
        "nanochat and modded-nanogpt use it to keep attention logits bounded).",
    )
    sliding_window: int | None = setting(
        None,
        help="Each token attends to itself and the sliding_window - 1 tokens before it "
        "(Mistral); null = the whole causal context.",
    )
    sliding_window_pattern: int = setting(
        0,
        help="With sliding_window: every N-th layer (N-1, 2N-1, ...) attends to the whole "
        "context and the others slide (Gemma 3: 6); 0 = every layer slides.",
    )
    rope_local_theta: float | None = setting(
        None,
        help="RoPE base of the sliding layers, which then take plain RoPE while rope_scaling "
        "applies to the others (Gemma 3's rope_local_base_freq); null = rope_theta for all.",
    )
    sandwich_norm: bool = setting(
        False,
        help="An RMSNorm also on the output of each block's attention and FFN, before the "
        "residual add (Gemma 2 and 3).",
    )
    ffn_activation: Literal["silu", "gelu_tanh"] = setting(
        "silu",
        help="Gate activation of the FFN: silu = SwiGLU; gelu_tanh = GeGLU with the tanh "
        "approximation of GELU (Gemma's gelu_pytorch_tanh).",
    )
    embed_scale: bool = setting(
        False,
        help="Multiply the token embeddings by sqrt(d_model), in the embedding's dtype (Gemma); "
        "a tied head reads the unscaled table.",
    )
    query_pre_attn_scalar: int | None = setting(
        None,
        help="Attention logits are scaled by 1/sqrt(this) (Gemma 3's query_pre_attn_scalar); "
        "null = head_dim.",
    )


@dataclass
class _KeysAfterMLA(Section):
    """RoPE, widths' rounding, norm, tying and dropout (the model keys after the MLA ones)."""

    partial_rotary: float = setting(
        1.0,
        help="Share of each head's dimensions RoPE rotates (Phi-4-mini: 0.75); the rest pass "
        "unrotated. head_dim * partial_rotary must be a whole, even number.",
    )
    rope_scaling: RopeScalingConfig = field(
        default_factory=RopeScalingConfig,
        metadata={"help": "RoPE scaling to read past the trained length (below)."},
    )
    multiple_of: int = setting(256, help="Rounding of the derived SwiGLU width (LLaMA uses 256).")
    max_seq_len: int = setting(
        2048, help="Longest context; RoPE tables are precomputed to this length."
    )
    rope_theta: float = setting(10000.0, help="RoPE base frequency.")
    norm_eps: float = setting(1e-5, help="Epsilon inside RMSNorm.")
    tie_embeddings: bool = setting(True, help="Share the output head with the token embedding.")
    dropout: float = setting(
        0.0, help="Dropout on the embedding output, attention weights and residual branches."
    )


@dataclass
class ModelConfig(MoEKeys, _KeysAfterMLA, MLAKeys, _KeysBeforeMLA):
    """The architecture: a LLaMA-style decoder-only Transformer."""

    _section: typing.ClassVar[str] = "model"

    family: str | None = setting(
        None,
        help="The published family this architecture is (llama, qwen2, qwen3, mistral, mixtral, "
        "qwen2_moe, qwen3_moe, gemma3, phi3, deepseek_v3: minillm.families), which names its "
        "exports. Set on import; null = resolved from the options above when a run starts.",
        # Not compared: two configs of the same options are the same model, whichever family
        # names its exports (a checkpoint saved before the key equals its resolved config).
        compare=False,
    )

    def __post_init__(self) -> None:
        self._positive("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "ffn_hidden")
        self._check_moe()
        self._check_mla()
        self._positive("multiple_of", "max_seq_len", "rope_theta", "norm_eps")
        self._positive("head_dim", "sliding_window", "rope_local_theta", "query_pre_attn_scalar")
        self._non_negative("sliding_window_pattern")
        if self.sliding_window_pattern and self.sliding_window is None:
            self._fail("sliding_window_pattern", "needs model.sliding_window (the local layers')")
        if self.n_experts and self.ffn_activation != "silu":
            self._fail("ffn_activation", "the experts of model.n_experts are SwiGLUs: use silu")
        if self.head_dim is None:
            if self.d_model % self.n_head:
                self._fail("n_head", f"{self.n_head} does not divide d_model={self.d_model}")
            if (self.d_model // self.n_head) % 2:
                self._fail(
                    "n_head",
                    f"head dim d_model/n_head = {self.d_model // self.n_head} must be even "
                    "for RoPE",
                )
            self.head_dim = self.d_model // self.n_head
        elif self.head_dim % 2:
            self._fail("head_dim", f"{self.head_dim} must be even for RoPE")
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
        if isinstance(self.rope_scaling, dict):  # ModelConfig(rope_scaling={...}) in Python
            self.rope_scaling = RopeScalingConfig(**self.rope_scaling)
        self._check_partial_rotary()
        if self.attention == "mla" and self.rope_scaling.type == "longrope":
            self._fail("rope_scaling.type", "longrope is Phi-3's: not built with attention mla")
        local_rope = self.rope_local_theta is not None or self.sliding_window_pattern
        if local_rope and self.rope_scaling.type == "dynamic":
            key = "rope_local_theta" if self.rope_local_theta else "sliding_window_pattern"
            self._fail(key, "with rope_scaling.type dynamic: not supported")

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE rotates (R): head_dim times partial_rotary."""
        return round(self.head_dim * self.partial_rotary)

    def _check_partial_rotary(self) -> None:
        """model.partial_rotary gives a whole, even number of rotated dimensions, and longrope's
        factors one per rotated pair."""
        p = self.partial_rotary
        if not 0.0 < p <= 1.0:
            self._fail("partial_rotary", f"must be in (0, 1], got {p}")
        R = self.head_dim * p
        if abs(R - round(R)) > 1e-6 or round(R) % 2 or round(R) < 2:
            self._fail(
                "partial_rotary",
                f"{p} of head_dim={self.head_dim} is {R:g} dimensions: RoPE rotates a whole, "
                "even number of them",
            )
        s = self.rope_scaling
        for key in ("short_factor", "long_factor"):
            if s.type == "longrope" and len(getattr(s, key)) != self.rotary_dim // 2:
                self._fail(
                    f"rope_scaling.{key}",
                    f"{len(getattr(s, key))} factors: longrope needs one per rotated pair, "
                    f"head_dim * partial_rotary / 2 = {self.rotary_dim // 2}",
                )

    def local_layer(self, i: int) -> bool:
        """Whether layer i attends within sliding_window (all do unless sliding_window_pattern
        makes every N-th one global)."""
        if self.sliding_window is None:
            return False
        N = self.sliding_window_pattern
        return not N or (i + 1) % N != 0

    @property
    def mixed_layers(self) -> bool:
        """Whether some layers slide and others do not (the KV cache then keeps every key)."""
        return len({self.local_layer(i) for i in range(self.n_layer)}) > 1


@dataclass
class DataConfig(Section):
    """Where the text comes from and where the tokenizer and token shards go."""

    _section: typing.ClassVar[str] = "data"

    source: str = setting(
        "data/tinyshakespeare.txt",
        help="A file, a glob, a folder, or a Hugging Face hub dataset name (needs a network).",
    )
    format: Literal["auto", "text", "json", "parquet", "csv"] = setting(
        "auto", help="File format; auto picks it from the extension (.txt, .json/.jsonl, ...)."
    )
    text_field: str = setting(
        "text",
        help="Column holding the text. A column of [{role, content}, ...] messages (roles "
        "system, user, assistant) is chat: each message becomes <|role|> + content + <|end|> "
        "(a published model's tokenizer: its own chat template).",
    )
    chat_format: Literal["auto", "messages", "sharegpt", "alpaca"] = setting(
        "auto",
        help="Layout of chat rows: messages ([{role, content}, ...] in text_field); sharegpt (a "
        "conversations column of [{from: human|gpt|system, value}, ...]); alpaca (instruction, "
        "input and output columns). auto = messages or sharegpt by what text_field holds, or, "
        "without a text_field column, a conversations column or instruction and output columns.",
    )
    loss_on: Literal["auto", "all", "assistant"] = setting(
        "auto",
        help="Which tokens are training targets: all, or (chat data) the assistant turns' tokens "
        "and their <|end|> (a published template's end of turn). auto = assistant for chat data, "
        "all otherwise.",
    )
    val_fraction: float = setting(
        0.1, help="Share of documents held out for validation (the tail of a single document)."
    )
    seed: int = setting(1337, help="Seed of the train/validation split of documents.")
    vocab_size: int = setting(4096, help="Vocabulary of the byte-level BPE tokenizer to train.")
    tokenizer: str = setting(
        "",
        help="Path of tokenizer.json (or a folder holding one); empty = <out_dir>/tokenizer.json.",
    )
    out_dir: str = setting(
        "data/tokens",
        help="Folder for the shards (train_000000.bin, ..., val_000000.bin, ...) and meta.json.",
    )
    tokenizer_sample_bytes: int = setting(
        256_000_000,
        help="Train the BPE on about this many bytes of the train split, a deterministic sample "
        "spread evenly over it, instead of all of it (a smaller corpus is used whole); 0 = all.",
    )
    shard_tokens: int = setting(
        100_000_000,
        help="Most tokens per shard file; a corpus smaller than this gives one shard per split. "
        "An interrupted tokenize resumes after its last checkpoint when run again.",
    )
    num_proc: int = setting(
        0,
        help="Worker processes that encode the text in `minillm tokenize`; 0 = one per CPU (at "
        "most the container's CPU quota), 1 = none (encode in the main process). The shards "
        "are the same for every value.",
    )
    streaming: bool = setting(
        False,
        help="Read json/jsonl/parquet/csv files and hub datasets as a stream, with nothing "
        "converted into the datasets cache; needs val_documents. Plain text is always streamed.",
    )
    max_documents: int = setting(
        0,
        help="Use only the first this many documents of the source (rows or files as read, "
        "empty ones included); 0 = all.",
    )
    max_bytes: int = setting(
        0,
        help="Use only the first documents whose text totals at least this many bytes (the last "
        "one whole; a text file cut at a safe cut just after it); 0 = all.",
    )
    val_documents: int = setting(
        0,
        help="When > 0, the first this many documents go to validation instead of a random "
        "val_fraction of them (a single text file keeps its val_fraction tail). Needed by "
        "streaming.",
    )
    decode_errors: Literal["strict", "replace", "skip_document"] = setting(
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
        # 256 byte tokens, end-of-text and the 4 chat tokens (minillm.tokenizer.bpe.MIN_VOCAB).
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
        for name in ("max_documents", "max_bytes", "val_documents"):
            if getattr(self, name) < 0:
                self._fail(name, f"must be >= 0, got {getattr(self, name)}")

    @property
    def tokenizer_path(self) -> Path:
        """data.tokenizer (a folder: its tokenizer.json), else the one out_dir's pass trains."""
        if not self.tokenizer:
            return Path(self.out_dir) / "tokenizer.json"
        path = Path(self.tokenizer)
        return path / "tokenizer.json" if path.is_dir() else path


@dataclass
class SampleConfig(Section):
    """Defaults of `minillm sample`."""

    _section: typing.ClassVar[str] = "sample"

    max_new_tokens: int = setting(200, help="Tokens to generate after the prompt.")
    temperature: float = setting(0.8, help="Softmax temperature; 0 = greedy.")
    top_k: int = setting(0, help="Keep the k most likely tokens (0 = off).")
    top_p: float = setting(
        1.0, help="Keep the smallest set of tokens whose mass reaches p (1 = off)."
    )

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
        if self.train.moe_bias_update and self.model.moe_router != "sigmoid":
            raise ConfigError(
                "train.moe_bias_update",
                f"{self.train.moe_bias_update} needs model.moe_router sigmoid (the routing bias "
                "it moves is DeepSeek-V3's)",
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
