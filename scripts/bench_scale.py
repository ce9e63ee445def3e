"""Published models at their real size (issue 60): minillm against transformers / peft, each job
a whole process of its own, its peak RSS (os.wait4's rusage of that child) and wall time.

    python scripts/bench_scale.py                     # TinyLlama-1.1B's and Llama-3.2-3B's shapes
    python scripts/bench_scale.py --shapes tinyllama  # one of them
    python scripts/bench_scale.py --quick             # a tiny shape: checks the script (a minute)
    python scripts/bench_scale.py --kernels           # NF4: bitsandbytes vs torchao's NF4Tensor
    python scripts/bench_scale.py --shapes mid --jobs sample lora qlora full --info --no-reference
                                                      # `minillm info`'s estimate beside each peak

The folders are random-weight `LlamaForCausalLM`s built with transformers' classes in bf16,
saved in shards with a byte-level BPE (scripts/make_published_folder.py's), cached under
`--cache` (default /tmp/minillm-bench-scale) and reused. The jobs, side by side:

- sample: load + 8 greedy tokens (`minillm sample --ckpt DIR`) vs `from_pretrained` + `generate`.
- lora: rank 16 on every projection, batch 1 x 128 tokens, 3 steps (minillm's Trainer on the
  folder's `train.init_from`) vs peft on transformers' load; the step time is the mean of steps 2-3.
- qlora: the same with the base in NF4 (`train.lora.quantize: nf4`) vs peft on transformers'
  `BitsAndBytesConfig(load_in_4bit=True, nf4, double quantization)`.
- full (`--jobs ... full`): a full fine-tune, AdamW on every parameter, vs transformers' model
  and torch's AdamW.

`--jobs` picks the jobs (default sample, lora, qlora), `--no-reference` skips the reference side,
`--seq` sets the training jobs' tokens (default 128) and `--prompt-tokens N` gives `sample` a
prompt of about N tokens (default: "Hello there"), to size the prefill. `--info` adds `minillm
info`'s estimate of each job (its `fits` total for that job, dtype and context) and the ratio
measured / estimate: the check of issue 60's "within 15%" (peak RSS in GB of 10^9 bytes).

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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# (d_model, layers, ffn, heads, kv heads, vocab, tied): the published configs' shapes.
SHAPES = {
    "tinyllama": (2048, 22, 5632, 32, 4, 32000, False),  # TinyLlama-1.1B
    "llama3.2-3b": (3072, 28, 8192, 24, 8, 128256, True),  # Llama-3.2-3B
    "mid": (1024, 20, 2816, 16, 4, 32000, False),  # 290M: every job incl. full FT under ~6 GB
    "tiny": (128, 2, 256, 4, 2, 1024, False),  # --quick
}
STEPS, SEQ, RANK, NEW_TOKENS = 3, 128, 16, 8
JOBS = ["sample", "lora", "qlora", "full"]
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


def lora_config(folder: Path, cache: Path, precision: str, quantize: str, seq: int = SEQ) -> Path:
    """A minillm LoRA (QLoRA; quantize "full": a full fine-tune) run's config on `folder`, its
    shards tokenized once."""
    import yaml

    tokens = cache / f"tokens-{folder.name}"
    raw = {
        "data": {"source": str(corpus(cache)), "out_dir": str(tokens)},
        "train": {
            "init_from": str(folder), "out_dir": str(cache / f"run-{folder.name}-{quantize}"),
            "batch_size": 1, "seq_len": seq, "max_steps": STEPS, "warmup_steps": 0,
            "device": "cpu", "precision": precision, "eval_every": 0, "ckpt_every": 0,
            "log_every": 1, "lora": {"rank": RANK, "alpha": 2 * RANK, "quantize": quantize},
        },
    }  # fmt: skip
    if quantize == "full":
        raw["train"]["lora"] = {"rank": 0}
    path = cache / f"lora-{folder.name}-{quantize}-{seq}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    if not (tokens / "meta.json").is_file():
        subprocess.run([sys.executable, "-m", "minillm", "tokenize", str(path)], check=True,
                       cwd=ROOT, capture_output=True)  # fmt: skip
    return path


# ----------------------------------------------------------------------------- the jobs (children)


def minillm_trainer(config: str, sets: list[str] | None = None) -> Any:
    """minillm's Trainer on `config` (with --set `sets`), a fresh run of it."""
    import shutil

    from minillm.checkpoint.init_from import load_run_config
    from minillm.train.run import prepare_run
    from minillm.train.trainer import Trainer

    cfg = load_run_config(config, sets or [])
    shutil.rmtree(cfg.train.out_dir, ignore_errors=True)
    return Trainer(prepare_run(cfg, resume=False, verbose=False))


