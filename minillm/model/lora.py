"""LoRA adapters (`train.lora`): low-rank updates trained on the linear layers of a frozen model.

Offers `LoRALinear`, `add_lora(model, lora)`, `adapters_off(model)`, `is_adapter(name)`,
`adapter_state(state_dict)`, `merge_lora(model)` and `trainable_frozen(model)`; the adapters
under Hugging Face peft's names (`minillm export --format peft`) are
minillm.checkpoint.peft_folder's, with each family's module names (minillm.families).

A target layer W (out, in) becomes W x + (alpha / r) B A x with A (r, in) and B (out, r); B starts
at zero, so step 0 is the base model exactly, and only A and B train. The fused projections get
one adapter each: wqkv's A is shared by q, k and v and the rows of its B are their three B's
(gate and up likewise), which is what peft holds for q_proj, k_proj and v_proj with equal A's.
So peft's adapters are a copy and a split, exact, and merging is W + (alpha / r) B A.
With model.attention mla, target wqkv means the latent attention's input projections (its
query projections, wkv_a and wkv_b, `minillm.model.mla.MLA.lora_layers`), each its own adapter.

`train.lora.train_tokens` also trains some rows of the embedding (`TokenRows`: the chosen rows
replaced by trainable copies, peft's trainable tokens): a base that never saw the chat tokens
learned never to predict them (every step pushed their head rows down, to one shared vector),
which no adapter can undo, so no reply ends. A tied head reads the same rows; an untied head
keeps its own (as in peft).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.config import LORA_TARGETS, LoRAConfig
from minillm.errors import ConfigError, warn
from minillm.model.bf16_cpu import linear
from minillm.model.nf4 import NF4Linear
from minillm.model.transformer import Transformer

# (module holding the layer, layer name) of a block, per target.
_OWNER = {"wqkv": "attn", "wo": "attn", "w_gate_up": "ffn", "w_down": "ffn"}


class LoRALinear(nn.Module):
    """base(x) + scale B A dropout(x): a frozen nn.Linear plus a trainable rank-r update."""

    def __init__(
        self, base: nn.Linear | NF4Linear, rank: int, alpha: float, dropout: float
    ) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.rank, self.scale = rank, alpha / rank
        # A QLoRA base loaded as NF4 (nf4_as_loaded) has no float weight: its packed codes say
        # where it lives, and its dtype is the one it was quantized from.
        if isinstance(base, NF4Linear):
            device, base_dtype = base.packed0.device, base.dtype
        else:
            device, base_dtype = base.weight.device, base.weight.dtype
        # The adapters in float32 over a base frozen in bf16/fp16 (train.precision's compute
        # dtype): their updates, gradients and optimizer state keep float32's precision.
        dtype = base_dtype if base_dtype in (torch.float32, torch.float64) else torch.float32
        shape_a, shape_b = (rank, base.in_features), (base.out_features, rank)
        self.lora_A = nn.Parameter(torch.empty(shape_a, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(shape_b, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # peft's (and nn.Linear's) init
        # No dropout module at p = 0: even then it would copy x, an activation kept per layer.
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (.to: a no-op but for float32 adapters on a half-precision base, outside autocast)
        # bf16_cpu.linear: F.linear, but in fp32 on a CPU whose bf16 gemm is slow (the base
        # too, an nn.Linear of use_cpu_kernels or an NF4Linear).
        low = linear(self.drop(x), self.lora_A.to(x.dtype))  # (..., r)
        update = linear(low, self.lora_B.to(low.dtype))  # (..., out)
        # In place on the base output (its backward needs neither): no third (..., out) tensor.
        return self.base(x).add_(update, alpha=self.scale)

    @property
    def bias(self) -> torch.Tensor | None:
        """The base's bias (model.attention_bias on wqkv), which no adapter changes."""
        return self.base.bias

    @property
    def weight(self) -> torch.Tensor:
        """The merged W + scale B A: what a reader of the weights (the decoding fast path,
        `minillm.model.decode.Decoder`) must multiply by to compute this layer's function (a
        QLoRA base, minillm.model.nf4.NF4Linear, dequantized)."""
        base = self.base.weight if isinstance(self.base, nn.Linear) else self.base.dequantized()
        return torch.addmm(
            base, self.lora_B.to(base.dtype), self.lora_A.to(base.dtype), alpha=self.scale
        )


class TokenRows(nn.Module):
    """A frozen nn.Embedding whose rows `token_ids` are replaced by the trainable `token_rows`
    (copies of them at the start, so step 0 is the base exactly)."""

    def __init__(self, base: nn.Embedding, token_ids: Sequence[int]) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        w = base.weight
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=w.device)
        self.register_buffer("token_ids", ids)
        self.token_rows = nn.Parameter(w.detach()[ids.clamp(max=w.shape[0] - 1)].clone())
        self.active = True  # False: the base's own rows (a DPO/GRPO reference, adapters off)

    @property
    def weight(self) -> torch.Tensor:
        """The embedding with the trained rows in place (also a tied head's weight)."""
        if not self.active:
            return self.base.weight
        return self.base.weight.index_copy(0, self.token_ids, self.token_rows)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight)


