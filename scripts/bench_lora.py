"""Full fine-tuning against LoRA (`train.lora`): trainable parameters, peak memory of a training
step and tokens/s, in one process, as the README's LoRA table prints them.

    python scripts/bench_lora.py                          # medium (33.6M) and large (158M)
    python scripts/bench_lora.py --shapes medium --steps 3 --ranks 8

Each row runs minillm's own training step on the same weights and batch: the CPU kernels the
trainer uses (`use_cpu_kernels`), `add_lora`, `build_optimizer` (AdamW; with LoRA it holds the
adapters alone), forward + backward + clipping + step. Peak memory is what the step holds at its
highest: on CUDA the caching allocator's `max_memory_allocated`; on a CPU the weights, buffers
and optimizer state held between steps (gradients are None there) plus the highest running
total of what the step itself allocates, from torch.profiler's memory events (profile_memory;
frees inside the step are seen). It is allocator accounting, not the process's RSS. Rows are
timed in turns (one step of each row per round), so a machine's drift hits every row alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minillm.config import LoRAConfig, ModelConfig, TrainConfig  # noqa: E402
from minillm.model import Transformer, use_cpu_kernels  # noqa: E402
from minillm.model.lora import add_lora, trainable_frozen  # noqa: E402
from minillm.runtime.perf import step_peak_bytes  # noqa: E402
from minillm.train.optim import build_optimizer  # noqa: E402

MiB = 1024**2


@dataclasses.dataclass
class Shape:
    model: ModelConfig
    seq: int
    batch: int


SHAPES = {
    "tiny": Shape(ModelConfig(vocab_size=256, d_model=64, n_layer=2, n_head=4, max_seq_len=32),
                  seq=32, batch=2),  # the smoke test's
    # bench_sample's medium: 33.6M parameters, 8 query / 4 key-value heads, a 16,384 vocabulary.
    "medium": Shape(ModelConfig(vocab_size=16384, d_model=512, n_layer=8, n_head=8, n_kv_head=4,
                                max_seq_len=256), seq=256, batch=4),
    # 158M parameters: d 1024, 12 layers, 16 query / 8 key-value heads, SwiGLU 2816.
    "large": Shape(ModelConfig(vocab_size=16384, d_model=1024, n_layer=12, n_head=16, n_kv_head=8,
                               max_seq_len=256), seq=256, batch=2),
}  # fmt: skip


@dataclasses.dataclass
class Row:
    name: str
    rank: int  # 0 = full fine-tuning
    trainable: int
    frozen: int
    step: Callable[[], None]
    peak: int = 0
    times: list[float] = dataclasses.field(default_factory=list)


def build_row(shape: Shape, rank: int, device: torch.device, base: dict) -> Row:
    """One variant on the shape's base weights: full fine-tuning (rank 0) or LoRA at `rank`."""
    torch.manual_seed(0)
    model = use_cpu_kernels(Transformer(shape.model))
    model.load_state_dict(base)
    lora = LoRAConfig(rank=rank, alpha=16.0)
    if rank:
        add_lora(model, lora)
    model.to(device).train()
    cfg = TrainConfig(lr=1e-4, min_lr=1e-5, init_from="base" if rank else "", lora=lora)
    optimizer = build_optimizer(model, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, shape.model.vocab_size, (shape.batch, shape.seq + 1), generator=g)
    x, y = idx[:, :-1].to(device), idx[:, 1:].to(device)

    def step() -> None:
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # a sync, as a trainer's logging step

    trainable, frozen = trainable_frozen(model)
    name = f"LoRA rank {rank}" if rank else "full fine-tuning"
    row = Row(name, rank, trainable, frozen, step)
    row.step()  # warm-up: the optimizer's state exists from here on
    row.peak = step_peak_bytes(row.step, device, held_bytes(model, optimizer))
    return row


def held_bytes(model: torch.nn.Module, optimizer: object) -> int:
    """What a model holds between steps: parameters, buffers and the optimizer's state."""
    tensors = [*model.parameters(), *model.buffers()]
    for opt in optimizer:
        for state in opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def bench_shape(name: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    shape = SHAPES[name]
    torch.manual_seed(0)
    base = Transformer(shape.model).state_dict()
    rows = [build_row(shape, rank, device, base) for rank in [0, *args.ranks]]
    tokens = shape.batch * shape.seq
    for _ in range(args.steps):  # in turns: each round times one step of every row
        for row in rows:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            row.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            row.times.append(time.perf_counter() - t0)
    m = shape.model
    n = rows[0].trainable
    print(f"\n== {name}: vocab {m.vocab_size}, d {m.d_model}, {m.n_layer} layers, {m.n_head} "
          f"heads ({m.n_kv_head} kv), seq {shape.seq}, batch {shape.batch} | {n / 1e6:.1f}M "
          f"params | {device.type}, fp32, {torch.get_num_threads()} threads, median of "
          f"{args.steps} steps")  # fmt: skip
    print("| variant | trainable params | peak MiB | vs full | tokens/s | vs full |")
    print("|---|---:|---:|---:|---:|---:|")
    full = rows[0]
    out = []
    for row in rows:
        med = sorted(row.times)[len(row.times) // 2]
        full_med = sorted(full.times)[len(full.times) // 2]
        share = row.trainable / (row.trainable + row.frozen)
        out.append(
            dict(shape=name, variant=row.name, trainable=row.trainable, frozen=row.frozen,
                 peak_bytes=row.peak, tokens_per_s=tokens / med)
        )  # fmt: skip
        print(
            f"| {row.name} | {row.trainable:,} ({share:.2%}) | {row.peak / MiB:,.0f} | "
            f"{row.peak / full.peak:.0%} | {tokens / med:,.0f} | {full_med / med:.2f}x |"
        )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="medium,large", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--ranks", default="8,64", help="LoRA ranks, comma separated")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=2, help="torch threads on CPU (0 = leave)")
    args = p.parse_args(argv)
    args.ranks = [int(r) for r in args.ranks.split(",") if r]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = []
    for name in args.shapes.split(","):
        results += bench_shape(name, args, device)
    return results


if __name__ == "__main__":
    main()
