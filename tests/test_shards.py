"""Numbered shards, reading across them, and resuming an interrupted `minillm tokenize`.

Each test tokenizes a slice of the shipped Grimm stories (jsonl, one document a line) with a
300-token BPE; small `data.shard_tokens` and checkpoint intervals make several shards and many
checkpoints out of it.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import Config, config_from_dict
from minillm.data import encode_batches as batches_mod
from minillm.data import shard_staging as staging_mod
from minillm.data import tokenizer_train as tokenizer_train_mod
from minillm.data.batches import eval_batches, train_batch
from minillm.data.meta import load_meta, open_mask, open_split
from minillm.data.shard_reader import ShardedArray
from minillm.data.shard_writer import ShardWriter
from minillm.data.tokenize_pass import write_shards
from minillm.errors import ConfigError, UserError
from tests.test_chat import chat_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
GRIMM = (ROOT / "data" / "grimm_stories.jsonl").read_text(encoding="utf-8").splitlines()[:24]


@pytest.fixture(autouse=True)
def _small_steps(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Many encode batches and checkpoints per run; `datasets`' arrow files out of ~/.cache."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.getbasetemp() / "hf")
    monkeypatch.setattr(batches_mod, "BATCH_CHARS", 4000)
    monkeypatch.setattr(staging_mod, "CHECKPOINT_BYTES", 20_000)


def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "grimm.jsonl"
    if not src.exists():
        src.write_text("\n".join(GRIMM) + "\n", encoding="utf-8")
    return src


def cfg_with(tmp_path: Path, out: str = "tokens", **keys: Any) -> Config:
    data = {"source": str(corpus(tmp_path)), "vocab_size": 300, "out_dir": str(tmp_path / out)}
    return config_from_dict(
        {
            "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 64},
            "data": {**data, **keys},
            "train": {"seq_len": 32, "out_dir": str(tmp_path / "run")},
        }
    )


def files(folder: Path) -> dict[str, bytes]:
    """The top-level files of a folder by name (what a reader sees; not .partial/)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def interrupt_after(monkeypatch: pytest.MonkeyPatch, calls: int, error: BaseException) -> None:
    """Make the `calls`+1-th shard write raise `error` (Ctrl-C, or anything else)."""
    real, seen = ShardWriter.write, []

    def write(self: Any, ids: np.ndarray) -> None:
        seen.append(1)
        if len(seen) > calls:
            raise error
        real(self, ids)

    monkeypatch.setattr(ShardWriter, "write", write)


def count_writes(monkeypatch: pytest.MonkeyPatch, cfg: Config) -> int:
    real, seen = ShardWriter.write, []

    def write(self: Any, ids: np.ndarray) -> None:
        seen.append(1)
        real(self, ids)

    with monkeypatch.context() as m:
        m.setattr(ShardWriter, "write", write)
        write_shards(cfg)
    return len(seen)


# ----------------------------------------------------------------------------- shards


def test_a_small_corpus_is_one_shard_per_split(tmp_path: Path) -> None:
    write_shards(cfg_with(tmp_path))
    out = tmp_path / "tokens"
    names = {p.name for p in out.iterdir()}
    assert names == {"meta.json", "tokenizer.json", "train_000000.bin", "val_000000.bin"}
    meta = load_meta(out)
    for split in ("train", "val"):
        (shard,) = meta[split]["shards"]
        assert shard["tokens"] == meta[split]["tokens"]
        assert shard["file_bytes"] == (out / shard["file"]).stat().st_size
        assert isinstance(open_split(out, split), np.memmap)  # one shard: the plain memmap


def test_many_shards_hold_the_one_shard_tokens(tmp_path: Path) -> None:
    write_shards(cfg_with(tmp_path, "one"))
    (tmp_path / "many").mkdir()
    shutil.copy(tmp_path / "one" / "tokenizer.json", tmp_path / "many" / "tokenizer.json")
    write_shards(cfg_with(tmp_path, "many", shard_tokens=1000))
    meta = load_meta(tmp_path / "many")
    shards = meta["train"]["shards"]
    assert len(shards) > 5 and meta["shard_tokens"] == 1000
    assert [s["tokens"] for s in shards[:-1]] == [1000] * (len(shards) - 1)
    assert [s["file"] for s in shards[:2]] == ["train_000000.bin", "train_000001.bin"]
    for split in ("train", "val"):
        many, one = open_split(tmp_path / "many", split), open_split(tmp_path / "one", split)
        assert np.array_equal(np.asarray(many), np.asarray(one))
    assert isinstance(open_split(tmp_path / "many", "train"), ShardedArray)


