"""Sentencepiece-style tokenizers (issue 50): Llama 2's tokenizer.json shape (a normalizer puts
"▁" for a space and before the text, the decoder strips it) and Mistral v0.3's (a Metaspace
pre-tokenizer), both with byte fallback (<0x00>..<0xFF>), built by tests/published.py, against
transformers' `tokenizer(text)`, `apply_chat_template`, `decode` and `generate` in the commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from typer.testing import CliRunner

from minillm.cli import app
from minillm.errors import CheckpointError
from minillm.infer.text_stream import TextStreamer, continuation
from minillm.tokenizer.bpe import load_tokenizer
from minillm.tokenizer.conventions import Conventions
from minillm.tokenizer.pieces import tokenizer_kind
from tests.helpers import error_line
from tests.published import VOCAB, family_folder, family_tokenizer, hf_tokenizer

runner = CliRunner()
SPM = ["llama2", "mistral-spm"]
# Byte fallback (letters, CJK and emoji outside the small vocabulary), space runs, a line break
# and special tokens written in the text.
TEXTS = [
    "Hello world",
    "  two  spaces\n\nand a line",
    "Grüße 日本語 🙂🚀",
    "ẞ𝔘 ok </s> written <s>",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spm")
    return {name: family_folder(root, name) for name in SPM}


def conventions(folder: Path) -> Conventions:
    return Conventions.of(load_tokenizer(folder / "tokenizer.json"), folder)


def padding(model) -> list[int]:  # noqa: ANN001
    return list(range(VOCAB, model.config.vocab_size))


@pytest.mark.parametrize("name", SPM)
def test_text_encodes_and_decodes_as_transformers(folders: dict, name: str) -> None:
    conv, hf = conventions(folders[name]), hf_tokenizer(folders[name])
    assert conv.kind == "sentencepiece"
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        assert conv.prompt_ids(text) == ids
        assert conv.texts_ids([text, text]) == [ids, ids]
        assert conv.tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    # Byte fallback was exercised: a CJK character is three <0xNN> tokens here.
    pieces = hf.convert_ids_to_tokens(hf("日")["input_ids"])
    assert pieces[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]


def test_a_tokens_bytes_are_its_text_with_spaces_or_its_one_byte(folders: dict) -> None:
    conv = conventions(folders["llama2"])
    tok = conv.tok
    assert conv.token_bytes(tok.token_to_id("<0xE6>")) == b"\xe6"
    assert conv.token_bytes(tok.token_to_id("<s>")) == b""
    for text in TEXTS[:3]:
        ids = conv.prompt_ids(text)
        # The normalizer's "▁" before the text is the one space the decoder strips.
        assert b"".join(conv.token_bytes(i) for i in ids) == (" " + text).encode("utf-8")


@pytest.mark.parametrize("name", SPM)
def test_streamed_pieces_join_into_the_decoded_text(folders: dict, name: str) -> None:
    """Pieces of a reply (byte-fallback characters held back until whole) join into what
    transformers decodes, the first word's space stripped as `decode` strips it."""
    conv, hf = conventions(folders[name]), hf_tokenizer(folders[name])
    reply = hf("The 日本 king 🙂 sleeps", add_special_tokens=False)["input_ids"]
    stream = TextStreamer(conv.tok)
    pieces = [stream.push(t) for t in reply]
    pieces.append(stream.flush())
    assert "".join(pieces) == hf.decode(reply) == "The 日本 king 🙂 sleeps"
    assert not any("\ufffd" in p for p in pieces)


def _spec(**changes: object) -> Tokenizer:
    spec = json.loads(family_tokenizer("llama2").to_str())
    spec.update(changes)
    return Tokenizer.from_str(json.dumps(spec))


