"""`data.streaming`, the prefixes `data.max_documents` / `data.max_bytes`, `data.val_documents`.

Rows come from the shipped Grimm stories (jsonl, one story a line), tokenized with a 300-token BPE.
A stream must give the very files a load does: the same shards, meta.json and tokenizer.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import Config, config_from_dict
from minillm.data import encode_batches as batches_mod
from minillm.data import shard_staging as staging_mod
from minillm.data import tokenizer_train as tokenizer_train_mod
from minillm.data.meta import load_meta, stale_data_keys
from minillm.data.sources import open_corpus
from minillm.data.table import TableCorpus
from minillm.data.tokenize_pass import write_shards
from minillm.errors import ConfigError
from minillm.runtime.progress import Progress
from tests.test_chat import chat_rows, write_jsonl
from tests.test_data import decoded_docs
from tests.test_shards import count_writes, files, interrupt_after

ROOT = Path(__file__).resolve().parents[1]
GRIMM = [
    json.loads(line)["text"]
    for line in (ROOT / "data" / "grimm_stories.jsonl").read_text(encoding="utf-8").splitlines()
][:24]


@pytest.fixture(autouse=True)
def _hf_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """`datasets`' cache in the test's folder, where a test can look for arrow files."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    return tmp_path / "hf"


def rows_file(tmp_path: Path, fmt: str, texts: list[str], name: str = "rows") -> Path:
    """`texts` as a jsonl or parquet file, one row each (with a title column besides)."""
    rows = [{"title": f"story {i}", "text": t} for i, t in enumerate(texts)]
    if fmt == "jsonl":
        return write_jsonl(tmp_path / f"{name}.jsonl", rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)  # several row groups
    return path


def cfg_for(tmp_path: Path, source: Path, out: str, **keys: Any) -> Config:
    data = {"source": str(source), "vocab_size": 300, "out_dir": str(tmp_path / out), **keys}
    return config_from_dict(
        {
            "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 64},
            "data": data,
            "train": {"seq_len": 32, "out_dir": str(tmp_path / "run")},
        }
    )


def arrow_files(folder: Path) -> list[Path]:
    return list(folder.rglob("*.arrow"))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize(
    "keys",
    [{"val_documents": 3}, {"val_documents": 2, "max_documents": 15, "max_bytes": 40_000}],
    ids=["whole", "prefix"],
)
def test_a_stream_gives_the_files_a_load_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, keys: dict[str, Any]
) -> None:
    import datasets.config

    src = rows_file(tmp_path, fmt, GRIMM)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_stream")
    write_shards(cfg_for(tmp_path, src, "streamed", streaming=True, **keys))
    assert not arrow_files(tmp_path / "hf_stream")  # nothing converted into the cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_load")
    write_shards(cfg_for(tmp_path, src, "loaded", **keys))
    assert arrow_files(tmp_path / "hf_load")  # (a load does convert: the check above can fail)
    streamed, loaded = files(tmp_path / "streamed"), files(tmp_path / "loaded")
    assert set(streamed) == {"meta.json", "tokenizer.json", "train_000000.bin", "val_000000.bin"}
    assert streamed == loaded  # byte for byte: shards, tokenizer.json and meta.json
    meta = load_meta(tmp_path / "streamed")
    assert meta["val"]["documents"] == keys["val_documents"]
    assert {k: meta["data"][k] for k in keys} == keys and "streaming" not in meta["data"]


@pytest.mark.parametrize("streaming", [False, True])
def test_max_documents_takes_the_first_rows_and_val_documents_the_first_of_those(
    tmp_path: Path, streaming: bool
) -> None:
    texts = GRIMM[:12]
    texts[2] = ""  # an empty row: read (it counts), but no document
    src = rows_file(tmp_path, "jsonl", texts)
    cfg = cfg_for(tmp_path, src, "tok", streaming=streaming, max_documents=10, val_documents=3)
    write_shards(cfg)
    meta = load_meta(tmp_path / "tok")
    assert (meta["train"]["documents"], meta["val"]["documents"]) == (7, 2)
    assert decoded_docs(tmp_path / "tok", "val") == texts[:2]
    assert decoded_docs(tmp_path / "tok", "train") == texts[3:10]
    assert meta["train"]["bytes"] == sum(len(t.encode()) for t in texts[3:10])
    # `minillm train` warns when the prefix changed since, not when only the reading did.
    assert stale_data_keys(meta, replace(cfg.data, streaming=not streaming)) == []
    assert stale_data_keys(meta, replace(cfg.data, max_documents=11)) == ["data.max_documents"]


