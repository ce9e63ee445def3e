"""Encoding batches of text or conversations into token ids, in this process or in workers.

Offers `EncodePool` (where the batches run), `Encoded` (a batch's result), and the two batch
functions `encode_text` and `encode_chats`. minillm.data.tokenize_pass drives them, with the
batches of minillm.data.encode_batches.

`data.num_proc` decides where a batch is encoded. With 1, on one thread of this process, through
`encode_batch_fast`, whose Rust threads may use every core: the reading and writing in the main
thread hide behind it. With N > 1, in N worker processes (spawned, each with its own copy of the
tokenizer and the tokenizer's own threads off), so that the Python side of encoding (building id
arrays, a chat conversation's template) runs on every core too, not only the Rust side. The
workers start with the first batch that is not the last, so a corpus of one batch never pays
for them.

Every batch gives the same ids wherever it runs (a piece of text encodes to the same ids in any
batch), and the caller writes results in the order it submitted them: the shards are identical
for every `num_proc`.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from minillm.errors import UserError
from minillm.tokenizer.chat_template import assistant_bytes, content_bytes

if TYPE_CHECKING:
    from minillm.tokenizer.conventions import Conventions


@dataclass
class Encoded:
    """One batch's ids; for chat data the target mask (None: every token is a target) and the
    bytes the targets spell; the seconds its encoding took (in a worker: that worker's)."""

    ids: np.ndarray
    mask: np.ndarray | None = None
    target_bytes: int = 0
    seconds: float = 0.0


def encode_text(
    conv: Conventions, pieces: list[str], ends: list[bool], eot: int, dtype: str
) -> Encoded:
    """The ids of `pieces` (`conv.texts_ids`), with the EOT id after each piece that ends a
    document. A published model's documents come whole (one piece each) and encode as
    `tokenizer(text)`, its BOS included; the EOT (its doc_end) follows unless its
    post-processor wrote it already."""
    start = time.perf_counter()
    tail = (eot,)
    ids = itertools.chain.from_iterable(
        itertools.chain(text, tail) if end and text[-1:] != [eot] else text
        for text, end in zip(conv.texts_ids(pieces), ends)
    )
    array = np.fromiter(ids, dtype=np.dtype(dtype))  # no list of all ids
    return Encoded(array, seconds=time.perf_counter() - start)


def encode_chats(
    conv: Conventions,
    conversations: list[list[dict[str, str]]],
    eot: int,
    dtype: str,
    masked: bool,
) -> Encoded:
    """Conversations through the chat template, each followed by EOT (never a target). With
    `masked` (loss on the assistant) the mask marks the targets; without, there is none."""
    start = time.perf_counter()
    ids: list[int] = []
    target: list[bool] = []
    target_bytes = 0
    for messages in conversations:
        try:
            if masked:
                conv_ids, conv_target = conv.chat_targets(messages)
            else:  # every token a target: no need to find the replies
                conv_ids = conv.chat_ids(messages, add_generation_prompt=False)
                conv_target = [True] * len(conv_ids)
        except UserError as e:  # the template's refusal: say which conversation
            first = messages[0]["content"][:40]
            raise UserError(f"data.source: the conversation that opens {first!r}: {e}") from None
        tail = [] if conv_ids[-1:] == [eot] else [eot]  # Phi-3's template ends with its eos
        ids += [*conv_ids, *tail]
        target += [*conv_target, *[False] * len(tail)]
        target_bytes += assistant_bytes(messages) if masked else content_bytes(messages)
    mask = np.asarray(target, dtype=np.uint8) if masked else None
    array = np.asarray(ids, dtype=np.dtype(dtype))
    return Encoded(array, mask, target_bytes, time.perf_counter() - start)


# ----------------------------------------------------------------------------- workers

_CONVENTIONS: Conventions | None = None  # a worker's own copy


def _exit_with_parent(parent: int) -> None:
    """A worker whose main process is gone (kill -9 skips every cleanup) exits too, instead of
    waiting forever for work: checked every second."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _start_worker(conv: Conventions, parent: int) -> None:
    # Ctrl-C reaches the whole process group: the main process handles it and stops the pool;
    # a worker that raised KeyboardInterrupt too would only print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core a worker: N workers, N cores
    global _CONVENTIONS
    _CONVENTIONS = conv  # unpickled with the tokenizer's settings as in the main process


def _quiet_resource_tracker() -> None:
    """After a kill -9 of this process, multiprocessing's resource tracker (a process of its own,
    started with this one's -W options) cleans up the pool's semaphores, and says so with a
    UserWarning on the user's terminal: nothing was leaked that it did not clean up."""
    quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
    if quiet not in sys.warnoptions:
        sys.warnoptions.append(quiet)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """A `__main__` without a file or spec while workers start. Otherwise spawn runs the main
    script again in every worker: a user's script without `if __name__ == "__main__":` would
    start its work over there (and fail), and `minillm` would import all of its CLI. The
    workers need only this module, which they import by name."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _in_worker(fn: Callable[..., Encoded], *args: Any) -> Encoded:
    assert _CONVENTIONS is not None
    return fn(_CONVENTIONS, *args)


class EncodePool:
    """Runs batch functions (`fn(conv, *args) -> Encoded`, conv the tokenizer's conventions)
    on a thread, or in `num_proc` workers, and hands their results to `write(encoded, tag)`
    in the order they were submitted.

    At most one batch waits on the thread (it encodes while the caller reads the next), or two
    per worker; `submit` writes the oldest results beyond that, `drain` all of them.
    `submit(..., last=True)` marks a batch after which no other comes: it runs on the thread when
    no worker has started, so a corpus of one batch starts none. `close()` stops everything;
    batches still queued are cancelled.
    """

    def __init__(
        self, conv: Conventions, num_proc: int, write: Callable[[Encoded, Any], None]
    ) -> None:
        self.conv, self.num_proc, self.write = conv, num_proc, write
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="encode")
        self.workers: Executor | None = None
        self.pending: deque[tuple[Future[Encoded], Any]] = deque()

    def submit(self, fn: Callable[..., Encoded], *args: Any, tag: Any, last: bool = False) -> None:
        if self.num_proc > 1 and (self.workers is not None or not last):
            if self.workers is None:
                _quiet_resource_tracker()
                # spawn, not fork: this process may hold threads (its encode thread, torch's),
                # and a forked copy of a thread pool can deadlock.
                self.workers = ProcessPoolExecutor(
                    self.num_proc,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_worker,
                    initargs=(self.conv, os.getpid()),
                )
            with _main_module_hidden():  # a submit may start a worker
                future = self.workers.submit(_in_worker, fn, *args)
        else:
            future = self.thread.submit(fn, self.conv, *args)
        self.pending.append((future, tag))
        limit = 2 * self.num_proc if self.workers is not None else 1
        while len(self.pending) > limit:
            self._write_oldest()

    def drain(self) -> None:
        while self.pending:
            self._write_oldest()

    def _write_oldest(self) -> None:
        future, tag = self.pending.popleft()
        self.write(future.result(), tag)

    def close(self) -> None:
        self.pending.clear()
        self.thread.shutdown(wait=True, cancel_futures=True)
        if self.workers is not None:
            self.workers.shutdown(wait=True, cancel_futures=True)
