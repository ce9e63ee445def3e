"""The byte-level BPE: exact round trips, the special token, sizes, save/load and reuse checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from minillm.errors import ConfigError, UserError
from minillm.tokenizer.bpe import (
    EOT,
    MIN_VOCAB,
    check_tokenizer,
    eot_id,
    load_tokenizer,
    save_tokenizer,
    special_tokens,
    train_tokenizer,
)

DATA = Path(__file__).resolve().parents[1] / "data"

TRICKY = [
    "",
    "hello world",
    " leading space and trailing space ",
    "Ünïcödé façade, naïve café — “quotes” ‘and’ …",
    "emoji 👋🏽👨‍👩‍👧 flags 🇫🇷 and a lone 🦀",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "whitespace runs:\t\t  \n\n\n   \u00a0\u3000 end",
    "windows\r\nline\r\nendings\r\n",
    "\n\nstarts and ends with newlines\n\n",
    "don't can't we'll I'm they've she'd it's",
    "numbers 1234567890 3.14159 -42 1e-5",
    f"a document that quotes {EOT} stays text",
    "\x01\x02 control chars \x7f and a \ufeff BOM",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    text = (DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")[:200_000]
    return train_tokenizer([text, *TRICKY], 512)


def test_round_trip_is_byte_exact(tok: Tokenizer) -> None:
    for text in TRICKY:
        assert tok.decode(tok.encode(text).ids) == text, repr(text)
    # Bytes the tokenizer never saw in training still round-trip: every byte is in the alphabet.
    unseen = "".join(chr(c) for c in range(0x2500, 0x2600)) + "𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    assert tok.decode(tok.encode(unseen).ids) == unseen


def test_literal_eot_is_text_and_eot_is_special(tok: Tokenizer) -> None:
    assert special_tokens(tok) == [EOT, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    eot = eot_id(tok)
    assert eot == tok.token_to_id(EOT)
    assert eot not in tok.encode(f"x {EOT} y").ids  # a quoted separator cannot end a document
    assert tok.decode([*tok.encode("a").ids, eot, *tok.encode("b").ids]) == "ab"


def test_vocab_size_is_exact(tok: Tokenizer) -> None:
    assert tok.get_vocab_size() == 512
    assert MIN_VOCAB == 261


def test_vocab_below_bytes_plus_specials_is_a_user_error() -> None:
    with pytest.raises(ConfigError, match="data.vocab_size.*at least 261"):
        train_tokenizer(["some text"], 256)


def test_chat_tokens_are_never_made_from_text(tok: Tokenizer) -> None:
    for name in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"):
        special = tok.token_to_id(name)
        assert special is not None
        ids = tok.encode(f"a {name} b").ids
        assert special not in ids  # quoted in a text, a chat token is text
        assert tok.decode(ids) == f"a {name} b"


def test_corpus_too_small_for_the_vocab_is_a_user_error() -> None:
    with pytest.raises(ConfigError, match="data.vocab_size.*only supports"):
        train_tokenizer(["ab ab ab"], 1000)


def test_save_and_load(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "sub" / "tokenizer.json"
    save_tokenizer(tok, path)
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temporary left
    again = load_tokenizer(path)
    for text in TRICKY:
        assert again.encode(text).ids == tok.encode(text).ids
    assert again.encode(EOT).ids != [eot_id(again)]  # loaded tokenizers also keep it as text


def test_load_missing_or_corrupt_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"tokenizer\.json: data\.tokenizer: no such tokenizer"):
        load_tokenizer(tmp_path / "tokenizer.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match=r"bad\.json: data\.tokenizer: not a readable"):
        load_tokenizer(bad)


def test_check_tokenizer_mismatches(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    check_tokenizer(tok, 512, path)
    with pytest.raises(ConfigError) as e:
        check_tokenizer(tok, 1024, path)
    assert e.value.file == str(path) and e.value.key == "data.vocab_size"
    assert "--retrain" in str(e.value)
    other = Tokenizer.from_str(tok.to_str())
    other.add_special_tokens(["<|pad|>"])
    with pytest.raises(ConfigError, match="data.tokenizer.*special tokens"):
        check_tokenizer(other, other.get_vocab_size(), path)