@pytest.mark.parametrize("streaming", [False, True])
def test_max_bytes_stops_after_the_document_that_reaches_it(
    tmp_path: Path, streaming: bool
) -> None:
    src = rows_file(tmp_path, "parquet", GRIMM)
    limit = sum(len(t.encode()) for t in GRIMM[:5]) + 1  # reached inside the sixth row
    cfg = cfg_for(tmp_path, src, "tok", streaming=streaming, max_bytes=limit, val_documents=1)
    write_shards(cfg)
    assert decoded_docs(tmp_path / "tok", "val") == GRIMM[:1]
    assert decoded_docs(tmp_path / "tok", "train") == GRIMM[1:6]  # the sixth taken whole


def test_max_bytes_cuts_a_text_file_at_a_safe_cut_after_it(tmp_path: Path) -> None:
    text = "\n".join(GRIMM[:6]) + "\n"
    src = tmp_path / "stories.txt"
    src.write_text(text, encoding="utf-8")
    write_shards(cfg_for(tmp_path, src, "tok", max_bytes=20_000, max_documents=1))
    meta = load_meta(tmp_path / "tok")
    kept = meta["train"]["bytes"] + meta["val"]["bytes"]
    assert 20_000 <= kept < 20_000 + 4096
    train, val = decoded_docs(tmp_path / "tok", "train"), decoded_docs(tmp_path / "tok", "val")
    assert (train[0] + val[0]).encode() == text.encode()[:kept]  # a prefix, tail split kept


def test_val_documents_takes_the_first_text_files(tmp_path: Path) -> None:
    for i, story in enumerate(GRIMM[:8]):
        (tmp_path / "books").mkdir(exist_ok=True)
        (tmp_path / "books" / f"{i:02d}.txt").write_text(story, encoding="utf-8")
    write_shards(cfg_for(tmp_path, tmp_path / "books", "tok", val_documents=2))
    assert decoded_docs(tmp_path / "tok", "val") == GRIMM[:2]
    assert decoded_docs(tmp_path / "tok", "train") == GRIMM[2:8]


def test_val_documents_of_every_document_is_the_empty_train_split(tmp_path: Path) -> None:
    src = rows_file(tmp_path, "jsonl", GRIMM[:4])
    with pytest.raises(ConfigError, match="val_documents"):
        write_shards(cfg_for(tmp_path, src, "tok", streaming=True, val_documents=4))
    assert not (tmp_path / "tok" / "meta.json").exists()


def test_too_many_val_documents_of_a_counted_corpus_fail_before_any_pass(tmp_path: Path) -> None:
    """A loaded table or a folder of files is counted up front: no tokenizer training first."""
    src = rows_file(tmp_path, "jsonl", GRIMM[:6])
    with pytest.raises(ConfigError, match=r"val_documents: 6, but the corpus has 5 documents kept"):
        open_corpus(cfg_for(tmp_path, src, "tok", val_documents=6, max_documents=5).data)
    folder = tmp_path / "texts"
    folder.mkdir()
    for k, text in enumerate(GRIMM[:3]):
        (folder / f"{k}.txt").write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"val_documents: 3, but the corpus has 3 documents:"):
        open_corpus(cfg_for(tmp_path, folder, "tok", val_documents=3).data)


