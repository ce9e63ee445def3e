"""Quality per unit of compute: train one config under several optimizer/schedule variants.

Each variant trains the same config for the same number of steps, one after another in this
process, with the same seed and therefore the same initial weights and batches; then its last
checkpoint is evaluated over the whole validation split by `minillm eval`'s own function
(`evaluate_checkpoint`), so the bits per byte are the ones `minillm eval --ckpt` would print.

    python scripts/bench_quality.py --steps 200                      # configs/tiny.yaml, 4 variants
    python scripts/bench_quality.py configs/tiny.yaml --steps 300 --variants adamw-cosine,muon-wsd \
        --variant "muon-lr03:train.optimizer=muon,train.muon_lr=0.03" --set train.warmup_steps=20

Knobs the trainer does not have yet, prototyped here to measure whether they are worth a config
key (`bench.` entries of a variant or of --set; not config keys):

    bench.attn_dropout=P    dropout on the attention weights P instead of model.dropout (0: only
                            the embedding and residual branches drop; SDPA keeps its fast kernel)

(`bench.zero_init`, prototyped here first, is the trainer's `train.zero_init_residual` now.)

An average of the weights is the trainer's own key, `train.ema_decay`: the row then scores the
average (what the checkpoint saves) and also reports the raw weights' score; `--ema-probes`
keeps further averages beside a run, which change nothing in it.

--curve-every N evaluates the whole validation split every N steps too (outside the timed
steps), and --plot PNG draws val bits/byte against training seconds for every variant (matplotlib,
an optional dependency of this script only); `--plot PNG --records a.json,b.json` draws earlier
--json records without training.

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
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from minillm.checkpoint.store import load_checkpoint, load_trainer_state
from minillm.config import Config, load_config
from minillm.data.meta import load_meta
from minillm.data.tokenize_pass import write_shards
from minillm.errors import UserError
from minillm.infer.evaluate import evaluate_checkpoint
from minillm.train.ema import WeightEMA
from minillm.train.run import prepare_run
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


# The knobs prototyped here, with the values that leave training as it is.
BENCH_KNOBS: dict[str, float] = {"attn_dropout": -1.0}  # -1: model.dropout


def split_knobs(sets: list[str]) -> tuple[list[str], dict[str, float]]:
    """Config overrides on one side, `bench.` knobs (parsed to numbers) on the other."""
    knobs = dict(BENCH_KNOBS)
    rest = []
    for s in sets:
        key, _, value = s.partition("=")
        if not key.startswith("bench."):
            rest.append(s)
            continue
        name = key.removeprefix("bench.")
        if name not in knobs:
            raise SystemExit(f"{s}: unknown knob; known: {', '.join(BENCH_KNOBS)}")
        knobs[name] = float(value)
    return rest, knobs


def average_state(model: torch.nn.Module, ema: WeightEMA) -> dict[str, torch.Tensor]:
    """The model's state dict with the average in place of its parameters."""
    names = [name for name, _ in model.named_parameters()]
    return {**model.state_dict(), **dict(zip(names, ema.average, strict=True))}


def load_variant(
    config: Path, base_sets: list[str], base_knobs: dict[str, float], sets: list[str]
) -> tuple[Config, dict[str, float]]:
    """A variant's config and knobs: its own knobs over --set's, where it sets them."""
    sets, knobs = split_knobs(sets)
    own = {k: v for k, v in knobs.items() if v != BENCH_KNOBS[k]}
    return load_config(config, [*base_sets, *sets]), {**base_knobs, **own}


def apply_knobs(model: torch.nn.Module, knobs: dict[str, float]) -> None:
    """The prototyped knobs (those not given: as they leave training), on the model before its
    first step."""
    knobs = {**BENCH_KNOBS, **knobs}
    if knobs["attn_dropout"] >= 0:
        for block in model.blocks:
            block.attn.dropout = knobs["attn_dropout"]


def ensure_data(cfg: Config) -> None:
    """Tokenize as `minillm tokenize` would, unless the shards are already there."""
    try:
        load_meta(cfg.data.out_dir)
    except UserError:
        write_shards(cfg)