def test_a_missing_or_damaged_middle_shard_is_one_error_line(tmp_path: Path) -> None:
    write_shards(cfg_with(tmp_path, shard_tokens=1000))
    out = tmp_path / "tokens"
    shard = out / "train_000003.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"train_000003.bin: data.out_dir: sha256 differs"):
        open_split(out, "train")
    shard.unlink()
    with pytest.raises(UserError, match=r"train_000003.bin: data.out_dir: missing; run `minillm"):
        open_split(out, "train")


def test_a_shard_is_hashed_once_per_version_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a corpus again reads no shard whose size, inode and times are those it had when it
    was last hashed; a shard written since, even given its old modification time back, is hashed
    (and refused) again; a file changed within the last seconds is never remembered."""
    import os

    from minillm.runtime import files as files_mod

    monkeypatch.setenv("MINILLM_CACHE_DIR", str(tmp_path / "cache"))
    write_shards(cfg_with(tmp_path, shard_tokens=1000))
    out = tmp_path / "tokens"
    hashed: list[str] = []
    real = files_mod.sha256_file
    monkeypatch.setattr(files_mod, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    n = len(load_meta(out)["train"]["shards"])
    open_split(out, "train")
    open_split(out, "train")
    assert len(hashed) == 2 * n  # just written: too fresh to remember (a write could keep times)
    monkeypatch.setattr(files_mod.HashCache, "SETTLED_S", 0.0)
    hashed.clear()
    open_split(out, "train")
    open_split(out, "train")
    assert len(hashed) == n  # settled: hashed by the first open only
    shard = out / "train_000002.bin"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[3] ^= 1
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old modification time back
    hashed.clear()
    with pytest.raises(UserError, match=r"train_000002.bin: data.out_dir: sha256 differs"):
        open_split(out, "train")
    assert hashed == ["train_000002.bin"]


def test_shards_open_without_a_home_for_the_hash_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minillm.runtime import files as files_mod

    write_shards(cfg_with(tmp_path))

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(files_mod, "cache_dir", no_home)
    assert len(open_split(tmp_path / "tokens", "train")) > 0


def test_version_1_shards_still_load(tmp_path: Path) -> None:
    """Shards of meta.json version 1 (train.bin, val.bin) from before the numbering."""
    write_shards(cfg_with(tmp_path))
    out = tmp_path / "tokens"
    before = {s: open_split(out, s).tolist() for s in ("train", "val")}
    meta = json.loads((out / "meta.json").read_text())
    meta["version"] = 1
    for s in ("train", "val"):
        (out / f"{s}_000000.bin").rename(out / f"{s}.bin")
        meta[s].pop("shards")
    (out / "meta.json").write_text(json.dumps(meta))
    assert {s: open_split(out, s).tolist() for s in ("train", "val")} == before
    write_shards(cfg_with(tmp_path))  # tokenizing again replaces them with numbered shards
    assert not (out / "train.bin").exists() and load_meta(out)["version"] == 2


def test_chat_masks_are_sharded_beside_their_tokens(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "chat.jsonl", chat_rows(80))
    keys = {"source": str(src), "text_field": "messages"}
    write_shards(cfg_with(tmp_path, "one", **keys))
    (tmp_path / "many").mkdir()
    shutil.copy(tmp_path / "one" / "tokenizer.json", tmp_path / "many" / "tokenizer.json")
    write_shards(cfg_with(tmp_path, "many", shard_tokens=300, **keys))
    meta = load_meta(tmp_path / "many")
    assert len(meta["train"]["shards"]) > 3
    assert all("mask_sha256" in s for s in meta["train"]["shards"])
    assert (tmp_path / "many" / "train_000001.mask").stat().st_size == 300
    one, many = load_meta(tmp_path / "one"), meta
    for split in ("train", "val"):
        a = np.asarray(open_mask(tmp_path / "one", split, one))
        b = np.asarray(open_mask(tmp_path / "many", split, many))
        assert a.dtype == b.dtype == np.bool_ and np.array_equal(a, b) and a.any()
    assert many["train"]["targets"] == one["train"]["targets"]


# ----------------------------------------------------------------------------- workers


def test_every_worker_count_writes_the_same_shards(tmp_path: Path) -> None:
    """1 (the main process), 2 and 4 worker processes: the same files, byte for byte; the
    tokenizer is trained once and reused so that only the encoding differs."""
    write_shards(cfg_with(tmp_path, "w1", num_proc=1, shard_tokens=1500))
    for n in (2, 4):
        (tmp_path / f"w{n}").mkdir()
        shutil.copy(tmp_path / "w1" / "tokenizer.json", tmp_path / f"w{n}" / "tokenizer.json")
        write_shards(cfg_with(tmp_path, f"w{n}", num_proc=n, shard_tokens=1500))
        assert files(tmp_path / f"w{n}") == files(tmp_path / "w1")
    assert len(load_meta(tmp_path / "w1")["train"]["shards"]) > 3


def test_every_worker_count_writes_the_same_chat_shards_and_masks(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "chat.jsonl", chat_rows(80))
    keys = {"source": str(src), "text_field": "messages", "shard_tokens": 700}
    write_shards(cfg_with(tmp_path, "w1", num_proc=1, **keys))
    (tmp_path / "w3").mkdir()
    shutil.copy(tmp_path / "w1" / "tokenizer.json", tmp_path / "w3" / "tokenizer.json")
    write_shards(cfg_with(tmp_path, "w3", num_proc=3, **keys))
    assert files(tmp_path / "w3") == files(tmp_path / "w1")
    assert (tmp_path / "w1" / "train_000001.mask").is_file()


def test_workers_start_only_for_a_corpus_of_more_than_one_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minillm.data import encode_pool

    started: list[int] = []
    real = encode_pool.ProcessPoolExecutor

    def spy(n: int, **kw: Any) -> Any:
        started.append(n)
        return real(n, **kw)

    monkeypatch.setattr(encode_pool, "ProcessPoolExecutor", spy)
    monkeypatch.setattr(batches_mod, "BATCH_CHARS", 10**9)  # every split: one batch
    monkeypatch.setattr(staging_mod, "CHECKPOINT_BYTES", 10**9)
    write_shards(cfg_with(tmp_path, "one", num_proc=2))
    assert started == []
    monkeypatch.setattr(batches_mod, "BATCH_CHARS", 4000)
    write_shards(
        cfg_with(tmp_path, "many", num_proc=2, tokenizer=str(tmp_path / "one" / "tokenizer.json"))
    )
    assert started == [2]


def _die_at_document_18(tok: Any, pieces: list[str], *args: Any) -> Any:
    """encode_text, but the worker process dies on the batch holding document 18's opening."""
    import os

    from minillm.data.encode_pool import encode_text

    if any(json.loads(GRIMM[18])["text"][:60] in p for p in pieces):
        os._exit(3)
    return encode_text(tok, pieces, *args)  # tok: the conventions


