"""What `Transformer.forward` derives from its arguments before the first block: checks, RoPE
positions and the attention mask.

Offers `check_inputs`, `AttentionMask` and `forward_inputs`. The checks come first so that a
wrong mask fails by name: without them a mask of the wrong shape fails deep inside attention with
PyTorch's "size of tensor a (20) must match ...", which names neither the argument nor the shape
it should have had. The rest is the bookkeeping of padding and packed documents, and asking the
KV cache where this forward's keys go (`KVCache.append`), kept here so that the model's forward
reads as the model.

Shape legend: B batch, T new tokens, S keys (cached + new).
"""

from __future__ import annotations

import torch

from minillm.model.kv_cache import CacheWrite, KVCache


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
    local: the mask of the layers that slide when others do not (model.sliding_window_pattern),
    else None.
    """

    local: AttentionMask | None = None

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
        key_valid: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
        device: torch.device,
        window: int | None = None,
    ) -> AttentionMask:
        """Causal mask for queries 0..T-1, with optional padding, documents and a sliding window
        (each query sees itself and the window - 1 keys before it)."""
        banded = window is not None and T > window
        if key_valid is None and doc_ids is None and not banded:
            return cls(None, is_causal=T > 1)
        q_pos = torch.arange(T, device=device)
        k_pos = torch.arange(T, device=device)
        allowed = (k_pos[None, :] <= q_pos[:, None])[None]  # (1, T, S)
        if banded:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)[None]
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
    B: int, T: int, attention_mask: torch.Tensor | None, doc_ids: torch.Tensor | None
) -> torch.Tensor | None:
    """RoPE positions (B, T) where they are not simply 0..T-1, else None."""
    if doc_ids is not None:  # restart at 0 at each document boundary
        t = torch.arange(T, device=doc_ids.device).expand(B, T)
        boundary = torch.ones_like(doc_ids, dtype=torch.bool)
        boundary[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        first = torch.where(boundary, t, torch.zeros_like(t)).cummax(dim=1).values
        return t - first
    if attention_mask is None:
        return None
    # Real tokens count from 0 in each row, whatever padding precedes them (as HF does).
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def forward_inputs(
    idx: torch.Tensor,
    attention_mask: torch.Tensor | None,
    doc_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    kv_cache: KVCache | None,
    max_seq_len: int,
    window: int | None = None,
    local_window: int | None = None,
) -> tuple[slice | torch.Tensor, AttentionMask, CacheWrite | None]:
    """Check the arguments of `Transformer.forward`; return the RoPE positions, the mask and,
    with a KV cache, the write that places this forward's keys and values in it.

    The positions index the RoPE tables: a slice while every row counts from one start (0, or
    the cache's length), else a (B, T) or (1, T) tensor (left padding, documents, the caller's
    position_ids, cached rows at different lengths). `window`: model.sliding_window (a KV
    cache applies its own, the model's). `local_window`: the window of the local layers when
    other layers see the whole context, as the mask's `local`.
    """
    check_inputs(idx, attention_mask, doc_ids, position_ids, max_seq_len)
    B, T = idx.shape
    if kv_cache is not None:
        # A cached row holds one sequence from position 0: padding or packing has no place in
        # it (the decoding core prefills each row alone, minillm.infer.engine).
        for name, given in (
            ("attention_mask", attention_mask),
            ("doc_ids", doc_ids),
            ("position_ids", position_ids),
        ):
            if given is not None:
                raise ValueError(f"{name} cannot be combined with a KV cache: fill rows alone")
        if kv_cache.batch_size != B:
            raise ValueError(f"idx has {B} rows, the KV cache {kv_cache.batch_size}")
        write = kv_cache.append(T)
        mask = AttentionMask(write.key_mask, is_causal=write.is_causal)
        if local_window is not None:
            band = write.band_mask(local_window)
            if band is not None:
                mask.local = AttentionMask(band)
        return write.positions, mask, write
    if T > max_seq_len:
        raise ValueError(f"sequence of {T} tokens exceeds max_seq_len")
    if attention_mask is not None:
        attention_mask = attention_mask.to(torch.bool)
        if bool(attention_mask.all()):
            attention_mask = None  # no padding: plain causal attention is the same and faster
    if position_ids is None:
        position_ids = _positions(B, T, attention_mask, doc_ids)
    mask = AttentionMask.build(T, attention_mask, doc_ids, idx.device, window)
    if local_window is not None:
        mask.local = AttentionMask.build(T, attention_mask, doc_ids, idx.device, local_window)
    return (slice(0, T) if position_ids is None else position_ids), mask, None
