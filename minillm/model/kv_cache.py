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
        self._step: tuple[int, int | torch.Tensor, int] | None = None  # see start_step
        self._layers = list(zip(self.k.unbind(0), self.v.unbind(0), strict=True))

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
        """Store k, v (B, K, T, D) after the filled slots; return all keys/values (B, K, S, D).

        During a `start_step` the B rows are rows 0..B-1, each storing its one token at its own
        slot, and S is the longest row's length after the step.
        """
        if self._step is not None:
            rows, slot, end = self._step
            keys, values = self._layers[layer]  # (B, K, S, D) views, looked up once
            if rows != self.batch_size:
                keys, values = keys[:rows], values[:rows]
            if isinstance(slot, int):  # every row at one length
                keys.narrow(2, slot, 1).copy_(k)
                values.narrow(2, slot, 1).copy_(v)
            else:  # each row at its own slot
                batch = torch.arange(rows, device=slot.device)
                keys[batch, :, slot] = k[:, :, 0]
                values[batch, :, slot] = v[:, :, 0]
            return keys[:, :, :end], values[:, :, :end]
        start = self.pos
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, T: int, attention_mask: torch.Tensor | None = None) -> None:
        """T slots of every row are now filled, and each row saw its real tokens among them."""
        self.lengths = [n + T for n in self.lengths]
        self.n_seen += T if attention_mask is None else attention_mask.long().sum(dim=1)

    def start_step(self, rows: int) -> torch.Tensor | None:
        """Begin a decoding step of one token for each of rows 0..rows-1, at its own slot.

        The `update` calls until `end_step` store each row's key and value at that row's next
        slot. Returns which keys each new token may see, (rows, 1, 1, S) for SDPA, or None when
        it may see all S (the rows are at one length and unpadded).
        """
        self.check_room(1, rows)
        lengths = self.lengths[:rows]
        end = max(lengths) + 1
        if min(lengths) == end - 1:
            self._step = (rows, end - 1, end)
            return self.key_valid[:rows, None, None, :end] if self.has_padding else None
        slots = torch.tensor(lengths, device=self.k.device)  # (rows,) each row's next slot
        self._step = (rows, slots, end)
        filled = torch.arange(end, device=slots.device) <= slots[:, None]  # (rows, S)
        return (filled & self.key_valid[:rows, :end])[:, None, None]

    def end_step(self, done: bool = True) -> None:
        """Rows 0..rows-1 of the step each filled one more slot with one real token (done), or
        the step failed and the rows stay as they were (their next slots are rewritten later)."""
        rows = self._step[0]
        self._step = None
        if not done:
            return
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
        view._step = None
        view._layers = list(zip(view.k.unbind(0), view.v.unbind(0), strict=True))
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