def test_empty_files_are_never_the_validation_split(tmp_path: Path) -> None:
    """The random pick is drawn among files with text; one file with text is split at its tail."""
    folder = tmp_path / "texts"
    folder.mkdir()
    texts = GRIMM[:4]
    for k in range(12):
        (folder / f"{k:02d}.txt").write_text(texts[k] if k < 4 else "", encoding="utf-8")
    for seed in range(6):
        corpus = open_corpus(cfg_for(tmp_path, folder, "tok", seed=seed).data)
        splits = [d.split for d in corpus.documents()]
        assert len(splits) == 4 and "val" in splits and "train" in splits
    for k in range(1, 4):
        (folder / f"{k:02d}.txt").write_text("", encoding="utf-8")
    train, val = open_corpus(cfg_for(tmp_path, folder, "tok").data).documents()
    assert (train.split, val.split) == ("train", "val") and train.path == val.path


def test_streaming_without_val_documents_is_one_error_line(tmp_path: Path) -> None:
    src = rows_file(tmp_path, "jsonl", GRIMM[:4])
    config = tmp_path / "stream.yaml"
    raw = {
        "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 64},
        "data": {"source": str(src), "vocab_size": 300, "out_dir": str(tmp_path / "tok")},
        "train": {"seq_len": 32, "out_dir": str(tmp_path / "run")},
    }
    raw["data"]["streaming"] = True
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    result = CliRunner().invoke(app, ["tokenize", str(config)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "data.val_documents" in lines[0] and "stream" in lines[0]
    assert not (tmp_path / "tok").exists()


def test_a_stream_fails_like_a_load_on_bad_input(tmp_path: Path) -> None:
    src = rows_file(tmp_path, "jsonl", GRIMM[:4])
    with pytest.raises(ConfigError) as err:
        cfg = cfg_for(tmp_path, src, "tok", streaming=True, val_documents=1, text_field="body")
        open_corpus(cfg.data)
    assert err.value.key == "data.text_field" and "columns found: title, text" in str(err.value)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(src.read_text() + "{not json\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        write_shards(cfg_for(tmp_path, broken, "tok", streaming=True, val_documents=1))
    assert err.value.key == "data.source" and err.value.file == str(broken)
    assert "cannot read as json" in err.value.message


def test_chat_rows_stream_too(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "chat.jsonl", chat_rows(60))
    keys = {"text_field": "messages", "val_documents": 6}
    write_shards(cfg_for(tmp_path, src, "streamed", streaming=True, **keys))
    write_shards(cfg_for(tmp_path, src, "loaded", **keys))
    assert files(tmp_path / "streamed") == files(tmp_path / "loaded")
    assert load_meta(tmp_path / "streamed")["loss_on"] == "assistant"


def test_a_stream_of_unknown_columns_decides_from_its_first_row(tmp_path: Path) -> None:
    """An IterableDataset whose features are unknown until read (datasets' json, at times)."""
    import datasets

    rows = chat_rows(5)
    ds = datasets.IterableDataset.from_generator(lambda: iter(rows))
    assert ds.features is None
    data = cfg_for(tmp_path, tmp_path, "tok", text_field="messages", val_documents=1).data
    docs = list(TableCorpus(ds, [], "hub", data, "someone/chat").documents())
    assert [d.split for d in docs] == ["val"] + ["train"] * 4
    assert [d.messages for d in docs] == [r["messages"] for r in rows]
    texts = datasets.IterableDataset.from_generator(lambda: iter([{"body": "x"}]))
    with pytest.raises(ConfigError, match="columns found: body"):
        TableCorpus(texts, [], "hub", data, "someone/texts")


def interrupted_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src: Path, at: float = 0.75
) -> tuple[Config, dict[str, Any]]:
    """`src` tokenized as a stream (3 validation documents, small batches and checkpoints) into
    straight/, and again into resumed/, interrupted after a share `at` of its shard writes: that
    run's config and checkpoint."""
    monkeypatch.setattr(batches_mod, "BATCH_CHARS", 4000)
    monkeypatch.setattr(staging_mod, "CHECKPOINT_BYTES", 20_000)
    keys = {"streaming": True, "val_documents": 3, "shard_tokens": 1500}
    writes = count_writes(monkeypatch, cfg_for(tmp_path, src, "straight", **keys))
    cfg = cfg_for(tmp_path, src, "resumed", **keys)
    with monkeypatch.context() as m:
        interrupt_after(m, int(writes * at), KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            write_shards(cfg)
    return cfg, json.loads((tmp_path / "resumed" / ".partial" / "state.json").read_text())


def test_resume_of_a_stream_equals_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = rows_file(tmp_path, "parquet", GRIMM)
    at = random.Random(0).uniform(0.5, 0.99)  # after a checkpoint or two
    cfg, state = interrupted_stream(tmp_path, monkeypatch, src, at)
    keys = {"streaming": True, "val_documents": 3, "shard_tokens": 1500}
    assert 0 < state["documents"] < len(GRIMM)
    assert state["inputs"]["data.val_documents"] == 3  # a changed one is refused (below)
    summary = write_shards(cfg)
    assert summary["resumed_documents"] == state["documents"]
    assert files(tmp_path / "resumed") == files(tmp_path / "straight")
    # A changed prefix is refused on resume, naming the key.
    with monkeypatch.context() as m:
        interrupt_after(m, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            write_shards(cfg_for(tmp_path, src, "again", **keys))
    with pytest.raises(ConfigError) as err:
        write_shards(cfg_for(tmp_path, src, "again", **{**keys, "max_documents": 10}))
    assert err.value.key == "data.max_documents"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_resumed_stream_starts_reading_at_its_cursor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """The rows before the checkpoint's cursor are not read again (a hub dataset is not
    downloaded again from its start), and the shards are those of an uninterrupted run."""
    import datasets

    from minillm.data import table as table_mod

    monkeypatch.setattr(table_mod, "ROWS_PER_BATCH", 4)  # many batches, many cursors
    texts = GRIMM + [""] + GRIMM[:5]  # an empty row: counted as read, no document
    cfg, state = interrupted_stream(tmp_path, monkeypatch, rows_file(tmp_path, fmt, texts))
    cursor = state["cursor"]
    assert 0 < cursor["row"] and cursor["documents"] <= state["documents"]
    read: list[int] = []
    real = datasets.IterableDataset.iter

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:  # the rows the stream yields
        for batch in real(self, *args, **kwargs):
            read.append(len(next(iter(batch.values()))))
            yield batch

    monkeypatch.setattr(datasets.IterableDataset, "iter", counting)
    assert write_shards(cfg)["resumed_documents"] == state["documents"]
    assert sum(read) == len(texts) - cursor["row"]  # from the cursor on, nothing before it
    assert files(tmp_path / "resumed") == files(tmp_path / "straight")


def test_a_hub_dataset_trains_the_tokenizer_on_its_first_sample_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub dataset's size is unknown: the tokenizer reads a prefix of the train split."""
    import datasets

    seen: list[str] = []
    real = tokenizer_train_mod.train_tokenizer

    def recording(texts: Any, vocab_size: int) -> Any:
        seen.extend(texts)
        return real(iter(seen), vocab_size)

    monkeypatch.setattr(tokenizer_train_mod, "train_tokenizer", recording)
    ds = datasets.IterableDataset.from_generator(lambda: iter({"text": t} for t in GRIMM))
    data = cfg_for(tmp_path, tmp_path, "tok", val_documents=2, tokenizer_sample_bytes=30_000).data
    corpus = TableCorpus(ds, [], "hub", data, "someone/grimm")
    from rich.console import Console

    tokenizer_train_mod.train_on_corpus(corpus, data, Console(quiet=True))
    sizes = [len(t.encode()) for t in GRIMM[2:]]
    n = next(k for k in range(len(sizes) + 1) if sum(sizes[:k]) >= 30_000)
    assert "".join(seen) == "".join(GRIMM[2 : 2 + n])  # whole documents, the first ones


def test_progress_of_an_unknown_total_counts_without_percent_or_eta(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rich.console import Console

    progress = Progress("encode", None, Console(force_terminal=False))
    progress.update(1234, 5_000_000, line=True)
    progress.close()
    out = capsys.readouterr().out
    assert out.startswith("encode: 1234  5.0 MB") and "%" not in out and "eta" not in out
    bar = Progress("encode", None, Console(force_terminal=True, width=100))  # a live bar
    bar.update(1234, 5_000_000)
    bar.close()
    assert "1234/?" in capsys.readouterr().out


def test_a_hub_dataset_is_streamed_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No network in tests: `datasets.load_dataset` stands in for the hub."""
    import datasets

    calls: list[dict[str, Any]] = []

    def load_dataset(name: str, **kw: Any) -> Any:
        calls.append({"name": name, **kw})
        if name == "someone/offline":
            raise ConnectionError("no network")
        return datasets.IterableDataset.from_generator(lambda: iter({"text": t} for t in GRIMM))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.chdir(tmp_path)  # "someone/grimm" must not be a local folder
    cfg = cfg_for(tmp_path, Path("someone/grimm"), "tok", streaming=True, val_documents=2)
    write_shards(cfg)
    assert calls[0] == {"name": "someone/grimm", "split": "train", "streaming": True}
    meta = load_meta(tmp_path / "tok")
    assert (meta["train"]["documents"], meta["val"]["documents"]) == (len(GRIMM) - 2, 2)
    offline = cfg_for(tmp_path, Path("someone/offline"), "tok2", streaming=True, val_documents=2)
    with pytest.raises(ConfigError, match="hub is unreachable"):
        open_corpus(offline.data)


def test_a_hub_dataset_is_known_by_its_revision_streamed_or_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same revision: one fingerprint in both modes; another revision (the dataset changed
    upstream): another fingerprint, which a resume refuses."""
    import datasets

    from minillm.data import sources as sources_mod

    def load_dataset(name: str, streaming: bool = False, **kw: Any) -> Any:
        if streaming:
            return datasets.IterableDataset.from_generator(lambda: iter({"text": t} for t in GRIMM))
        return datasets.Dataset.from_dict({"text": GRIMM})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.chdir(tmp_path)
    revision = ["rev1"]
    monkeypatch.setattr(sources_mod, "hub_revision", lambda name: revision[0])
    data = cfg_for(tmp_path, Path("someone/grimm"), "tok", val_documents=2).data
    streamed = open_corpus(replace(data, streaming=True)).fingerprint
    assert open_corpus(data).fingerprint == streamed
    revision[0] = "rev2"
    assert open_corpus(replace(data, streaming=True)).fingerprint != streamed


def test_a_stream_position_from_another_datasets_version_reads_from_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import datasets

    from minillm.data import table as table_mod

    monkeypatch.setattr(table_mod, "ROWS_PER_BATCH", 4)
    cfg, state = interrupted_stream(tmp_path, monkeypatch, rows_file(tmp_path, "jsonl", GRIMM))
    assert state["cursor"]["row"] > 0
    monkeypatch.setattr(datasets, "__version__", "0.0.1")  # the cursor was saved by another
    assert write_shards(cfg)["resumed_documents"] == state["documents"]
    assert "saved by datasets" in capsys.readouterr().err
    assert files(tmp_path / "resumed") == files(tmp_path / "straight")


def test_a_checkpoint_from_before_the_prefix_keys_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its state.json has no data.max_documents, max_bytes, val_documents: they were 0."""
    monkeypatch.setattr(batches_mod, "BATCH_CHARS", 4000)
    monkeypatch.setattr(staging_mod, "CHECKPOINT_BYTES", 20_000)
    cfg = cfg_for(tmp_path, rows_file(tmp_path, "jsonl", GRIMM), "tok")
    with monkeypatch.context() as m:
        interrupt_after(m, 12, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            write_shards(cfg)
    state_path = tmp_path / "tok" / ".partial" / "state.json"
    state = json.loads(state_path.read_text())
    for key in ("data.max_documents", "data.max_bytes", "data.val_documents"):
        del state["inputs"][key]
    state_path.write_text(json.dumps(state))
    assert write_shards(cfg)["resumed_documents"] == state["documents"] > 0
