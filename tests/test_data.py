"""The data pipeline: sources, splits, safe cuts, shards and meta.json, batches, and bad input.

Every test builds its corpus in tmp_path (or copies one from data/), trains a small tokenizer on
it and runs the real code; the CLI tests go through `minillm tokenize` with CliRunner.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from tokenizers import Tokenizer
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import Config, config_from_dict
from minillm.data import encode_batches as batches_mod
from minillm.data import text as text_mod
from minillm.data import tokenize_pass as pass_mod
from minillm.data import tokenizer_train as tokenizer_train_mod
from minillm.data.batches import MicroBatch, eval_batches, train_batch
from minillm.data.corpus import val_mask
from minillm.data.meta import load_meta, open_split, shard_dtype
from minillm.data.shard_writer import ShardWriter
from minillm.data.sources import _looks_like_hub, open_corpus
from minillm.data.table import TableCorpus
from minillm.data.text import is_cut, read_text_blocks, split_pieces
from minillm.data.tokenize_pass import write_shards
from minillm.errors import ConfigError, UserError
from minillm.runtime import progress as progress_mod
from minillm.tokenizer.bpe import load_tokenizer, train_tokenizer

DATA = Path(__file__).resolve().parents[1] / "data"
SHAKESPEARE = (DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")
EXCERPT = SHAKESPEARE[: SHAKESPEARE.index("\n\n", 100_000) + 1]  # ~100 KB, whole speeches


def adversarial_text(n: int = 20_000, seed: int = 0) -> str:
    """Words, digits, punctuation, CJK, emoji and every awkward run of whitespace, shuffled."""
    rng = random.Random(seed)
    parts = ["word", "Cap", "x", "123", "4.5", "!!", "'s", "'ll", "中文", "日本", "👋🏽", "é", "—"]
    parts += [" ", "  ", "\n", "\n\n", " \n", "\n ", "\t", "\r\n", "\u00a0", "\u3000", "\x0b"]
    return "".join(rng.choice(parts) for _ in range(n))


@pytest.fixture(autouse=True)
def _datasets_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keep the arrow files `datasets` converts our tmp corpora into out of ~/.cache."""
    import datasets.config

    cache = tmp_path_factory.getbasetemp() / "hf_datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer([EXCERPT, adversarial_text()], 400)


def make_cfg(tmp_path: Path, **data: Any) -> Config:
    data = {"vocab_size": 300, "out_dir": str(tmp_path / "tokens"), **data}
    return config_from_dict(
        {
            "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 64},
            "data": data,
            "train": {"seq_len": 32, "out_dir": str(tmp_path / "run")},
        }
    )


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))  # write_text would turn "\n" into os.linesep elsewhere
    return path


def decoded_docs(out_dir: Path, split: str) -> list[str]:
    """The documents of a shard, decoded: the ids between EOT separators."""
    meta = load_meta(out_dir)
    tok = load_tokenizer(out_dir / "tokenizer.json")
    ids = open_split(out_dir, split).tolist()
    assert ids[-1] == meta["eot_id"]
    docs, start = [], 0
    for i, t in enumerate(ids):
        if t == meta["eot_id"]:
            docs.append(tok.decode(ids[start:i], skip_special_tokens=False))
            start = i + 1
    return docs