def minillm_step(trainer: Any) -> None:
    """One training step of `trainer`, its loss read (the step finished)."""
    out = trainer.train_step()
    float(out.loss)
    trainer.count_step(out)


def job_minillm_train(config: str) -> dict:
    """minillm's Trainer on `config` (a fresh run): load, then STEPS timed steps."""
    start = time.perf_counter()
    trainer = minillm_trainer(config)
    load = time.perf_counter() - start
    steps = []
    for _ in range(STEPS):
        t = time.perf_counter()
        minillm_step(trainer)
        steps.append(time.perf_counter() - t)
    trainer.close()
    return {"load_s": load, "steps_s": steps}


def peft_model(folder: str, precision: str, quantize: str) -> tuple[Any, Any]:
    """peft's LoRA (on bitsandbytes' NF4 base with quantize nf4) on transformers' load, with
    quantize "full" transformers' model itself, every parameter trained; and its AdamW."""
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
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kw)
    if quantize != "full":
        model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK,
                                                          target_modules=PEFT_TARGETS))  # fmt: skip
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def peft_step(model: Any, opt: Any, ids: Any) -> None:
    """One training step of `model` on the batch `ids` (its own labels), its loss read."""
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    float(loss.detach())


def job_peft_train(folder: str, precision: str, quantize: str, seq: int = SEQ) -> dict:
    """peft_model's STEPS steps after its load, timed."""
    import torch

    start = time.perf_counter()
    model, opt = peft_model(folder, precision, quantize)
    load = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(STEPS):
        ids = torch.randint(0, 1000, (1, seq), generator=gen)
        t = time.perf_counter()
        peft_step(model, opt, ids)
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
        result = job_peft_train(args.folder, args.precision, args.quantize, args.seq)
    else:
        result = job_hf_sample(args.folder, args.precision)
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- the parent


# Runs `python -m MODULE ARGS` or `python SCRIPT ARGS` and writes, last on stderr, its VmHWM:
# the high-water mark of its memory since its exec. os.wait4's ru_maxrss would do but for one
# thing: Linux carries the parent's RSS at the fork into it (this script's, once it has built a
# folder with torch and transformers imported: ~0.5 GB, more than a tiny job's whole peak).
HWM = """
import atexit, runpy, sys
hwm = lambda: [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
atexit.register(lambda: sys.stderr.write("\\n" + hwm()))
module = sys.argv[1] == "-m"
sys.argv = sys.argv[2:] if module else sys.argv[1:]
if module:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_child(cmd: list[str]) -> dict:
    """Run `cmd` (a python command line) as a child: its own peak RSS (GB: its VmHWM, see HWM)
    and wall, plus what it printed after RESULT."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    cmd = [cmd[0], "-c", HWM, *cmd[1:]]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
    hwm = [line for line in err.splitlines() if line.startswith("VmHWM:")]
    kb = int(hwm[-1].split()[1]) if hwm else usage.ru_maxrss  # Linux: KiB either way
    result = {"wall_s": wall, "rss_gb": kb * 1024 / 1e9}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT ") :]))
    return result


def prompt_file(folder: Path, cache: Path, tokens: int) -> tuple[Path, int]:
    """A prompt of about `tokens` tokens of the corpus (its exact count by the folder's
    tokenizer), for a sample whose prefill is that long."""
    from tokenizers import Tokenizer

    text = corpus(cache).read_text(encoding="utf-8")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(text[: tokens * 8], add_special_tokens=False).ids[:tokens]
    path = cache / f"prompt-{folder.name}-{tokens}.txt"
    path.write_text(tok.decode(ids), encoding="utf-8")
    return path, len(tok.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids)


