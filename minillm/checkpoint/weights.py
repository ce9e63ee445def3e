"""Weights into a model, with errors that name the tensors at fault.

Offers `load_weights_into`, what a minillm checkpoint, a Hugging Face folder (`--ckpt`,
`train.init_from`) and the trainer's `init_from` all load through, `fit_error` (its message,
which lazy loading, minillm.checkpoint.lazy, shares) and `weights_sha256`, the identity of a
LoRA run's base (`streamed_sha256`: the same digest of weights read again and again from their
files, for a QLoRA base that is never held in float; `SortedDigest`: the same digest computed
as a load reads the weights, once). It lives apart from `store` and
`hf_import` so that each can use it without the two importing each other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from minillm.errors import CheckpointError


def fit_error(
    own: Mapping[str, tuple[int, ...]], given: Mapping[str, tuple[int, ...]], where: str
) -> CheckpointError | None:
    """The error naming the missing, unexpected and mis-shaped tensors of weights `given` (name
    -> shape) for a model whose state_dict has `own` (name -> shape); None when they fit."""
    missing = sorted(set(own) - set(given))
    unexpected = sorted(set(given) - set(own))
    shapes = [
        f"{k} {tuple(given[k])} vs {tuple(own[k])}"
        for k in own
        if k in given and tuple(given[k]) != tuple(own[k])
    ]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        extra = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        problems.append(f"unexpected {extra}")
    if shapes:
        problems.append(f"shape mismatch {', '.join(shapes[:3])}")
    if not problems:
        return None
    return CheckpointError(f"{where}: weights do not fit the model: {'; '.join(problems)}")


def load_weights_into(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """load_state_dict with errors that name the missing, unexpected and mis-shaped tensors."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    error = fit_error(own, {k: tuple(v.shape) for k, v in state.items()}, where)
    if error is not None:
        raise error
    with torch.no_grad():
        model.load_state_dict(state, strict=True)


def weights_sha256(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
    """sha256 of a state_dict's names, shapes and float32 values, in name order: the same for
    the same weights however they were stored (a checkpoint, an HF folder in bf16 or sharded).
    With `dtype`, of the values rounded to it first: a LoRA base frozen in bf16 is identified
    by what it computed with, which a float32 load of the same files reproduces."""
    h = hashlib.sha256()
    for name in sorted(state):
        _hash_one(h, name, state[name], dtype)
    return h.hexdigest()


# Values hashed this many at a time: a bf16 embedding is not copied whole to float32 to hash it.
_HASH_CHUNK = 1 << 22


def _hash_one(h: Any, name: str, t: torch.Tensor, dtype: torch.dtype | None) -> None:
    # The bytes of t (rounded to `dtype`) as float32, fed in chunks: sha256 is a stream, so the
    # digest is that of the whole tensor's bytes.
    t = t.detach().to("cpu")
    rounded = dtype is not None and t.is_floating_point()
    h.update(f"{name} {tuple(t.shape)}\n".encode())
    for chunk in t.reshape(-1).split(_HASH_CHUNK):
        chunk = chunk.to(dtype) if rounded else chunk
        h.update(chunk.float().contiguous().numpy().data)


class SortedDigest:
    """weights_sha256 of the weights `names`, fed one at a time in any order (`add`, fill_model's
    `on_read`): each is hashed as soon as every name before it (sorted) has been, the others kept
    (a reference: one the model keeps costs nothing) until then, at most ~`budget` bytes of
    them. Past that it gives up: `hexdigest()` is then None, and the caller reads the digest
    another way (streamed_sha256). A load in the order of minillm.checkpoint.lazy.by_group keeps
    at most one block."""

    def __init__(self, names: Iterable[str], dtype: torch.dtype | None, budget: int) -> None:
        self._order = sorted(names)
        self._dtype, self._budget = dtype, budget
        self._h, self._done = hashlib.sha256(), 0
        self._held: dict[str, torch.Tensor] = {}
        self._held_bytes = 0
        self.gave_up = False

    def add(self, name: str, t: torch.Tensor) -> None:
        """Take weight `name`: hash it (and what it held waiting for it) or keep it."""
        if self.gave_up or name in self._held:
            return
        order = self._order
        if self._done >= len(order) or order[self._done] != name:
            self._held[name] = t
            self._held_bytes += t.nbytes
            if self._held_bytes > self._budget:
                self.gave_up, self._held, self._held_bytes = True, {}, 0
            return
        _hash_one(self._h, name, t, self._dtype)
        self._done += 1
        while self._done < len(order) and order[self._done] in self._held:
            held = self._held.pop(order[self._done])
            self._held_bytes -= held.nbytes
            _hash_one(self._h, order[self._done], held, self._dtype)
            self._done += 1

    def hexdigest(self) -> str | None:
        """weights_sha256 of what was added, or None (it gave up, or a name never came)."""
        if self.gave_up or self._done < len(self._order):
            return None
        return self._h.hexdigest()


def streamed_sha256(
    names: Sequence[str],
    passes: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    dtype: torch.dtype | None,
    budget: int,
    convert: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, t: t,
) -> str:
    """weights_sha256 of the weights `names` that `passes()` yields, in any order, each time it
    is called (each as `convert(name, tensor)`, a load's dtype conversion, done only for those
    hashed or kept), holding at most ~`budget` bytes of them at once (and the tensor at hand).

    The digest is over the names in sorted order, which a source rarely yields them in (a
    folder's layers come 0, 1, 2, ...; the sorted names 0, 1, 10, ...): each pass hashes what it
    can and keeps what comes early within the budget, and the next pass goes on where it
    stopped. With a budget of one layer, three or four passes for up to 100 layers."""
    order = sorted(names)
    rank = {name: i for i, name in enumerate(order)}
    h, done = hashlib.sha256(), 0
    while done < len(order):
        start, held, held_bytes = done, {}, 0
        for name, t in passes():
            i = rank.get(name, -1)
            if i < done or name in held:
                continue
            if i == done:
                _hash_one(h, name, convert(name, t), dtype)
                done += 1
                while done < len(order) and order[done] in held:
                    t = held.pop(order[done])
                    held_bytes -= t.nbytes
                    _hash_one(h, order[done], t, dtype)
                    done += 1
            elif held_bytes + t.nbytes <= budget:
                held[name] = convert(name, t)
                held_bytes += held[name].nbytes
            del t
        if done == start:
            raise KeyError(order[done])  # the source has no such tensor
    return h.hexdigest()