def test_other_tokenizer_kinds_are_refused_naming_the_key() -> None:
    spec = json.loads(family_tokenizer("llama2").to_str())
    no_fallback = {**spec["model"], "byte_fallback": False}
    cases = {
        "model.byte_fallback": _spec(model=no_fallback),
        "pre_tokenizer": _spec(normalizer=None, pre_tokenizer={"type": "Whitespace"}),
        "decoder": _spec(decoder={"type": "Metaspace", "replacement": "\u2581"}),
        "model": Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
    }
    cases["model"].pre_tokenizer = pre_tokenizers.Whitespace()
    for key, tok in cases.items():
        with pytest.raises(
            CheckpointError, match=rf"^x/tokenizer.json: {key.replace('.', '[.]')}:"
        ):
            tokenizer_kind(tok, "x/tokenizer.json")


def test_a_folder_with_another_kind_is_one_error_line(folders: dict, tmp_path: Path) -> None:
    import shutil

    folder = shutil.copytree(folders["llama2"], tmp_path / "nofallback")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = False
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    result = runner.invoke(app, ["sample", "--ckpt", str(folder), "--prompt", "Hi"])
    line = error_line(result)
    assert "tokenizer.json: model.byte_fallback:" in line


def test_sample_and_chat_equal_generate(folders: dict) -> None:
    """Greedy `sample` and `chat` give generate's tokens, printed as pieces that keep the space
    before a reply's first word (decoded after the prompt's last tokens)."""
    folder = folders["llama2"]
    hf = hf_tokenizer(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = hf("The king", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=10, do_sample=False, suppress_tokens=padding(model))
    args = ["sample", "--ckpt", str(folder), "--prompt", "The king", "--max-new-tokens", "10"]
    result = runner.invoke(app, [*args, "--temperature", "0"])
    assert result.exit_code == 0, result.output
    reply = out[0, ids.shape[1] :].tolist()
    assert result.stdout == "The king" + _streamed(hf, ids[0].tolist(), reply) + "\n"

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = hf.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, suppress_tokens=padding(model))
    reply = out[0, prompt.shape[1] :].tolist()
    args = ["chat", "--ckpt", str(folder), "--system", "Be brief.", "--message", "Hi"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "8", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout == hf.decode(reply, skip_special_tokens=True) + "\n"


def _streamed(hf, prompt: list[int], reply: list[int]) -> str:  # noqa: ANN001
    """The pieces transformers' tokenizer decodes for `reply` one token at a time after the
    prompt (the text of a random model's reply may hold bytes that are not UTF-8)."""
    stream = TextStreamer(hf.backend_tokenizer, prompt)
    return "".join([*(stream.push(t) for t in reply), stream.flush()])


def test_a_replys_first_word_keeps_its_space_after_the_prompt(folders: dict) -> None:
    conv, hf = conventions(folders["llama2"]), hf_tokenizer(folders["llama2"])
    prompt = hf("The king")["input_ids"]
    reply = hf("The king was here", add_special_tokens=False)["input_ids"][len(prompt) - 1 :]
    assert hf.decode(reply) == "was here"  # decoded alone, the space is gone
    assert continuation(conv.tok, prompt, reply) == " was here"
    assert _streamed(hf, prompt, reply) == " was here"


@pytest.mark.slow
def test_chat_sft_lora_eval_and_exports_through_the_cli(folders: dict, tmp_path: Path) -> None:
    """A Llama 2-style folder through tokenize (chat SFT, transformers' masks), train (LoRA),
    eval, chat and export hf/peft; the published folder is never written."""
    import hashlib

    import numpy as np
    import yaml

    from tests.published import CONVERSATIONS

    folder = folders["llama2"]
    before = {p.name: hashlib.sha256(p.read_bytes()).digest() for p in folder.iterdir()}
    rows = [m for m in CONVERSATIONS if m[-1]["role"] == "assistant"] * 6
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    cfg = {
        "data": {"source": str(source), "text_field": "messages", "out_dir": str(tmp_path / "t"),
                 "val_fraction": 0.25},
        "train": {"init_from": str(folder), "device": "cpu", "precision": "fp32",
                  "batch_size": 2, "seq_len": 64, "max_steps": 3, "eval_every": 3,
                  "eval_steps": 1, "ckpt_every": 3, "log_every": 1, "lr": 1e-2,
                  "out_dir": str(tmp_path / "run"), "lora": {"rank": 2, "alpha": 4}},
    }  # fmt: skip
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    for command in (["tokenize", str(config)], ["train", str(config)]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
    # The shards hold apply_chat_template's ids, the targets its replies and their </s>.
    hf = hf_tokenizer(folder)
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    expected = [hf.apply_chat_template(m, return_dict=False) for m in rows]
    end = conventions(folder).doc_end
    for split in ("train", "val"):
        files = sorted((tmp_path / "t").glob(f"{split}_*.bin"))
        ids = np.concatenate([np.fromfile(f, dtype=meta["dtype"]) for f in files]).tolist()
        at, seen = 0, 0
        while at < len(ids):  # one whole conversation after another (its </s> ends it)
            match = next(e for e in expected if ids[at : at + len(e)] == e)
            at += len(match) + (match[-1] != end)
            seen += 1
        assert seen >= 1
    run = tmp_path / "run"
    result = runner.invoke(app, ["eval", "--ckpt", str(run), "--data", str(source)])
    assert result.exit_code == 0, result.output
    args = ["chat", "--ckpt", str(run), "--message", "Speak.", "--max-new-tokens", "4"]
    assert runner.invoke(app, args).exit_code == 0
    out = tmp_path / "hf"
    result = runner.invoke(app, ["export", "--ckpt", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    ours = hf_tokenizer(out)
    for text in TEXTS:
        assert ours(text)["input_ids"] == hf(text)["input_ids"]
    for m in rows[:2]:
        want = hf.apply_chat_template(m, return_dict=False)
        assert ours.apply_chat_template(m, return_dict=False) == want
    adapter = tmp_path / "adapter"
    args = ["export", "--ckpt", str(run), "--format", "peft", "--out", str(adapter)]
    assert runner.invoke(app, args).exit_code == 0
    assert (adapter / "adapter_model.safetensors").is_file()
    assert {p.name: hashlib.sha256(p.read_bytes()).digest() for p in folder.iterdir()} == before


def test_serve_replies_keep_bytes_and_spaces_as_transformers_decodes(
    folders: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the API a chat reply is `decode(reply)` (as `minillm chat`), a completion the
    prompt's continuation (its first space kept), and each token's logprob bytes spell it:
    byte-fallback tokens one byte each."""
    import asyncio

    from minillm.checkpoint.store import load_checkpoint
    from minillm.serve import protocol as P
    from minillm.serve.handlers import Handler
    from minillm.serve.worker import EngineThread
    from tests.helpers import script_tokens
    from tests.test_serve import Connected

    folder = folders["llama2"]
    ckpt = load_checkpoint(folder)
    hf = hf_tokenizer(folder)
    engine = EngineThread(ckpt.model, ckpt.tokenizer, max_batch=2, max_queue=4)
    handler = Handler(ckpt, "spm", engine, 1 << 20, None)
    words = hf("I see 日本 🙂 now", add_special_tokens=False)["input_ids"]
    assert hf.convert_ids_to_tokens(words)[:2] == ["▁", "I"]  # the first word's space
    script_tokens(monkeypatch, [*words, hf.eos_token_id, *words, hf.eos_token_id])
    messages = [{"role": "user", "content": "Speak."}]
    body = {"messages": messages, "max_tokens": 30, "logprobs": True}
    chat = P.parse_chat(body, handler.limits, handler.encode_chat)
    body = {"prompt": "The king", "max_tokens": 30, "logprobs": 0}
    completion = P.parse_completion(body, handler.limits, handler.encode_text, hf.decode)
    engine.start()
    try:
        answer = asyncio.run(handler.complete(Connected(), chat))
        text = asyncio.run(handler.complete(Connected(), completion))
    finally:
        engine.close()
    (choice,) = answer["choices"]
    assert choice["message"]["content"] == hf.decode(words) == "I see 日本 🙂 now"
    spelled = b"".join(bytes(e["bytes"]) for e in choice["logprobs"]["content"])
    assert spelled == b" I see \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x99\x82 now"
    (choice,) = text["choices"]
    full = hf.decode(hf("The king")["input_ids"] + words, skip_special_tokens=True)
    assert "The king" + choice["text"] == full == "The king I see 日本 🙂 now"