@pytest.mark.slow
def test_a_dead_worker_is_one_error_line_and_the_pass_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_shards(cfg_with(tmp_path, "straight", num_proc=2, shard_tokens=1500))
    cfg = cfg_with(tmp_path, "died", num_proc=2, shard_tokens=1500)
    with monkeypatch.context() as m:
        m.setattr(batches_mod, "encode_text", _die_at_document_18)
        with pytest.raises(UserError, match="an encoding worker process died"):
            write_shards(cfg)
    assert json.loads((tmp_path / "died" / ".partial" / "state.json").read_text())["documents"]
    assert write_shards(cfg)["resumed_documents"] > 0
    assert files(tmp_path / "died") == files(tmp_path / "straight")


def test_workers_run_from_a_script_without_a_main_guard(tmp_path: Path) -> None:
    """spawn runs the main script again in each worker unless told otherwise: a user's script
    that calls prepare_data at the top level must not start over (or fail) in the workers."""
    script = tmp_path / "prepare.py"
    script.write_text(
        f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
print("started", flush=True)
from minillm.config import config_from_dict
from minillm.data import encode_batches, tokenize_pass
encode_batches.BATCH_CHARS = 4000
data = {{"source": {str(corpus(tmp_path))!r}, "vocab_size": 300, "num_proc": 2,
        "out_dir": {str(tmp_path / "out")!r}}}
model = {{"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 64}}
tokenize_pass.write_shards(
    config_from_dict({{"model": model, "data": data, "train": {{"seq_len": 32}}}})
)
""",
        encoding="utf-8",
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("started") == 1  # the workers did not run the script
    assert load_meta(tmp_path / "out")["train"]["tokens"] > 0


@pytest.mark.slow
def test_workers_exit_when_the_main_process_is_killed(tmp_path: Path) -> None:
    """kill -9 runs no cleanup: the workers notice their parent is gone and exit by themselves."""
    script = f"""
import os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from tokenizers import Tokenizer
from minillm.data.encode_pool import EncodePool, encode_text
from minillm.tokenizer.bpe import train_tokenizer
tok = train_tokenizer([open({str(ROOT / "data" / "grimm_stories.jsonl")!r}).read()], 300)
from minillm.tokenizer.conventions import Conventions
pool = EncodePool(Conventions.of_own(tok), 2, lambda encoded, tag: None)
for _ in range(4):
    pool.submit(encode_text, ["a b"], [True], 0, "<u2", tag=None)
pool.drain()
print(*[p.pid for p in pool.workers._processes.values()], flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    workers = [int(pid) for pid in proc.stdout.readline().split()]
    assert len(workers) == 2
    proc.kill()
    _, err = proc.communicate(timeout=30)  # until the workers and the tracker close its stderr
    assert "leaked" not in err and "Warning" not in err, err
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
        time.sleep(0.2)
    alive = [p for p in workers if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
    assert not alive, f"workers still running after their parent's kill -9: {alive}"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


# ----------------------------------------------------------------------------- batches


def test_batches_across_shard_boundaries_equal_one_array() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=5000).astype(np.uint16)
    mask = rng.random(5000) < 0.5
    cuts = [0, 7, 7, 1000, 1001, 3333, 5000]  # an empty shard, a one-token shard
    sharded = ShardedArray([tokens[a:b] for a, b in zip(cuts, cuts[1:])])
    sharded_mask = ShardedArray([mask[a:b] for a, b in zip(cuts, cuts[1:])])
    assert len(sharded) == 5000 and np.array_equal(np.asarray(sharded), tokens)
    for lo, hi in [(0, 7), (5, 9), (6, 1002), (999, 4000), (4990, 5100), (3000, 3000)]:
        assert np.array_equal(sharded[lo:hi], tokens[lo:hi]), (lo, hi)
    assert sharded[1000] == tokens[1000] and sharded[-1] == tokens[-1]
    kw = dict(world_size=2, batch_size=4, grad_accum=2, seq_len=64)
    for step in range(20):
        for rank in range(2):
            a = train_batch(tokens, seed=1, step=step, rank=rank, mask=mask, eot_id=5, **kw)
            b = train_batch(
                sharded, seed=1, step=step, rank=rank, mask=sharded_mask, eot_id=5, **kw
            )
            for x, y in zip(a, b, strict=True):
                assert all(np.array_equal(u, v) for u, v in zip(x, y, strict=True))
    a, b = (
        eval_batches(tokens, seq_len=64, batch_size=8),
        eval_batches(sharded, seq_len=64, batch_size=8),
    )
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resume_after_an_interruption_equals_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    writes = count_writes(monkeypatch, cfg_with(tmp_path, "straight", shard_tokens=1500))
    at = random.Random(seed).randrange(writes // 3, writes)  # after the first checkpoints
    cfg = cfg_with(tmp_path, "resumed", shard_tokens=1500)
    with monkeypatch.context() as m:
        interrupt_after(m, at, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            write_shards(cfg)
    out = tmp_path / "resumed"
    state = json.loads((out / ".partial" / "state.json").read_text())
    assert 0 < state["documents"] < len(GRIMM) and not (out / "meta.json").exists()
    summary = write_shards(cfg)
    assert summary["resumed_documents"] == state["documents"]  # those were not encoded again
    total = summary["splits"]["total"]
    done = sum(st["bytes"] for st in state["stats"].values())
    assert 0 < done < total["bytes"]  # the pace counts the bytes this pass encoded, only:
    assert total["mb_per_s"] * total["seconds"] * 1e6 == pytest.approx(total["bytes"] - done)
    assert files(out) == files(tmp_path / "straight")  # tokenizer, every shard and meta.json
    assert not (out / ".partial").exists()


@pytest.mark.slow
def test_kill_9_then_rerun_equals_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGKILL mid-pass (no cleanup runs), then `minillm tokenize` again."""
    writes = count_writes(monkeypatch, cfg_with(tmp_path, "straight", shard_tokens=1500))
    at = random.Random(3).randrange(writes // 4, writes)
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
import datasets.config
datasets.config.HF_DATASETS_CACHE = {str(tmp_path / "hf")!r}
from minillm.config import config_from_dict
from minillm.data import encode_batches, shard_staging as staging, tokenize_pass
from minillm.data.shard_writer import ShardWriter
encode_batches.BATCH_CHARS, staging.CHECKPOINT_BYTES = 4000, 20_000
real, n = ShardWriter.write, [0]
def write(self, ids):
    n[0] += 1
    if n[0] > {at}:
        os.kill(os.getpid(), signal.SIGKILL)
    real(self, ids)
ShardWriter.write = write
data = {{"source": {str(corpus(tmp_path))!r}, "vocab_size": 300, "shard_tokens": 1500,
        "out_dir": {str(tmp_path / "killed")!r}}}
model = {{"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 64}}
train = {{"seq_len": 32}}
tokenize_pass.write_shards(config_from_dict({{"model": model, "data": data, "train": train}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    out = tmp_path / "killed"
    assert (out / ".partial" / "state.json").is_file()
    result = CliRunner().invoke(
        app, ["tokenize", str(write_config(tmp_path, "killed")), "--set", "data.shard_tokens=1500"]
    )
    assert result.exit_code == 0, result.output
    assert "resumed after" in result.stdout
    assert files(out) == files(tmp_path / "straight")


def write_config(tmp_path: Path, out: str) -> Path:
    import yaml

    path = tmp_path / f"{out}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 64},
                "data": {"source": str(corpus(tmp_path)), "vocab_size": 300,
                         "out_dir": str(tmp_path / out)},
                "train": {"seq_len": 32},
            }
        )
    )  # fmt: skip
    return path


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"seed": 7}, "data.seed"),
        ({"shard_tokens": 999}, "data.shard_tokens"),
        ({"val_fraction": 0.2}, "data.val_fraction"),
        ({}, "data.source"),  # the file itself changed
    ],
)
def test_a_changed_config_or_source_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: dict[str, Any], key: str
) -> None:
    cfg = cfg_with(tmp_path, shard_tokens=1500)
    with monkeypatch.context() as m:
        interrupt_after(m, 12, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            write_shards(cfg)
    if not change:
        with open(corpus(tmp_path), "a", encoding="utf-8") as f:
            f.write(GRIMM[0] + "\n")
    with pytest.raises(ConfigError, match=f"{key}: changed since the interrupted"):
        write_shards(cfg_with(tmp_path, **{"shard_tokens": 1500, **change}))
    assert (tmp_path / "tokens" / ".partial" / "state.json").is_file()  # refused: kept as it was
    args = [f"data.{k}={v}" for k, v in {"shard_tokens": 1500, **change}.items()]
    result = CliRunner().invoke(
        app, ["tokenize", str(write_config(tmp_path, "tokens"))]
        + [a for arg in args for a in ("--set", arg)]
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and f"{key}: changed" in lines[0], lines
    # --retrain starts over, and the result is that of a fresh run.
    write_shards(cfg_with(tmp_path, **{"shard_tokens": 1500, **change}), retrain=True)
    write_shards(cfg_with(tmp_path, "fresh", **{"shard_tokens": 1500, **change}))
    assert files(tmp_path / "tokens") == files(tmp_path / "fresh")


# ----------------------------------------------------------------------------- tokenizer sample


def recording_trainer(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Record the texts each tokenizer training is given."""
    real, runs = tokenizer_train_mod.train_tokenizer, []

    def train(texts: Any, vocab_size: int) -> Any:
        runs.append(list(texts))
        return real(iter(runs[-1]), vocab_size)

    monkeypatch.setattr(tokenizer_train_mod, "train_tokenizer", train)
    return runs


def test_the_tokenizer_sample_is_deterministic_and_spread_over_the_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = recording_trainer(monkeypatch)
    sample = 40_000
    write_shards(cfg_with(tmp_path, "a", tokenizer_sample_bytes=sample))
    write_shards(cfg_with(tmp_path, "b", tokenizer_sample_bytes=sample))
    write_shards(cfg_with(tmp_path, "all", tokenizer_sample_bytes=0))
    a, b, whole = runs
    assert a == b  # the same pieces, so the same tokenizer
    tok = {d: (tmp_path / d / "tokenizer.json").read_bytes() for d in ("a", "b", "all")}
    assert tok["a"] == tok["b"] != tok["all"]
    chars = sum(len(p) for p in a)
    assert 0.6 * sample < chars < 1.3 * sample < sum(len(p) for p in whole)
    # Spread over the split: pieces from its first and from its last quarter are in the sample.
    position = {p: i for i, p in enumerate(whole)}
    taken = sorted(position[p] for p in a)
    assert taken[0] < len(whole) // 4 and taken[-1] > 3 * len(whole) // 4
    # A corpus smaller than the sample trains on all of it: the default changes nothing small.
    write_shards(cfg_with(tmp_path, "default"))
    assert runs[-1] == whole


def test_the_tokenizer_sample_of_a_single_text_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = recording_trainer(monkeypatch)
    src = tmp_path / "book.txt"
    src.write_bytes((ROOT / "data" / "tinyshakespeare.txt").read_bytes()[:400_000])
    write_shards(cfg_with(tmp_path, source=str(src), tokenizer_sample_bytes=50_000))
    write_shards(cfg_with(tmp_path, "all", source=str(src), tokenizer_sample_bytes=0))
    sample, whole = runs
    # One document: pieces of it are taken, off by at most one piece from the 50,000 bytes.
    assert abs(sum(len(p) for p in sample) - 50_000) <= max(len(p) for p in whole)
    assert sum(len(p) for p in whole) > 300_000 and set(sample) < set(whole)


def test_training_on_many_shards_equals_training_on_one(tmp_path: Path) -> None:
    """The trainer reads a sharded split as one array: same batches, bit-identical weights."""
    import torch

    from tests.helpers import make_trainer

    write_shards(cfg_with(tmp_path, "one"))
    (tmp_path / "many").mkdir()
    shutil.copy(tmp_path / "one" / "tokenizer.json", tmp_path / "many" / "tokenizer.json")
    write_shards(cfg_with(tmp_path, "many", shard_tokens=700))
    weights = []
    for out in ("one", "many"):
        cfg = config_from_dict(
            {
                "model": dict(d_model=32, n_layer=1, n_head=2, ffn_hidden=64, max_seq_len=64),
                "data": {"source": str(corpus(tmp_path)), "vocab_size": 300,
                         "out_dir": str(tmp_path / out)},
                "train": dict(out_dir=str(tmp_path / f"run_{out}"), batch_size=4, seq_len=48,
                              max_steps=4, eval_every=2, eval_steps=2, ckpt_every=4,
                              device="cpu", precision="fp32", warmup_steps=1),
            }
        )  # fmt: skip
        trainer = make_trainer(cfg, verbose=False)
        try:
            trainer.fit()
        finally:
            trainer.close()
        weights.append(trainer.model.state_dict())
    assert len(load_meta(tmp_path / "many")["train"]["shards"]) > 20
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name


def test_the_default_worker_count_keeps_to_the_container_cpu_quota(tmp_path: Path) -> None:
    import os

    from minillm.runtime.cpus import default_num_proc

    cpus = len(os.sched_getaffinity(0))
    assert default_num_proc(tmp_path / "none") == cpus  # no cgroup files: the affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert default_num_proc(tmp_path) == cpus  # no quota
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert default_num_proc(tmp_path) == 1  # half a CPU: one worker
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert default_num_proc(v1) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert default_num_proc(v1) == cpus
