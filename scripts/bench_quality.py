"""Quality per unit of compute: train one config under several optimizer/schedule variants.

Each variant trains the same config for the same number of steps, one after another in this
process, with the same seed and therefore the same initial weights and batches; then its last
checkpoint is evaluated over the whole validation split by `minillm eval`'s own function
(`evaluate_checkpoint`), so the bits per byte are the ones `minillm eval --ckpt` would print.

    python scripts/bench_quality.py --steps 200                      # configs/tiny.yaml, 4 variants
    python scripts/bench_quality.py configs/tiny.yaml --steps 300 --variants adamw-cosine,muon-wsd \
        --variant "muon-lr03:train.optimizer=muon,train.muon_lr=0.03" --set train.warmup_steps=20

Columns: val bits/byte; train loss (mean over the last tenth of the steps); wall seconds of
`fit` (compile warm-up and the final in-loop evaluation included, the separate evaluation not);
tokens/s over the training steps alone; the share of step time spent in `optimizer.step` (Muon's
Newton-Schulz iterations live there); and each row's bits/byte minus the first row's. Timings on a
shared machine drift; compare rows of one run.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from minillm.checkpoint.store import load_checkpoint
from minillm.config import Config, load_config
from minillm.data.meta import load_meta
from minillm.data.shard_writer import write_shards
from minillm.errors import UserError
from minillm.infer.evaluate import evaluate_checkpoint
from minillm.train.trainer import Trainer

# The variants of the issue, in the order of the table; AdamW + cosine (today's default) first.
VARIANTS: dict[str, list[str]] = {
    "adamw-cosine": [],
    "adamw-wsd": ["train.schedule=wsd"],
    "muon-cosine": ["train.optimizer=muon"],
    "muon-wsd": ["train.optimizer=muon", "train.schedule=wsd"],
}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`name:key=value,key=value` -> (name, overrides)."""
    name, _, sets = text.partition(":")
    if not name or not sets:
        raise SystemExit(f"--variant {text!r}: expected NAME:key=value[,key=value...]")
    return name, [s for s in sets.split(",") if s]


def ensure_data(cfg: Config) -> None:
    """Tokenize as `minillm tokenize` would, unless the shards are already there."""
    try:
        load_meta(cfg.data.out_dir)
    except UserError:
        write_shards(cfg)


def run_variant(cfg: Config, out_dir: Path) -> dict[str, Any]:
    """Train `cfg` into out_dir from scratch; time it and evaluate its last checkpoint."""
    cfg = copy.deepcopy(cfg)
    tc = cfg.train
    tc.out_dir = str(out_dir)
    tc.eval_every, tc.ckpt_every = 0, 0  # one checkpoint, at the end
    tc.eval_steps = 1  # the trainer's own final evaluation: the real one is below
    tc.log_every = max(tc.log_every, tc.max_steps)
    trainer = Trainer.from_config(cfg, resume=False, force=True, verbose=False)
    losses: list[float] = []
    step_s: list[float] = []
    optim_s: list[float] = []
    train_step, optim_step = trainer.train_step, trainer.optimizer.step

    def timed_train_step(micro: Any = None) -> Any:
        t0 = time.perf_counter()
        out = train_step(micro)
        losses.append(float(out.loss))  # a device tensor: reading it waits for the step
        step_s.append(time.perf_counter() - t0)
        return out

    def timed_optim_step(*args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        optim_step(*args, **kwargs)
        optim_s.append(time.perf_counter() - t0)

    trainer.train_step = timed_train_step  # instance attributes: only this run is timed
    trainer.optimizer.step = timed_optim_step
    try:
        start = time.perf_counter()
        trainer.fit()
        wall = time.perf_counter() - start
    finally:
        trainer.close()
    result = evaluate_checkpoint(load_checkpoint(out_dir, trainer.device))
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "val_bpb": result["bits_per_byte"],
        "val_loss": result["loss"],
        "train_loss": sum(tail) / len(tail),
        "wall_s": wall,
        "tokens_per_s": trainer.tokens_seen / max(sum(step_s), 1e-9),
        "optim_share": sum(optim_s) / max(sum(step_s), 1e-9),
    }


def format_table(rows: list[tuple[str, dict[str, Any]]], steps: int) -> str:
    """A markdown table, the first row the reference for the last column."""
    head = (
        f"| variant ({steps} steps) | val bits/byte | train loss | wall s | tokens/s "
        "| optimizer share | Δ bits/byte |\n|---|---|---|---|---|---|---|"
    )
    base = rows[0][1]["val_bpb"]
    lines = [
        f"| {name} | {r['val_bpb']:.4f} | {r['train_loss']:.4f} | {r['wall_s']:.0f} "
        f"| {r['tokens_per_s']:,.0f} | {r['optim_share']:.0%} | {r['val_bpb'] - base:+.4f} |"
        for name, r in rows
    ]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("config", nargs="?", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, required=True, help="train.max_steps of every variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated built-ins")
    p.add_argument("--variant", action="append", default=[], help="NAME:key=value,... (repeatable)")
    p.add_argument("--set", action="append", default=[], help="override for every variant")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", type=Path, help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    chosen = [(n, VARIANTS[n]) for n in args.variants.split(",") if n]
    chosen += [parse_variant(v) for v in args.variant]
    base_sets = [*args.set, f"train.max_steps={args.steps}"]
    ensure_data(load_config(args.config, base_sets))
    rows: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="bench_quality_") as tmp:
        for name, sets in chosen:
            cfg = load_config(args.config, [*base_sets, *sets])
            rows.append((name, run_variant(cfg, Path(tmp) / name)))
            r = rows[-1][1]
            print(f"{name}: val bits/byte {r['val_bpb']:.4f}, {r['wall_s']:.0f} s", flush=True)
    print(f"\n{args.config}, --set {' '.join(base_sets)}\n")
    print(format_table(rows, args.steps))
    if args.json:
        args.json.write_text(json.dumps([{"variant": n, **r} for n, r in rows], indent=2))


if __name__ == "__main__":
    main()
