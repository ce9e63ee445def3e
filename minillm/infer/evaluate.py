"""Loss, perplexity and bits per byte of a checkpoint over its validation shard or a data file.

Offers `evaluate_tokens(model, ids, seq_len, batch_size, device) -> (total_nll, n_predicted)`,
`metrics(total_nll, n_predicted, n_bytes) -> dict`, `evaluate_checkpoint(ckpt, data, max_tokens)`
(what `minillm eval` runs) and `format_result`.

Every token after the first is predicted exactly once: windows of T tokens start at 0, T, 2T, ...
(inputs ids[i:i+T], targets ids[i+1:i+T+1], the last window shorter), the window logic of
`minillm.data.eval_batches`. T is the run's train.seq_len, the context the model was trained on
and the one the trainer's val/loss uses, so `minillm eval` reproduces it; a Hugging Face folder's
is its whole context (max_position_embeddings), and `--seq-len` chooses another, up to the
model's context. The last, shorter window is forwarded at its own length, never padded to T: a
text shorter than the context is one forward of its own length, what transformers' `model(ids,
labels=ids)` computes, and costs no more. Bits per byte divide the total negative
log-likelihood by ln 2 and by the UTF-8 bytes of the text: unlike loss per token, that compares
models with different tokenizers.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minillm.data.batches import eval_batches
from minillm.errors import UserError
from minillm.infer.evaluate_chat import chat_eval_data
from minillm.runtime.device import sum_dtype
from minillm.runtime.files import read_user_text
from minillm.runtime.progress import Progress

if TYPE_CHECKING:
    from minillm.checkpoint.store import LoadedCheckpoint
    from minillm.config import ModelConfig
    from minillm.tokenizer.conventions import Conventions

LN2 = math.log(2.0)
JSON_KEYS = ("loss", "perplexity", "bits_per_byte", "tokens", "bytes")


@torch.no_grad()
def evaluate_tokens(
    model: torch.nn.Module,
    ids: np.ndarray | torch.Tensor,
    seq_len: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    progress: bool = False,
    *,
    max_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    autocast: contextlib.AbstractContextManager | None = None,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[float, int]:
    """Summed cross-entropy (nats) over every token of `ids` after the first, and their count.

    max_batches: only the first batches (the trainer's eval_steps). With world_size > 1 this is
    rank `rank`'s share, every world_size-th batch, padded with batches that predict nothing so
    that all ranks run the same number of forwards (FSDP's are collective); the caller sums the
    shares. no_grad rather than inference_mode: the trainer's model goes on training after it.
    batches: these (x, y) instead of `ids`' windows (chat data: one conversation per row).
    """
    if isinstance(ids, torch.Tensor):
        ids = ids.cpu().numpy()
    windows = batches is None
    if batches is not None:
        n_batches = len(batches)
    else:
        batches = eval_batches(ids, seq_len=seq_len, batch_size=batch_size, max_batches=max_batches)
        n_batches = math.ceil(math.ceil(max(len(ids) - 1, 0) / seq_len) / batch_size)
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
    if world_size > 1:
        every = list(batches)
        batches = every[rank::world_size]
        n_batches = math.ceil(len(every) / world_size)
        if every:
            x, y = every[0]
            batches += [(x, torch.full_like(y, -100))] * (n_batches - len(batches))
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=sum_dtype(device), device=device), 0
    bar = Progress("eval", n_batches, enabled=progress, stderr=True)
    try:
        # The text's last window also forwards the text's last token (its prediction unused),
        # as transformers' model(ids, labels=ids) does: under dynamic NTK the RoPE scaling
        # depends on the forward's length. Where the context allows it, one rank alone.
        context = getattr(getattr(model, "cfg", None), "max_seq_len", 0)
        for b, (x, y) in enumerate(batches):
            count += int((y != -100).sum())  # counted on the host: no device sync per batch
            final = windows and world_size == 1 and b == n_batches - 1
            for xs, ys in _unpadded(x, y, context if final else 0) if windows else [(x, y)]:
                with autocast or contextlib.nullcontext():
                    _, loss_sum = model(xs.to(device), ys.to(device), reduction="sum")
                total += loss_sum.to(total.dtype)
            bar.advance()
    finally:
        bar.close()
        model.train(was_training)
    return float(total), count


def _unpadded(
    x: torch.Tensor, y: torch.Tensor, context: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A batch of eval windows (B, T) as forwards without padding: eval_batches pads only the
    last window of the text, which is then forwarded alone at its length n (its inputs and
    targets are the first n columns). The padded batch's sums to float rounding (the model is
    causal: the padding comes after every target), without the padding's cost: the 2,047
    targets of a 2,048-token text in an 8,192-token context were an 8,192-token forward. A
    batch whose last row predicts nothing is a distributed rank's placeholder, kept whole.
    With `context` (the text's last batch), the last window's forward also takes its last
    target token as an input where n + 1 <= context, predicting nothing after it."""
    n = int((y[-1] != -100).sum())
    extend = 0 < n and n + 1 <= context
    if n == 0 or (n == y.shape[1] and not extend):
        return [(x, y)]
    pieces = [(x[:-1], y[:-1])] if len(x) > 1 else []
    xs, ys = x[-1:, :n], y[-1:, :n]
    if extend:
        xs = torch.cat((xs, ys[:, -1:]), dim=1)
        ys = torch.cat((ys, torch.full_like(ys[:, -1:], -100)), dim=1)
    return [*pieces, (xs, ys)]


def metrics(total_nll: float, n_predicted: int, n_bytes: float) -> dict[str, Any]:
    """The `eval --json` object (docs/design.md, "CLI") from the summed NLL (nats), the
    predicted tokens and the text bytes."""
    loss = total_nll / n_predicted
    try:
        perplexity = math.exp(loss)
    except OverflowError:
        perplexity = math.inf
    return {
        "loss": loss,
        "perplexity": perplexity,
        "bits_per_byte": total_nll / LN2 / n_bytes,
        "tokens": n_predicted,
        "bytes": int(round(n_bytes)),
    }


def _cap(ids: list[int], n_bytes: int, max_tokens: int | None) -> tuple[np.ndarray, float]:
    """The first max_tokens + 1 ids, and the bytes scaled by the share of predictions made, as
    for the shard: the whole file's bits per byte, estimated from its first tokens."""
    scaled = float(n_bytes)
    if max_tokens is not None and len(ids) > max_tokens + 1:
        scaled *= max_tokens / (len(ids) - 1)
        ids = ids[: max_tokens + 1]
    return np.asarray(ids, dtype=np.int64), scaled


def _data_tokens(
    path: Path, ckpt: LoadedCheckpoint, text_field: str | None, max_tokens: int | None
) -> tuple[np.ndarray, float]:
    """Token ids and UTF-8 bytes of `--data`: a dataset file (by its extension) as `minillm
    tokenize` reads it, else a text file as one document."""
    from minillm.data.sources import EXTENSIONS

    fmt = EXTENSIONS.get(path.suffix.lower(), "text")
    if fmt == "text":
        if text_field is not None:
            raise UserError(f"--text-field: {path} is plain text (one document), not a table")
        return _file_tokens(path, ckpt.conventions, max_tokens)
    return _table_tokens(path, ckpt, text_field, max_tokens)


def _table_tokens(
    path: Path, ckpt: LoadedCheckpoint, text_field: str | None, max_tokens: int | None
) -> tuple[np.ndarray, float]:
    """Rows of a json/jsonl/parquet/csv file through the corpus loader of `minillm tokenize`
    (text_field, chat rows rendered), each row a document followed by end-of-text as in the
    shards, so that the loss is the one the run's val/loss measures on such data."""
    import dataclasses

    from minillm.data.sources import open_corpus
    from minillm.data.table import TableCorpus
    from minillm.errors import ConfigError

    if not path.is_file():
        raise UserError(f"{path}: no such file")
    data = dataclasses.replace(
        ckpt.config.data,
        source=str(path),
        format="auto",
        text_field=text_field or ckpt.config.data.text_field,
        streaming=False,  # every row of the file, whatever prefix and split the run used
        max_documents=0,
        max_bytes=0,
        val_documents=0,
    )
    try:
        corpus = open_corpus(data)
    except ConfigError as e:  # name the flag the user typed, not the run's config key
        flag = {"data.text_field": "--text-field"}.get(e.key, "--data")
        raise UserError(f"{e.file or path}: {flag}: {e.message}") from None
    assert isinstance(corpus, TableCorpus)
    conv = ckpt.conventions  # as in the shards (minillm.tokenizer.conventions)
    eot = conv.doc_end
    ids: list[int] = []
    n_bytes = 0
    for text in corpus.texts():
        if not text:  # like tokenize: an empty row is no document
            continue
        ids.extend(conv.text_ids(text))
        if ids[-1] != eot:
            ids.append(eot)
        n_bytes += len(text.encode("utf-8"))
        if max_tokens is not None and len(ids) > max_tokens + 1:
            break  # enough rows read; the bytes below are scaled to the tokens kept
    return _cap(ids, n_bytes, max_tokens)


def _file_tokens(path: Path, conv: Conventions, max_tokens: int | None) -> tuple[np.ndarray, float]:
    """Token ids of a text file (one document, as the shards hold it: minillm's own tokenizer
    adds no special token, a published model's its BOS) and its UTF-8 bytes."""
    text = read_user_text(path, "file")
    ids = conv.text_ids(text)
    return _cap(ids, len(text.encode("utf-8")), max_tokens)


def _val_tokens(ckpt: LoadedCheckpoint, max_tokens: int | None) -> tuple[np.ndarray, float, str]:
    """The run's validation shard, its bytes (scaled to the share used) and a note saying so."""
    from minillm.data.meta import load_meta, open_split
    from minillm.tokenizer.bpe import tokenizer_sha256

    out_dir = Path(ckpt.config.data.out_dir)
    if not (out_dir / "meta.json").is_file():
        raise UserError(
            f"{out_dir / 'meta.json'}: no validation shard (the run's data.out_dir, relative to "
            "the folder you trained in); run from there, or pass --data FILE"
        )
    meta = load_meta(out_dir)
    tok = ckpt.tokenizer
    same = meta["eot_id"] == ckpt.conventions.doc_end and meta["vocab_size"] == tok.get_vocab_size()
    tok_file = Path(ckpt.path) / "tokenizer.json"
    if same and meta.get("tokenizer_sha256") and tok_file.is_file():
        same = tokenizer_sha256(tok_file) == meta["tokenizer_sha256"]
    if not same:
        raise UserError(
            f"{out_dir / 'meta.json'}: these shards were made with another tokenizer than the "
            f"checkpoint's; pass --data FILE, or re-tokenize with the run's tokenizer"
        )
    tokens = open_split(out_dir, "val")
    n_bytes = float(meta["val"]["bytes"])
    note = f"{out_dir} (val shards)"
    if max_tokens is not None and len(tokens) > max_tokens + 1:
        share = max_tokens / (len(tokens) - 1)
        n_bytes *= share
        note += f" (first {max_tokens + 1} tokens; bytes scaled by their share, {share:.2%})"
        tokens = tokens[: max_tokens + 1]
    return tokens, n_bytes, note


def evaluate_checkpoint(
    ckpt: LoadedCheckpoint,
    data: str | Path | None = None,
    max_tokens: int | None = None,
    batch_size: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    text_field: str | None = None,
    seq_len: int | None = None,
) -> dict[str, Any]:
    """Evaluate a LoadedCheckpoint over its validation shard, or over a file `data` (plain
    text, or a dataset file read through its `text_field`, default the run's data.text_field).

    max_tokens caps the predicted tokens. seq_len (`--seq-len`): the window length, at most the
    model's context (`at_context` raises that for `eval --seq-len` past it); default the run's
    train.seq_len (a Hugging Face folder's: its context). batch_size defaults to the run's
    train.batch_size, or with seq_len to as many windows as hold the tokens of that batch.
    Returns the `eval --json` object (docs/design.md, "CLI") plus `source`, `seq_len` (the
    longest window forwarded) and `seconds`.
    """
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {max_tokens}")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    cfg = ckpt.config
    if seq_len is None:
        seq_len = min(cfg.train.seq_len, cfg.model.max_seq_len)
    else:
        check_seq_len(seq_len, cfg.model)
        batch_size = batch_size or max(1, cfg.train.batch_size * cfg.train.seq_len // seq_len)
    batch_size = batch_size or cfg.train.batch_size
    # Chat data (a chat run's shard, a jsonl of messages): every conversation on its own.
    chat = chat_eval_data(ckpt, data, seq_len, batch_size, max_tokens, text_field)
    batches = None
    if chat is not None:
        if data is None:
            _val_tokens(ckpt, None)  # its checks: the shards' tokenizer is the checkpoint's
        batches, n_bytes, source = chat
        ids = np.zeros(0, dtype=np.int64)
    elif data is not None:
        ids, n_bytes = _data_tokens(Path(data), ckpt, text_field, max_tokens)
        source = str(data)
    elif text_field is not None:
        raise UserError("--text-field: only with --data (a dataset file)")
    else:
        ids, n_bytes, source = _val_tokens(ckpt, max_tokens)
    if chat is None and len(ids) < 2:
        raise UserError(f"{source}: {len(ids)} token(s); at least 2 are needed to predict one")
    if device is None:
        device = next(ckpt.model.parameters()).device
    start = time.perf_counter()
    total, n = evaluate_tokens(
        ckpt.model, ids, seq_len, batch_size, device, progress=progress, batches=batches
    )
    result = metrics(total, n, n_bytes)
    if chat is None:  # a text shorter than the window is read in one window of its length
        seq_len = min(seq_len, n)
    result.update(source=source, seq_len=seq_len, seconds=time.perf_counter() - start)
    return result


def check_seq_len(seq_len: int, model: ModelConfig) -> None:
    """UserError unless `--seq-len` is a window the model reads: 1 .. model.max_seq_len, the
    context its RoPE tables cover (with rope_scaling, the scaled context: max_position_embeddings,
    or under dynamic NTK the original length times the factor)."""
    if seq_len < 1:
        raise UserError(f"--seq-len must be >= 1, got {seq_len}")
    if seq_len > model.max_seq_len:
        scaling = model.rope_scaling.type
        how = f", with its {scaling} RoPE scaling" if scaling != "none" else ""
        raise UserError(
            f"--seq-len: {seq_len} exceeds the model's context of {model.max_seq_len} tokens "
            f"(model.max_seq_len{how}); pass at most {model.max_seq_len}"
        )


def format_result(result: dict[str, Any]) -> str:
    """A few human lines for the terminal."""
    return (
        f"loss {result['loss']:.4f} nats/token   perplexity {result['perplexity']:.3f}   "
        f"bits/byte {result['bits_per_byte']:.4f}\n"
        f"{result['tokens']:,} tokens predicted, {result['bytes']:,} bytes, "
        f"context {result['seq_len']}, {result['seconds']:.1f}s: {result['source']}"
    )
