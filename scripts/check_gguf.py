"""Export a checkpoint of your own as GGUF and compare it in llama.cpp with minillm.

Exports --ckpt with `minillm export --format gguf` (into a temporary folder, or --out), loads the
file with llama-cpp-python (`make interop` builds it) and prints, for the checkpoint's tokenizer
and weights: whether llama.cpp's ids for a whole text file equal ours, the largest logit
difference over one context of that text (as a fraction of the logit range), and the greedy
continuation of its first tokens by each. Exits 1 if the ids differ, or (f32) the greedy tokens.

    python scripts/check_gguf.py --ckpt runs/tiny
    python scripts/check_gguf.py --ckpt runs/sft --dtype q8_0 --text data/tiny_chat_test.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from minillm.checkpoint.gguf_file import export_gguf
from minillm.checkpoint.store import load_checkpoint
from minillm.infer.engine import SamplingParams, generate
from minillm.tokenizer.bpe import eot_id


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="A run directory or one checkpoint.")
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16", "q8_0"])
    ap.add_argument("--text", default="data/tinyshakespeare.txt", help="A UTF-8 file to compare.")
    ap.add_argument("--out", help="Where to write the .gguf (default: a temporary folder).")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="Greedy prompt length.")
    args = ap.parse_args()

    from llama_cpp import Llama

    loaded = load_checkpoint(args.ckpt)
    tok, m = loaded.tokenizer, loaded.config.model
    text = Path(args.text).read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        path = export_gguf(loaded, args.out or Path(tmp) / "model.gguf", args.dtype, force=True)
        print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB, {args.dtype}")
        ctx = m.max_seq_len
        llm = Llama(
            model_path=str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True,
            type_k=0, type_v=0, verbose=False,
        )  # fmt: skip
        ours = tok.encode(text).ids
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        same_ids = ours == theirs
        if first is None:  # one is a prefix of the other
            first = min(len(ours), len(theirs))
        where = "" if same_ids else f" (first difference at id {first})"
        print(f"ids of {args.text}: {len(ours):,} ours, {len(theirs):,} llama.cpp, "
              f"{'equal' if same_ids else 'DIFFERENT'}{where}")  # fmt: skip

        ids = [eot_id(tok), *ours][:ctx]
        llm.eval(ids)
        with torch.no_grad():
            logits = loaded.model(torch.tensor([ids]))[0][0].numpy()
        diff = np.abs(np.asarray(llm.scores[: len(ids)]) - logits).max()
        print(f"logits over {len(ids)} tokens: max |diff| {diff:.3g} = "
              f"{diff / (logits.max() - logits.min()):.2e} of the logit range")  # fmt: skip

        prompt = ids[: args.prompt_tokens]
        n = ctx - len(prompt)
        mine = generate(loaded.model, [prompt], SamplingParams.greedy(n))[0]
        llm.reset()
        theirs_new = list(itertools.islice(llm.generate(prompt, temp=0.0), n))
        same_text = mine == theirs_new
        drift = "" if same_text or args.dtype == "f32" else " (rounding may do that below f32)"
        print(f"greedy, {n} tokens: {'equal' if same_text else 'DIFFERENT'}{drift}")
        print(f"  minillm:   {tok.decode(mine)!r}")
        print(f"  llama.cpp: {tok.decode(theirs_new)!r}")
        llm.close()
    return 0 if same_ids and (same_text or args.dtype != "f32") else 1


if __name__ == "__main__":
    sys.exit(main())
