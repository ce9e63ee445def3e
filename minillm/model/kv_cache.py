"""The KV cache for incremental decoding, with the bookkeeping that goes with it.

Offers `KVCache`. Keys and values of past tokens live here, preallocated to `max_len`, outside the
modules so that the block math is the same with and without a cache. The cache also remembers
which keys are padding (left-padded batches) and how many real tokens each row has seen (the RoPE
position of its next token); only its own methods change that bookkeeping.

Shape legend: L layers, B batch, K key/value heads, S slots (max_len), T new tokens, D head dim.
"""

from __future__ import annotations

import torch

from minillm.config import ModelConfig


class KVCache:
    """Keys and values (L, B, K, S, D) of past tokens, preallocated to `max_len` slots.

    `pos` slots are filled; `key_valid` (B, S) says which keys are real (not left padding);
    `n_seen` (B,) counts each row's real tokens.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if max_len > cfg.max_seq_len:
            raise ValueError(f"KV cache of {max_len} exceeds max_seq_len={cfg.max_seq_len}")
        shape = (cfg.n_layer, batch_size, cfg.n_kv_head, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.key_valid = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self.n_seen = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.pos = 0  # slots filled
        self.has_padding = False

    def check_room(self, T: int) -> None:
        """ValueError unless T more tokens fit."""
        if self.pos + T > self.max_len:
            raise ValueError(
                f"KV cache of {self.max_len} tokens is full: {self.pos + T} tokens do not fit"
            )

    def mark_keys(self, attention_mask: torch.Tensor | None, T: int) -> torch.Tensor | None:
        """Record which of the next T keys are real (attention_mask (B, T) bool, None = all).

        Returns the validity of every key so far, (B, pos + T), or None while no row has padding.
        """
        start = self.pos
        new = attention_mask if attention_mask is not None else True
        self.key_valid[:, start : start + T] = new
        if attention_mask is not None and not bool(attention_mask.all()):
            self.has_padding = True
        return self.key_valid[:, : start + T] if self.has_padding else None

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, K, T, D) after the filled slots; return all keys/values (B, K, S, D)."""
        end = self.pos + k.shape[2]
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, T: int, attention_mask: torch.Tensor | None = None) -> None:
        """T slots are now filled, and each row saw its real tokens among them."""
        self.pos += T
        self.n_seen += T if attention_mask is None else attention_mask.long().sum(dim=1)

    def reset(self) -> None:
        self.pos = 0
        self.has_padding = False
        self.key_valid.fill_(True)
        self.n_seen.zero_()
