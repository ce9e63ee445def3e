"""What `--quantize int8` costs in quality: fp32 against int8 on one checkpoint, and both against
llama.cpp's q8_0 of the same weights.

Prints held-out bits per byte (the run's validation shards, or --data), the accuracy of --task
files (`minillm eval --task`'s scoring), and greedy agreement: over --prompts prompts (--prompt-
tokens tokens each, from the validation text at evenly spaced places), the share whose first
--new-tokens greedy tokens equal fp32's, for minillm int8 and for llama.cpp on `minillm export
--format gguf --dtype q8_0` (llama-cpp-python, when it imports), and between those two. Every
number comes from the same loaded weights in this process.

    python scripts/bench_int8_quality.py --ckpt runs/tiny --task data/shakespeare_next_line.jsonl
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import tempfile
from pathlib import Path

import torch

from minillm.checkpoint.store import load_checkpoint
from minillm.infer.engine import SamplingParams, generate
from minillm.infer.evaluate import evaluate_checkpoint
from minillm.infer.task_format import read_tasks
from minillm.infer.task_scoring import evaluate_tasks
from minillm.model.quantize import quantize_int8
from minillm.tokenizer.bpe import eot_id


def agreement(a: list[list[int]], b: list[list[int]], n: int) -> float:
    return sum(x[:n] == y[:n] for x, y in zip(a, b)) / len(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default="runs/tiny")
    ap.add_argument("--data", help="held-out text instead of the run's validation shards")
    ap.add_argument("--task", action="append", default=[], help="a task file (repeatable)")
    ap.add_argument("--text", default="data/tinyshakespeare.txt", help="the prompts' source")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()

    fp32 = load_checkpoint(args.ckpt)
    int8 = copy.copy(fp32)
    int8.model = copy.deepcopy(fp32.model)
    problem = quantize_int8(int8.model)
    if problem is not None:
        raise SystemExit(f"error: {problem}")
    report: dict = {"ckpt": args.ckpt}
    tasks = read_tasks(args.task) if args.task else []
    for label, loaded in (("fp32", fp32), ("int8", int8)):
        ev = evaluate_checkpoint(loaded, data=args.data)
        report[label] = {"bits_per_byte": ev["bits_per_byte"], "loss": ev["loss"]}
        if tasks:
            report[label]["tasks"] = evaluate_tasks(loaded, tasks)

    # Prompts: --prompt-tokens ids at evenly spaced places of the last tenth of --text (the
    # demo's validation split is its end), each after end-of-text as `minillm sample` puts it.
    tok = fp32.tokenizer
    ids = tok.encode(Path(args.text).read_text(encoding="utf-8")).ids
    held = ids[len(ids) * 9 // 10 :]
    stride = max(1, (len(held) - args.prompt_tokens) // args.prompts)
    eot = eot_id(tok)
    prompts = [
        [eot, *held[i : i + args.prompt_tokens]] for i in range(0, stride * args.prompts, stride)
    ]
    params = SamplingParams.greedy(args.new_tokens)
    greedy = {
        label: generate(m.model, prompts, params, tokenizer=tok)
        for label, m in (("fp32", fp32), ("int8", int8))
    }
    if args.llama_cpp:
        from llama_cpp import Llama

        from minillm.checkpoint.gguf_file import export_gguf

        with tempfile.TemporaryDirectory() as tmp:
            path = export_gguf(fp32, Path(tmp) / "model.gguf", "q8_0", force=True)
            ctx = fp32.config.model.max_seq_len
            llm = Llama(model_path=str(path), n_ctx=ctx, type_k=0, type_v=0, verbose=False)
            rows = []
            for p in prompts:
                llm.reset()
                rows.append(list(itertools.islice(llm.generate(p, temp=0.0), args.new_tokens)))
            greedy["llama.cpp q8_0"] = rows
            llm.close()
    n = args.new_tokens
    report["greedy"] = {
        "prompts": len(prompts),
        "new_tokens": n,
        **{
            f"{a} = {b}": agreement(greedy[a], greedy[b], n)
            for a, b in itertools.combinations(greedy, 2)
        },
    }
    print(json.dumps(report, indent=1))
    fb, ib = report["fp32"]["bits_per_byte"], report["int8"]["bits_per_byte"]
    print(f"\nbits/byte fp32 {fb:.5f}, int8 {ib:.5f} ({(ib / fb - 1) * 100:+.3f}%)")
    for name in report["fp32"].get("tasks", {}):
        f, q = report["fp32"]["tasks"][name], report["int8"]["tasks"][name]
        key = "accuracy" if "accuracy" in f else "exact_match"
        print(f"{name}: {key} fp32 {f[key]:.4f}, int8 {q[key]:.4f} ({f['examples']} examples)")
    for pair, share in report["greedy"].items():
        if "=" in pair:
            print(f"greedy {n} tokens equal, {pair}: {share:.0%} of {len(prompts)} prompts")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
