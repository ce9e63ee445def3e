"""A LoRA step against peft's on the same published-model folder, alternating in one process: the
step-time ratio that scripts/bench_scale.py's separate processes measure through this machine's
drift (+-15-30% from one minute to the next).

    python scripts/bench_lora_step.py                        # TinyLlama-1.1B's shape, fp32
    python scripts/bench_lora_step.py --shapes mid --rounds 9

Both sides as bench_scale.py's lora job runs them: minillm's Trainer on the folder's
`train.init_from` (rank 16 on every projection, batch 1 x --seq tokens, fp32) and peft on
transformers' fp32 load with AdamW (its batch drawn outside the timed step); one warm-up step
each, then --rounds rounds of one step of each, which side goes first alternating. The table
gives the median step of each side and the median of the rounds' ratios. (minillm's fp32 LoRA
run keeps glibc's malloc settings, so peft's step runs under the same ones.)
Both models are held at once (1.1B: ~13 GB).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import minillm  # noqa: F401  # isort: skip  (OMP_WAIT_POLICY=PASSIVE before torch loads)
import bench_scale as bs  # scripts/ is on sys.path when run as a script
import torch


def sides(folder: Path, cache: Path, seq: int) -> tuple[Callable[[], None], ...]:
    """(minillm's step, peft's step, minillm's close) on `folder`, as bench_scale's lora job
    builds them; peft's batches drawn beforehand."""
    config = bs.lora_config(folder, cache, "fp32", "none", seq)
    trainer = bs.minillm_trainer(str(config), ["train.max_steps=1000"])
    model, opt = bs.peft_model(str(folder), "fp32", "none")
    pool = torch.randint(0, 1000, (64, 1, seq), generator=torch.Generator().manual_seed(0))
    batches = itertools.cycle(pool)

    def ours() -> None:
        bs.minillm_step(trainer)

    def theirs() -> None:
        bs.peft_step(model, opt, next(batches))

    return ours, theirs, trainer.close


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tinyllama"], choices=sorted(bs.SHAPES))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/minillm-bench-scale"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seq", type=int, default=bs.SEQ)
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    print(f"load {open('/proc/loadavg').read().split()[:3]}, {os.cpu_count()} CPUs")
    print("shape | step s minillm | step s peft | ratio (median of rounds)")
    for shape in args.shapes:
        folder = bs.build_folder(shape, args.cache)
        ours, theirs, close = sides(folder, args.cache, args.seq)
        ours(), theirs()  # warm-up
        rounds = []
        for i in range(args.rounds):
            if i % 2:
                b = timed(theirs)
                rounds.append((timed(ours), b))
            else:
                rounds.append((timed(ours), timed(theirs)))
        close()
        a, b = (statistics.median(side) for side in zip(*rounds))
        ratio = statistics.median(x / y for x, y in rounds)
        print(f"{shape} | {a:.2f} | {b:.2f} | {ratio:.2f}x", flush=True)
    print(f"load {open('/proc/loadavg').read().split()[:3]} after")


if __name__ == "__main__":
    main()
