"""GRPO rollout speed: the decoding core (what `train.objective: grpo` samples with) against
Hugging Face `generate` on the same model exported with `minillm export --format hf`.

The same rollouts both ways, in one process, alternated: --prompts prompts of a task file, each
sampled --group times at temperature 1 (do_sample, num_return_sequences=group for HF), up to
--max-new-tokens, stopping at <|end|>. Ours submits every prompt's group to one Engine, as a GRPO
step does (one prefill per prompt, the rows in one KV-cached batch); HF gets the prompts as one
batch (the demo's prompts all have the same length: no padding). Rollout tokens count each
reply's tokens up to and including its stop token (HF keeps stepping a batch's finished rows;
those steps are not counted). The median of --repeats runs of each, wall-clock and process CPU
seconds (the CPU-time ratio suffers less from other processes on a shared machine).

    python scripts/bench_rollouts.py --ckpt runs/rl-sft --task data/rl_sort_prompts.jsonl
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from minillm.checkpoint.store import load_checkpoint
from minillm.infer.engine import Engine, SamplingParams
from minillm.infer.task_format import read_task
from minillm.tokenizer.bpe import eot_id


def ours(model, tok, prompts, group, max_new, stops, seed) -> int:
    engine = Engine(model, tok)
    rows = []
    for j, p in enumerate(prompts):
        params = SamplingParams(max_new, 1.0, 0, 1.0, seed=seed + j, stop_ids=stops)
        rows += engine.submit([p], params, n=group)
    engine.run()
    return sum(len(r.tokens) for r in rows)


def theirs(hf, prompts, group, max_new, stops, pad) -> int:
    width = max(len(p) for p in prompts)  # left-padded, masked: generate's batched prompts
    idx = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(idx, attention_mask=mask, do_sample=True,
                          temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                          num_return_sequences=group, eos_token_id=sorted(stops),
                          pad_token_id=pad)  # fmt: skip
    n = 0
    for row in out[:, idx.shape[1] :].tolist():
        for t in row:
            n += 1
            if t in stops:
                break
    return n


def timed(fn) -> tuple[float, float, int]:
    w, c = time.perf_counter(), time.process_time()
    n = fn()
    return time.perf_counter() - w, time.process_time() - c, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", type=Path, default=Path("runs/rl-sft"))
    parser.add_argument("--task", type=Path, default=Path("data/rl_sort_prompts.jsonl"))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (batch_size)")
    parser.add_argument("--group", type=int, default=8, help="replies per prompt (group_size)")
    parser.add_argument("--max-new-tokens", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    ckpt = load_checkpoint(args.ckpt, "cpu")
    model, tok = ckpt.model.eval(), ckpt.tokenizer
    conv = ckpt.conventions
    stops = conv.stop_ids
    task = read_task(args.task)
    prompts = [conv.chat_prompt(ex.messages) for ex in task.examples]
    prompts = prompts[: args.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf"
        subprocess.run([Path(sys.executable).parent / "minillm", "export", "--ckpt",
                        str(args.ckpt), "--format", "hf", "--out", str(out)],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf.eval()
    G, M = args.group, args.max_new_tokens
    runs = {"minillm decoding core": [], "HF generate": []}
    for r in range(args.repeats + 1):  # the first of each: warm-up, not counted
        a = timed(lambda r=r: ours(model, tok, prompts, G, M, stops, 1000 * r))
        b = timed(lambda: theirs(hf, prompts, G, M, stops, eot_id(tok)))
        if r:
            runs["minillm decoding core"].append(a)
            runs["HF generate"].append(b)
    threads = os.environ.get("OMP_NUM_THREADS", f"{torch.get_num_threads()} (torch default)")
    print(f"{len(prompts)} prompts x {G} replies, <= {M} new tokens, temperature 1; "
          f"{args.repeats} runs each, medians; OMP_NUM_THREADS={threads}; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| rollouts through | tokens per step | wall s | tokens/s | CPU s | tokens per CPU s |")
    print("|---|---|---|---|---|---|")
    med = {}
    for name, rs in runs.items():
        wall = statistics.median(x[0] for x in rs)
        cpu = statistics.median(x[1] for x in rs)
        n = statistics.median(x[2] for x in rs)
        med[name] = (n / wall, n / cpu)
        print(f"| {name} | {n:.0f} | {wall:.3f} | {n / wall:.0f} | {cpu:.3f} | {n / cpu:.0f} |")
    a, b = med["minillm decoding core"], med["HF generate"]
    print(f"ratio (ours / HF): {a[0] / b[0]:.1f}x tokens/s, {a[1] / b[1]:.1f}x tokens per CPU s")


if __name__ == "__main__":
    main()
