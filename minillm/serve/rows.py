"""The active rows of the engine: one KV cache whose rows are at different lengths.

Offers `Rows`: `prefill(ids)` (a prompt into the next free row, alone; logits of its next
token), `add(seq)` (that row's sequence joins the batch), `remove(seqs)` (rows leave), `step()`
(one batched decoder step: logits (n, V) after every row's pending token).

Built on minillm.model's continuous-batching decoder (`Decoder.prefill`, `Decoder.step` over
rows 0..n-1 each at its own position, `KVCache.move_row`): the active sequences are kept at
rows 0..n-1, and when one leaves, the last row moves into its slot, so a step never computes a
free row and a leaving row costs one row's copy. The cache holds `max_rows` rows of the whole
context, allocated once; the server admits only prompt + max_tokens <= max_seq_len, so a row
never runs out of slots.

Shape legend: n active rows, P prompt tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.model import KVCache
from minillm.model.decode import Decoder


class Rows:
    """Sequences at rows 0..n-1 of one KV cache (module docstring). A seq has `pending`, the
    token to feed at the next step."""

    def __init__(self, model: torch.nn.Module, max_rows: int) -> None:
        param = next(model.parameters())
        self.device = param.device
        cfg = model.cfg
        self.cache = KVCache(cfg, max_rows, cfg.max_seq_len, device=param.device, dtype=param.dtype)
        self.decoder = Decoder(model, self.cache)
        self.seqs: list[Any] = []

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Run prompt ids through the next free row, alone; logits (V,) of its next token. The
        row is the sequence's once `add` is called; until then the next prefill reuses it."""
        if len(self.seqs) >= self.cache.batch_size:
            raise RuntimeError("every row of the KV cache is taken")
        row = len(self.seqs)
        return self.decoder.prefill(row, torch.tensor(ids, dtype=torch.long, device=self.device))

    def add(self, seq: Any) -> None:
        self.seqs.append(seq)

    def remove(self, seqs: list[Any]) -> None:
        """These sequences leave; the last rows move into their slots."""
        gone = {id(s) for s in seqs}
        r = 0
        while r < len(self.seqs):
            if id(self.seqs[r]) in gone:
                last = len(self.seqs) - 1
                self.cache.move_row(last, r)  # a no-op when r is the last row
                self.seqs[r] = self.seqs[last]
                self.seqs.pop()
                if r == last:
                    self.cache.clear_row(r)
            else:
                r += 1

    def step(self) -> torch.Tensor:
        """Feed every row its pending token; logits (n, V) of each row's next token."""
        if not self.seqs:
            raise RuntimeError("no active rows")
        tokens = torch.tensor([s.pending for s in self.seqs], dtype=torch.long, device=self.device)
        return self.decoder.step(tokens)
