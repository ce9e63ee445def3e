"""Which optimizer trains which parameter: the one rule that `train` and `info` both follow.

Offers `optimizer_split(model, optimizer)`, `split_summary(model, cfg)` (for `info`) and
`describe(model, cfg)` (the banner's line; with train.lora also the trainable and frozen
parameter counts).
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.config import TrainConfig

MUON_RULE = "the 2-D matrices inside the blocks (attention wqkv/wo, SwiGLU w_gate_up/w_down)"


def optimizer_split(
    model: torch.nn.Module, optimizer: str
) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Trainable (name, parameter) pairs per optimizer, each parameter in exactly one list.

    With "muon": Muon takes the 2-D weights of `model.blocks`, whose update it orthogonalises;
    AdamW keeps the embedding, the untied head (a lookup table and a classifier, not linear maps
    between hidden states: the Muon authors keep them on AdamW too) and every 1-D norm gain.
    With "adamw": AdamW takes everything. A tied head is the embedding (named once).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if optimizer == "adamw":
        return {"adamw": named}
    muon = [(n, p) for n, p in named if n.startswith("blocks.") and p.dim() == 2]
    taken = {id(p) for _, p in muon}
    return {"muon": muon, "adamw": [(n, p) for n, p in named if id(p) not in taken]}


def split_summary(model: torch.nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
    """Per optimizer: parameter count, tensor count, peak lr, weight decay and what it trains."""
    rows = []
    for name, named in optimizer_split(model, cfg.optimizer).items():
        muon = name == "muon"
        what = MUON_RULE if muon else _adamw_what(named, cfg.optimizer)
        rows.append({
            "optimizer": name,
            "params": sum(p.numel() for _, p in named),
            "tensors": len(named),
            "lr": cfg.muon_lr if muon else cfg.lr,
            "weight_decay": cfg.muon_weight_decay if muon else cfg.weight_decay,
            "what": what,
        })  # fmt: skip
    return rows


def _adamw_what(named: list[tuple[str, torch.nn.Parameter]], optimizer: str) -> str:
    adapters = sum(1 for n, _ in named if n.endswith(".lora_A"))
    rows = [p for n, p in named if n.endswith(".token_rows")]
    if adapters and len(named) == 2 * adapters + len(rows):
        tokens = f" and {rows[0].shape[0]} token rows of the embedding" if rows else ""
        return f"the LoRA adapters (A and B of {adapters} layers){tokens}; the rest is frozen"
    if optimizer == "adamw":
        return "every parameter (weight decay on matrices only)"
    gains = sum(1 for _, p in named if p.dim() < 2)
    others = [n.removesuffix(".weight") for n, p in named if p.dim() >= 2]
    return ", ".join(others + [f"{gains} norm gains"]) if named else "nothing"


def describe(model: torch.nn.Module, cfg: TrainConfig) -> str:
    """One line for the banner: which optimizer runs on which parameters."""
    parts = [
        f"{r['optimizer']} (lr {r['lr']:g}, weight decay {r['weight_decay']:g}) on "
        f"{r['params'] / 1e6:.2f}M params in {r['tensors']} tensors: {r['what']}"
        for r in split_summary(model, cfg) if r["tensors"]
    ]  # fmt: skip
    line = "optimizer: " + "; ".join(parts)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters()) - trainable
    if frozen:  # train.lora: say how little trains
        line += (f"\nLoRA rank {cfg.lora.rank}: {trainable:,} trainable parameters, {frozen:,} "
                 f"frozen ({trainable / (trainable + frozen):.2%} train)")  # fmt: skip
    return line