def estimate(job: str, target: str, precision: str, seq: int) -> float:
    """`minillm info`'s estimate (GB) of `job` on `target` (a config, or a folder to sample) at
    `seq` tokens: its `fits` total for that job."""
    if job == "sample":
        # the run row at the dtype the measured `sample --dtype` loads in
        cmd = ["--ckpt", target, "--dtype", "bfloat16" if precision == "bf16" else "float32",
               "--set", f"train.seq_len={seq}", "--set", "train.device=cpu"]  # fmt: skip
    else:
        cmd = [target]
    out = subprocess.run([sys.executable, "-m", "minillm", "info", *cmd, "--json"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    fits = json.loads(out)["fits"]
    return fits["run" if job == "sample" else job]["total"] / 1e9


def jobs(shape: str, cache: Path, args: argparse.Namespace) -> list[tuple[str, dict, dict]]:
    """(job, minillm's numbers, the reference's) for one shape; with --info minillm's carry
    `info_gb`, the estimate of the job as it ran."""
    precision = args.precision
    folder = build_folder(shape, cache)
    me = [sys.executable, str(Path(__file__).resolve()), "--child"]
    rows = []
    for job in args.jobs:
        if job == "sample":
            if args.prompt_tokens:
                path, n = prompt_file(folder, cache, args.prompt_tokens)
                prompt = ["--prompt-file", str(path)]
            else:
                prompt, n = ["--prompt", "Hello there"], 4
            cmd = [sys.executable, "-m", "minillm", "sample", "--ckpt", str(folder), *prompt,
                   "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0", "--ignore-eos",
                   "--device", "cpu",
                   "--dtype", "bfloat16" if precision == "bf16" else "float32"]  # fmt: skip
            ref = [*me, "hf-sample", "--folder", str(folder), "--precision", precision]
            target, seq = str(folder), n + NEW_TOKENS
        else:
            quantize = {"lora": "none", "qlora": "nf4", "full": "full"}[job]
            config = lora_config(folder, cache, precision, quantize, args.seq)
            cmd = [*me, "minillm-train", "--config", str(config)]
            ref = [*me, "peft-train", "--folder", str(folder), "--precision", precision,
                   "--quantize", quantize, "--seq", str(args.seq)]  # fmt: skip
            target, seq = str(config), args.seq
        ours = run_child(cmd)
        if args.info:
            ours["info_gb"] = estimate(job, target, precision, seq)
        theirs = {} if args.no_reference else run_child(ref)
        rows.append((job, ours, theirs))
    return rows


def step_s(r: dict) -> float | None:
    steps = r.get("steps_s")
    return None if not steps else sum(steps[1:]) / max(len(steps) - 1, 1)


def table(shape: str, rows: list[tuple[str, dict, dict]]) -> str:
    info = any("info_gb" in ours for _, ours, _ in rows)
    head = f"{shape}: job | peak RSS GB minillm / ref (x) | wall s minillm / ref (x) | step s"
    lines = [head + " minillm / ref (x)" + (" | info GB (measured / info)" if info else "")]
    for job, ours, ref in rows:
        cells = []
        for get in (lambda r: r.get("rss_gb"), lambda r: r.get("wall_s"), step_s):
            a, b = get(ours), get(ref)
            cells.append("-" if a is None else f"{a:.2f}" if b is None else
                         f"{a:.2f} / {b:.2f} ({a / b:.2f}x)")  # fmt: skip
        if "info_gb" in ours:
            cells.append(f"{ours['info_gb']:.2f} ({ours['rss_gb'] / ours['info_gb']:.2f}x)")
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
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=JOBS[:3])
    parser.add_argument("--no-reference", action="store_true", help="minillm's side only")
    parser.add_argument("--info", action="store_true", help="minillm info's estimate of each job")
    parser.add_argument("--seq", type=int, default=SEQ, help="the training jobs' tokens")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="sample's prompt length")
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
        print(table(shape, jobs(shape, args.cache, args)), flush=True)


if __name__ == "__main__":
    main()
