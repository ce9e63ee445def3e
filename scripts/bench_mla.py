"""GQA against MLA against MLA + DeepSeekMoE at equal wall time on the demo's data (issue 51).

Three variants of configs/tiny.yaml (the demo), each within 1% of its 2.5M parameters:

    gqa       the demo as it is: 4 query heads of 64, 2 key/value heads
    mla       model.attention mla: 4 heads, kv_lora_rank 96, qk_nope 32 + qk_rope 32, v 64, no
              query bottleneck (V2-Lite's q_lora_rank null)
    mla-moe   mla with a DeepSeekMoE FFN: 8 experts of 40, 2 per token, a shared expert of 64,
              the sigmoid router and train.moe_bias_update 1e-3 (equal total parameters; the
              active ones are 0.71x)

First their training steps are timed alternately in this process (bench_quality.pace), so that
each gets the steps that fill --seconds of training at its own pace; then each trains from
scratch for those steps (its schedule, warm-up and decay fitted to them, as the demo's are to
its 1,990), its checkpoint is scored on the whole validation split (`minillm eval`'s own
function: val bits/byte), and decoded greedily through the decoding core (`generate`): 1 stream
and 8 streams of 16-token prompts and --new-tokens tokens, the median of --repeats alternated
runs, tokens/s counting every row's new tokens. KV-cache bytes per token is the cache's own
storage for one row of max_seq_len tokens (fp32) over those tokens, every layer included. Read
the variants' relative training speed from "ms a step, alternated" (the pacing): train tokens/s
is each run's own, one after another, so a change of the machine's load between runs shows there.

    python scripts/bench_mla.py --seconds 240 --threads 1 --new-tokens 64   # README's table
    python scripts/bench_mla.py --seconds 20 --variants gqa,mla  # a quick look

Prints a markdown table. Timings on a shared machine drift: the load average is printed; the
pace step alternates the variants so the split of time between them is fair at the load of the
moment. Not a test: the README quotes one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from bench_quality import ensure_data, pace, run_variant  # scripts/ is on sys.path
from bench_sample import alternate

from minillm.checkpoint.store import load_checkpoint
from minillm.config import ModelConfig, load_config
from minillm.infer.engine import SamplingParams, generate
from minillm.model import KVCache

MLA = [
    "model.attention=mla",
    "model.n_kv_head=null",
    "model.kv_lora_rank=96",
    "model.qk_nope_head_dim=32",
    "model.qk_rope_head_dim=32",
    "model.v_head_dim=64",
]
VARIANTS: dict[str, list[str]] = {
    "gqa": [],
    "mla": MLA,
    "mla-moe": [
        *MLA,
        "model.n_experts=8",
        "model.n_experts_per_token=2",
        "model.moe_ffn_hidden=40",
        "model.moe_shared_ffn_hidden=64",
        "model.moe_router=sigmoid",
        "train.moe_bias_update=1e-3",
    ],
}


def cache_bytes_per_token(cfg: ModelConfig) -> float:
    """The KV cache's storage for one row of max_seq_len tokens, per token (fp32)."""
    cache = KVCache(cfg, 1)
    cache.reserve(1, cfg.max_seq_len)
    return cache.nbytes() / cfg.max_seq_len


def decode_speed(model: torch.nn.Module, vocab: int, new: int, repeats: int) -> dict[str, float]:
    """Greedy tokens/s of the decoding core at 1 and 8 streams (median of alternated runs)."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, vocab, (16,), generator=gen).tolist() for _ in range(8)]
    sides = {
        "1": lambda: generate(model, prompts[:1], SamplingParams.greedy(new)),
        "8": lambda: generate(model, prompts, SamplingParams.greedy(new)),
    }
    for fn in sides.values():
        fn()  # warm-up
    wall = alternate(sides, repeats)
    return {k: int(k) * new / statistics.median(v) for k, v in wall.items()}


def format_table(rows: list[tuple[str, dict[str, Any]]], seconds: float) -> str:
    head = (
        f"| variant ({seconds:g} s of training each) | params (active) | ms a step, alternated "
        "| steps | val bits/byte | train tokens/s | KV cache bytes/token "
        "| decode tokens/s, 1 stream | 8 streams |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {name} | {r['params'] / 1e6:.2f}M ({r['params_active'] / 1e6:.2f}M) "
        f"| {r['pace_ms']:.0f} | {r['steps']} "
        f"| {r['val_bpb']:.4f} | {r['tokens_per_s']:,.0f} | {r['cache_bytes']:,.0f} "
        f"| {r['decode']['1']:,.0f} | {r['decode']['8']:,.0f} |"
        for name, r in rows
    ]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("config", nargs="?", default="configs/tiny.yaml")
    p.add_argument("--seconds", type=float, default=180.0, help="training time of each variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, in order")
    p.add_argument("--set", action="append", default=[], help="override for every variant")
    p.add_argument("--pace-steps", type=int, default=20, help="alternated steps timed each")
    p.add_argument("--new-tokens", type=int, default=128, help="decoded tokens per stream")
    p.add_argument("--repeats", type=int, default=3, help="alternated decode runs per side")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", type=Path, help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    cfgs = [load_config(args.config, [*args.set, *VARIANTS[n]]) for n in names]
    ensure_data(cfgs[0])
    threads = torch.get_num_threads()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {threads} threads")
    rows: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="bench_mla_") as tmp:
        step_s = pace(cfgs, args.pace_steps, Path(tmp))
        for name, cfg, s in zip(names, cfgs, step_s, strict=True):
            cfg.train.max_steps = max(1, round(args.seconds / s))
            cfg.train.warmup_steps = min(cfg.train.warmup_steps, cfg.train.max_steps // 10)
            print(f"{name}: {s * 1e3:.0f} ms a step -> {cfg.train.max_steps} steps", flush=True)
        for name, cfg, s in zip(names, cfgs, step_s, strict=True):
            row = run_variant(cfg, Path(tmp) / name)
            row["pace_ms"] = s * 1e3
            model = load_checkpoint(Path(tmp) / name).model.eval()
            row["params_active"] = model.active_param_count()
            row["cache_bytes"] = cache_bytes_per_token(cfg.model)
            row["decode"] = decode_speed(model, cfg.model.vocab_size, args.new_tokens, args.repeats)
            rows.append((name, row))
            print(f"{name}: val bits/byte {row['val_bpb']:.4f}, {row['wall_s']:.0f} s", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}\n")
    print(format_table(rows, args.seconds))
    if args.json:
        args.json.write_text(json.dumps([{"variant": n, **r} for n, r in rows], indent=1))


if __name__ == "__main__":
    main()
