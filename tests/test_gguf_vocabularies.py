"""GGUF export of published vocabularies (issues 50 and 52): the Qwen2, Llama 3 and SmolLM
pre-tokenizers as llama.cpp's `qwen2`, `llama-bpe` and `smollm`, and a byte-level BPE that lacks
byte tokens (UTF-8 lead bytes 0xF1 and 0xF2 among them), written as llama.cpp's converter
writes it with one warning. Checked by llama.cpp itself (llama-cpp-python): its ids for held-out
texts are `tokenizer(text)`'s, its greedy chat is `minillm chat`'s; a LoRA fine-tune of the
vocabulary with holes exports too. Any other split is one error line naming the key.
"""

from __future__ import annotations

import importlib.util
import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from minillm.checkpoint import gguf_tokens
from minillm.checkpoint.gguf_file import export_gguf
from minillm.checkpoint.gguf_tokens import llama_cpp_pre_tokenizer
from minillm.checkpoint.init_from import load_run_config
from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.data.tokenize_pass import write_shards
from minillm.errors import CheckpointError
from tests.helpers import QUICK_TRAIN, run_trainer
from tests.published import CONVERSATIONS, family_tokenizer, hf_tokenizer
from tests.test_published_exports import _chats_as_minillm, _kv, _llama, published

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed; `make interop` builds it from source",
)
runner = CliRunner()
# Texts none of the stand-ins were trained on: each kind of piece the splits treat apart.
HELD_OUT = [
    "The quick brown fox jumps over the lazy dog.",
    "Señora Müller's résumé: déjà vu, ¿qué tal? Ærøskøbing, Łódź, İstanbul",
    "東京は晴れ、明日は雨でしょう。中文测试，한국어 텍스트",
    "emoji 🙂🚀👍🏽 and flags 🇫🇷🇯🇵, a ZWJ family 👩‍👩‍👧",
    "digits 1234567890 3.14159 2024-12-04 007 x42y 9999999",
    "contractions: I'm you're he's we've they'll she'd DON'T It'S O'Neil's",
    "whitespace   runs\t\ttabs\n\n\nnewlines  \n  trailing   ",
    "mixed: x=42;y=1e-9 // ‘quotes’ «guillemets» … \r\n crlf",
    "",
]
# Byte tokens the vocabulary lacks: 21 of them, as there: the 13 bytes UTF-8 never has,
# six control characters, and the lead bytes of U+40000 to U+BFFFF (unassigned planes).
LACKING = (0xC0, 0xC1, *range(0xF5, 0x100), *range(0x0E, 0x14), 0xF1, 0xF2)