def run_variant(
    cfg: Config,
    out_dir: Path,
    knobs: dict[str, float] | None = None,
    curve_every: int = 0,
    ema_probes: tuple[float, ...] = (),
) -> dict[str, Any]:
    """Train `cfg` into out_dir from scratch; time it and evaluate its last checkpoint.

    curve_every: also evaluate the whole validation split every this many steps, outside the
    timed steps, into the row's "curve" (step, training seconds so far, val bits/byte).
    ema_probes: decays of extra weight averages kept beside the run (they change nothing in it)
    and evaluated at the end only, into the row's "ema_probes" {decay: val bits/byte}.
    """
    cfg = copy.deepcopy(cfg)
    tc = cfg.train
    tc.out_dir = str(out_dir)
    tc.eval_every, tc.ckpt_every = 0, 0  # one checkpoint, at the end
    tc.eval_steps = 1  # the trainer's own final evaluation: the real one is below
    tc.log_every = max(tc.log_every, tc.max_steps)
    trainer = Trainer(prepare_run(cfg, resume=False, force=True, verbose=False))
    tc = trainer.cfg.train  # the run's own config (prepare_run resolves it into a new one)
    apply_knobs(trainer.model, knobs or {})
    probes = [WeightEMA(trainer.model, d) for d in ema_probes]
    curve: list[dict[str, float]] = []
    load_before = os.getloadavg()[0]
    losses: list[float] = []
    step_s: list[float] = []
    optim_s: list[float] = []
    train_step, optim_step = trainer.train_step, trainer.optimizer.step

    def timed_train_step(micro: Any = None) -> Any:
        t0 = time.perf_counter()
        out = train_step(micro)
        for average in probes:
            average.update()
        losses.append(float(out.loss))  # a device tensor: reading it waits for the step
        step_s.append(time.perf_counter() - t0)
        if curve_every and len(losses) % curve_every == 0 and len(losses) < tc.max_steps:
            curve.append({"step": len(losses), "seconds": sum(step_s), "val_bpb": val_now()})
        return out

    def val_now() -> float:
        """The whole split, as `minillm eval` scores it (the average under train.ema_decay)."""
        eval_steps, tc.eval_steps = tc.eval_steps, 0
        try:
            return trainer.evaluate()["bits_per_byte"]
        finally:
            tc.eval_steps = eval_steps

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
    ckpt = load_checkpoint(out_dir, trainer.device)
    result = evaluate_checkpoint(ckpt)  # under train.ema_decay, the average
    raw_bpb = result["bits_per_byte"]
    if trainer.ema is not None:  # the raw weights, kept in the trainer state
        ckpt.model.load_state_dict(load_trainer_state(ckpt.path)["ema"]["weights"])
        raw_bpb = evaluate_checkpoint(ckpt)["bits_per_byte"]
    curve.append({"step": len(losses), "seconds": sum(step_s), "val_bpb": result["bits_per_byte"]})
    probe_bpb = {}
    for average in probes:
        ckpt.model.load_state_dict(average_state(ckpt.model, average))
        probe_bpb[str(average.decay)] = evaluate_checkpoint(ckpt)["bits_per_byte"]
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "val_bpb": result["bits_per_byte"],
        "raw_val_bpb": raw_bpb,
        "steps": len(losses),
        "tokens": trainer.state.tokens_seen,
        "params": trainer.model.param_count(),
        "load": (load_before + os.getloadavg()[0]) / 2,
        "curve": curve,
        "ema_probes": probe_bpb,
        "val_loss": result["loss"],
        "train_loss": sum(tail) / len(tail),
        "wall_s": wall,
        "tokens_per_s": trainer.state.tokens_seen / max(sum(step_s), 1e-9),
        "optim_share": sum(optim_s) / max(sum(step_s), 1e-9),
    }


