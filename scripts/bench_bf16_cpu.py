"""A bf16 LoRA (or QLoRA) step on a CPU without a fast bf16 matmul: torch's bf16 products against
minillm's fp32 ones (minillm.model.bf16_cpu), and an fp32 run's step, in one process.

    python scripts/bench_bf16_cpu.py                         # d 1024, 4 layers, 1 x 128 tokens
    python scripts/bench_bf16_cpu.py --nf4 --threads 1       # QLoRA's base, one thread
    python scripts/bench_bf16_cpu.py --torch-rounds 0        # skip torch's bf16 (minutes a step)

Each row is the trainer's model (`use_cpu_kernels`, the base in bf16 or fp32, adapters of rank 16
on every projection) stepping forward + backward under bf16 autocast (the fp32 row without);
`bf16_cpu.bf16_slow` is forced to pick the branch. Rows run in turns, so the machine's drift hits
each alike; the first round is a warm-up, the best of the others is printed. Check /proc/loadavg.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minillm.config import LoRAConfig, ModelConfig  # noqa: E402
from minillm.model import Transformer, bf16_cpu, use_cpu_kernels  # noqa: E402
from minillm.model.lora import add_lora  # noqa: E402
from minillm.runtime.device import cpu_bf16_slowdown  # noqa: E402

ROWS = {  # row: (base dtype, fp32 products?)
    "bf16, fp32 products (minillm)": (torch.bfloat16, True),
    "fp32 run": (torch.float32, False),
    "bf16, torch's bf16 products": (torch.bfloat16, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--torch-rounds", type=int, default=2, help="rounds of torch's bf16 row")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--nf4", action="store_true", help="QLoRA: the base's layers in NF4")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    d = args.d_model
    cfg = ModelConfig(vocab_size=args.vocab, d_model=d, n_layer=args.layers, n_head=d // 64,
                      n_kv_head=d // 128, max_seq_len=args.seq)  # fmt: skip
    print(f"load {open('/proc/loadavg').read().split()[:3]}, {torch.get_num_threads()} threads, "
          f"probe: torch's bf16 matmul {cpu_bf16_slowdown():.0f}x fp32's")  # fmt: skip

    models = {}
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        model = add_lora(use_cpu_kernels(Transformer(cfg)).to(dtype), LoRAConfig(rank=16))
        if args.nf4:
            from minillm.model.nf4 import quantize_nf4

            quantize_nf4(model)
        models[dtype] = model.train()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, args.vocab, (1, args.seq + 1), generator=gen)

    def step(row: str) -> float:
        dtype, fp32_products = ROWS[row]
        bf16_cpu.bf16_slow = lambda: fp32_products
        model = models[dtype]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for r in range(args.rounds):
        for row in ROWS:
            if row.endswith("torch's bf16 products") and r >= args.torch_rounds:
                continue
            times[row].append(step(row))
            print(f"round {r} {row}: {times[row][-1]:.2f} s", flush=True)
    best = {row: min(t[1:] or t) for row, t in times.items() if t}
    for row, s in best.items():
        print(f"{row:32s} {s:8.2f} s a step")
    ours, fp32 = best["bf16, fp32 products (minillm)"], best["fp32 run"]
    print(f"fp32 products / fp32 run: {ours / fp32:.2f}x")
    slow = best.get("bf16, torch's bf16 products")
    if slow is not None:
        print(f"torch's bf16 / fp32 products: {slow / ours:.1f}x")
    print(f"load {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
