"""One NF4 layer of TinyLlama's FFN shape (5632 x 2048), fp32, 128 tokens: forward + backward
with the weight dequantized into a fresh tensor each time (minillm before the scratch buffer)
against NF4Linear's scratch buffer (minillm.model.nf4.NF4Linear.scratch_weight), alternated in
one process, under glibc's 1 MB mmap threshold as a QLoRA run sets it.

    PYTHONPATH=. python scripts/bench_nf4_layer.py          # the QLoRA run's malloc setting
    PYTHONPATH=. python scripts/bench_nf4_layer.py --no-mmap-threshold   # glibc's default

Prints the median ms of each and the ratio, with /proc/loadavg.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from minillm.checkpoint.lazy import map_large_blocks
from minillm.model.nf4 import NF4Linear


class _Fresh(torch.autograd.Function):
    """The layer's product as before the scratch buffer: dequantized() in the forward and again
    in the backward, each a tensor of its own."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: NF4Linear) -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.dequantized(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad @ ctx.layer.dequantized(grad.dtype), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-mmap-threshold", action="store_true", help="glibc's default")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not args.no_mmap_threshold:
        map_large_blocks()
    torch.manual_seed(0)
    layer = NF4Linear(torch.randn(5632, 2048) * 0.02)
    x = torch.randn(128, 2048, requires_grad=True)

    def step(fn: Any) -> float:
        start = time.perf_counter()
        fn(x).sum().backward()
        x.grad = None
        return (time.perf_counter() - start) * 1e3

    fresh, scratch = (lambda t: _Fresh.apply(t, layer)), layer
    step(fresh), step(scratch)  # warm-up
    times: dict[str, list[float]] = {"fresh": [], "scratch": []}
    for _ in range(args.rounds):
        times["fresh"].append(step(fresh))
        times["scratch"].append(step(scratch))
    a, b = (statistics.median(times[k]) for k in ("fresh", "scratch"))
    print(f"load {open('/proc/loadavg').read().split()[:3]}, mmap threshold "
          f"{'glibc default' if args.no_mmap_threshold else '1 MB'}")  # fmt: skip
    print(f"fwd+bwd 128 x 2048 -> 5632, fp32: fresh {a:.1f} ms, scratch {b:.1f} ms ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
