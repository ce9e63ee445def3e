"""GGUF export of sentencepiece-style tokenizers (issue 50): llama.cpp's `llama` (SPM) model with
scores that make its merges tokenizers' merges, token types, and add_space_prefix for Llama 2's
normalizer, Mistral's Metaspace (one warning: what differs) and Gemma's Replace. Checked by
llama.cpp itself (llama-cpp-python): held-out texts tokenize to `tokenizer(text)`'s ids, and a
greedy chat replies as `minillm chat`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from minillm.checkpoint import gguf_spm
from minillm.checkpoint.gguf_file import export_gguf
from minillm.checkpoint.gguf_spm import sentencepiece_vocab, space_prefix
from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.errors import CheckpointError
from tests.published import _script, family_tokenizer, hf_tokenizer
from tests.test_gguf import _one_error_line
from tests.test_gguf_vocabularies import (
    HELD_OUT,
    _export,
    _tokenizes_as_the_model,
    _warnings,
    needs_llama_cpp,
    runner,
)
from tests.test_published_exports import CHATS, _kv, _llama, published

SHAPES = ("llama2", "mistral-spm")  # Prepend + Replace normalizer; Metaspace prepend "first"
# More texts where spaces sit apart: leading, doubled, trailing, around line breaks.
SPACES = ["a  b", "tail ", "x\n y", "  two leading", "\t tab then space"]


@pytest.fixture(scope="module", params=SHAPES)
def spm_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, its published folder, its GGUF by the CLI, the export's warnings)."""
    root = tmp_path_factory.mktemp(f"spm-{request.param}")
    folder = published(root, request.param)
    result = _export(folder, root / "m.gguf")
    return request.param, folder, root / "m.gguf", _warnings(result)


