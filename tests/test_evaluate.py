"""Evaluation: loss against a hand computation, bits per byte by hand, the CLI and its errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.infer.evaluate import evaluate_checkpoint, evaluate_tokens, metrics
from tests.helpers import error_line, eval_json, make_run, tiny_tokenizer, trained_run, write_shards

LN2 = math.log(2)
runner = CliRunner()
DOCS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    "All:\nSpeak, speak.\n",
    "Grüße aus Köln — 日本語 🙂, and a longer line of plain English words to tokenize.\n" * 3,
    "MENENIUS:\nEither you must confess yourselves wondrous malicious, or be accused of folly.\n",
] * 3


def hand_nll(model: torch.nn.Module, ids: list[int], T: int) -> tuple[float, int]:
    """The definition, one window at a time: windows at 0, T, 2T, ...; the last one shorter."""
    total, n = 0.0, 0
    for i in range(0, len(ids) - 1, T):
        x = torch.tensor([ids[i : i + T]])
        y = torch.tensor(ids[i + 1 : i + T + 1])
        x = x[:, : len(y)]
        with torch.no_grad():
            logp = torch.log_softmax(model(x)[0][0].double(), dim=-1)
        total -= logp[torch.arange(len(y)), y].sum().item()
        n += len(y)
    return total, n


@pytest.mark.parametrize("length, batch_size", [(50, 3), (49, 1), (33, 8), (2, 4)])
def test_loss_equals_hand_computation(tmp_path: Path, length: int, batch_size: int) -> None:
    _, _, model = make_run(tmp_path)
    ids = torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(length))
    total, n = evaluate_tokens(model, ids, seq_len=16, batch_size=batch_size)
    ref_total, ref_n = hand_nll(model, ids.tolist(), 16)
    assert n == ref_n == length - 1
    assert total == pytest.approx(ref_total, rel=1e-6)


def test_bits_per_byte_worked_by_hand() -> None:
    # 4 predicted tokens costing 12 bits in all (12 ln 2 nats), over 6 bytes of text:
    # loss = 3 ln 2 nats/token, perplexity = 2^3 = 8, bits per byte = 12 / 6 = 2.
    got = metrics(total_nll=12 * LN2, n_predicted=4, n_bytes=6)
    assert got["loss"] == pytest.approx(3 * LN2)
    assert got["perplexity"] == pytest.approx(8.0)
    assert got["bits_per_byte"] == pytest.approx(2.0)
    assert (got["tokens"], got["bytes"]) == (4, 6)
    assert metrics(1e6, 1, 1)["perplexity"] == math.inf


def test_file_eval_of_a_uniform_model_by_hand(tmp_path: Path) -> None:
    # Zero weights give zero logits: every token costs ln(320) nats = log2(320) bits.
    run_dir, cfg, _ = make_run(tmp_path, uniform=True)
    text = "Grüße, 日本語 🙂! The quick brown fox.\n"  # 46 UTF-8 bytes for 36 characters
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    n_tokens = len(tiny_tokenizer().encode(text).ids)
    result = runner.invoke(app, ["eval", "--ckpt", str(run_dir), "--data", str(path), "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert set(got) == {"loss", "perplexity", "bits_per_byte", "tokens", "bytes"}
    assert got["tokens"] == n_tokens - 1 and got["bytes"] == len(text.encode()) == 46
    assert got["loss"] == pytest.approx(math.log(320))
    assert got["perplexity"] == pytest.approx(320)
    assert got["bits_per_byte"] == pytest.approx((n_tokens - 1) * math.log2(320) / 46)
    # --max-tokens on a file: as on the shard, the bytes are scaled by the share predicted
    args = ["eval", "--ckpt", str(run_dir), "--data", str(path), "--json", "--max-tokens", "3"]
    got = json.loads(runner.invoke(app, args).stdout)
    share = 3 / (n_tokens - 1)
    assert got["tokens"] == 3 and got["bytes"] == round(46 * share)
    assert got["bits_per_byte"] == pytest.approx(3 * math.log2(320) / (46 * share))


def test_val_shard_eval_and_max_tokens_scaling(tmp_path: Path) -> None:
    run_dir, cfg, _ = make_run(tmp_path, uniform=True)
    meta = write_shards(cfg, DOCS)
    val = meta["val"]
    result = runner.invoke(app, ["eval", "--ckpt", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert (got["tokens"], got["bytes"]) == (val["tokens"] - 1, val["bytes"])
    assert got["bits_per_byte"] == pytest.approx(got["tokens"] * math.log2(320) / val["bytes"])
    args = ["eval", "--ckpt", str(run_dir), "--json", "--max-tokens", "20"]
    got = json.loads(runner.invoke(app, args).stdout)
    share = 20 / (val["tokens"] - 1)
    assert got["tokens"] == 20 and got["bytes"] == round(val["bytes"] * share)
    assert got["bits_per_byte"] == pytest.approx(20 * math.log2(320) / (val["bytes"] * share))
    human = runner.invoke(app, ["eval", "--ckpt", str(run_dir), "--max-tokens", "20"])
    assert "bytes scaled by their share" in human.stdout and "bits/byte" in human.stdout


def test_val_shard_loss_matches_the_hand_computation(tmp_path: Path) -> None:
    run_dir, cfg, model = make_run(tmp_path)
    write_shards(cfg, DOCS)
    from minillm.data.meta import open_split

    ids = [int(t) for t in open_split(cfg.data.out_dir, "val")]
    got = evaluate_checkpoint(load_checkpoint(run_dir))
    total, n = hand_nll(model, ids, cfg.train.seq_len)
    assert got["tokens"] == n and got["seq_len"] == 16
    assert got["loss"] == pytest.approx(total / n, rel=1e-6)


def test_eval_help_states_the_window_rule() -> None:
    text = runner.invoke(app, ["eval", "--help"], terminal_width=200).stdout
    assert "start at 0, T, 2T" in text and "targets tokens i+1 .. i+T" in text


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("evalerr"))[0]


def one_line_error(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_eval_errors_are_one_line(run_dir: Path, tmp_path: Path) -> None:
    ckpt = ["eval", "--ckpt", str(run_dir)]
    assert "meta.json: no validation shard" in one_line_error(ckpt)  # never tokenized
    assert "no such file" in one_line_error([*ckpt, "--data", str(tmp_path / "nope.txt")])
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    assert "not UTF-8" in one_line_error([*ckpt, "--data", str(tmp_path / "latin1.txt")])
    (tmp_path / "one.txt").write_text("a")
    assert "at least 2 are needed" in one_line_error([*ckpt, "--data", str(tmp_path / "one.txt")])
    (tmp_path / "ok.txt").write_text("plenty of text here")
    args = [*ckpt, "--data", str(tmp_path / "ok.txt"), "--max-tokens", "0"]
    assert "--max-tokens must be >= 1" in one_line_error(args)
    assert "not a minillm run directory" in one_line_error(["eval", "--ckpt", str(tmp_path)])


def test_damaged_and_foreign_weights_are_one_line(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from minillm.runtime.files import sha256_file

    run_dir, _, _ = make_run(tmp_path)
    ckpt = next((run_dir / "checkpoints").glob("step_*"))
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    for path in (ckpt, run_dir):
        assert "sha256 does not match" in one_line_error(["eval", "--ckpt", str(path)])
    # A foreign file whose hash state.json vouches for: caught when the weights are loaded.
    save_file({"transformer.wte.weight": torch.zeros(4, 4)}, weights)
    state = json.loads((ckpt / "state.json").read_text())
    state["files"]["model.safetensors"] = sha256_file(weights)
    (ckpt / "state.json").write_text(json.dumps(state))
    line = one_line_error(["sample", "--ckpt", str(ckpt), "--prompt", "x"])
    assert "weights do not fit the model: missing" in line
    weights.write_bytes(b"not a safetensors file at all")
    state["files"]["model.safetensors"] = sha256_file(weights)
    (ckpt / "state.json").write_text(json.dumps(state))
    line = one_line_error(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "x")])
    assert "not a readable safetensors file" in line


# ----------------------------------------------------------------------------- eval --data


def invoke(args: list[str]):  # noqa: ANN201
    return runner.invoke(app, args, prog_name="minillm")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4 (BEST names one of them)."""
    return trained_run(tmp_path_factory.mktemp("run")) / "run"


