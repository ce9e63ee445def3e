"""A tiny trained-looking run for the eval, sample and export tests (random weights, no training).

Offers `tiny_tokenizer()` (a 300-token byte-level BPE trained once per session on a few KB of
Shakespeare plus some non-ASCII text), `make_run(root, ...)`, which writes a run directory the way
the trainer does (`save_checkpoint` with `state={"config": config_to_dict(cfg), ...}`) and returns
it with its config and model, and `write_shards` (numbered shards and meta.json by the real
data pipeline).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from minillm.checkpoint.store import save_checkpoint
from minillm.config import Config, config_from_dict, config_to_dict
from minillm.model import Transformer

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT / "data" / "tinyshakespeare.txt"
EXTRA = "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά.\n"
VOCAB = 300


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    from minillm.data.tokenizer import train_tokenizer

    text = SHAKESPEARE.read_text(encoding="utf-8")[:6000] + EXTRA * 3
    return train_tokenizer([text], VOCAB).to_str()


def legacy_tokenizer_json() -> str:
    """A tokenizer from before minillm reserved the chat tokens (only <|endoftext|>)."""
    from tokenizers import trainers

    from minillm.data.tokenizer import EOT, new_tokenizer

    legacy = new_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOT], show_progress=False)
    legacy.train_from_iterator([SHAKESPEARE.read_text(encoding="utf-8")[:6000]], trainer)
    return legacy.to_str()


def tiny_tokenizer() -> Tokenizer:
    tok = Tokenizer.from_str(tokenizer_json())
    tok.encode_special_tokens = True
    return tok


def make_run(
    root: Path,
    *,
    model: dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
    sample: dict[str, Any] | None = None,
    seed: int = 0,
    uniform: bool = False,
    tokenizer: Tokenizer | None = None,
) -> tuple[Path, Config, Transformer]:
    """A run directory at root/run with one checkpoint of a random tiny model; data at root/tokens.

    Weights are drawn with a larger spread than the trainer's init so that logits are far from
    uniform (greedy choices are then robust to 1e-6 differences) and norms are not all ones.
    uniform: all weights zero instead, so every token costs exactly ln(vocab_size) nats.
    tokenizer: the run's tokenizer instead of `tiny_tokenizer()` (model.vocab_size must fit it).
    """
    tok_path = root / "tokenizer.json"
    tok_path.parent.mkdir(parents=True, exist_ok=True)
    text = tokenizer_json() if tokenizer is None else tokenizer.to_str()
    tok_path.write_text(text, encoding="utf-8")
    raw = {
        "model": {
            "vocab_size": VOCAB + 20,  # a padded embedding table, as people round vocab up
            "d_model": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_kv_head": 2,
            "ffn_hidden": 96,
            "max_seq_len": 64,
            **(model or {}),
        },
        "data": dict(
            source=str(root / "corpus.jsonl"),
            vocab_size=VOCAB if tokenizer is None else tokenizer.get_vocab_size(),
            tokenizer=str(tok_path),
            out_dir=str(root / "tokens"),
        ),
        "train": {"out_dir": str(root / "run"), "batch_size": 3, "seq_len": 16, **(train or {})},
        "sample": {"max_new_tokens": 20, "temperature": 0.8, "top_k": 0, **(sample or {})},
    }
    cfg = config_from_dict(raw)
    torch.manual_seed(seed)
    net = Transformer(cfg.model).eval()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if uniform:
                p.zero_()
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    run_dir = Path(cfg.train.out_dir)
    save_checkpoint(
        run_dir,
        step=10,
        model_state=net.state_dict(),
        trainer_state={"step": 10},
        state={"config": config_to_dict(cfg), "tokens_seen": 1000, "val_loss": 5.0},
        tokenizer_file=tok_path,
    )
    return run_dir, cfg, net


def write_shards(cfg: Config, documents: list[str]) -> dict[str, Any]:
    """Tokenize `documents` into the run's data.out_dir with the real pipeline; return meta.json.

    The documents go to a .jsonl file (one document a row) at data.source; the run's tokenizer
    (data.tokenizer) is reused.
    """
    from minillm.data.meta import load_meta
    from minillm.data.tokenize_pass import write_shards

    source = Path(cfg.data.source)
    with source.open("w", encoding="utf-8") as f:
        for doc in documents:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    write_shards(cfg)
    return load_meta(cfg.data.out_dir)
