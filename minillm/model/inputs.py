"""What `Transformer.forward` derives from its arguments before the first block: checks, RoPE
positions and the attention mask.

Offers `check_inputs`, `AttentionMask` and `forward_inputs`. The checks come first so that a
wrong mask fails by name: without them a mask of the wrong shape fails deep inside attention with
PyTorch's "size of tensor a (20) must match ...", which names neither the argument nor the shape
it should have had. The rest is the bookkeeping of padding, packed documents and the KV cache,
kept here so that the model's forward reads as the model.

Shape legend: B batch, T new tokens, S keys (cached + new).
"""

from __future__ import annotations

import torch

from minillm.model.kv_cache import KVCache


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


class AttentionMask:
    """What SDPA needs to know about which keys each query may see, built once per forward.

    bool_mask: (B, 1, T, S) True = may attend, or None when plain causality (or nothing) suffices.
    empty_rows: (B, 1, T, 1) True where a query may see no key; those outputs are set to zero.
    """

    def __init__(
        self,
        bool_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        empty_rows: torch.Tensor | None = None,
    ) -> None:
        self.bool_mask, self.is_causal, self.empty_rows = bool_mask, is_causal, empty_rows

    @classmethod
    def build(
        cls,
        T: int,
        start: int,
        key_valid: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
        device: torch.device,
    ) -> AttentionMask:
        """Causal mask for queries at start..start+T-1, with optional padding and documents."""
        if key_valid is None and doc_ids is None and (start == 0 or T == 1):
            # Plain causality, or one new token that may see every cached key.
            return cls(None, is_causal=start == 0 and T > 1)
        q_pos = torch.arange(start, start + T, device=device)
        k_pos = torch.arange(start + T, device=device)
        allowed = (k_pos[None, :] <= q_pos[:, None])[None]  # (1, T, S)
        if key_valid is not None:
            allowed = allowed & key_valid[:, None, :]  # (B, T, S)
        if doc_ids is not None:
            allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
        empty = ~allowed.any(dim=-1, keepdim=True)  # (B, T, 1)
        if not bool(empty.any()):
            return cls(allowed[:, None])
        # An all-False row would make SDPA return NaN (and NaN gradients): let it attend anywhere,
        # then zero its output.
        return cls((allowed | empty)[:, None], empty_rows=empty[:, None])


def _positions(
    B: int,
    T: int,
    attention_mask: torch.Tensor | None,
    doc_ids: torch.Tensor | None,
    kv_cache: KVCache | None,
) -> torch.Tensor | None:
    """RoPE positions (B, T) where they are not simply start..start+T-1, else None."""
    if doc_ids is not None:  # restart at 0 at each document boundary
        t = torch.arange(T, device=doc_ids.device).expand(B, T)
        boundary = torch.ones_like(doc_ids, dtype=torch.bool)
        boundary[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        first = torch.where(boundary, t, torch.zeros_like(t)).cummax(dim=1).values
        return t - first
    if attention_mask is None and (kv_cache is None or not kv_cache.has_padding):
        return None
    if attention_mask is None:
        attention_mask = torch.ones(B, T, dtype=torch.bool, device=kv_cache.n_seen.device)
    # Real tokens count from 0 in each row, whatever padding precedes them (as HF does).
    seen = kv_cache.n_seen[:, None] if kv_cache is not None else 0
    return (seen + attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def forward_inputs(
    idx: torch.Tensor,
    attention_mask: torch.Tensor | None,
    doc_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    kv_cache: KVCache | None,
    max_seq_len: int,
) -> tuple[slice | torch.Tensor, AttentionMask]:
    """Check the arguments of `Transformer.forward`; return the RoPE positions and the mask.

    The positions index the RoPE tables: a slice start..start+T while every row counts from the
    cache's length (or 0), else a (B, T) or (1, T) tensor (left padding, documents, the caller's
    position_ids). The cache records which of the new keys are real.
    """
    check_inputs(idx, attention_mask, doc_ids, position_ids, max_seq_len)
    B, T = idx.shape
    start = kv_cache.pos if kv_cache is not None else 0
    if start + T > max_seq_len:
        raise ValueError(f"sequence of {start + T} tokens exceeds max_seq_len")
    if kv_cache is not None:
        kv_cache.check_room(T)
    if doc_ids is not None and kv_cache is not None:
        raise ValueError("doc_ids (packed sequences) cannot be combined with a KV cache")

    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.bool)
        if kv_cache is None and bool(attention_mask.all()):
            attention_mask = None  # no padding: plain causal attention is the same and faster
    if position_ids is None:
        position_ids = _positions(B, T, attention_mask, doc_ids, kv_cache)
    key_valid = kv_cache.mark_keys(attention_mask, T) if kv_cache is not None else attention_mask
    mask = AttentionMask.build(T, start, key_valid, doc_ids, idx.device)
    return (slice(start, start + T) if position_ids is None else position_ids), mask