def hashes(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


# ----------------------------------------------------------------------------- safe cuts


@pytest.mark.parametrize(
    ("text", "i", "expected"),
    [
        ("a\nB", 2, True),  # after a lone line break
        ("a b", 1, True),  # before a lone space
        ("a\n\nB", 3, False),  # "a\n\n" alone would end in one "\n\n" token
        ("a \nB", 3, False),
        ("a\n B", 2, False),
        ("a\r\nB", 3, False),
        ("a  b", 1, False),
        ("a b", 2, False),
        ("a\n", 2, False),  # the next character is not known yet
    ],
)
def test_is_cut(text: str, i: int, expected: bool) -> None:
    assert is_cut(text, i) is expected


def test_naive_newline_cut_would_change_tokens(tok: Tokenizer) -> None:
    """Why is_cut wants the "\\n" lone: cutting "a\\n\\nB" after the second "\\n" is not safe."""
    text = "Speak.\n\nFirst Citizen:"
    cut = text.index("First")
    assert tok.encode(text[:cut]).ids + tok.encode(text[cut:]).ids != tok.encode(text).ids


@pytest.mark.parametrize("target", [1, 7, 64, 1000])
def test_pieces_encode_like_the_whole_text(tok: Tokenizer, target: int) -> None:
    text = adversarial_text(8000, seed=target) + EXCERPT[:20_000]
    rng = random.Random(target)
    cuts = sorted(rng.sample(range(1, len(text)), 50))
    blocks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]  # arbitrary blocks
    pieces = list(split_pieces(blocks, target))
    assert "".join(pieces) == text
    assert len(pieces) > len(text) // max(target, 100) // 4  # it did cut, many times
    ids = [i for enc in tok.encode_batch(pieces) for i in enc.ids]
    assert ids == tok.encode(text).ids


