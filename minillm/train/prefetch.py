"""The next step's batches, cut from the memmap while this step runs on the device.

Offers `Prefetcher(batches, end, pin)`: called with step s it returns `batches(s)` (ready, when
the previous call asked for s) and starts `batches(s + 1)` on a background thread. The batches stay
a pure function of (seed, step, rank): only when they are made changes, never which step they
belong to, so the order and a resume are unchanged. On CUDA (`pin`) every tensor of every
`MicroBatch` (doc_ids too) is copied into pinned memory on that thread, so the trainer's
`.to(device, non_blocking=True)` is an asynchronous copy.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from minillm.data.batches import MicroBatch

MicroBatches = list[Any]


class Prefetcher:
    """`batches(step)` one step ahead on one worker thread; steps >= `end` are never made."""

    def __init__(self, batches: Callable[[int], MicroBatches], end: int, pin: bool = False) -> None:
        self.batches, self.end, self.pin = batches, end, pin
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minillm-prefetch")
        self.pending: tuple[int, Future[MicroBatches]] | None = None

    def _make(self, step: int) -> MicroBatches:
        micro = self.batches(step)
        if self.pin:  # the token shards' micro-batches (other objectives' hold lists of ids)
            micro = [m.map(lambda t: t.pin_memory()) if isinstance(m, MicroBatch) else m
                     for m in micro]  # fmt: skip
        return micro

    def __call__(self, step: int) -> MicroBatches:
        if self.pending is not None and self.pending[0] == step:
            micro = self.pending[1].result()  # re-raises the worker's exception here
        else:  # the first step, or a caller that skipped around: make it now
            if self.pending is not None:
                self.pending[1].cancel()
            micro = self._make(step)
        self.pending = None
        if step + 1 < self.end:
            self.pending = (step + 1, self.pool.submit(self._make, step + 1))
        return micro

    def close(self) -> None:
        """Drop the batch in flight (if any) and stop the thread."""
        if self.pending is not None:
            self.pending[1].cancel()
            self.pending = None
        self.pool.shutdown(wait=True)
