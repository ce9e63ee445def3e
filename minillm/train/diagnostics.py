"""Per-layer health numbers for TensorBoard: how much a step moved each block, how loud it is.

Offers `block_snapshot`, `update_ratios` and `activation_rms`. They cost a copy of the block
weights and one extra forward, so the trainer takes them every `log_every * 10` steps only.
"""

from __future__ import annotations

import contextlib

import torch

from minillm.model import Transformer


def _flat(block: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in block.parameters()])


def block_snapshot(model: Transformer) -> list[torch.Tensor]:
    """A copy of every block's weights, flattened, taken before an optimizer step."""
    return [_flat(block).clone() for block in model.blocks]


def update_ratios(model: Transformer, before: list[torch.Tensor]) -> dict[str, float]:
    """|w_after - w_before| / |w_after| per block: ~1e-3 is healthy, >1e-2 is a large step."""
    stats = {}
    for i, (block, old) in enumerate(zip(model.blocks, before)):
        new = _flat(block)
        ratio = (new - old).norm() / new.norm().clamp(min=1e-12)
        stats[f"xray/update_ratio/{i:02d}"] = float(ratio)
    return stats


@torch.no_grad()
def activation_rms(
    model: Transformer, x: torch.Tensor, autocast: contextlib.AbstractContextManager
) -> dict[str, float]:
    """RMS of each block's output on the batch x, in eval mode (no dropout, no RNG drawn)."""
    rms: dict[str, float] = {}

    def record(n: int):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            rms[f"xray/activation_rms/{n:02d}"] = float(out.float().pow(2).mean().sqrt())

        return hook

    hooks = [block.register_forward_hook(record(n)) for n, block in enumerate(model.blocks)]
    was_training = model.training
    model.eval()
    try:
        with autocast:
            model(x)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return rms