def test_pipeline_encoding_equals_whole_text_encoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shakespeare through write_shards with tiny blocks and pieces == one encode of each split."""
    monkeypatch.setattr(text_mod, "BLOCK_BYTES", 4099)
    monkeypatch.setattr(text_mod, "PIECE_CHARS", 300)
    cfg = make_cfg(tmp_path, source=str(write_text(tmp_path / "s.txt", SHAKESPEARE)))
    write_shards(cfg)
    out, meta = tmp_path / "tokens", load_meta(tmp_path / "tokens")
    tok = load_tokenizer(out / "tokenizer.json")
    raw = SHAKESPEARE.encode("utf-8")
    train_text = raw[: meta["train"]["bytes"]].decode("utf-8")
    val_text = raw[meta["train"]["bytes"] :].decode("utf-8")
    eot = meta["eot_id"]
    assert open_split(out, "train").tolist() == tok.encode(train_text).ids + [eot]
    assert open_split(out, "val").tolist() == tok.encode(val_text).ids + [eot]


# ----------------------------------------------------------------------------- reading text


def test_read_text_blocks_any_block_size(tmp_path: Path) -> None:
    text = "héllo wörld 👋🏽 中文\r\n" * 20
    path = write_text(tmp_path / "t.txt", text)
    for block in (1, 2, 3, 5, 7, 64):
        assert "".join(read_text_blocks(path, block_bytes=block)) == text
    raw = text.encode("utf-8")
    start, end = raw.index("中".encode()), raw.index(b"\r\n", 100)
    assert "".join(read_text_blocks(path, start, end, block_bytes=3)) == raw[start:end].decode()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"ok\xe2\x82xyz", "not UTF-8 text at byte 2"),
        (b"ok\xe2\x82", "not UTF-8 text at byte 2"),  # truncated at the end of the file
        (b"fine text\n\xff\xfe", "not UTF-8 text at byte 10"),
        ("\u00e9t\u00e9\x00".encode(), "a NUL byte at byte 5"),
    ],
)
def test_binary_input_names_file_and_offset(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bin.txt"
    path.write_bytes(content)
    for block in (3, 1 << 20):
        with pytest.raises(UserError, match=f"bin.txt: data.source: {message}"):
            list(read_text_blocks(path, block_bytes=block))


# ----------------------------------------------------------------------------- sources, splits


def test_val_mask_is_deterministic_and_never_empty() -> None:
    assert np.array_equal(val_mask(100, 0.1, 1), val_mask(100, 0.1, 1))
    assert not np.array_equal(val_mask(100, 0.1, 1), val_mask(100, 0.1, 2))
    assert val_mask(100, 0.1, 1).sum() == 10
    assert val_mask(2, 0.01, 1).sum() == 1 and val_mask(2, 0.99, 1).sum() == 1
    assert val_mask(5, 0.5, -3).sum() == 2  # negative seeds are fine


def test_hub_names_vs_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert _looks_like_hub("roneneldan/TinyStories")
    assert _looks_like_hub("wikitext")
    for path_like in ("data/missing", "missing.txt", "./x", "/abs/x", "~/x", "a/b/c", "a\\b"):
        assert not _looks_like_hub(path_like), path_like


def test_folder_keeps_data_files_and_skips_hidden(tmp_path: Path) -> None:
    for name in ("b.txt", "a.md", "sub/c.txt", ".hidden/d.txt", "README", ".e.txt"):
        write_text(tmp_path / "corpus" / name, f"text of {name}\n")
    corpus = open_corpus(make_cfg(tmp_path, source=str(tmp_path / "corpus")).data)
    assert [f.relative_to(tmp_path / "corpus").as_posix() for f in corpus.files] == [
        "a.md",
        "b.txt",
        "sub/c.txt",
    ]
    glob = open_corpus(make_cfg(tmp_path, source=str(tmp_path / "corpus" / "**" / "*.txt")).data)
    assert [f.name for f in glob.files] == ["b.txt", "c.txt"]


def test_fingerprint_follows_files_and_split_settings(tmp_path: Path) -> None:
    src = str(write_text(tmp_path / "t.txt", EXCERPT))
    first = open_corpus(make_cfg(tmp_path, source=src).data).fingerprint
    assert open_corpus(make_cfg(tmp_path, source=src).data).fingerprint == first
    assert open_corpus(make_cfg(tmp_path, source=src, seed=2).data).fingerprint != first
    write_text(tmp_path / "t.txt", EXCERPT + "more\n")
    assert open_corpus(make_cfg(tmp_path, source=src).data).fingerprint != first


def test_single_text_file_splits_at_its_tail(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, source=str(write_text(tmp_path / "s.txt", EXCERPT)))
    summary = write_shards(cfg)
    meta = load_meta(tmp_path / "tokens")
    size = len(EXCERPT.encode("utf-8"))
    assert meta["train"]["bytes"] + meta["val"]["bytes"] == size
    assert abs(meta["val"]["bytes"] - 0.1 * size) < 0.01 * size
    train, val = (
        decoded_docs(tmp_path / "tokens", "train"),
        decoded_docs(tmp_path / "tokens", "val"),
    )
    assert len(train) == len(val) == 1 and train[0] + val[0] == EXCERPT
    assert train[0].endswith("\n") and not val[0][0].isspace()  # cut at a line start
    assert summary["splits"]["total"]["tokens"] == meta["train"]["tokens"] + meta["val"]["tokens"]


def test_jsonl_documents_split_and_byte_counts(tmp_path: Path) -> None:
    src = str(shutil.copy(DATA / "grimm_stories.jsonl", tmp_path / "grimm.jsonl"))
    texts = [json.loads(line)["text"] for line in open(src, encoding="utf-8")]
    write_shards(make_cfg(tmp_path, source=src))
    out = tmp_path / "tokens"
    meta = load_meta(out)
    train, val = decoded_docs(out, "train"), decoded_docs(out, "val")
    assert (meta["train"]["documents"], meta["val"]["documents"]) == (len(train), len(val))
    assert len(val) == round(0.1 * len(texts)) and sorted(train + val) == sorted(texts)
    for split, docs in (("train", train), ("val", val)):
        assert meta[split]["bytes"] == sum(len(d.encode("utf-8")) for d in docs)
        assert (
            meta[split]["shards"][0]["sha256"]
            == hashlib.sha256((out / f"{split}_000000.bin").read_bytes()).hexdigest()
        )
    assert (
        meta["tokenizer_sha256"]
        == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    )
    before = hashes(out)
    assert write_shards(make_cfg(tmp_path, source=src))["tokenizer"]["trained"] is False
    assert hashes(out) == before  # deterministic: same tokenizer reused, same split, same shards
    write_shards(make_cfg(tmp_path, source=src, seed=7))
    assert sorted(decoded_docs(out, "val")) != sorted(val)


def test_parquet_csv_and_jsonl_give_the_same_documents(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in open(DATA / "grimm_stories.jsonl", encoding="utf-8")]
    with open(tmp_path / "grimm.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["title", "text"])
        writer.writeheader()
        writer.writerows(rows)
    shutil.copy(DATA / "grimm_stories.parquet", tmp_path / "grimm.parquet")
    metas = []
    for name in ("grimm.parquet", "grimm.csv"):
        out = tmp_path / name.replace(".", "_")
        write_shards(make_cfg(tmp_path, source=str(tmp_path / name), out_dir=str(out)))
        metas.append(load_meta(out))
        docs = decoded_docs(out, "train") + decoded_docs(out, "val")
        assert sorted(docs) == sorted(r["text"] for r in rows)
    assert metas[0]["train"] == metas[1]["train"] and metas[0]["val"] == metas[1]["val"]


def test_chat_messages_are_rendered(tmp_path: Path) -> None:
    src = str(shutil.copy(DATA / "gsm8k_chat_200.jsonl", tmp_path / "chat.jsonl"))
    write_shards(make_cfg(tmp_path, source=src, text_field="messages"))
    docs = decoded_docs(tmp_path / "tokens", "train") + decoded_docs(tmp_path / "tokens", "val")
    expected = [
        "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in json.loads(line)["messages"])
        for line in open(src, encoding="utf-8")
    ]
    assert len(docs) == 200 and sorted(docs) == sorted(expected)
    assert docs[0].startswith("<|user|>")


def test_in_memory_dataset_and_a_single_row(tmp_path: Path) -> None:
    """Rows that are no cache file (a hub dataset kept in memory); one row splits at its tail."""
    import datasets

    data = make_cfg(tmp_path).data
    rows = datasets.Dataset.from_dict({"text": ["first doc", "", "third doc", "fourth"]})
    docs = list(TableCorpus(rows, [], "hub", data, "someone/rows").documents())
    assert sorted(d.text for d in docs) == ["first doc", "fourth", "third doc"]  # empty skipped
    one = datasets.Dataset.from_dict({"text": [EXCERPT[:5000]]})
    train, val = TableCorpus(one, [], "hub", data, "someone/one").documents()
    assert (train.split, val.split) == ("train", "val") and train.text + val.text == EXCERPT[:5000]
    assert abs(len(val.text) - 500) < 100 and train.text.endswith("\n")


def test_folder_of_text_files_one_document_each(tmp_path: Path) -> None:
    stories = [EXCERPT[i * 9000 : (i + 1) * 9000] for i in range(10)]
    for i, story in enumerate(stories):
        write_text(tmp_path / "books" / f"{i:02d}.txt", story)
    write_text(tmp_path / "books" / "empty.txt", "")  # no document, no stray separator
    write_shards(make_cfg(tmp_path, source=str(tmp_path / "books"), val_fraction=0.2))
    train, val = (
        decoded_docs(tmp_path / "tokens", "train"),
        decoded_docs(tmp_path / "tokens", "val"),
    )
    assert len(val) == 2 and sorted(train + val) == sorted(stories)


# ----------------------------------------------------------------------------- shards


def test_shard_dtype_switches_above_65536() -> None:
    assert shard_dtype(65536) == "uint16"
    assert shard_dtype(65537) == "uint32"


def test_uint32_shards_hold_the_same_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = str(write_text(tmp_path / "s.txt", EXCERPT))
    write_shards(make_cfg(tmp_path, source=src, out_dir=str(tmp_path / "a")))
    monkeypatch.setattr(pass_mod, "shard_dtype", lambda vocab_size: "uint32")
    write_shards(make_cfg(tmp_path, source=src, out_dir=str(tmp_path / "b")))
    assert load_meta(tmp_path / "b")["dtype"] == "uint32"
    assert (tmp_path / "b" / "train_000000.bin").stat().st_size == 2 * (
        tmp_path / "a" / "train_000000.bin"
    ).stat().st_size
    for split in ("train", "val"):
        a, b = open_split(tmp_path / "a", split), open_split(tmp_path / "b", split)
        assert b.dtype == np.dtype("<u4") and np.array_equal(a, b)


@pytest.mark.parametrize("error", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_interrupted_run_keeps_previous_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    src = str(write_text(tmp_path / "s.txt", EXCERPT))
    write_shards(make_cfg(tmp_path, source=src))
    out = tmp_path / "tokens"
    before, train = hashes(out), open_split(out, "train").copy()
    real_write, calls = ShardWriter.write, []

    def failing_write(self: Any, ids: np.ndarray) -> None:
        calls.append(1)
        if len(calls) > 1:
            raise error
        real_write(self, ids)

    monkeypatch.setattr(batches_mod, "BATCH_CHARS", 1000)  # many writes
    monkeypatch.setattr(ShardWriter, "write", failing_write)
    with pytest.raises(type(error)):
        write_shards(make_cfg(tmp_path, source=src, vocab_size=350), retrain=True)
    assert hashes(out) == before  # tokenizer, shards and meta untouched, no temporary left
    assert np.array_equal(open_split(out, "train"), train)


def test_crash_between_renames_leaves_no_accepted_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = str(write_text(tmp_path / "s.txt", EXCERPT))
    write_shards(make_cfg(tmp_path, source=src))
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:  # the power fails as the val shard is moved in
        if Path(dst).name == "val_000000.bin":
            raise OSError("power cut")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(UserError, match="power cut"):
        write_shards(make_cfg(tmp_path, source=src, vocab_size=350), retrain=True)
    for split in ("train", "val"):
        with pytest.raises(UserError, match="minillm tokenize"):
            open_split(tmp_path / "tokens", split)


def test_full_disk_is_one_line_and_keeps_previous_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    src = str(write_text(tmp_path / "s.txt", EXCERPT))
    write_shards(make_cfg(tmp_path, source=src))
    out = tmp_path / "tokens"
    before = hashes(out)

    def full(self: Any, ids: np.ndarray) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ShardWriter, "write", full)
    with pytest.raises(UserError, match="tokens: no space left on the device writing token shards"):
        write_shards(make_cfg(tmp_path, source=src, vocab_size=350), retrain=True)
    assert hashes(out) == before


def test_open_split_checks_size_against_meta(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="meta.json: data.out_dir: .*minillm tokenize CONFIG"):
        open_split(tmp_path / "nothing", "train")
    write_shards(make_cfg(tmp_path, source=str(write_text(tmp_path / "s.txt", EXCERPT))))
    shard = tmp_path / "tokens" / "train_000000.bin"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-2])
    with pytest.raises(UserError, match="train_000000.bin: data.out_dir: .* bytes, but meta.json"):
        open_split(tmp_path / "tokens", "train")
    shard.write_bytes(whole[:-2] + bytes([whole[-2] ^ 1, whole[-1]]))  # same size, one bit off
    with pytest.raises(UserError, match="train_000000.bin: data.out_dir: sha256 differs"):
        open_split(tmp_path / "tokens", "train")
    shard.unlink()
    with pytest.raises(UserError, match="train_000000.bin: data.out_dir: missing; run `minillm"):
        open_split(tmp_path / "tokens", "train")
    (tmp_path / "tokens" / "meta.json").write_text('{"version": 99}')
    with pytest.raises(UserError, match="not a meta.json of version 2"):
        load_meta(tmp_path / "tokens")


# ----------------------------------------------------------------------------- batches


def batch_kwargs(**kw: Any) -> dict[str, Any]:
    base = {"seed": 3, "step": 5, "rank": 0, "world_size": 1, "batch_size": 4, "grad_accum": 2}
    return {**base, "seq_len": 16, **kw}


def test_train_batch_shapes_shift_and_determinism() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    batches = train_batch(tokens, **batch_kwargs())
    assert len(batches) == 2
    for x, y, docs in batches:
        assert docs is None  # no document masking asked for
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)  # arange: the target is the next token
    again = train_batch(tokens, **batch_kwargs())
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    other = train_batch(tokens, **batch_kwargs(step=6))
    assert not torch.equal(batches[0][0], other[0][0])


def test_train_batch_is_the_same_global_batch_on_any_world_size() -> None:
    tokens = np.random.default_rng(0).integers(0, 300, 5000).astype(np.uint16)

    def windows(batches: list[MicroBatch]) -> list[tuple[int, ...]]:
        return [tuple(row.tolist()) for m in batches for row in m.tokens]

    one = windows(train_batch(tokens, **batch_kwargs(grad_accum=4)))
    two = [
        w
        for rank in range(2)
        for w in windows(train_batch(tokens, **batch_kwargs(rank=rank, world_size=2)))
    ]
    halves = windows(train_batch(tokens, **batch_kwargs(batch_size=2, grad_accum=8)))
    assert len(one) == 16 and sorted(one) == sorted(two) == sorted(halves)


def test_train_batch_offsets_reach_the_last_window_and_need_enough_tokens() -> None:
    tokens = np.arange(17, dtype=np.uint16)  # exactly seq_len + 1: one possible window
    (x, y, _), *_ = train_batch(tokens, **batch_kwargs())
    assert x[0].tolist() == list(range(16)) and y[0].tolist() == list(range(1, 17))
    with pytest.raises(UserError, match="train.seq_len: 16 needs at least 17 tokens.* only 16"):
        train_batch(tokens[:16], **batch_kwargs())


@pytest.mark.parametrize("n", [2, 17, 33, 100, 101])
def test_eval_batches_cover_every_target_once(n: int) -> None:
    tokens = np.arange(n, dtype=np.uint16) + 1
    xs, ys = [], []
    for x, y in eval_batches(tokens, seq_len=8, batch_size=3):
        assert x.shape == y.shape and x.shape[1] == 8 and x.shape[0] <= 3
        mask = y != -100
        assert torch.equal(y[mask], x[mask] + 1)
        assert (x[~mask] == 0).all()
        xs.append(x[mask])
        ys.append(y[mask])
    assert torch.cat(ys).tolist() == tokens[1:].tolist()
    assert torch.cat(xs).tolist() == tokens[:-1].tolist()


def test_eval_batches_max_batches_is_a_deterministic_prefix() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    all_batches = list(eval_batches(tokens, seq_len=10, batch_size=4))
    first = list(eval_batches(tokens, seq_len=10, batch_size=4, max_batches=3))
    assert len(first) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(first, all_batches))
    assert list(eval_batches(np.zeros(1, np.uint16), seq_len=4, batch_size=2)) == []


def test_progress_prints_plain_lines_off_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rich.console import Console

    monkeypatch.setattr(progress_mod, "PLAIN_EVERY_S", 0.0)
    progress = progress_mod.Progress("encode", 100, Console(file=io.StringIO()))
    progress.update(50, 2_000_000)
    progress.close()
    assert "encode: 50/100 (50%)" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["txt", "jsonl"])
def test_progress_ends_at_its_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """The bars count bytes of text files or rows of tables and must end exactly full."""
    seen: dict[str, tuple[int, int, int]] = {}

    class Recording(progress_mod.Progress):
        def close(self) -> None:
            seen[self.description] = (self.done, self.total, self.nbytes)
            super().close()

    monkeypatch.setattr(pass_mod, "Progress", Recording)
    monkeypatch.setattr(tokenizer_train_mod, "Progress", Recording)
    monkeypatch.setattr(batches_mod, "BATCH_CHARS", 5000)
    if fmt == "txt":
        src = str(write_text(tmp_path / "s.txt", EXCERPT))
    else:
        src = str(shutil.copy(DATA / "grimm_stories.jsonl", tmp_path / "g.jsonl"))
    write_shards(make_cfg(tmp_path, source=src))
    meta = load_meta(tmp_path / "tokens")
    done, total, nbytes = seen["encode"]
    assert done == total and nbytes == meta["train"]["bytes"] + meta["val"]["bytes"]
    done, total, nbytes = seen["train tokenizer"]
    assert done == total and nbytes == meta["train"]["bytes"]


# ----------------------------------------------------------------------------- the CLI


@pytest.fixture
def good_run(tmp_path: Path) -> tuple[Path, Path]:
    """A config and a successful `minillm tokenize` of it: the state bad runs must not touch."""
    src = write_text(tmp_path / "s.txt", EXCERPT)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 64},
                "data": {"source": str(src), "vocab_size": 300, "out_dir": str(tmp_path / "out")},
                "train": {"seq_len": 32},
            }
        )
    )
    result = CliRunner().invoke(app, ["tokenize", str(config)])
    assert result.exit_code == 0, result.output
    for word in ("train", "val", "total", "bytes/token", "MB/s", "trained"):
        assert word in result.stdout
    return config, tmp_path / "out"


def test_tokenize_reuses_the_tokenizer(good_run: tuple[Path, Path]) -> None:
    config, out = good_run
    tokenizer = hashes(out)["tokenizer.json"]
    result = CliRunner().invoke(app, ["tokenize", str(config), "--force"])  # else up to date
    assert result.exit_code == 0 and "reused" in result.stdout
    assert hashes(out)["tokenizer.json"] == tokenizer


def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    """(extra CLI arguments, what the one error line must contain) for each kind of bad input."""
    write_text(tmp / "empty.txt", "")
    (tmp / "binary.txt").write_bytes(b"plain start\n\x89PNG\r\n\x1a\n\x00\x00")
    write_text(tmp / "books" / "a.txt", EXCERPT[:30_000])
    (tmp / "books" / "b.txt").write_bytes(EXCERPT[:30_000].encode() + b"\xc3\x28 broken")
    shutil.copy(DATA / "grimm_stories.jsonl", tmp / "grimm.jsonl")
    write_text(tmp / "notes.log", "a log\n")
    write_text(tmp / "a_file", "in the way\n")
    return [
        (["--set", f"data.source={tmp / 'missing.txt'}"], "missing.txt: data.source: no such"),
        (["--set", f"data.source={tmp / 'empty.txt'}"], "empty.txt: data.source: no text"),
        (["--set", f"data.source={tmp / 'binary.txt'}"], "binary.txt: data.source: not UTF-8"),
        (["--set", f"data.source={tmp / 'books'}"], "b.txt: data.source: not UTF-8 text at byte"),
        (
            ["--set", f"data.source={tmp / 'books'}", "--retrain"],
            "b.txt: data.source: not UTF-8 text at byte",
        ),
        (
            ["--set", f"data.source={tmp / 'grimm.jsonl'}", "--set", "data.text_field=body"],
            "grimm.jsonl: data.text_field: no column 'body' (columns found: title, text)",
        ),
        (["--set", f"data.source={tmp / 'notes.log'}"], "notes.log: data.format: cannot tell"),
        (["--set", "data.vocab_size=200", "--retrain"], "data.vocab_size: 200 is too small"),
        (["--set", "data.vocab_size=280"], "tokenizer.json: data.vocab_size: the existing"),
        (
            ["--set", f"data.out_dir={tmp / 'a_file' / 'out'}"],
            "a_file/out: data.out_dir: not writable",
        ),
        (
            ["--set", f"data.tokenizer={tmp / 'a_file' / 'tok.json'}"],
            "a_file: data.tokenizer: not writable",
        ),
    ]


def test_bad_input_is_one_line_and_touches_nothing(
    good_run: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    config, out = good_run
    before = hashes(out)
    for args, expected in _bad_inputs(tmp_path_factory.mktemp("bad")):
        result = CliRunner().invoke(app, ["tokenize", str(config), *args])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2, (args, result.output)
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
        assert expected in lines[0], (args, lines[0])
        assert "Traceback" not in result.output
        assert hashes(out) == before, args  # shards, meta and tokenizer untouched, no temp files


def test_unreachable_hub_is_one_line(
    good_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    def offline(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError(
            "Couldn't reach 'someone/stories' on the Hub (LocalEntryNotFoundError)"
        )

    monkeypatch.setattr(datasets, "load_dataset", offline)
    config, out = good_run
    result = CliRunner().invoke(
        app, ["tokenize", str(config), "--set", "data.source=someone/stories"]
    )
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: someone/stories: data.source: not a local file or folder, and the Hugging Face "
        "hub is unreachable to look it up"
    ]


def test_empty_rows_only_is_an_empty_corpus(tmp_path: Path) -> None:
    src = tmp_path / "blank.jsonl"
    src.write_text("".join(json.dumps({"text": ""}) + "\n" for _ in range(5)))
    with pytest.raises(ConfigError, match="blank.jsonl: data.source: no text"):
        write_shards(make_cfg(tmp_path, source=str(src)))
    assert not (tmp_path / "tokens" / "meta.json").exists()