def token_ids_of(lora: LoRAConfig, tokenizer: Any, where: str | Path) -> list[int]:
    """The ids of lora.train_tokens in the run's tokenizer (a `tokenizers.Tokenizer` read from
    `where`); a token it lacks is a ConfigError."""
    ids = []
    for token in lora.train_tokens:
        i = tokenizer.token_to_id(token)
        if i is None:
            raise ConfigError(
                "train.lora.train_tokens",
                f"{token!r} is not a token of {where} (a single token, spelled as the "
                "tokenizer has it, e.g. '<|end|>')",
            )
        ids.append(i)
    return ids


def warn_unseen_chat_tokens(
    model: Transformer, lora: LoRAConfig, tokenizer: Any, chat: bool
) -> None:
    """Warn when LoRA fine-tunes on chat (`chat`) a base that never saw the chat tokens and
    lora.train_tokens is empty: their head rows are all one vector (cosine > 0.999), since every
    step of its training pushed them down alike, and no adapter can make a reply end."""
    tokens = ["<|user|>", "<|assistant|>", "<|end|>"]
    ids = [tokenizer.token_to_id(t) for t in tokens]
    if not chat or lora.train_tokens or None in ids or max(ids) >= model.cfg.vocab_size:
        return
    rows = F.normalize(model.head_weight.detach()[ids].float(), dim=1)
    if bool(((rows @ rows.T) > 0.999).all()):
        warn(
            f"train.lora.train_tokens: the base never learned to predict {', '.join(tokens)} "
            "(their head rows are one vector) and adapters alone cannot teach it, so replies "
            "will not end; set train.lora.train_tokens: [<|system|>, <|user|>, <|assistant|>, "
            "<|end|>]"
        )


def _layers(model: Transformer, targets: Sequence[str]) -> list[tuple[nn.Module, str]]:
    """(owner, layer name) of each target's layers in every block: a target names its own
    layer, or the ones its owner lists under it (an MLA module's `lora_layers`: wqkv its query
    and key/value projections) where they exist."""
    out = []
    for block in model.blocks:
        for t in targets:
            owner = getattr(block, _OWNER[t])
            named = getattr(owner, "lora_layers", None)
            if named is None:
                out.append((owner, t))
            else:
                out += [(owner, n) for n in named.get(t, ()) if getattr(owner, n) is not None]
    return out


def add_lora(
    model: Transformer, lora: LoRAConfig, token_ids: Sequence[int] | None = None
) -> Transformer:
    """Freeze every parameter of `model` and wrap its target layers in LoRALinear (in place),
    and its embedding in TokenRows when lora.train_tokens names some: token_ids are their ids
    (None: placeholders, for a model whose adapters are loaded next, which hold the ids).

    A's initial values are drawn from torch's generator, block by block, so a seeded run starts
    the same every time."""
    layers = _layers(model, lora.targets)
    for owner, name in layers:
        if not isinstance(getattr(owner, name, None), (nn.Linear, NF4Linear)):
            raise ConfigError(
                "train.lora.targets",
                f"{name}: this model has no such linear layer (a mixture of experts, "
                "model.n_experts, has no dense w_gate_up/w_down: LoRA on its experts is not "
                "built; target wqkv and wo)",
            )
    for p in model.parameters():
        p.requires_grad_(False)
    for owner, name in layers:
        setattr(owner, name, LoRALinear(getattr(owner, name), lora.rank, lora.alpha, lora.dropout))
    if lora.train_tokens:
        ids = [0] * len(lora.train_tokens) if token_ids is None else list(token_ids)
        model.tok_emb = TokenRows(model.tok_emb, ids)
    return model


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """`model` as its frozen base for the block: every adapter's scale 0 (W x + 0 * B A x is W x
    exactly) and trained token rows back to the base's. What a DPO or GRPO reference of a LoRA
    run is, without a second copy of the weights."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    rows = [m for m in model.modules() if isinstance(m, TokenRows)]
    scales = [m.scale for m in layers]
    try:
        for m in layers:
            m.scale = 0.0
        for m in rows:
            m.active = False
        yield model
    finally:
        for m, s in zip(layers, scales, strict=True):
            m.scale = s
        for m in rows:
            m.active = True


def trainable_frozen(model: torch.nn.Module) -> tuple[int, int]:
    """Parameters that train and that are frozen (a tied head counted once)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters()) - trainable


def is_adapter(name: str) -> bool:
    """Whether a state_dict key is an adapter's (A or B of a LoRALinear, TokenRows' rows and
    their ids)."""
    return name.endswith((".lora_A", ".lora_B", ".token_rows", ".token_ids"))


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters' entries of a state_dict: what a LoRA checkpoint saves."""
    return {k: v for k, v in state.items() if is_adapter(k)}


@torch.no_grad()
def merge_lora(model: Transformer) -> Transformer:
    """Fold every adapter into its base weight (W += scale B A) and put the plain nn.Linear
    back, in place: the model is then an ordinary Transformer (for inference and export), every
    parameter trainable again as a loaded model's are."""
    for owner, name in _layers(model, LORA_TARGETS):
        layer = getattr(owner, name, None)  # a mixture of experts has no w_gate_up
        if isinstance(layer, LoRALinear):
            layer.base.weight.copy_(layer.weight)
            setattr(owner, name, layer.base)
    if isinstance(model.tok_emb, TokenRows):
        model.tok_emb.base.weight.copy_(model.tok_emb.weight)
        model.tok_emb = model.tok_emb.base
    for p in model.parameters():
        p.requires_grad_(True)
    return model
