"""`minillm eval --ckpt FOLDER --data FILE` against transformers' loss on the same text, same
model, in one process: time per evaluation and peak memory, as the README's eval row prints them.

    python scripts/bench_eval.py                    # SmolLM2-135M's shape, 2,048 tokens
    python scripts/bench_eval.py --tokens 2048 --repeats 5 --padded

The folder is built here, nothing downloaded: transformers' `LlamaForCausalLM` with random weights
in a published shape (SmolLM2-135M's config.json: d 576, 30 layers, 9 heads with 3 key/value
heads, SwiGLU 1536, vocabulary 49,152, tied, max_position_embeddings 8192), saved by
`save_pretrained`, with a byte-level BPE trained on the shipped Shakespeare. The minillm row is
`evaluate_checkpoint` on the folder loaded by `load_checkpoint` (what `minillm eval` runs after
loading: tokenizing the file, the windows, the forwards); the transformers row is
`model(ids, labels=ids).loss` on the same ids, the loss transformers' users compute. Both run
under no_grad and are timed in turns (one of each per round), medians of --repeats after a
warm-up. --padded adds the way eval scored before: one window of the model's whole context,
the text padded to it. Peak memory is torch.profiler's allocator accounting of one extra call
(the weights excluded), not the process's RSS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minillm.checkpoint.store import load_checkpoint  # noqa: E402
from minillm.infer.evaluate import evaluate_checkpoint  # noqa: E402
from minillm.runtime.perf import step_peak_bytes  # noqa: E402
from minillm.tokenizer.bpe import EOT, train_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024**2
# SmolLM2-135M's config.json (the sizes; weights random).
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
             rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)  # fmt: skip


def build_folder(folder: Path, text: str, layers: int) -> transformers.LlamaForCausalLM:
    """A random-weight LlamaForCausalLM of SHAPE saved in `folder` with a tokenizer.json."""
    tok = train_tokenizer([text], vocab_size=4096)
    eot = tok.token_to_id(EOT)
    cfg = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": layers},
                                   bos_token_id=eot, eos_token_id=eot)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return hf


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens of text to score")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"],
                   help="fewer layers for a quick run (the smoke test)")  # fmt: skip
    p.add_argument("--padded", action="store_true", help="add the padded-window row (slow)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (0 = leave)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        hf = build_folder(folder, corpus, args.layers)
        loaded = load_checkpoint(folder)
        tok = loaded.tokenizer
        ids = tok.encode(corpus[: args.tokens * 8], add_special_tokens=False).ids[: args.tokens]
        text = tok.decode(ids)
        ids = tok.encode(text, add_special_tokens=False).ids  # what eval reads from the file
        data = Path(tmp) / "text.txt"
        data.write_text(text, encoding="utf-8")
        x = torch.tensor([ids])
        context = loaded.config.model.max_seq_len
        padded = torch.zeros((1, context), dtype=torch.int64)
        padded_y = torch.full((1, context), -100, dtype=torch.int64)
        padded[0, : len(ids) - 1], padded_y[0, : len(ids) - 1] = x[0, :-1], x[0, 1:]

        @torch.no_grad()
        def ours() -> float:
            return evaluate_checkpoint(loaded, data=data)["loss"]

        @torch.no_grad()
        def theirs() -> float:
            return hf(x, labels=x).loss.item()

        @torch.no_grad()
        def ours_padded() -> float:  # eval before: one window of the context, padded to it
            _, loss = loaded.model(padded, padded_y)
            return loss.item()

        rows: dict[str, Callable[[], float]] = {"transformers": theirs, "minillm eval": ours}
        if args.padded:
            rows["minillm, padded (before)"] = ours_padded
        losses = {name: fn() for name, fn in rows.items()}  # warm-up
        weights = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
        peaks = {name: step_peak_bytes(fn, torch.device("cpu"), 0) for name, fn in rows.items()}
        times: dict[str, list[float]] = {name: [] for name in rows}
        before = loadavg()
        for _ in range(args.repeats):
            for name, fn in rows.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        after = loadavg()
    params = sum(p.numel() for p in hf.parameters())
    print(f"\n== {params / 1e6:.1f}M params ({args.layers} layers of SmolLM2-135M's shape, "
          f"context {context}), {len(ids):,} tokens, fp32, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}; loadavg {before:.2f} -> {after:.2f}; weights "
          f"{weights / MiB:,.0f} MiB (not in the peaks)")  # fmt: skip
    print("| what | loss | seconds | vs transformers | peak MiB | vs transformers |")
    print("|---|---:|---:|---:|---:|---:|")
    ref_time = statistics.median(times["transformers"])
    out = []
    for name in rows:
        med, peak = statistics.median(times[name]), peaks[name]
        print(f"| {name} | {losses[name]:.6f} | {med:.3f} | {med / ref_time:.2f}x | "
              f"{peak / MiB:,.0f} | {peak / peaks['transformers']:.2f}x |")  # fmt: skip
        out.append(dict(row=name, loss=losses[name], seconds=med, peak_bytes=peaks[name]))
    return out


if __name__ == "__main__":
    main()
