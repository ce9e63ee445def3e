"""The active rows of the engine: one KV cache whose rows are at different lengths.

Offers `Rows`: `new_cache(T)` (a one-row cache to prefill a prompt into), `add(seq, cache)` (the
prefilled row joins), `remove(seqs)` (rows leave), `step()` (one batched decoder step: logits
(B, V) after every row's pending token).

Built on minillm.model's KVCache and Decoder as they are: the decoder writes every row's new key
at the same slot and hides each row's left padding (`key_valid`), with each row's own RoPE
position (`n_seen`). So the rows are kept right-aligned: a row of length n fills the last n of
the `pos` filled slots. When rows join or leave, or the slots run out, the cache is repacked
(each row's keys copied to its new place, `pos` = the longest row); between those events a step
costs no copy. A row never needs more than the context (the server admits only prompt +
max_tokens <= max_seq_len), so after a repack there is always a free slot.

Shape legend: L layers, B rows, K key/value heads, S slots, D head dim, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.model import KVCache
from minillm.model.decode import Decoder


class Rows:
    """Rows of one KV cache at different lengths (module docstring). A seq has `pending` (the
    token to feed next) and `length` (its tokens in the cache), kept up to date here."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.cfg = model, model.cfg
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.seqs: list[Any] = []
        self._joining: dict[int, KVCache] = {}  # id(seq) -> its prefilled one-row cache
        self._cache: KVCache | None = None
        self._decoder: Decoder | None = None
        self._old: dict[int, int] = {}  # id(seq) -> its row in _cache
        self._dirty = False

    def new_cache(self, tokens: int) -> KVCache:
        return KVCache(self.cfg, 1, tokens, device=self.device, dtype=self.dtype)

    def add(self, seq: Any, cache: KVCache) -> None:
        self.seqs.append(seq)
        self._joining[id(seq)] = cache
        self._dirty = True

    def remove(self, seqs: list[Any]) -> None:
        if not seqs:
            return
        gone = {id(s) for s in seqs}
        self.seqs = [s for s in self.seqs if id(s) not in gone]
        for key in gone:
            self._joining.pop(key, None)
        self._dirty = True
        if not self.seqs:  # nothing left: free the cache
            self._cache = self._decoder = None
            self._dirty = False

    def _segment(self, seq: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's keys and values (L, K, n, D), from its own cache or the shared one."""
        n = seq.length
        joining = self._joining.get(id(seq))
        if joining is not None:
            return joining.k[:, 0, :, :n], joining.v[:, 0, :, :n]
        assert self._cache is not None and self._old is not None
        r, pos = self._old[id(seq)], self._cache.pos
        return self._cache.k[:, r, :, pos - n : pos], self._cache.v[:, r, :, pos - n : pos]

    def _repack(self) -> None:
        """A new cache holding every row right-aligned at pos = the longest row."""
        lengths = [s.length for s in self.seqs]
        pos = max(lengths)
        cache = KVCache(self.cfg, len(self.seqs), self.cfg.max_seq_len, self.device, self.dtype)
        for r, seq in enumerate(self.seqs):
            k, v = self._segment(seq)
            n = seq.length
            cache.k[:, r, :, pos - n : pos] = k
            cache.v[:, r, :, pos - n : pos] = v
            cache.key_valid[r, : pos - n] = False
        cache.n_seen = torch.tensor(lengths, dtype=torch.long, device=self.device)
        cache.pos = pos
        cache.has_padding = min(lengths) < pos
        self._cache, self._decoder = cache, Decoder(self.model, cache)
        self._old = {id(s): r for r, s in enumerate(self.seqs)}
        self._joining.clear()
        self._dirty = False

    def step(self) -> torch.Tensor:
        """Feed every row its pending token; logits (B, V) of each row's next token."""
        if not self.seqs:
            raise RuntimeError("no active rows")
        if self._dirty or self._cache is None or self._cache.pos >= self._cache.max_len:
            self._repack()
        assert self._decoder is not None
        tokens = torch.tensor([s.pending for s in self.seqs], dtype=torch.long, device=self.device)
        logits = self._decoder.step(tokens)
        for seq in self.seqs:
            seq.length += 1
        return logits
