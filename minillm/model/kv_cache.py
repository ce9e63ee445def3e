"""The KV cache for incremental decoding, with the bookkeeping that goes with it.

Offers `KVCache`. Keys and values of past tokens live here, preallocated to `max_len` slots per
row, outside the modules so that the block math is the same with and without a cache. The cache
also remembers, per row, how many slots it has filled (`lengths`), which keys are padding
(left-padded batches) and how many real tokens it has seen (`n_seen`, the RoPE position of its
next token); only its own methods change that bookkeeping.

Rows may be at different lengths (continuous batching: `Decoder.prefill` fills one row,
`Decoder.step` advances rows 0..n-1 each at its own slot, `move_row` and `clear_row` free them).
A model forward through the cache (`Transformer.forward(..., kv_cache=cache)`) moves every row
together and needs them at one length, `pos`.

Shape legend: L layers, B batch (rows), K key/value heads, S slots (max_len), T new tokens,
D head dim.
"""

from __future__ import annotations

import torch

from minillm.config import ModelConfig


class KVCache:
    """Keys and values (L, B, K, S, D) of past tokens, preallocated to `max_len` slots per row.

    `lengths[b]` slots of row b are filled; `key_valid` (B, S) says which keys are real (False
    only at left padding, inside a row's filled slots); `n_seen` (B,) counts each row's real
    tokens.
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
        self.batch_size, self.max_len = batch_size, max_len
        # Host-side: the decoder slices with these every step, and a tensor would cost a sync.
        self.lengths = [0] * batch_size
        self.has_padding = False  # whether any key_valid is False

    @property
    def pos(self) -> int:
        """The slots filled in every row; a ValueError while the rows are at different lengths."""
        first = self.lengths[0]
        if any(n != first for n in self.lengths):
            raise ValueError(
                f"the rows of this KV cache are at different lengths {self.lengths}: a model "
                "forward through it needs them equal (Decoder.step advances rows separately)"
            )
        return first

    def check_room(self, T: int, rows: int | None = None) -> None:
        """ValueError unless T more tokens fit in each of the first `rows` rows (None = all)."""
        longest = max(self.lengths[: self.batch_size if rows is None else rows], default=0)
        if longest + T > self.max_len:
            raise ValueError(
                f"KV cache of {self.max_len} tokens is full: {longest + T} tokens do not fit"
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
        start = self.pos
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, T: int, attention_mask: torch.Tensor | None = None) -> None:
        """T slots of every row are now filled, and each row saw its real tokens among them."""
        self.lengths = [n + T for n in self.lengths]
        self.n_seen += T if attention_mask is None else attention_mask.long().sum(dim=1)

    def advance_rows(self, rows: int) -> None:
        """Rows 0..rows-1 each filled one more slot with one real token (a decoding step)."""
        for r in range(rows):
            self.lengths[r] += 1
        self.n_seen[:rows] += 1

    def row(self, row: int) -> KVCache:
        """A one-row KVCache viewing row `row`'s storage: a forward through it fills that row.

        Its `lengths` is its own list: copy it back with `set_length` once the forward is done.
        """
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, row : row + 1], self.v[:, row : row + 1]
        view.key_valid = self.key_valid[row : row + 1]
        view.n_seen = self.n_seen[row : row + 1]  # a view: `+=` on it updates this cache
        view.batch_size, view.max_len = 1, self.max_len
        view.lengths = [self.lengths[row]]
        view.has_padding = self.has_padding
        return view

    def set_length(self, row: int, length: int) -> None:
        """Row `row` has `length` slots filled (after a forward through `row(row)`)."""
        self.lengths[row] = length

    def clear_row(self, row: int) -> None:
        """Empty row `row` for a new sequence (its stale keys stay, masked by its length)."""
        self.lengths[row] = 0
        self.n_seen[row] = 0
        self.key_valid[row] = True

    def move_row(self, src: int, dst: int) -> None:
        """Move row src's sequence into row dst (compaction after dst's request left); src is
        empty afterwards."""
        if src == dst:
            return
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.key_valid[dst] = self.key_valid[src]
        self.n_seen[dst] = self.n_seen[src]
        self.lengths[dst] = n
        self.clear_row(src)

    def reset(self) -> None:
        """Empty every row."""
        self.lengths = [0] * self.batch_size
        self.has_padding = False
        self.key_valid.fill_(True)
        self.n_seen.zero_()
