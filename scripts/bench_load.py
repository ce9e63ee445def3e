"""Loading a published-size model: `minillm sample` against transformers' from_pretrained +
generate, each a whole process under /usr/bin/time -v (peak RSS, wall), one after the other.

    python scripts/bench_load.py build /tmp/tinyllama            # once: random bf16 shards
    python scripts/bench_load.py run /tmp/tinyllama [--tokens 8] [--dtype auto]
    python scripts/bench_load.py decode /tmp/tinyllama   # ms/token: fp32 +- W^T copies, bf16
    python scripts/bench_load.py nf4 /tmp/tinyllama      # --quantize nf4's load: as read, after

`build` writes a random-weight LlamaForCausalLM at TinyLlama-1.1B's shape (or `--shape 3b`,
Llama-3.2-3B's) in bf16 safetensors shards with a byte-level BPE tokenizer, through
transformers' own classes. `run` times `python -m minillm sample --ckpt DIR --max-new-tokens N`
and `python scripts/bench_load.py hf DIR` (from_pretrained in the folder's dtype + N greedy
tokens). scripts/bench_scale.py calls `measure(cmd)` and `jobs(folder, tokens, dtype)`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    # TinyLlama-1.1B's config.json (the sizes; weights random)
    "1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                 rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Llama-3.2-3B's (no rope scaling: minillm's llama3 scaling is its own test's)
    "3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=8192,
               rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
}  # fmt: skip
PROMPT = "The quick brown fox"


def build(folder: Path, shape: str) -> None:
    """A random-weight bf16 LlamaForCausalLM of SHAPES[shape] in 1 GB shards + a tokenizer."""
    import torch
    import transformers

    from minillm.tokenizer.bpe import EOT, train_tokenizer

    text = " ".join(f"word{i} the fox jumps over the lazy dog {i * 7}" for i in range(4000))
    tok = train_tokenizer([text], vocab_size=4096)
    eot = tok.token_to_id(EOT)
    cfg = transformers.LlamaConfig(**SHAPES[shape], bos_token_id=eot, eos_token_id=eot,
                                   dtype="bfloat16")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size="1GB")
    tok.save(str(folder / "tokenizer.json"))


def hf_job(folder: Path, tokens: int, dtype: str) -> None:
    """transformers' side of the comparison: from_pretrained (the folder's dtype) + generate."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    kw = {"dtype": "auto" if dtype == "auto" else getattr(torch, dtype)}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
    t1 = time.perf_counter()
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                             min_new_tokens=tokens)  # fmt: skip
    t2 = time.perf_counter()
    print(f"load {t1 - t0:.1f}s generate {t2 - t1:.1f}s ({out.shape[1] - len(ids)} tokens, "
          f"{next(model.parameters()).dtype})")  # fmt: skip


def decode_job(folder: Path, steps: int = 8) -> None:
    """ms per decoded token (one row, after a 16-token prompt) of the folder in float32 with the
    decoder's transposed copies, float32 without, and bfloat16 (which never has them): what the
    rule of minillm.model.decode.transposed_copies rests on. One process, in turn."""
    import torch

    import minillm.model.decode as decode
    from minillm.checkpoint.store import load_checkpoint
    from minillm.model.kv_cache import KVCache

    def per_token(model: torch.nn.Module) -> float:
        cache = KVCache(model.cfg, 1, 64, dtype=next(model.parameters()).dtype)
        decoder = decode.Decoder(model, cache)
        with torch.inference_mode():
            decoder.prefill(0, torch.arange(16))
            decoder.step(torch.tensor([1]))  # warm-up (and the copies, if any)
            t0 = time.perf_counter()
            for i in range(steps):
                decoder.step(torch.tensor([i + 2]))
        return (time.perf_counter() - t0) / steps * 1e3

    for dtype in ("float32", "bfloat16"):
        model = load_checkpoint(folder, dtype=dtype).model
        if dtype == "float32":
            limit = decode.COPY_LIMIT_BYTES
            decode.COPY_LIMIT_BYTES = 2**62  # copies forced on
            print(f"float32 with W^T copies: {per_token(model):.0f} ms/token")
            decode.COPY_LIMIT_BYTES = limit
        print(f"{dtype} (no copies): {per_token(model):.0f} ms/token")
        del model


def nf4_job(folder: Path, rounds: int = 2) -> None:
    """Seconds of `--quantize nf4`'s load in the folder's dtype, each layer quantized as it is
    read, against the whole model loaded then quantized (what it did before), in turn in one
    process (the same load on the machine for both); the peaks are `run`'s whole processes."""
    from minillm.checkpoint.store import load_checkpoint
    from minillm.families import fused_rows
    from minillm.model.nf4 import quantize_nf4

    for _ in range(rounds):
        t0 = time.perf_counter()
        model = load_checkpoint(folder, dtype="auto", quantize="nf4").model
        t1 = time.perf_counter()
        del model
        loaded = load_checkpoint(folder, dtype="auto")
        quantize_nf4(loaded.model, fused_rows(loaded.config.model))
        t2 = time.perf_counter()
        del loaded
        print(f"as read {t1 - t0:.1f} s, whole then quantized {t2 - t1:.1f} s")


def jobs(folder: Path, tokens: int, dtype: str) -> dict[str, list[str]]:
    """The two commands compared, each run in its own process."""
    py = sys.executable
    ours = [py, "-m", "minillm", "sample", "--ckpt", str(folder), "--prompt", PROMPT,
            "--max-new-tokens", str(tokens), "--temperature", "0", "--dtype", dtype]  # fmt: skip
    hf = [py, str(Path(__file__).resolve()), "hf", str(folder), "--tokens", str(tokens),
          "--dtype", dtype]  # fmt: skip
    return {"minillm": ours, "transformers": hf}


def measure(cmd: list[str]) -> dict[str, float]:
    """Peak RSS (GB) and wall (s) of `cmd` under /usr/bin/time -v; its output's last line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", done.stderr)
    parts = [float(p) for p in wall.group(1).split(":")]  # type: ignore[union-attr]
    seconds = sum(p * 60**i for i, p in enumerate(reversed(parts)))
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return {"rss_gb": int(rss.group(1)) / 1e6, "wall_s": seconds, "out": last}  # type: ignore


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=["build", "run", "hf", "decode", "nf4"])
    p.add_argument("folder", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.1b")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    if args.what == "build":
        build(args.folder, args.shape)
        return
    if args.what == "decode":
        print(f"loadavg before: {os.getloadavg()}")
        decode_job(args.folder)
        print(f"loadavg after: {os.getloadavg()}")
        return
    if args.what == "nf4":
        print(f"loadavg before: {os.getloadavg()}")
        nf4_job(args.folder)
        print(f"loadavg after: {os.getloadavg()}")
        return
    if args.what == "hf":
        hf_job(args.folder, args.tokens, args.dtype)
        return
    print(f"loadavg before: {os.getloadavg()}")
    for name, cmd in jobs(args.folder, args.tokens, args.dtype).items():
        r = measure(cmd)
        print(f"{name:13s} peak RSS {r['rss_gb']:.2f} GB  wall {r['wall_s']:.1f} s   {r['out']}")
    print(f"loadavg after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
