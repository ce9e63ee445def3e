"""Context extension of a trained run, measured: held-out bits per byte at longer windows with
no RoPE scaling (plain extrapolation), position interpolation (linear), dynamic NTK and YaRN,
each with no fine-tuning and after a short fine-tune at the new length (issue 42, item 4).

Every number comes from a `minillm` command, printed before it runs, so any row can be rerun by
hand:

    minillm eval --ckpt BASE --seq-len L --json [--set model.rope_scaling.type=T ...]   # no FT
    minillm train CONFIG --set train.init_from=BASE --set model.max_seq_len=L \\
        --set train.seq_len=L --set model.rope_scaling.type=T ... --no-resume --force     # FT
    minillm eval --ckpt OUT/T-L --json                # the fine-tuned run, at its own L and T

    python scripts/context_extension.py                 # runs/tiny (after `make demo`), 1024, 2048
    python scripts/context_extension.py --lengths 1024 --methods none,yarn --ft-steps 10

The factor of each scaling is L / the base's max_seq_len (its original length); a fine-tune
keeps the base's tokens per step (batch_size x seq_len = 2,048 for configs/tiny.yaml, so batch
2048 // L), trains --ft-steps steps at --lr (default 1e-4, configs/tiny.yaml's min_lr, where
pretraining ended; wsd, --warmup steps) without the weight average (train.ema_decay 0), on the
base's own training shards; its share of the base's pretraining tokens is printed. A control row
fine-tunes the same way at the trained length with no scaling: what the fine-tune alone does
(3e-4 cost 0.025 bits/byte there, 1e-4 0.003). Every evaluation is the whole validation split,
windows of L tokens at 0, L, 2L, ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

METHODS = ("none", "linear", "dynamic", "yarn")
LABELS = {
    "none": "no scaling (extrapolation)",
    "linear": "position interpolation (linear)",
    "dynamic": "dynamic NTK",
    "yarn": "YaRN",
}


def scaling_sets(method: str, factor: float, original: int) -> list[str]:
    """The `--set` overrides of one scaling at `factor` over `original` positions."""
    if method == "none":
        return []
    sets = [f"model.rope_scaling.type={method}", f"model.rope_scaling.factor={factor:g}"]
    if method != "linear":
        sets.append(f"model.rope_scaling.original_max_position_embeddings={original}")
    return sets


def as_args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def minillm(args: list[str], log: list[dict[str, Any]]) -> str:
    """Run `minillm ARGS` (this interpreter's minillm), print the command, return its stdout."""
    shown = "minillm " + " ".join(args)
    print(f"$ {shown}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "minillm", *args], capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"failed ({proc.returncode}): {shown}")
    log.append({"command": shown, "seconds": round(seconds, 1), "load": os.getloadavg()[0]})
    return proc.stdout


def evaluate(args: list[str], log: list[dict[str, Any]]) -> float:
    """bits per byte of `minillm eval ARGS --json`."""
    return json.loads(minillm(["eval", *args, "--json"], log).strip().splitlines()[-1])[
        "bits_per_byte"
    ]


def base_facts(base: str) -> tuple[int, int, int]:
    """The base run's context (max_seq_len), tokens per step and tokens trained."""
    from minillm.checkpoint.layout import read_state, resolve_checkpoint

    state = read_state(resolve_checkpoint(base))
    train = state["config"]["train"]
    per_step = train["batch_size"] * train["grad_accum"] * train["seq_len"]
    return state["config"]["model"]["max_seq_len"], per_step, int(state["tokens_seen"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    original, per_step, pretrained = base_facts(args.base)
    lengths = [int(n) for n in args.lengths.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    log: list[dict[str, Any]] = []
    rows: dict[str, dict[str, Any]] = {m: {} for m in methods}
    result: dict[str, Any] = {"base": args.base, "original": original, "rows": rows, "log": log}
    result["bpb_trained"] = evaluate(["--ckpt", args.base], log)
    for length in lengths:
        factor = length / original
        batch = max(1, per_step // length)
        ft_tokens = args.ft_steps * batch * length
        result.setdefault("ft", {})[str(length)] = {
            "steps": args.ft_steps,
            "batch": batch,
            "tokens": ft_tokens,
            "share": ft_tokens / pretrained,
        }
        for method in methods:
            sets = scaling_sets(method, factor, original)
            row = rows[method].setdefault(str(length), {})
            row["no_ft"] = evaluate(
                ["--ckpt", args.base, "--seq-len", str(length), *as_args(sets)], log
            )
            if args.no_finetune:
                continue
            out = finetune(args, f"{method}-{length}", length, batch, sets, log)
            row["ft"] = evaluate(["--ckpt", out], log)
            row["ft_at_trained"] = evaluate(["--ckpt", out, "--seq-len", str(original)], log)
    if not args.no_finetune:
        # The control: the same fine-tune at the trained length, no scaling. What the fine-tune
        # does to the model by itself (another lr, no average) is not the longer context's.
        out = finetune(args, f"control-{original}", original, max(1, per_step // original), [], log)
        result["control"] = evaluate(["--ckpt", out], log)
    result["pretrained_tokens"] = pretrained
    return result


def finetune(
    args: argparse.Namespace,
    name: str,
    length: int,
    batch: int,
    sets: list[str],
    log: list[dict[str, Any]],
) -> str:
    """Fine-tune the base at `length` with the scaling `sets` into OUT/name; the run's path."""
    out = str(Path(args.out) / name)
    train_sets = [
        f"train.init_from={args.base}",
        f"train.out_dir={out}",
        f"model.max_seq_len={length}",
        f"train.seq_len={length}",
        f"train.batch_size={batch}",
        f"train.max_steps={args.ft_steps}",
        f"train.lr={args.lr:g}",
        f"train.warmup_steps={args.warmup}",
        "train.ema_decay=0",
        "train.eval_steps=1",  # the trainer's own last evaluation; the score is eval's
        *sets,
    ]
    minillm(["train", args.config, *as_args(train_sets), "--no-resume", "--force"], log)
    return out


def format_table(result: dict[str, Any]) -> str:
    """Markdown: one row per scaling, no FT and FT per length, and the FT run back at the
    trained length."""
    lengths = list(next(iter(result["rows"].values())))
    head = ["RoPE scaling", f"{result['original']} (trained)"]
    for n in lengths:
        head += [f"{int(n):,} no FT", f"{int(n):,} FT"]
    head += [f"FT at {int(n):,}, read at {result['original']}" for n in lengths]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for method, per_len in result["rows"].items():
        cells = [LABELS[method], f"{result['bpb_trained']:.4f}"]
        for n in lengths:
            r = per_len[n]
            cells += [f"{r['no_ft']:.4f}", f"{r['ft']:.4f}" if "ft" in r else "-"]
        for n in lengths:
            r = per_len[n]
            cells.append(f"{r['ft_at_trained']:.4f}" if "ft_at_trained" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    if "control" in result:
        cells = [f"control: the same fine-tune at {result['original']}, no scaling"]
        cells += [f"{result['control']:.4f}"] + ["-"] * (len(head) - 2)
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        f"fine-tune at {int(n):,}: {f['steps']} steps x {f['batch']} x {int(n):,} = "
        f"{f['tokens']:,} tokens, {f['share']:.2%} of the base's {result['pretrained_tokens']:,}"
        for n, f in result.get("ft", {}).items()
    ]
    return "\n".join(lines + [""] + notes)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", default="runs/tiny", help="the trained run (make demo's)")
    p.add_argument("--config", default="configs/tiny.yaml", help="the base's config, for data")
    p.add_argument("--lengths", default="1024,2048", help="comma-separated window lengths")
    p.add_argument("--methods", default=",".join(METHODS), help="of: " + ", ".join(METHODS))
    p.add_argument("--ft-steps", type=int, default=20, help="fine-tuning steps per run")
    p.add_argument("--lr", type=float, default=1e-4, help="fine-tuning peak learning rate")
    p.add_argument("--warmup", type=int, default=5, help="fine-tuning warmup steps")
    p.add_argument("--out", default="runs/ctx", help="folder of the fine-tuned runs")
    p.add_argument("--no-finetune", action="store_true", help="only the no-FT columns")
    p.add_argument("--json", type=Path, help="also write the results (and commands) here")
    args = p.parse_args(argv)
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        raise SystemExit(f"--methods: unknown {', '.join(sorted(unknown))}; known: {METHODS}")
    result = run(args)
    print()
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