def test_eval_data_reads_tables_as_tokenize_does(run: Path, tmp_path: Path) -> None:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["The king had three sons.", "The youngest went into the forest."]
    jsonl = tmp_path / "stories.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"body": texts}), tmp_path / "stories.parquet")
    plain = tmp_path / "stories.txt"
    plain.write_text("\n".join(texts))

    from_jsonl = eval_json(["--ckpt", str(run), "--data", str(jsonl)])
    # The texts' bytes, not the JSON's: the rows were read, not the file's raw text.
    assert from_jsonl["bytes"] == sum(len(t.encode()) for t in texts)
    parquet = eval_json(["--ckpt", str(run), "--data", str(tmp_path / "stories.parquet"),
                         "--text-field", "body"])  # fmt: skip
    assert parquet == from_jsonl
    raw = eval_json(["--ckpt", str(run), "--data", str(plain)])
    assert raw["bytes"] == len(plain.read_bytes()) and raw != from_jsonl

    line = error_line(invoke(["eval", "--ckpt", str(run), "--data", str(jsonl),
                              "--text-field", "body"]))  # fmt: skip
    assert line == f"error: {jsonl}: --text-field: no column 'body' (columns found: text, n)"


def test_eval_data_scores_chat_rows_over_the_answers(run: Path, tmp_path: Path) -> None:
    """Chat rows go through the chat template: the loss is over the assistant's tokens and its
    <|end|>, bits per byte over the assistant's bytes (as a chat run's val/loss)."""
    import json

    from minillm.tokenizer.chat_template import assistant_bytes

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": messages}) + "\n")
    result = eval_json(["--ckpt", str(run), "--data", str(chat), "--text-field", "messages"])
    assert result["bytes"] == assistant_bytes(messages) == 6
    assert 2 <= result["tokens"] <= 7  # "Hello." in 1-6 tokens, then <|end|>
