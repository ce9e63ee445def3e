"""`data.decode_errors`: a corpus with invalid UTF-8 through `minillm tokenize` (issue 36).

strict stops with one error line that names the file, the byte and the key; replace reads the
document with U+FFFD in place of the bad bytes; skip_document leaves it out. Both are counted in
the summary and meta.json, recorded with the data settings, and an interrupted pass resumes to the
same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import config_from_dict, load_config
from minillm.data import encode_batches as batches_mod
from minillm.data import shard_staging as staging_mod
from minillm.data.meta import load_meta
from minillm.data.text import is_cut, read_text_blocks
from minillm.data.tokenize_pass import write_shards
from minillm.errors import ConfigError
from tests.test_data import EXCERPT, decoded_docs
from tests.test_shards import count_writes, files, interrupt_after

BAD = b"\xff\xfe"  # never UTF-8
MARK = "MARKED-DOCUMENT"  # text that only the damaged document holds


@pytest.fixture(autouse=True)
def _datasets_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.getbasetemp() / "hf")


def books(folder: Path, n: int = 8, bad: tuple[int, ...] = (2,)) -> Path:
    """`n` text files of ~10 KB; those in `bad` carry MARK and invalid bytes in their middle."""
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        raw = EXCERPT[k * 10_000 : (k + 1) * 10_000].encode("utf-8")
        if k in bad:
            raw = raw[:5000] + f" {MARK} ".encode() + BAD + b" " + raw[5000:]
        (folder / f"b{k}.txt").write_bytes(raw)
    return folder


def write_config(tmp_path: Path, source: Path, out: str = "tokens", **data: Any) -> Path:
    path = tmp_path / f"{out}.yaml"
    config = {
        "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 64},
        "data": {"source": str(source), "vocab_size": 300, "out_dir": str(tmp_path / out), **data},
        "train": {"seq_len": 32},
    }
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def tokenize(config: Path, *sets: str) -> Any:
    args = [a for s in sets for a in ("--set", s)]
    return CliRunner().invoke(app, ["tokenize", str(config), *args])


def all_text(out: Path) -> str:
    return "".join(decoded_docs(out, "train") + decoded_docs(out, "val"))


def counts(out: Path, key: str) -> int:
    meta = load_meta(out)
    return meta["train"][key] + meta["val"][key]


# ----------------------------------------------------------------------------- text files


def test_strict_is_one_error_line_naming_the_byte_and_the_key(tmp_path: Path) -> None:
    result = tokenize(write_config(tmp_path, books(tmp_path / "books")))
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    offset = EXCERPT[20_000:30_000].encode()[:5000] + f" {MARK} ".encode()
    assert f"b2.txt: data.source: not UTF-8 text at byte {len(offset)}" in lines[0]
    assert "data.decode_errors" in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "tokens").exists()  # nothing left behind


def test_replace_reads_the_document_with_u_fffd_and_counts_it(tmp_path: Path) -> None:
    result = tokenize(
        write_config(tmp_path, books(tmp_path / "books")), "data.decode_errors=replace"
    )
    assert result.exit_code == 0, result.output
    assert "Documents with invalid UTF-8 (data.decode_errors): 1 read with U+FFFD" in " ".join(
        result.stdout.split()
    )
    out = tmp_path / "tokens"
    text = all_text(out)
    assert f"{MARK} \ufffd\ufffd " in text  # each invalid byte one U+FFFD, nothing else lost
    assert counts(out, "replaced_documents") == 1 and counts(out, "skipped_documents") == 0
    meta = load_meta(out)
    assert meta["train"]["documents"] + meta["val"]["documents"] == 8
    assert meta["data"]["decode_errors"] == "replace"


def test_skip_document_leaves_it_out_and_counts_it(tmp_path: Path) -> None:
    result = tokenize(
        write_config(tmp_path, books(tmp_path / "books")), "data.decode_errors=skip_document"
    )
    assert result.exit_code == 0, result.output
    assert "0 read with U+FFFD in place of those bytes, 1 left out" in " ".join(
        result.stdout.split()
    )
    out = tmp_path / "tokens"
    assert MARK not in all_text(out) and "\ufffd" not in all_text(out)
    meta = load_meta(out)
    assert meta["train"]["documents"] + meta["val"]["documents"] == 7
    assert counts(out, "skipped_documents") == 1 and counts(out, "replaced_documents") == 0


def test_a_single_file_is_split_at_a_safe_cut_past_its_invalid_bytes(tmp_path: Path) -> None:
    """The tail split counts the file's bytes, invalid ones included, and cuts where it is safe."""
    raw = EXCERPT[:30_000].encode()
    src = tmp_path / "one.txt"
    src.write_bytes(raw[:10_000] + BAD + raw[10_000:])  # before the tail: it shifts the cut
    result = tokenize(write_config(tmp_path, src), "data.decode_errors=replace")
    assert result.exit_code == 0, result.output
    out = tmp_path / "tokens"
    meta = load_meta(out)
    assert meta["train"]["bytes"] + meta["val"]["bytes"] == len(raw) + len(BAD)
    assert meta["train"]["replaced_documents"] == 1 and meta["val"]["replaced_documents"] == 0
    (train,), (val,) = decoded_docs(tmp_path / "tokens", "train"), decoded_docs(out, "val")
    assert train + val == src.read_bytes().decode("utf-8", "replace")  # no byte lost or doubled
    assert is_cut(train + val, len(train))  # the cut's byte offset counted BAD as 2 bytes
    assert meta["val"]["bytes"] == len(val.encode())


