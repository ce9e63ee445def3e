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
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import minillm  # noqa: F401  # isort: skip  (OMP_WAIT_POLICY=PASSIVE before torch loads)
import torch
from bench_scale import PEFT_TARGETS, RANK, SEQ, SHAPES, build_folder, lora_config

from minillm.checkpoint.init_from import load_run_config
from minillm.train.run import prepare_run
from minillm.train.trainer import Trainer


def minillm_step(config: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    """One step of minillm's Trainer on `config`, a fresh run of it; and its close."""
    cfg = load_run_config(str(config), ["train.max_steps=1000"])
    shutil.rmtree(cfg.train.out_dir, ignore_errors=True)
    trainer = Trainer(prepare_run(cfg, resume=False, verbose=False))

    def step() -> None:
        out = trainer.train_step()
        float(out.loss)
        trainer.count_step(out)

    return step, trainer.close


def peft_step(folder: Path, seq: int) -> Callable[[], None]:
    """One step of peft's LoRA on transformers' fp32 load (bench_scale.job_peft_train's)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=PEFT_TARGETS)
    model = peft.get_peft_model(model, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 1000, (64, 1, seq), generator=gen)  # the batches, drawn beforehand
    drawn = [0]

    def step() -> None:
        ids = pool[drawn[0] % len(pool)]
        drawn[0] += 1
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())

    return step


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tinyllama"], choices=sorted(SHAPES))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/minillm-bench-scale"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seq", type=int, default=SEQ)
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    print(f"load {open('/proc/loadavg').read().split()[:3]}, {os.cpu_count()} CPUs")
    print("shape | step s minillm | step s peft | ratio (median of rounds)")
    for shape in args.shapes:
        folder = build_folder(shape, args.cache)
        ours, close = minillm_step(lora_config(folder, args.cache, "fp32", "none", args.seq))
        theirs = peft_step(folder, args.seq)
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