def pace(
    cfgs: list[Config], rounds: int, root: Path, knobs: list[dict[str, float]] | None = None
) -> list[float]:
    """Median seconds of one training step per config (and its knobs), their steps alternated
    round-robin in this process so that a shared machine's load falls on all of them alike
    (ratios are what to read; the first rounds, warm-up, are dropped)."""
    trainers = []
    for i, cfg in enumerate(cfgs):
        cfg = copy.deepcopy(cfg)
        cfg.train.out_dir = str(root / f"pace{i}")
        trainers.append(Trainer(prepare_run(cfg, resume=False, force=True, verbose=False)))
        apply_knobs(trainers[-1].model, knobs[i] if knobs else {})
    times: list[list[float]] = [[] for _ in trainers]
    try:
        for _ in range(rounds + 2):
            for trainer, ts in zip(trainers, times, strict=True):
                t0 = time.perf_counter()
                float(trainer.train_step().loss)
                trainer.state.step += 1
                ts.append(time.perf_counter() - t0)
    finally:
        for trainer in trainers:
            trainer.close()
    return [sorted(ts[2:])[len(ts[2:]) // 2] for ts in times]


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


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Val bits/byte against training seconds, one line per record with a curve."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in records:
        pts = r.get("curve") or [{"seconds": r["wall_s"], "val_bpb": r["val_bpb"]}]
        xs, ys = [p["seconds"] for p in pts], [p["val_bpb"] for p in pts]
        ax.plot(xs, ys, marker="o", ms=3, label=f"{r['variant']}: {r['val_bpb']:.3f}")
    ax.set_xlabel("training seconds (as measured; see each record's load)")
    ax.set_ylabel("val bits/byte (whole split)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("config", nargs="?", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, help="train.max_steps of every variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated built-ins")
    p.add_argument("--variant", action="append", default=[], help="NAME:key=value,... (repeatable)")
    p.add_argument("--set", action="append", default=[], help="override for every variant")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", type=Path, help="also write the rows to this file")
    p.add_argument("--curve-every", type=int, default=0, help="also evaluate every N steps")
    p.add_argument("--pace", type=int, default=0, help="only time N alternated steps each")
    p.add_argument("--ema-probes", default="", help="comma-separated decays of extra averages")
    p.add_argument("--plot", type=Path, help="write a PNG of val bits/byte against seconds")
    p.add_argument("--records", default="", help="comma-separated --json files for --plot")
    args = p.parse_args(argv)
    if args.records:
        if not args.plot:
            raise SystemExit("--records: only with --plot")
        files = [Path(f) for f in args.records.split(",") if f]
        plot([r for f in files for r in json.loads(f.read_text())], args.plot)
        return
    if args.steps is None:
        raise SystemExit("--steps is required (unless --plot with --records)")
    if args.threads:
        torch.set_num_threads(args.threads)

    chosen = [(n, VARIANTS[n]) for n in args.variants.split(",") if n]
    chosen += [parse_variant(v) for v in args.variant]
    base_sets, base_knobs = split_knobs([*args.set, f"train.max_steps={args.steps}"])
    ensure_data(load_config(args.config, base_sets))
    if args.pace:
        variants = [load_variant(args.config, base_sets, base_knobs, s) for _, s in chosen]
        cfgs, knobs = [c for c, _ in variants], [k for _, k in variants]
        with tempfile.TemporaryDirectory(prefix="bench_pace_") as tmp:
            medians = pace(cfgs, args.pace, Path(tmp), knobs)
        for (name, _), m, cfg in zip(chosen, medians, cfgs, strict=True):
            tokens = cfg.train.batch_size * cfg.train.grad_accum * cfg.train.seq_len
            print(f"{name}: {m * 1000:.0f} ms/step ({m / medians[0]:.3f}x the first), "
                  f"{tokens / m:,.0f} tokens/s")  # fmt: skip
        return
    probes = tuple(float(d) for d in args.ema_probes.split(",") if d)
    rows: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="bench_quality_") as tmp:
        for name, sets in chosen:
            cfg, knobs = load_variant(args.config, base_sets, base_knobs, sets)
            row = run_variant(cfg, Path(tmp) / name, knobs, args.curve_every, probes)
            rows.append((name, row))
            r = rows[-1][1]
            print(f"{name}: val bits/byte {r['val_bpb']:.4f}, {r['wall_s']:.0f} s, "
                  f"load {r['load']:.1f}, EMA probes {r['ema_probes']}", flush=True)  # fmt: skip
    print(f"\n{args.config}, --set {' '.join(base_sets)}\n")
    print(format_table(rows, args.steps))
    records = [{"variant": n, **r} for n, r in rows]
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    if args.plot:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