@pytest.mark.parametrize("errors", ["replace", "surrogateescape"])
def test_reading_past_invalid_bytes_does_not_depend_on_the_block_size(
    tmp_path: Path, errors: str
) -> None:
    raw = "héllo 中文 👋🏽\n".encode() * 3
    raw = raw[:7] + b"\xe2\x82" + raw[7:20] + b"\xf0\x90\x80" + raw[20:] + b"\xc3"  # cut short
    path = tmp_path / "t.txt"
    path.write_bytes(raw)
    whole = raw.decode("utf-8", errors)
    for block in (1, 2, 3, 4, 5, 7, 64):
        assert "".join(read_text_blocks(path, block_bytes=block, errors=errors)) == whole


# ----------------------------------------------------------------------------- rows


def jsonl(path: Path) -> Path:
    rows = [{"text": EXCERPT[k * 3000 : (k + 1) * 3000]} for k in range(10)]
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in rows]
    lines[3] = lines[3][:-10] + BAD + lines[3][-10:]  # inside row 4's string
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_jsonl_rows_strict_replace_and_skip(tmp_path: Path) -> None:
    src = jsonl(tmp_path / "rows.jsonl")
    result = tokenize(write_config(tmp_path, src))
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "rows.jsonl: data.source: row 4: text: not UTF-8 text" in lines[0]
    assert "data.decode_errors" in lines[0]

    result = tokenize(write_config(tmp_path, src, "replaced", decode_errors="replace"))
    assert result.exit_code == 0, result.output
    assert counts(tmp_path / "replaced", "replaced_documents") == 1
    assert "\ufffd\ufffd" in all_text(tmp_path / "replaced")

    result = tokenize(write_config(tmp_path, src, "skipped", decode_errors="skip_document"))
    assert result.exit_code == 0, result.output
    meta = load_meta(tmp_path / "skipped")
    assert meta["train"]["documents"] + meta["val"]["documents"] == 9
    assert counts(tmp_path / "skipped", "skipped_documents") == 1


def test_a_chat_row_with_invalid_bytes_is_replaced(tmp_path: Path) -> None:
    rows = []
    for k in range(8):
        messages = [
            {"role": "user", "content": f"question {k} " + EXCERPT[k * 500 : k * 500 + 400]},
            {"role": "assistant", "content": f"answer {k} " + EXCERPT[k * 700 : k * 700 + 400]},
        ]
        rows.append(json.dumps({"messages": messages}, ensure_ascii=False).encode())
    rows[5] = rows[5].replace(b"answer 5", b"answer \xff5")
    src = tmp_path / "chat.jsonl"
    src.write_bytes(b"\n".join(rows) + b"\n")
    cfg = write_config(tmp_path, src, text_field="messages", decode_errors="replace")
    result = tokenize(cfg, "data.vocab_size=400")
    assert result.exit_code == 0, result.output
    assert counts(tmp_path / "tokens", "replaced_documents") == 1


# ----------------------------------------------------------------------------- resume


def test_an_interrupted_replace_pass_resumes_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batches_mod, "BATCH_CHARS", 4000)
    monkeypatch.setattr(staging_mod, "CHECKPOINT_BYTES", 20_000)
    src = books(tmp_path / "books", n=10, bad=(1, 4, 8))
    straight = write_config(tmp_path, src, "straight", decode_errors="replace", shard_tokens=1500)
    config = write_config(tmp_path, src, "resumed", decode_errors="replace", shard_tokens=1500)
    writes = count_writes(monkeypatch, load_config(straight))
    with monkeypatch.context() as m:
        interrupt_after(m, writes * 2 // 3, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            write_shards(load_config(config))
    out = tmp_path / "resumed"
    state = json.loads((out / ".partial" / "state.json").read_text())
    assert state["documents"] > 2 and state["stats"]["train"]["replaced"] >= 1  # past one
    # Another decode_errors is refused: the shards so far were made with replace.
    result = tokenize(config, "data.decode_errors=skip_document")
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and "data.decode_errors: changed since" in lines[0], lines
    result = tokenize(config)
    assert result.exit_code == 0, result.output
    assert "resumed after" in result.stdout
    assert files(out) == files(tmp_path / "straight")  # tokenizer, every shard and meta.json
    assert counts(out, "replaced_documents") == 3


def test_changing_decode_errors_warns_that_the_shards_were_made_otherwise(
    tmp_path: Path,
) -> None:
    from minillm.data.meta import stale_data_keys

    src = books(tmp_path / "books")
    write_shards(load_config(write_config(tmp_path, src, decode_errors="replace")))
    data = load_config(write_config(tmp_path, src, decode_errors="skip_document")).data
    assert stale_data_keys(load_meta(tmp_path / "tokens"), data) == ["data.decode_errors"]


def test_an_unknown_value_names_the_key(tmp_path: Path) -> None:
    result = tokenize(write_config(tmp_path, tmp_path), "data.decode_errors=ignore")
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1
    assert "data.decode_errors: expected one of 'strict', 'replace', 'skip_document'" in lines[0]
    with pytest.raises(ConfigError, match="data.decode_errors"):
        config_from_dict({"model": {"d_model": 32, "n_layer": 1, "n_head": 2},
                          "data": {"decode_errors": "ignore"}})  # fmt: skip
