"""One-row decode steps on one thread against torch's threads, on published models' shapes: the
measurement behind minillm.runtime.device.ALL_THREADS_FROM (which layers step on every thread
under OMP_WAIT_POLICY=PASSIVE, minillm's default).

    python scripts/bench_step_threads.py                          # TinyLlama-1.1B, each kind
    python scripts/bench_step_threads.py --shapes llama3.2-3b --kinds bfloat16

Each kind loads the folder (scripts/bench_scale.py's random-weight bf16 folders, built once under
--cache) the way `minillm sample --dtype D [--quantize Q]` does: float32, bfloat16, int8 (float32
loaded, quantized per layer) or nf4 (bfloat16 base). After a 5-token prefill, --steps one-row
steps through the Decoder, on one thread and on torch's, alternating --repeats times in this
process; the table gives the median ms a token and the ratio torch's threads / one thread (below
1: the second core pays). Check /proc/loadavg first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import minillm  # noqa: F401  # isort: skip  (OMP_WAIT_POLICY=PASSIVE before torch loads)
import torch
from bench_scale import SHAPES, build_folder  # scripts/ is on sys.path when run as a script

from minillm.checkpoint.hf_import import hf_model_config, load_hf_model
from minillm.checkpoint.quantized_load import as_loaded, finish
from minillm.model.decode import Decoder
from minillm.model.kv_cache import KVCache

KINDS = {"float32": None, "bfloat16": None, "int8": "int8", "nf4": "nf4"}


def load(folder: Path, kind: str) -> tuple[torch.nn.Module, torch.dtype]:
    """The folder's model as `minillm sample --dtype/--quantize` would hold it."""
    quantize = KINDS[kind]
    dtype = torch.float32 if kind in ("float32", "int8") else torch.bfloat16
    cfg = hf_model_config(folder)
    hook, problem = as_loaded(quantize, cfg, "cpu") if quantize else (None, None)
    if problem is not None:
        raise SystemExit(f"{kind}: {problem}")
    model = load_hf_model(folder, cfg, dtype, "cpu", hook)
    if quantize and (problem := finish(model, quantize, cfg)) is not None:
        raise SystemExit(f"{kind}: {problem}")  # not an fp32 row labelled int8
    return model.eval(), dtype


def token_ms(model: torch.nn.Module, dtype: torch.dtype, threads: int, steps: int) -> float:
    """Median ms of a one-row step on `threads` threads, after a 5-token prefill."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = KVCache(model.cfg, max_len=steps + 8, dtype=dtype)
        cache.add_rows(1)
        decoder = Decoder(model, cache)
        with torch.inference_mode():
            token = decoder.prefill(0, torch.arange(1, 6)).argmax(-1).view(1)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                token = decoder.step(token).argmax(-1)
                times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tinyllama"], choices=sorted(SHAPES))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/minillm-bench-scale"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is not counted)")
    many = torch.get_num_threads()
    policy = os.environ.get("OMP_WAIT_POLICY")
    print(f"load {open('/proc/loadavg').read().split()[:3]}, {os.cpu_count()} CPUs, "
          f"torch's threads {many}, OMP_WAIT_POLICY={policy}")  # fmt: skip
    print("shape | kind | ms/token, 1 thread | ms/token, torch's threads | ratio")
    for shape in args.shapes:
        folder = build_folder(shape, args.cache)
        for kind in args.kinds:
            model, dtype = load(folder, kind)
            one, all_ = [], []
            for _ in range(args.repeats):
                one.append(token_ms(model, dtype, 1, args.steps))
                all_.append(token_ms(model, dtype, many, args.steps))
            a, b = statistics.median(one), statistics.median(all_)
            print(f"{shape} | {kind} | {a:.0f} | {b:.0f} | {b / a:.2f}x", flush=True)
            del model


if __name__ == "__main__":
    main()