def test_the_file_holds_llama_cpps_spm_vocabulary(spm_export) -> None:
    from gguf import TokenType

    name, folder, path, warnings = spm_export
    kv, tok = _kv(path), family_tokenizer(name)
    spec = json.loads(tok.to_str())
    assert kv["tokenizer.ggml.model"] == "llama"
    assert "tokenizer.ggml.merges" not in kv and "tokenizer.ggml.pre" not in kv
    assert kv["tokenizer.ggml.add_space_prefix"] is True
    assert kv["tokenizer.ggml.add_bos_token"] is True  # the post-processor's <s>
    for key, token in (("bos", "<s>"), ("eos", "</s>"), ("unknown", "<unk>")):
        assert kv[f"tokenizer.ggml.{key}_token_id"] == tok.token_to_id(token)
    tokens, types, scores = (kv[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
    assert tokens == [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    want = {"<unk>": TokenType.UNKNOWN, "<s>": TokenType.CONTROL, "</s>": TokenType.CONTROL,
            "[INST]": TokenType.CONTROL, "<0x00>": TokenType.BYTE, "<0xFF>": TokenType.BYTE,
            "▁t": TokenType.NORMAL, "e": TokenType.NORMAL}  # fmt: skip
    for token, kind in want.items():
        if token in tokens:
            assert types[tokens.index(token)] == kind, token
    assert types.count(TokenType.BYTE) == 256
    # Each merge's product scores minus its rank; the rest lie below every merge.
    merges = spec["model"]["merges"]
    for rank, (left, right) in enumerate(merges):
        assert scores[tokens.index(left + right)] == -rank
    assert scores[tokens.index("e")] < -len(merges) + 1
    if name == "llama2":  # the normalizer puts the same ▁s as llama.cpp
        assert warnings == []
    else:  # Metaspace's "first": one warning saying what differs
        assert len(warnings) == 1
        assert "pre_tokenizer.prepend_scheme: first" in warnings[0]
        assert "after a special token" in warnings[0] and "starts with a space" in warnings[0]


@needs_llama_cpp
def test_llama_cpp_tokenizes_held_out_texts_as_the_tokenizer(spm_export) -> None:
    name, folder, path, _ = spm_export
    llm = _llama(path, vocab_only=True)
    same = [t for t in SPACES if not (name == "mistral-spm" and t.startswith(" "))]
    _tokenizes_as_the_model(llm, folder, HELD_OUT + same)
    if name == "llama2":
        return
    # What the warning says, exactly: llama.cpp puts one ▁ more before a text that starts with
    # a space and before the text after a special token, as if a space were written there.
    hf = hf_tokenizer(folder)
    for text in ("  two leading", " lead"):
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == hf(" " + text).input_ids
    prompt = "<s>[INST] Who art thou? [/INST] Fine.</s>[INST]Next[/INST]"
    got = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    spaced = "<s>[INST]  Who art thou? [/INST]  Fine.</s>[INST] Next[/INST]"
    assert got == hf(spaced, add_special_tokens=False).input_ids
    assert got != hf(prompt, add_special_tokens=False).input_ids


@needs_llama_cpp
def test_a_larger_vocabulary_tokenizes_as_the_tokenizer_by_its_scores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 tokens, most of them merges: the score order carries llama.cpp through the same
    merges on texts it was not trained on. gguf-py's LlamaHfVocab scores every token -1000:
    llama.cpp then merges leftmost first, which gives other ids."""
    from gguf import TokenType
    from tokenizers import Tokenizer

    script = _script()
    text = script.tokenizer_json("llama2", 2000, 60000)
    assert len(json.loads(text)["model"]["merges"]) > 1000
    folder = script.build(tmp_path / "big", "llama2", text)
    path = export_gguf(load_checkpoint(folder), tmp_path / "big.gguf")
    kv, rows = _kv(path), json.loads((folder / "config.json").read_text())["vocab_size"]
    pads = range(Tokenizer.from_str(text).get_vocab_size(), rows)  # build() pads 16 rows
    assert kv["tokenizer.ggml.tokens"][pads.start :] == [f"[PAD{i}]" for i in pads]
    assert set(kv["tokenizer.ggml.token_type"][pads.start :]) == {int(TokenType.UNUSED)}
    llm = _llama(path, vocab_only=True)
    _tokenizes_as_the_model(llm, folder, HELD_OUT + SPACES)
    # Every word of the shipped texts, most past the 60,000 characters it was trained on: some
    # 650 pairs of tokens join into a token that no merge makes, which llama.cpp would merge and
    # tokenizers would not; no word reaches one (the merges' order makes the same pieces first).
    tok = Tokenizer.from_str(text)
    words = sorted({w for p in script.TEXTS for w in p.read_text(encoding="utf-8").split()})
    assert len(words) > 25000
    ids = [e.ids for e in tok.encode_batch(words, add_special_tokens=False)]
    assert [llm.tokenize(w.encode(), add_bos=False, special=False) for w in words] == ids
    real = gguf_spm.sentencepiece_vocab

    def flat(*args: Any) -> Any:
        vocab = real(*args)
        vocab.scores = [-1000.0] * len(vocab.scores)
        return vocab

    monkeypatch.setattr("minillm.checkpoint.gguf_tokens.sentencepiece_vocab", flat)
    path = export_gguf(load_checkpoint(folder), tmp_path / "flat.gguf")
    with pytest.raises(AssertionError):
        _tokenizes_as_the_model(_llama(path, vocab_only=True), folder, HELD_OUT)


def _edited(folder: Path, out: Path, edit: Any) -> Path:
    """A copy of `folder` whose tokenizer.json `edit` (a function of the parsed spec) changed."""
    shutil.copytree(folder, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    edit(spec)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


@needs_llama_cpp
def test_gemmas_normalizer_and_metaspaces_always(spm_export, tmp_path: Path) -> None:
    """Gemma's Replace(" ", "▁") alone is add_space_prefix false and the same ids; Metaspace's
    `always` differs only where a text starts with a space (its warning)."""
    name, folder, _, _ = spm_export

    def gemma(spec: dict[str, Any]) -> None:
        spec["normalizer"] = spec["normalizer"]["normalizers"][1]  # Replace(" ", "▁") alone
        spec["decoder"]["decoders"] = spec["decoder"]["decoders"][:-1]  # no Strip: none put

    def always(spec: dict[str, Any]) -> None:
        spec["pre_tokenizer"]["prepend_scheme"] = "always"

    edited = _edited(folder, tmp_path / "edited", gemma if name == "llama2" else always)
    path = export_gguf(load_checkpoint(edited), tmp_path / "edited.gguf")
    assert _kv(path)["tokenizer.ggml.add_space_prefix"] is (name != "llama2")
    llm = _llama(path, vocab_only=True)
    if name == "llama2":
        _tokenizes_as_the_model(llm, edited, HELD_OUT + SPACES)
        return
    _tokenizes_as_the_model(llm, edited, HELD_OUT + [t for t in SPACES if t[0] != " "])
    hf = hf_tokenizer(edited)
    prompt = "<s>[INST]Who[/INST]x</s>[INST]y"  # a ▁ after each special token, as tokenizers
    assert (
        llm.tokenize(prompt.encode(), False, True) == hf(prompt, add_special_tokens=False).input_ids
    )
    for text in (" lead", "<s>[INST] Who"):
        got = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert got == hf(text.replace(" ", "  "), add_special_tokens=False).input_ids
        assert got != hf(text, add_special_tokens=False).input_ids


@pytest.mark.slow
@needs_llama_cpp
def test_llama_cpp_chat_replies_as_minillm_chat(spm_export) -> None:
    """llama.cpp renders the file's template, tokenizes it and picks greedily the tokens of
    `minillm chat`'s reply. Compared as tokens: random weights emit runs of byte tokens that are
    no UTF-8, which tokenizers' ByteFallback writes as one U+FFFD per token where
    llama-cpp-python keeps the valid bytes among them."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    name, folder, path, _ = spm_export
    if name != "llama2":
        pytest.skip("Metaspace's first: llama.cpp's chat prompt has other ids (the warning)")
    llm = _llama(path, chat_format="chat_template.default")
    tok = family_tokenizer(name)
    eos = tok.token_to_id("</s>")
    render = Jinja2ChatFormatter(_kv(path)["tokenizer.chat_template"], "</s>", "<s>")
    stopped = 0
    for messages in CHATS:
        theirs = llm.create_chat_completion(messages, temperature=0.0, max_tokens=30)
        prompt = llm.tokenize(render(messages=messages).prompt.encode(), False, True)
        assert prompt == load_checkpoint(folder).conventions.chat_ids(messages, True)
        reply: list[int] = []
        for token in llm.generate(prompt, temp=0.0, top_k=1):
            if token == eos or len(reply) == 30:
                break
            reply.append(token)
        stopped += len(reply) < 30
        text = llm.detokenize(reply, prev_tokens=prompt).decode("utf-8", errors="ignore")
        assert theirs["choices"][0]["message"]["content"] == text
        args = ["chat", "--ckpt", str(folder), "--temperature", "0", "--max-new-tokens", "30"]
        if messages[0]["role"] == "system":
            args += ["--system", messages[0]["content"]]
        result = runner.invoke(app, [*args, "--message", messages[-1]["content"]])
        assert result.exit_code == 0, result.output
        assert result.stdout == tok.decode(reply) + "\n", messages  # how chat --message writes
    assert stopped >= 1  # published()'s head ends the first reply at </s>


def _spec(name: str = "llama2", **changes: Any) -> dict[str, Any]:
    spec = json.loads(family_tokenizer(name).to_str())
    for path, value in changes.items():
        *keys, last = path.split("__")
        node = spec
        for key in keys:
            node = node[key]
        node[last] = value
    return spec


@pytest.mark.parametrize(
    "name, changes, key",
    [
        ("llama2", dict(normalizer={"type": "NFKC"}), "normalizer"),
        ("llama2", dict(normalizer__normalizers=[{"type": "Lowercase"}]), "normalizer"),
        ("llama2", dict(pre_tokenizer={"type": "Whitespace"}), "pre_tokenizer"),
        ("mistral-spm", dict(pre_tokenizer__split=True), "pre_tokenizer.split"),
        ("mistral-spm", dict(pre_tokenizer__replacement="_"), "pre_tokenizer.replacement"),
        ("mistral-spm", dict(pre_tokenizer={"type": "Whitespace"}), "pre_tokenizer"),
        ("llama2", dict(model__ignore_merges=True), "model.ignore_merges"),
        ("llama2", dict(model__dropout=0.1), "model.dropout"),
        ("llama2", dict(post_processor={"type": "BertProcessing"}), "post_processor"),
    ],
)  # fmt: skip
def test_a_shape_llama_cpp_cannot_follow_is_refused_by_key(
    name: str, changes: dict[str, Any], key: str
) -> None:
    tok = family_tokenizer(name)
    spec = _spec(name, **changes)
    with pytest.raises(CheckpointError, match=f"^tokenizer.json: {key}: .*no equivalent") as e:
        sentencepiece_vocab(tok, spec, tok.get_vocab_size(), "tokenizer.json")
    assert "\n" not in str(e.value)


def test_prepend_schemes_and_a_missing_byte_token(capsys: pytest.CaptureFixture) -> None:
    from tokenizers import Tokenizer

    assert space_prefix(_spec("mistral-spm", pre_tokenizer__prepend_scheme="never"), "t") is False
    assert capsys.readouterr().err == ""
    # `always` puts its ▁ after special tokens too: only a text starting with a space differs
    # (test_gemmas_normalizer_and_metaspaces_always).
    assert space_prefix(_spec("mistral-spm", pre_tokenizer__prepend_scheme="always"), "t") is True
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: t: pre_tokenizer.prepend_scheme: always: llama.cpp puts a ")
    assert "second ▁ before a text that starts with a space" in line
    assert "where tokenizers puts none" not in line
    spec = _spec()
    byte = spec["model"]["vocab"].pop("<0x41>")
    spec["model"]["vocab"]["<0x41>x"] = byte  # the row stays, the byte's token is gone
    tok = Tokenizer.from_str(json.dumps(spec))
    with pytest.raises(CheckpointError, match=r"^t: model.vocab: lacks 1 byte tokens \(<0x41>\)"):
        sentencepiece_vocab(tok, spec, tok.get_vocab_size(), "t")


def test_a_refused_shape_is_one_error_line_from_the_cli_and_nothing_written(
    spm_export, tmp_path: Path
) -> None:
    name, folder, _, _ = spm_export
    if name != "mistral-spm":
        pytest.skip("one refusal through the CLI is enough")
    split = tmp_path / "split"
    shutil.copytree(folder, split)
    spec = json.loads((split / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["split"] = True
    (split / "tokenizer.json").write_text(json.dumps(spec))
    out = tmp_path / "out.gguf"
    args = ["export", "--ckpt", str(split), "--format", "gguf", "--out", str(out)]
    line = _one_error_line(runner.invoke(app, args))
    assert "tokenizer.json: pre_tokenizer.split: true" in line
    assert not out.exists() and not out.with_suffix(".Modelfile").exists()