def _export(folder: Path, out: Path) -> Any:
    result = runner.invoke(app, ["export", "--ckpt", str(folder), "--format", "gguf", "--out",
                                 str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    return result


def _warnings(result: Any) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("warning: ")]


def _tokenizes_as_the_model(llm: Any, folder: Path, texts: list[str]) -> None:
    theirs = hf_tokenizer(folder)
    for text in texts:
        got = llm.tokenize(text.encode(), add_bos=True, special=False)
        assert got == theirs(text).input_ids, text


# ----------------------------------------------------------------------------- splits (issue 50)

SPLITS = {  # make_published_folder's split -> (family, llama.cpp's tokenizer.ggml.pre)
    "qwen2": ("chatml", "qwen2"),
    "llama3": ("llama3", "llama-bpe"),
    "smollm": ("chatml", "smollm"),
}


@pytest.fixture(scope="module", params=list(SPLITS))
def split_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(split, a published folder whose tokenizer.json carries that split, its GGUF, the
    export's warnings)."""
    family, _ = SPLITS[request.param]
    root = tmp_path_factory.mktemp(f"split-{request.param}")
    folder = published(root, family, split=request.param)
    result = _export(folder, root / "m.gguf")
    return request.param, folder, root / "m.gguf", _warnings(result)


def test_the_split_is_written_as_llama_cpps_pre_tokenizer(split_export) -> None:
    split, folder, path, warnings = split_export
    assert _kv(path)["tokenizer.ggml.pre"] == SPLITS[split][1]
    if split == "qwen2":  # its NFC normalizer, which llama.cpp does not apply, is one warning
        assert len(warnings) == 1
        assert "normalizer: NFC, which llama.cpp does not apply" in warnings[0]
    else:
        assert warnings == []


@needs_llama_cpp
def test_llama_cpp_tokenizes_held_out_texts_as_the_split_does(
    split_export, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    split, folder, path, _ = split_export
    llm = _llama(path, vocab_only=True)
    _tokenizes_as_the_model(llm, folder, HELD_OUT)
    # The name matters: another split llama.cpp has gives other ids for one of these texts.
    wrong = {"qwen2": "gpt-2", "llama3": "gpt-2", "smollm": "llama-bpe"}[split]
    monkeypatch.setattr(gguf_tokens, "llama_cpp_pre_tokenizer", lambda spec, where: wrong)
    other = _llama(export_gguf(load_checkpoint(folder), tmp_path / "wrong.gguf"), vocab_only=True)
    with pytest.raises(AssertionError):
        _tokenizes_as_the_model(other, folder, HELD_OUT)
    # The pieces differ between the splits (else this test could not tell them apart): the
    # digits 2024 are one piece for GPT-2's regex, up to three for Llama 3's, one each for
    # Qwen2's and SmolLM's.
    tok = family_tokenizer(SPLITS[split][0], split)
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("in 2024")]
    assert pieces == {"qwen2": ["in", "Ġ", "2", "0", "2", "4"],
                      "llama3": ["in", "Ġ", "202", "4"],
                      "smollm": ["in", "Ġ", "2", "0", "2", "4"]}[split]  # fmt: skip
    if split == "qwen2":  # what the warning says: a decomposed accent is tokenized otherwise
        nfd = unicodedata.normalize("NFD", "déjà vu, café")
        got = llm.tokenize(nfd.encode(), add_bos=True, special=False)
        assert got != hf_tokenizer(folder)(nfd).input_ids


@pytest.mark.slow
@needs_llama_cpp
def test_llama_cpp_chat_replies_as_minillm_chat(split_export) -> None:
    _, folder, path, _ = split_export
    _chats_as_minillm(_llama(path, chat_format="chat_template.default"), folder)


def _edit(tok: Any, path: str, value: Any) -> dict[str, Any]:
    """tokenizer.json of `tok`, parsed, with the value at `path` (keys and indices, dotted)."""
    spec = json.loads(tok.to_str())
    *keys, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = spec
    for key in keys:
        node = node[key]
    node[last] = value
    return spec


@pytest.mark.parametrize(
    "split, path, value, key",
    [
        ("qwen2", "normalizer", {"type": "NFKC"}, "normalizer"),
        ("qwen2", "pre_tokenizer.pretokenizers.0.pattern.Regex", r"\p{N}{1,2}", "pre_tokenizer"),
        ("qwen2", "pre_tokenizer.pretokenizers.0.behavior", "Removed", "pre_tokenizer"),
        ("qwen2", "pre_tokenizer.pretokenizers.1.use_regex", True, "pre_tokenizer"),
        ("qwen2", "pre_tokenizer.pretokenizers.1.add_prefix_space", True, "pre_tokenizer"),
        ("qwen2", "model.ignore_merges", True, "model.ignore_merges"),
        ("llama3", "model.ignore_merges", False, "model.ignore_merges"),
        ("llama3", "pre_tokenizer.pretokenizers.0.invert", True, "pre_tokenizer"),
        ("smollm", "pre_tokenizer.pretokenizers.0.individual_digits", False, "pre_tokenizer"),
    ],
)  # fmt: skip
def test_a_split_off_the_published_shapes_is_refused_by_key(
    split: str, path: str, value: Any, key: str
) -> None:
    family, name = SPLITS[split]
    tok = family_tokenizer(family, split)
    assert llama_cpp_pre_tokenizer(json.loads(tok.to_str()), "tokenizer.json") == name
    with pytest.raises(CheckpointError, match=f"^tokenizer.json: {key}: .*no equivalent") as e:
        llama_cpp_pre_tokenizer(_edit(tok, path, value), "tokenizer.json")
    assert "\n" not in str(e.value)


def test_a_refused_split_is_one_error_line_and_writes_nothing(tmp_path: Path) -> None:
    folder = published(tmp_path, "chatml", split="qwen2")
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{N}{1,2}"
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    out = tmp_path / "m.gguf"
    result = runner.invoke(
        app, ["export", "--ckpt", str(folder), "--format", "gguf", "--out", str(out)]
    )
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {folder / 'tokenizer.json'}: pre_tokenizer: ")
    assert not list(tmp_path.glob("m.*"))


# ----------------------------------------------------------------------------- bytes (issue 52)


@pytest.fixture(scope="module")
def lacking_export(tmp_path_factory: pytest.TempPathFactory):
    """(a published ChatML Llama whose vocabulary lacks the LACKING byte tokens, its GGUF, the
    export's warnings)."""
    root = tmp_path_factory.mktemp("lacking")
    folder = published(root, "chatml", without=LACKING)
    result = _export(folder, root / "m.gguf")
    return folder, root / "m.gguf", _warnings(result)


def test_a_vocabulary_lacking_byte_tokens_exports_with_one_warning(lacking_export) -> None:
    folder, path, warnings = lacking_export
    assert len(warnings) == 1
    assert warnings[0] == (
        f"warning: {folder / 'tokenizer.json'}: model.vocab: lacks the tokens of 8 bytes UTF-8 "
        "text can hold (0x0E, 0x0F, 0x10, 0x11, 0x12, 0x13, ...): llama.cpp leaves such a byte "
        "out of a text's tokens (as tokenizers does), so the model never sees it (exported all "
        "the same, as llama.cpp's converter does)"
    )
    tokens = _kv(path)["tokenizer.ggml.tokens"]
    assert len(tokens) == family_tokenizer("chatml", without=LACKING).get_vocab_size()
    assert not any(t.startswith("[PAD") for t in tokens)  # no holes: a vocabulary trained so


@needs_llama_cpp
def test_llama_cpp_tokenizes_as_the_vocabulary_lacking_bytes(lacking_export) -> None:
    """Held-out texts give tokenizer(text)'s ids; so do texts holding a byte without a token:
    both leave the byte out and merge nothing across it (what the warning says)."""
    folder, path, _ = lacking_export
    llm = _llama(path, vocab_only=True)
    holding = ["a\x0eb \x0f\x10end", "plane 4: \U00040000, plane 8: \U00080001 here", "x\x13\ny",
               "the\x0e king"]  # fmt: skip
    _tokenizes_as_the_model(llm, folder, HELD_OUT + holding)
    # The byte is left out and its neighbours are not merged: "h" and "e" make "he" alone.
    ids = hf_tokenizer(folder)(["h", "e", "he", "h\x0ee"]).input_ids
    assert ids[3] == ids[0] + ids[1] != ids[2] and len(ids[2]) == 1


@pytest.mark.slow
@needs_llama_cpp
def test_llama_cpp_chat_with_the_vocabulary_lacking_bytes_is_minillm_chats(lacking_export) -> None:
    folder, path, _ = lacking_export
    _chats_as_minillm(_llama(path, chat_format="chat_template.default"), folder)


@pytest.mark.slow
@needs_llama_cpp
def test_a_lora_fine_tune_of_the_vocabulary_lacking_bytes_exports(
    lacking_export, tmp_path: Path
) -> None:
    """The issue's second case: a LoRA SFT run on that folder exports (merged) with the same
    warning, and llama.cpp chats as `minillm chat` on the run."""
    folder, _, _ = lacking_export
    rows = [{"messages": m} for m in CONVERSATIONS[1:]] * 10
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    raw = {
        "data": {"source": str(tmp_path / "sft.jsonl"), "text_field": "messages",
                 "out_dir": str(tmp_path / "tokens")},
        "train": {"init_from": str(folder), "out_dir": str(tmp_path / "run"),
                  **{**QUICK_TRAIN, "lr": 5e-2, "max_steps": 4},
                  "lora": {"rank": 4, "alpha": 8, "targets": ["wqkv", "wo"]}},
        "sample": {"temperature": 0.0, "max_new_tokens": 30},
    }  # fmt: skip
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    cfg = load_run_config(tmp_path / "lora.yaml")
    write_shards(cfg)
    run_trainer(cfg)
    run = tmp_path / "run"
    result = _export(run, tmp_path / "lora.gguf")
    assert [w for w in _warnings(result) if "model.vocab: lacks the tokens of 8 bytes" in w]
    llm = _llama(tmp_path / "lora.gguf", chat_format="chat_template.default")
    _tokenizes_as_the_model(llm, folder, HELD_OUT[:4])
    ours = load_checkpoint(run).model.state_dict()
    base = load_checkpoint(folder).model.state_dict()
    assert any((ours[k] - base[k]).abs().max() > 1e-3 for k in ours)  # the adapters matter
    _chats_as_minillm(llm, run, stops=0)
