"""Up-front checks of what `Transformer.forward` is given, so that a wrong mask fails by name.

Offers `check_inputs`. Without it a mask of the wrong shape fails deep inside attention with
PyTorch's "size of tensor a (20) must match ...", which names neither the argument nor the shape
it should have had.

Shape legend: B batch, T tokens.
"""

from __future__ import annotations

import torch


def _integer(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def check_inputs(
    idx: torch.Tensor,
    attention_mask: torch.Tensor | None,
    doc_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    max_seq_len: int,
) -> None:
    """ValueError naming the argument, its shape or dtype, and what it must be (idx's (B, T))."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or not _integer(idx):
        what = f"{tuple(idx.shape)} {idx.dtype}" if isinstance(idx, torch.Tensor) else type(idx)
        raise ValueError(f"idx must be token ids of shape (B, T) and an integer dtype, got {what}")
    B, T = idx.shape
    given = {"attention_mask": attention_mask, "doc_ids": doc_ids, "position_ids": position_ids}
    for name, t in given.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor of shape (B, T) = {(B, T)}, got {type(t)}")
        # position_ids may be shared by every row, as in Hugging Face: (1, T).
        ok = t.shape == (B, T) or (name == "position_ids" and t.shape == (1, T))
        if not ok:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, but idx has shape (B, T) = {(B, T)}: "
                f"{name} must be {(B, T)}"
            )
    # A float attention mask could be an additive one (0 / -inf), whose meaning is the opposite
    # of this model's 1 = attend: refuse it rather than guess.
    if attention_mask is not None and attention_mask.is_floating_point():
        raise ValueError(
            f"attention_mask must be bool or integer (1 = real token, 0 = padding), got "
            f"{attention_mask.dtype}"
        )
    for name, t in (("doc_ids", doc_ids), ("position_ids", position_ids)):
        if t is not None and not _integer(t):
            raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")
    if position_ids is not None and position_ids.numel():
        low, high = int(position_ids.min()), int(position_ids.max())
        if low < 0 or high >= max_seq_len:
            raise ValueError(
                f"position_ids must lie in [0, {max_seq_len}) (model.max_seq_len), got "
                f"values from {low} to {high}"
            )
