"""Published models at their real size (issue 60): minillm against transformers / peft, each job
a whole process of its own, its peak RSS (os.wait4's rusage of that child) and wall time.

    python scripts/bench_scale.py                     # TinyLlama-1.1B's and Llama-3.2-3B's shapes
    python scripts/bench_scale.py --shapes tinyllama  # one of them
    python scripts/bench_scale.py --quick             # a tiny shape: checks the script (a minute)
    python scripts/bench_scale.py --kernels           # NF4: bitsandbytes vs torchao's NF4Tensor

The folders are random-weight `LlamaForCausalLM`s built with transformers' classes in bf16,
saved in shards with a byte-level BPE (scripts/make_published_folder.py's), cached under
`--cache` (default /tmp/minillm-bench-scale) and reused. The jobs, side by side:

- sample: load + 8 greedy tokens (`minillm sample --ckpt DIR`) vs `from_pretrained` + `generate`.
- lora: rank 16 on every projection, batch 1 x 128 tokens, 3 steps (minillm's Trainer on the
  folder's `train.init_from`) vs peft on transformers' load; the step time is the mean of steps 2-3.
- qlora: the same with the base in NF4 (`train.lora.quantize: nf4`) vs peft on transformers'
  `BitsAndBytesConfig(load_in_4bit=True, nf4, double quantization)`.

Both sides compute in `--precision` (bf16 or fp32; transformers loads in that dtype). The table
gives each job's minillm / reference ratio of peak RSS, wall and step time. Check
/proc/loadavg before a run you report: the times are the machine's, under its load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (d_model, layers, ffn, heads, kv heads, vocab, tied): the published configs' shapes.
SHAPES = {
    "tinyllama": (2048, 22, 5632, 32, 4, 32000, False),  # TinyLlama-1.1B
    "llama3.2-3b": (3072, 28, 8192, 24, 8, 128256, True),  # Llama-3.2-3B
    "tiny": (128, 2, 256, 4, 2, 1024, False),  # --quick
}
STEPS, SEQ, RANK, NEW_TOKENS = 3, 128, 16, 8
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_folder(shape: str, cache: Path) -> Path:
    """The random-weight bf16 folder of `shape` (sharded), built once under `cache`."""
    folder = cache / shape
    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "scripts"))
    from make_published_folder import tokenizer_json

    d, n, ffn, heads, kv, vocab, tied = SHAPES[shape]
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=n,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
        tie_word_embeddings=tied, rope_theta=500000.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of a 3B model
    try:
        model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="1GB" if shape != "tiny" else "200KB")
    (tmp / "tokenizer.json").write_text(tokenizer_json("chatml", 1000, 20000), encoding="utf-8")
    tmp.rename(folder)
    return folder


def corpus(cache: Path) -> Path:
    path = cache / "corpus.txt"
    if not path.is_file():
        text = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:200_000]
        path.write_text(text, encoding="utf-8")
    return path


def lora_config(folder: Path, cache: Path, precision: str, quantize: str) -> Path:
    """A minillm LoRA (QLoRA) run's config on `folder`, its shards tokenized once."""
    import yaml

    tokens = cache / f"tokens-{folder.name}"
    raw = {
        "data": {"source": str(corpus(cache)), "out_dir": str(tokens)},
        "train": {
            "init_from": str(folder), "out_dir": str(cache / f"run-{folder.name}-{quantize}"),
            "batch_size": 1, "seq_len": SEQ, "max_steps": STEPS, "warmup_steps": 0,
            "device": "cpu", "precision": precision, "eval_every": 0, "ckpt_every": 0,
            "log_every": 1, "lora": {"rank": RANK, "alpha": 2 * RANK, "quantize": quantize},
        },
    }  # fmt: skip
    path = cache / f"lora-{folder.name}-{quantize}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    if not (tokens / "meta.json").is_file():
        subprocess.run([sys.executable, "-m", "minillm", "tokenize", str(path)], check=True,
                       cwd=ROOT, capture_output=True)  # fmt: skip
    return path


# ----------------------------------------------------------------------------- the jobs (children)


def job_minillm_train(config: str) -> dict:
    """minillm's Trainer on `config` (a fresh run): load, then STEPS timed steps."""
    import shutil

    from minillm.checkpoint.init_from import load_run_config
    from minillm.train.run import prepare_run
    from minillm.train.trainer import Trainer

    cfg = load_run_config(config, [])
    shutil.rmtree(cfg.train.out_dir, ignore_errors=True)
    start = time.perf_counter()
    trainer = Trainer(prepare_run(cfg, resume=False, verbose=False))
    load = time.perf_counter() - start
    steps = []
    for _ in range(STEPS):
        t = time.perf_counter()
        out = trainer.train_step()
        float(out.loss)
        trainer.count_step(out)
        steps.append(time.perf_counter() - t)
    trainer.close()
    return {"load_s": load, "steps_s": steps}


def job_peft_train(folder: str, precision: str, quantize: str) -> dict:
    """peft's LoRA (on bitsandbytes' NF4 base with quantize nf4) on transformers' load."""
    import peft
    import torch
    import transformers

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    kw: dict = {"dtype": dtype}
    if quantize == "nf4":
        kw["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )  # fmt: skip
        kw["device_map"] = "cpu"
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kw)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK,
                                                      target_modules=PEFT_TARGETS))  # fmt: skip
    load = time.perf_counter() - start
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(STEPS):
        ids = torch.randint(0, 1000, (1, SEQ), generator=gen)
        t = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
        steps.append(time.perf_counter() - t)
    return {"load_s": load, "steps_s": steps}


