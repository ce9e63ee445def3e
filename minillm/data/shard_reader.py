"""A split stored as several shard files, read as one array.

Offers `ShardedArray`: the memmaps of a split's shards behind the parts of the ndarray interface
that batches, packing and evaluation use (len, slicing, `np.asarray`, `tolist`). A slice that
crosses a shard boundary is concatenated, so a window at offset o is the same tokens whatever
`data.shard_tokens` was: batches stay a pure function of (seed, step, rank).
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np


class ShardedArray:
    """Read-only 1-D concatenation of arrays (the shards of one split), copied only on access."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.starts = [0]  # starts[i]: global offset of parts[i]; the last entry is the length
        for p in self.parts:
            self.starts.append(self.starts[-1] + len(p))
        self.dtype = parts[0].dtype if parts else np.dtype("u2")

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: Any) -> Any:
        n = len(self)
        if isinstance(key, slice):
            lo, hi, step = key.indices(n)
            if step != 1:
                return np.asarray(self)[key]
            return self._range(lo, max(lo, hi))
        i = int(key)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {key} is out of bounds for length {n}")
        part = bisect.bisect_right(self.starts, i) - 1
        return self.parts[part][i - self.starts[part]]

    def _range(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) as one array: a view inside one shard, a copy across shards."""
        if lo == hi:
            return np.zeros(0, dtype=self.dtype)
        first = bisect.bisect_right(self.starts, lo) - 1
        last = bisect.bisect_right(self.starts, hi - 1) - 1
        pieces = [
            self.parts[p][
                max(lo, self.starts[p]) - self.starts[p] : min(hi, self.starts[p + 1])
                - self.starts[p]
            ]
            for p in range(first, last + 1)
        ]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self._range(0, len(self))
        return np.array(whole, dtype=dtype) if dtype is not None else np.array(whole)

    def tolist(self) -> list[Any]:
        return np.asarray(self).tolist()

    def copy(self) -> np.ndarray:
        return np.array(self)
