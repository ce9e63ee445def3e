"""A from-scratch run on a published tokenizer.json (issue 62): a size that is not
data.vocab_size says to set data.vocab_size to the file's size and never suggests --retrain,
which would overwrite a file minillm did not write (and --retrain refuses to); data.tokenizer
naming a folder reads the folder's tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import config_to_dict
from tests.helpers import SHAKESPEARE, error_line, tiny_config
from tests.published import VOCAB, family_tokenizer

runner = CliRunner()


def published(folder: Path, with_config: bool) -> Path:
    """A published tokenizer.json (Qwen's specials), with its tokenizer_config.json or alone."""
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(family_tokenizer("chatml").to_str(), encoding="utf-8")
    if with_config:
        cfg = {"eos_token": "<|im_end|>", "chat_template": "{{ messages }}"}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return folder


def config(root: Path, tokenizer: Path, vocab: int = 4096) -> Path:
    (root / "corpus.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000])
    raw = config_to_dict(tiny_config(root, data=dict(tokenizer=str(tokenizer), vocab_size=vocab)))
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("with_config", [True, False])
def test_a_size_mismatch_says_to_set_vocab_size_not_retrain(tmp_path: Path, with_config: bool):
    tok = published(tmp_path / "tok", with_config) / "tokenizer.json"
    before = tok.read_bytes()
    line = error_line(runner.invoke(app, ["tokenize", str(config(tmp_path, tok))]))
    assert line == (
        f"error: {tok}: data.vocab_size: the existing tokenizer has {VOCAB} tokens but "
        f"data.vocab_size is 4096; it is a published tokenizer: set data.vocab_size to {VOCAB} "
        "to use it"
    )
    assert "--retrain" not in line and tok.read_bytes() == before


def test_retrain_refuses_to_overwrite_a_published_tokenizer(tmp_path: Path) -> None:
    tok = published(tmp_path / "tok", with_config=True) / "tokenizer.json"
    before = tok.read_bytes()
    result = runner.invoke(app, ["tokenize", str(config(tmp_path, tok)), "--retrain"])
    line = error_line(result)
    assert line.startswith(f"error: {tok}: data.tokenizer: a published tokenizer, not one ")
    assert tok.read_bytes() == before


def test_data_tokenizer_may_name_the_folder(tmp_path: Path) -> None:
    folder = published(tmp_path / "tok", with_config=True)
    before = (folder / "tokenizer.json").read_bytes()
    result = runner.invoke(app, ["tokenize", str(config(tmp_path, folder, vocab=VOCAB))])
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    assert meta["vocab_size"] == VOCAB
    assert (folder / "tokenizer.json").read_bytes() == before  # read, not trained anew
    assert not (tmp_path / "tokens" / "tokenizer.json").exists()