def job_hf_sample(folder: str, precision: str) -> dict:
    """transformers' from_pretrained + 8 greedy tokens."""
    import torch
    import transformers

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    ids = torch.tensor([[1, 300, 301, 302, 303]])
    model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return {}


def child(args: argparse.Namespace) -> None:
    if args.job == "minillm-train":
        result = job_minillm_train(args.config)
    elif args.job == "peft-train":
        result = job_peft_train(args.folder, args.precision, args.quantize)
    else:
        result = job_hf_sample(args.folder, args.precision)
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- the parent


def run_child(cmd: list[str]) -> dict:
    """Run `cmd` as a child: its own peak RSS (GB: os.wait4's rusage of that child, not of every
    child so far as RUSAGE_CHILDREN would give) and wall, plus what it printed after RESULT."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
    result = {"wall_s": wall, "rss_gb": usage.ru_maxrss / 1e6}  # Linux: ru_maxrss in KB
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT ") :]))
    return result


def jobs(shape: str, cache: Path, precision: str) -> list[tuple[str, dict, dict]]:
    """(job, minillm's numbers, the reference's) for one shape."""
    folder = build_folder(shape, cache)
    me = [sys.executable, str(Path(__file__).resolve()), "--child"]
    sample = [sys.executable, "-m", "minillm", "sample", "--ckpt", str(folder), "--prompt",
              "Hello there", "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0",
              "--ignore-eos", "--device", "cpu",
              "--dtype", "bfloat16" if precision == "bf16" else "float32"]  # fmt: skip
    rows = [
        (
            "sample",
            run_child(sample),
            run_child([*me, "hf-sample", "--folder", str(folder), "--precision", precision]),
        )
    ]
    for quantize in ("none", "nf4"):
        config = lora_config(folder, cache, precision, quantize)
        ours = run_child([*me, "minillm-train", "--config", str(config)])
        theirs = run_child([*me, "peft-train", "--folder", str(folder), "--precision",
                            precision, "--quantize", quantize])  # fmt: skip
        rows.append(("lora" if quantize == "none" else "qlora", ours, theirs))
    return rows


def step_s(r: dict) -> float | None:
    steps = r.get("steps_s")
    return None if not steps else sum(steps[1:]) / max(len(steps) - 1, 1)


def table(shape: str, rows: list[tuple[str, dict, dict]]) -> str:
    lines = [f"{shape}: job | peak RSS GB minillm / ref (x) | wall s minillm / ref (x) | "
             "step s minillm / ref (x)"]  # fmt: skip
    for job, ours, ref in rows:
        cells = []
        for get in (lambda r: r["rss_gb"], lambda r: r["wall_s"], step_s):
            a, b = get(ours), get(ref)
            cells.append("-" if a is None or b is None else f"{a:.2f} / {b:.2f} ({a / b:.2f}x)")
        lines.append(f"  {job:6s} | " + " | ".join(cells))
    lora = {job: ours["rss_gb"] for job, ours, _ in rows}
    if "lora" in lora and "qlora" in lora:
        lines.append(f"  QLoRA peak / LoRA peak (minillm): {lora['qlora'] / lora['lora']:.2f}x")
    return "\n".join(lines)


def kernels() -> None:
    """NF4 of one 5632 x 2048 layer (TinyLlama's FFN): dequantize, and a fp32 forward + backward
    of 128 tokens, bitsandbytes against torchao's NF4Tensor (why minillm.model.nf4 chose one)."""
    import torch
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import to_nf4  # older torchao
        except ImportError:
            raise SystemExit("--kernels compares against torchao: pip install torchao") from None
    torch.manual_seed(0)
    w = torch.randn(5632, 2048) * 0.02
    x = torch.randn(128, 2048, requires_grad=True)
    q, state = quantize_4bit(w.to(torch.bfloat16), quant_type="nf4", compress_statistics=True)
    t = to_nf4(w.to(torch.bfloat16))

    def bench(fn, n: int = 5) -> float:  # noqa: ANN001
        fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e3

    def step(dequant) -> float:  # noqa: ANN001
        def go() -> None:
            y = x @ dequant().float().t()
            y.sum().backward()
            x.grad = None

        return bench(go)

    print(f"load {open('/proc/loadavg').read().split()[:3]}")
    print(f"bitsandbytes: dequantize {bench(lambda: dequantize_4bit(q, state)):.1f} ms, "
          f"fwd+bwd {step(lambda: dequantize_4bit(q, state)):.1f} ms")  # fmt: skip
    print(f"torchao:      dequantize {bench(t.get_original_weight):.1f} ms, "
          f"fwd+bwd {step(t.get_original_weight):.1f} ms")  # fmt: skip
    print(f"fp32 linear:  fwd+bwd {step(lambda: w):.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tinyllama", "llama3.2-3b"],
                        choices=sorted(SHAPES))  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="the tiny shape only")
    parser.add_argument("--kernels", action="store_true", help="NF4 libraries, one layer")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/minillm-bench-scale"))
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--child", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--quantize", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.job = args.child
        return child(args)
    if args.kernels:
        return kernels()
    args.cache.mkdir(parents=True, exist_ok=True)
    print(f"load {open('/proc/loadavg').read().split()[:3]}, {os.cpu_count()} CPUs, "
          f"precision {args.precision}")  # fmt: skip
    for shape in ["tiny"] if args.quick else args.shapes:
        print(table(shape, jobs(shape, args.cache, args.precision)), flush=True)


if __name__ == "__main__":
    main()
