"""The KV cache: keys and values of past tokens, one row per sequence, each row at its own length.

Offers `KVCache` and `CacheWrite`. The cache owns all of its state: the storage and each row's
length, which is also the RoPE position of the row's next token (a row holds one sequence from
position 0; there is no padding in it). Whoever runs a forward through the cache, the model
(`Transformer.forward(..., kv_cache=cache)`) or the decoding fast path
(`minillm.model.decode.Decoder`), asks it for one `CacheWrite`:

    write = cache.append(T, rows)    # T new tokens for each row of `rows` (a range): their
                                     # lengths grow by T now; write.positions, write.key_mask
    keys, values = write.update(layer, k, v)   # per layer: store k, v (n, K, T, D), read all

`cache.rows(r0, r1)` is the same cache seen as rows r0..r1-1 only (what a model forward over
one row's prompt takes); it holds no state of its own. The storage grows as rows and tokens
arrive (doubling, up to `max_len` slots per row, W under a window) rather than reserved for the
whole context up front; `reserve` sizes it exactly when the caller knows. A forward that raises
leaves the contents of its rows undefined: clear or refill them.

Under `model.sliding_window` W (shorter than `max_len`) a row keeps only the keys its next token
can see: W slots, a ring where position p sits in slot p % W (its memory 2 L K W D values per
row, however long the row grows). A token decoded alone writes its key over the one W positions
back, which no query from then on sees, then reads the W slots; several new tokens at once (a
prompt) read the ring's keys and their own, with the band as a mask, then keep their last W.

With `model.attention: mla` a token's entry is its compressed latent and RoPE key instead
(kv_lora_rank + qk_rope_head_dim numbers per layer, stored as the one "key head" of that width,
with values 0 wide: `minillm.model.mla` reads the latent back out of the keys).

Shape legend: L layers, B rows, K key/value heads, S slots, T new tokens, D head dim, n rows of
one write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.config import ModelConfig


@dataclass
class CacheWrite:
    """Where one forward's T new tokens go in rows r0..r0+n-1, and what each of them may see.

    positions: RoPE positions, a slice while every row starts at one length, else (n, T).
    key_mask: (n, 1, T, S) True = may attend, over the S keys `update` returns, or None when
    plain causality suffices (every row at one length: is_causal for a first chunk, nothing at
    all for T = 1; in a ring also a T = 1 step whose rows all hold W keys).
    ring: the window W of a ring cache (KVCache's docstring), else None: slot = position.
    slots: in a ring, where each row's last min(T, W) new keys go (n, min(T, W)), computed once
    here rather than in every layer; None for a one-token step of rows at one length.
    """

    cache: KVCache
    r0: int
    n: int
    T: int
    starts: list[int]
    end: int  # the longest row's length after this write (position, not slot)
    positions: slice | torch.Tensor
    key_mask: torch.Tensor | None
    is_causal: bool
    ring: int | None = None
    slots: torch.Tensor | None = None

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (n, K, T, D) at each row's next slots; return keys, values (n, K, S, D)."""
        # A decoded token costs little more than its matrix-vector products: the per-layer views
        # are made once per storage, and narrow + copy_ is the cheapest write.
        keys, values = self.cache.layers[layer]  # (B_alloc, K, S_alloc, D) views
        if self.r0 or self.n != keys.shape[0]:
            keys, values = keys[self.r0 : self.r0 + self.n], values[self.r0 : self.r0 + self.n]
        if self.ring is not None:
            return self._ring_update(keys, values, k, v)
        end = self.end
        if isinstance(self.positions, slice):  # every row at one length
            keys.narrow(2, self.starts[0], self.T).copy_(k)
            values.narrow(2, self.starts[0], self.T).copy_(v)
        else:  # each row at its own slots
            batch = torch.arange(self.n, device=k.device)[:, None]  # (n, 1)
            keys[batch, :, self.positions] = k.transpose(1, 2)  # (n, T, K, D) at (n, T)
            values[batch, :, self.positions] = v.transpose(1, 2)
        return keys[:, :, :end], values[:, :, :end]

    def _ring_update(
        self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        W, T = self.ring, self.T
        if T == 1:  # write over the key W positions back, then read the ring
            if len(set(self.starts)) == 1:
                slot = self.starts[0] % W
                keys.narrow(2, slot, 1).copy_(k)
                values.narrow(2, slot, 1).copy_(v)
            else:
                self._store(keys, values, k, v)
            read = min(max(self.starts) + 1, W)
            return keys[:, :, :read], values[:, :, :read]
        held = min(max(self.starts), W)  # the ring's keys, then these: what the mask covers
        all_k, all_v = k, v
        if held:
            all_k = torch.cat((keys[:, :, :held], k), dim=2)
            all_v = torch.cat((values[:, :, :held], v), dim=2)
        self._store(keys, values, k, v)  # after the copies above: it overwrites ring keys
        return all_k, all_v

    def _store(
        self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Put the last min(T, W) new keys and values of each row at their ring slots."""
        kept = self.slots.shape[1]
        batch = torch.arange(self.n, device=k.device)[:, None]
        keys[batch, :, self.slots] = k[:, :, self.T - kept :].transpose(1, 2)
        values[batch, :, self.slots] = v[:, :, self.T - kept :].transpose(1, 2)

    def band_mask(self, window: int) -> torch.Tensor | None:
        """The mask (n, 1, T, S) of a local layer that sees `window` keys (itself and the
        window - 1 before it) in a cache that keeps every key (model.sliding_window_pattern);
        None where no query reaches that far back (key_mask serves)."""
        if self.end <= window:
            return None
        dev = self.cache.device
        first = torch.tensor(self.starts, device=dev)[:, None]  # (n, 1)
        queries = (first + torch.arange(self.T, device=dev))[:, :, None]  # (n, T, 1)
        keys = torch.arange(self.end, device=dev)  # (S,)
        return ((keys <= queries) & (keys > queries - window))[:, None]

    def alone(self, i: int) -> int:
        """For a one-token write: how many keys row i reads were it alone, with no mask (the
        decoder's batched == alone)."""
        S = self.starts[i] + 1
        return S if self.ring is None else min(S, self.ring)


class KVCache:
    """Keys and values (L, B, K, S, D) of past tokens; row b holds `lengths[b]` tokens.

    `batch_size` rows exist (`add_rows` makes more); each may hold up to `max_len` tokens, in as
    many slots, or in W slots under a sliding window W < max_len (`ring`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int = 0,
        max_len: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        max_len = cfg.max_seq_len if max_len is None else max_len
        if max_len > cfg.max_seq_len:
            raise ValueError(f"KV cache of {max_len} exceeds max_seq_len={cfg.max_seq_len}")
        self.cfg, self.max_len, self.device, self.dtype = cfg, max_len, torch.device(device), dtype
        # Per token and layer: K heads of D keys and D values; model.attention mla stores its
        # latent and RoPE key, R + P numbers, as one "key" and no value (minillm.model.mla).
        self.heads, self.widths = cfg.n_kv_head, (cfg.head_dim, cfg.head_dim)
        if cfg.attention == "mla":
            self.heads, self.widths = 1, (cfg.kv_lora_rank + cfg.qk_rope_head_dim, 0)
        # A ring only where every layer slides: with model.sliding_window_pattern the global
        # layers read every key, and the local ones a band of them (CacheWrite.band_mask).
        window = None if cfg.mixed_layers else cfg.sliding_window
        self.ring = window if window is not None and window < max_len else None
        self.max_slots = self.ring or max_len
        self.lengths: list[int] = []  # host-side: read every step, a tensor would cost a sync
        # Each row's token ids, kept by a dynamic NTK model's forward to refill a row past its
        # original length (Transformer.forward); empty otherwise.
        self.ids: list[torch.Tensor] = []
        self._store(*self._pair(0, 0))
        self.add_rows(batch_size)

    def _empty(self, rows: int, slots: int, width: int) -> torch.Tensor:
        shape = (self.cfg.n_layer, rows, self.heads, slots, width)
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _pair(self, rows: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._empty(rows, slots, self.widths[0]), self._empty(rows, slots, self.widths[1])

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def pos(self) -> int:
        """The one length of every row; a ValueError while the rows are at different lengths."""
        if len(set(self.lengths)) > 1:
            raise ValueError(f"the rows of this KV cache are at different lengths {self.lengths}")
        return self.lengths[0] if self.lengths else 0

    def token_bytes(self) -> int:
        """Bytes one token takes in every layer: 2 L K D values, or L (R + P) under mla."""
        per_layer = self.heads * sum(self.widths)
        return self.cfg.n_layer * per_layer * torch.empty((), dtype=self.dtype).element_size()

    def nbytes(self) -> int:
        """Bytes of storage held now (keys and values)."""
        return (self.k.numel() + self.v.numel()) * self.k.element_size()

    # ------------------------------------------------------------------ storage

    def reserve(self, rows: int, slots: int) -> None:
        """Hold storage for at least `rows` rows of `slots` tokens (grows, never shrinks; a
        ring's rows never take more than its W slots)."""
        if slots > self.max_len:
            raise ValueError(
                f"KV cache of {self.max_len} tokens is full: {slots} tokens do not fit"
            )
        slots = min(slots, self.max_slots)
        _, have_rows, _, have_slots, _ = self.k.shape
        if rows <= have_rows and slots <= have_slots:
            return
        # Doubling keeps the copies to O(1) per token; the slots never pass max_slots.
        rows = max(rows, 2 * have_rows) if rows > have_rows else have_rows
        grown = min(self.max_slots, max(slots, 2 * have_slots))
        slots = grown if slots > have_slots else have_slots
        k, v = self._pair(rows, slots)
        k[:, :have_rows, :, :have_slots] = self.k
        v[:, :have_rows, :, :have_slots] = self.v
        self._store(k, v)

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        self.layers = list(zip(k.unbind(0), v.unbind(0), strict=True))  # per layer (B, K, S, D)

    def release(self) -> None:
        """Free the storage of a cache whose rows are all gone (a server gone idle)."""
        if self.lengths:
            raise ValueError(f"{self.batch_size} rows still hold sequences")
        self._store(*self._pair(0, 0))

    # ------------------------------------------------------------------ rows

    def add_rows(self, n: int = 1) -> int:
        """n new empty rows at the end; returns the index of the first."""
        first = self.batch_size
        self.lengths += [0] * n
        self.ids += [self._no_ids()] * n
        return first

    def _no_ids(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.long, device=self.device)

    def pop_row(self) -> None:
        """Drop the last row (move a row you keep into a freed index first: `move_row`)."""
        self.lengths.pop()
        self.ids.pop()

    def clear_row(self, row: int) -> None:
        """Empty row `row` for a new sequence (its stale keys stay, past its length)."""
        self.lengths[row] = 0
        self.ids[row] = self._no_ids()

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src's sequence into row dst (whose own is dropped); src stays as it was."""
        if src == dst:
            return
        n = min(self.lengths[src], self.max_slots)  # a ring's slots depend on positions only
        if n:
            self.reserve(max(src, dst) + 1, n)
            self.k[:, dst, :, :n] = self.k[:, src, :, :n]
            self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = self.lengths[src]
        self.ids[dst] = self.ids[src]

    def rows(self, r0: int, r1: int) -> _Rows:
        """This cache seen as rows r0..r1-1 only, for a model forward over those rows."""
        if not 0 <= r0 < r1 <= self.batch_size:
            raise ValueError(f"rows {r0}..{r1 - 1} are not in this KV cache of {self.batch_size}")
        return _Rows(self, r0, r1)

    # ------------------------------------------------------------------ one forward

    def append(self, T: int, rows: range | None = None) -> CacheWrite:
        """Make room for T new tokens in each of `rows` (a range, default all): their lengths
        grow by T now, and the returned CacheWrite places the forward's keys and values."""
        rows = range(self.batch_size) if rows is None else rows
        if rows.step != 1 or len(rows) == 0:
            raise ValueError(f"a KV cache write takes a non-empty range of rows, got {rows}")
        starts = self.lengths[rows.start : rows.stop]
        end = max(starts) + T
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} tokens is full: {end} tokens do not fit")
        self.reserve(rows.stop, end)
        for r in rows:
            self.lengths[r] += T
        n, dev = len(rows), self.device
        one_length = min(starts) == starts[0] == end - T
        if one_length and T == 1:  # a decode step, rows at one length: nothing to build
            where = slice(end - 1, end)
            return CacheWrite(self, rows.start, n, 1, starts, end, where, None, False, self.ring)
        first = torch.tensor(starts, device=dev)[:, None]  # (n, 1)
        new = first + torch.arange(T, device=dev)  # (n, T): the new tokens' positions
        positions = slice(starts[0], end) if one_length else new
        slots = None
        if self.ring is not None:
            mask = self._ring_mask(starts, T, first, new)
            causal = mask is None and T > 1  # every row from 0, no longer than the window
            slots = new[:, max(0, T - self.ring) :] % self.ring  # the last W new tokens' slots
        elif one_length:  # a chunk after cached tokens needs the mask, a first chunk is causal
            mask = None
            if starts[0] > 0 and T > 1:
                mask = (torch.arange(end, device=dev) <= new[0, :, None])[None, None]
            causal = starts[0] == 0 and T > 1
        else:  # each row sees its own keys only
            mask = (torch.arange(end, device=dev)[None, None, :] <= new[:, :, None])[:, None]
            causal = False
        return CacheWrite(
            self, rows.start, n, T, starts, end, positions, mask, causal, self.ring, slots
        )

    def _ring_mask(
        self, starts: list[int], T: int, first: torch.Tensor, new: torch.Tensor
    ) -> torch.Tensor | None:
        """The mask (n, 1, T, S) of a write into a ring of W slots (`CacheWrite._ring_update`):
        keys within the band (position > query - W) that hold a token; None where every row
        reads all it is given."""
        W, dev = self.ring, self.device
        if T == 1:  # slots 0..read-1 after the write; a row shorter than W holds fewer
            read = min(max(starts) + 1, W)
            if all(min(s + 1, W) == read for s in starts):
                return None
            return (torch.arange(read, device=dev) <= first)[:, None, None, :]
        held = min(max(starts), W)
        if held == 0:  # every row from position 0: causal, banded past W
            if T <= W:
                return None
            return ((new[0, None, :] <= new[0, :, None]) & (new[0, None, :] > new[0, :, None] - W))[
                None, None
            ].expand(len(starts), 1, T, T)
        # Slot j of a row of length L holds the latest position p < L with p % W == j
        # (negative: none yet); then come the T new tokens.
        j = torch.arange(held, device=dev)
        ring_pos = (first - 1) - (first - 1 - j).remainder(W)  # (n, held)
        keys = torch.cat((ring_pos, new), dim=1)[:, None, :]  # (n, 1, held + T)
        queries = new[:, :, None]  # (n, T, 1)
        seen = (keys <= queries) & (keys > queries - W) & (keys >= 0)
        return seen[:, None]


class _Rows:
    """Rows r0..r1-1 of a KVCache, for a forward over just them (`KVCache.rows`)."""

    def __init__(self, cache: KVCache, r0: int, r1: int) -> None:
        self.cache, self.r0, self.r1 = cache, r0, r1

    @property
    def batch_size(self) -> int:
        return self.r1 - self.r0

    def append(self, T: int) -> CacheWrite:
        return self.cache.append(T, range(self.r0, self.r1))
