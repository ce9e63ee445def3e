"""GGUF export, checked by llama.cpp itself (llama-cpp-python), not by a reader of our own.

llama.cpp's tokenizer gives our ids (prose, digits, whitespace, newlines, non-ASCII, the chat
tokens, a megabyte of Shakespeare), its logits match ours (f32: to 1e-4 of the logit range), its
greedy continuation is ours, and its Jinja chat formatter with the embedded template stops at
`<|end|>` or `<|endoftext|>` with `minillm chat --message`'s reply. Tied and untied heads, GQA
and MQA, odd widths.

The tests that load a file in llama.cpp skip, saying so, when llama-cpp-python is not installed
(`make interop` builds it); the file's layout and the bad-input refusals are tested without it.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from minillm.checkpoint import gguf_file, gguf_tokens
from minillm.checkpoint.gguf_file import export_gguf, modelfile_path
from minillm.checkpoint.gguf_tokens import llama_cpp_pre_tokenizer
from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.errors import CheckpointError
from minillm.families.llama import rope_pairs_permute
from minillm.infer.engine import SamplingParams, generate
from minillm.tokenizer.bpe import EOT, eot_id, train_tokenizer
from minillm.tokenizer.chat_template import END
from minillm.tokenizer.conventions import Conventions
from tests.helpers import SHAKESPEARE, assert_same_function, make_run, tiny_tokenizer

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed; `make interop` builds it from source "
    "(minutes, once per machine)",
)

# Two shapes: the default tiny run (GQA 4/2, tied head, a padded vocabulary of 320 rows for 300
# tokens) and an awkward one (MQA 6/1, head dim 6, widths not multiples of 32, untied head,
# other RoPE base and epsilon, 303 rows).
SHAPES: dict[str, dict[str, Any]] = {
    "gqa-tied": dict(tie_embeddings=True),
    "mqa-untied-odd": dict(
        d_model=36,
        n_layer=3,
        n_head=6,
        n_kv_head=1,
        ffn_hidden=50,
        vocab_size=303,
        tie_embeddings=False,
        rope_theta=5000.0,
        norm_eps=1e-6,
    ),
}
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak. 1234 — Grüße 🙂\n\n  end"
# The bounds on max |ours - llama.cpp| / (max - min of our logits) over a prompt, per weight type
# and KV cache type (0 = f32; None = llama.cpp's default, f16). Measured values are printed.
LOGIT_BOUNDS = [("f32", 0, 1e-4), ("f32", None, 5e-3), ("f16", 0, 5e-3), ("q8_0", 0, 6e-2)]


def _llama(path: Path, **kw: Any) -> Any:
    from llama_cpp import Llama

    return Llama(
        model_path=str(path),
        n_ctx=64,
        n_batch=64,
        n_ubatch=64,
        n_threads=2,
        n_threads_batch=2,
        verbose=False,
        **kw,
    )


@pytest.fixture(scope="module", params=list(SHAPES))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A random tiny run of each shape and its f32, f16 and q8_0 exports."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    run_dir, _, _ = make_run(root, model=SHAPES[request.param])
    loaded = load_checkpoint(run_dir)
    files = {
        dtype: export_gguf(loaded, root / f"model-{dtype}.gguf", dtype)
        for dtype in gguf_file.GGUF_DTYPES
    }
    return loaded, files


def _prompt(loaded: Any, n: int) -> list[int]:
    """End-of-text then TEXT, n ids in all: a fresh document, as `minillm sample` starts one."""
    ids = [eot_id(loaded.tokenizer), *loaded.tokenizer.encode(TEXT).ids][:n]
    assert len(ids) == n
    return ids


# ----------------------------------------------------------------------------- the file itself


def test_file_holds_llama_metadata_tokenizer_and_tensors(exported) -> None:
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader, TokenType

    loaded, files = exported
    m, tok = loaded.config.model, loaded.tokenizer
    reader = GGUFReader(files["q8_0"])
    kv = {name: field.contents() for name, field in reader.fields.items()}
    assert kv["general.architecture"] == "llama" and kv["minillm.version"] == "0.1.0"
    assert (kv["llama.block_count"], kv["llama.embedding_length"]) == (m.n_layer, m.d_model)
    assert kv["llama.attention.head_count_kv"] == m.n_kv_head
    assert kv["llama.feed_forward_length"] == m.ffn_hidden
    assert kv["llama.rope.dimension_count"] == m.head_dim
    assert kv["llama.rope.freq_base"] == pytest.approx(m.rope_theta)
    assert kv["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(m.norm_eps)
    assert (kv["tokenizer.ggml.model"], kv["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == m.vocab_size  # one per embedding row, padding included
    end = tok.token_to_id(END)
    assert tokens[end] == END and types[end] == TokenType.CONTROL
    assert types[eot_id(tok)] == TokenType.CONTROL and tokens[eot_id(tok)] == EOT
    assert tokens[-1] == f"[PAD{m.vocab_size - 1}]" and types[-1] == TokenType.UNUSED
    assert types[tok.token_to_id("a")] == TokenType.NORMAL
    assert kv["tokenizer.ggml.eot_token_id"] == end and kv["tokenizer.ggml.eos_token_id"] == 0
    assert kv["tokenizer.ggml.add_bos_token"] is False
    assert kv["tokenizer.chat_template"].startswith("{% for message in messages %}")

    qtypes = {t.name: t.tensor_type for t in reader.tensors}
    assert ("output.weight" in qtypes) == (not m.tie_embeddings)  # tied: llama.cpp reuses embd
    assert qtypes["output_norm.weight"] == qtypes["blk.0.attn_norm.weight"] == Q.F32
    # q8_0 where rows are a multiple of 32 long, f16 where not (d_model 36, ffn 50)
    expect = Q.Q8_0 if m.d_model % 32 == 0 else Q.F16
    assert qtypes["blk.0.attn_q.weight"] == qtypes["token_embd.weight"] == expect
    assert qtypes["blk.0.ffn_down.weight"] == (Q.Q8_0 if m.ffn_hidden % 32 == 0 else Q.F16)
    size = {dtype: path.stat().st_size for dtype, path in files.items()}
    assert size["q8_0"] <= size["f16"] < size["f32"]
    assert (size["q8_0"] < size["f16"]) == (expect == Q.Q8_0)


def test_modelfile_beside_the_file_carries_the_template_and_stops(exported) -> None:
    loaded, files = exported
    text = modelfile_path(files["f32"]).read_text()
    assert text.splitlines()[1] == "FROM ./model-f32.gguf"
    assert 'TEMPLATE """{{- range .Messages }}<|{{ .Role }}|>{{ .Content }}<|end|>' in text
    assert 'PARAMETER stop "<|end|>"' in text and 'PARAMETER stop "<|endoftext|>"' in text
    assert f"PARAMETER num_ctx {loaded.config.model.max_seq_len}" in text
    assert "PARAMETER temperature 0.8" in text  # the run's sample section
    assert not list(files["f32"].parent.glob(".*tmp*"))  # no temporary file left behind


def test_a_tokenizer_without_chat_tokens_exports_plain_text_only(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A tokenizer from before the chat tokens: no template, no end of turn; and one trained
    without the 256 byte tokens exports with a warning (llama.cpp leaves a byte it has no token
    for out, as tokenizers does: tests/test_gguf_vocabularies.py)."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer, pre_tokenizers, trainers

    from minillm.tokenizer.bpe import new_tokenizer
    from tests.helpers import legacy_tokenizer_json

    no_bytes = Tokenizer.from_str(legacy_tokenizer_json())
    run_dir, _, _ = make_run(tmp_path / "a", tokenizer=no_bytes)
    capsys.readouterr()
    export_gguf(load_checkpoint(run_dir), tmp_path / "a.gguf")
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and "model.vocab: lacks the tokens of 1" in warnings[0]

    legacy = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    legacy.train_from_iterator([SHAKESPEARE.read_text(encoding="utf-8")[:6000]], trainer)
    run_dir, _, _ = make_run(tmp_path / "b", tokenizer=legacy)
    path = export_gguf(load_checkpoint(run_dir), tmp_path / "plain.gguf")
    keys = set(GGUFReader(path).fields)
    assert "tokenizer.ggml.eos_token_id" in keys
    assert not keys & {"tokenizer.chat_template", "tokenizer.ggml.eot_token_id"}
    text = modelfile_path(path).read_text()
    assert 'TEMPLATE """{{ .Prompt }}"""' in text and "<|end|>" not in text


def test_rope_permutation_turns_rotate_half_into_adjacent_pairs() -> None:
    """q @ W rotated our way equals (q @ permuted W) rotated llama.cpp's way, rows put back."""
    from minillm.model.rope import apply_rope, rope_tables

    H, D, C, T = 3, 8, 12, 5
    w = torch.randn(H * D, C)
    x = torch.randn(T, C)
    cos, sin = rope_tables(D, T, 10000.0)
    ours = apply_rope((x @ w.T).view(T, H, D)[None], cos[:, None], sin[:, None])[0]

    # llama.cpp's NORM rope: pair (2i, 2i+1) rotated by position * theta^(-2i/D)
    y = (x @ rope_pairs_permute(w, H).T).view(T, H, D // 2, 2)
    angle = torch.arange(T)[:, None] * 10000.0 ** (-torch.arange(0, D, 2) / D)
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    pairs = torch.stack([y[..., 0] * c - y[..., 1] * s, y[..., 0] * s + y[..., 1] * c], -1)
    theirs = pairs.transpose(-1, -2).reshape(T, H, D)  # (x0, x2, ..., x1, x3, ...) = halves
    assert_same_function(theirs, ours)


# ----------------------------------------------------------------------------- llama.cpp: ids

TOKENIZER_TEXTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "1 12 123 1234 12345 123456 3.14159 2024-01-01 0x1F 1,000,000",
    "  two  spaces,   three,\t\ttabs \t mixed    \n\n\n  trailing   ",
    "line one\nline two\r\nline three\n\n\nlast\n",
    "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🙂🚀👩‍👩‍👧, Ελληνικά, кириллица, עברית",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, We'Ve a'lL",
    "quoted specials stay text: <|endoftext|> <|user|>hi<|end|><|assistant|>",
    # llama.cpp's own pre-tokenizer probe (convert_hf_to_gguf.py's chktxt, abridged)
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ ✅ 🦙🦙 3 33 333 "
    "3333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо "
    "''''''```````\"\"\"\"......!!!!!!??????",
]


@needs_llama_cpp
def test_llama_cpp_tokenizer_gives_our_ids_and_bytes(exported) -> None:
    loaded, files = exported
    tok = loaded.tokenizer
    llm = _llama(files["f32"], vocab_only=True)
    for text in TOKENIZER_TEXTS:
        ours = tok.encode(text).ids
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        assert theirs == ours, text
        assert llm.detokenize(ours) == text.encode("utf-8"), text
    # Parsing specials, the chat tokens are single CONTROL tokens, never text.
    ids = {name: tok.token_to_id(name) for name in ("<|system|>", "<|user|>", "<|end|>")}
    rendered = "<|system|>Be terse.<|end|><|user|>Hi<|end|><|assistant|>"
    expected = Conventions.of_own(tok).chat_prompt((("system", "Be terse."), ("user", "Hi")))
    assert llm.tokenize(rendered.encode(), add_bos=False, special=True) == expected
    assert expected[0] == ids["<|system|>"]
    assert llm.detokenize([ids["<|end|>"]]) == b""  # a control token is no text
    assert llm.token_eos() == llm.token_bos() == eot_id(tok)


@pytest.fixture(scope="module")
def shakespeare_export(tmp_path_factory: pytest.TempPathFactory):
    """A 2,048-token BPE trained on Shakespeare and a one-layer model using it, exported."""
    root = tmp_path_factory.mktemp("gguf-shakespeare")
    text = SHAKESPEARE.read_text(encoding="utf-8")
    tok = train_tokenizer([text[:300_000]], 2048)
    model = dict(vocab_size=2048, d_model=32, n_layer=1, n_head=2, n_kv_head=1, ffn_hidden=32)
    run_dir, _, _ = make_run(root, model=model, tokenizer=tok)
    return load_checkpoint(run_dir), text, root


@pytest.mark.slow
@needs_llama_cpp
def test_llama_cpp_tokenizes_a_megabyte_of_shakespeare_as_we_do(
    shakespeare_export, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All of tinyshakespeare.txt (1.1 MB) gives the same ids; the pre-tokenizer name matters:
    llama3's, which agrees on everyday short strings, gives other ids."""
    loaded, text, root = shakespeare_export
    ours = loaded.tokenizer.encode(text).ids
    path = export_gguf(loaded, root / "right.gguf")
    theirs = _llama(path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=False)
    assert len(ours) > 250_000 and theirs == ours

    monkeypatch.setattr(gguf_tokens, "llama_cpp_pre_tokenizer", lambda spec, where: "llama3")
    wrong = export_gguf(loaded, root / "wrong.gguf")
    llm = _llama(wrong, vocab_only=True)
    short = "First Citizen: Before we proceed any further, hear me speak."
    assert llm.tokenize(short.encode(), add_bos=False) == loaded.tokenizer.encode(short).ids
    theirs = llm.tokenize(text.encode(), add_bos=False, special=False)
    first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    print(f"\nllama3's pre-tokenizer first differs at id {first} of {len(ours)}")
    assert first > 1000  # short texts alone would not have caught it


# ----------------------------------------------------------------------------- llama.cpp: logits


@needs_llama_cpp
@pytest.mark.parametrize("dtype,cache,bound", LOGIT_BOUNDS)
def test_llama_cpp_logits_match_ours(exported, dtype: str, cache: int | None, bound: float) -> None:
    loaded, files = exported
    ids = _prompt(loaded, 56)
    kv = {} if cache is None else dict(type_k=cache, type_v=cache)
    llm = _llama(files[dtype], logits_all=True, **kv)
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)])
    with torch.no_grad():
        ours = loaded.model(torch.tensor([ids]))[0][0].numpy()
    assert theirs.shape == ours.shape == (len(ids), loaded.config.model.vocab_size)
    rel = np.abs(theirs - ours).max() / (ours.max() - ours.min())
    kv_type = "f16" if cache is None else "f32"
    agree = (theirs.argmax(-1) == ours.argmax(-1)).mean()
    print(
        f"\n{dtype} weights, {kv_type} KV cache: max |diff| {rel:.2e} of the logit range, ", end=""
    )
    print(f"the same top token at {agree:.0%} of positions")
    assert rel <= bound
    assert agree >= (1.0 if dtype != "q8_0" else 0.9)


@needs_llama_cpp
def test_llama_cpp_greedy_continuation_is_ours(exported) -> None:
    loaded, files = exported
    ids = _prompt(loaded, 20)
    n = loaded.config.model.max_seq_len - len(ids)  # to the end of the context
    ours = generate(loaded.model, [ids], SamplingParams.greedy(n))[0]
    llm = _llama(files["f32"], type_k=0, type_v=0)
    theirs = list(itertools.islice(llm.generate(ids, temp=0.0, repeat_penalty=1.0), n))
    assert len(ours) == n > 30 and theirs == ours


# ----------------------------------------------------------------------------- llama.cpp: chat

# With seed 7's random weights, four of these replies end with <|end|> within 30 tokens (after 8
# to 21 tokens) and two run out of tokens.
CHATS = [
    [{"role": "user", "content": m}]
    for m in ("What is 2 + 2?", "Good morrow", "How now?", "Hello", "Grüße!")
] + [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]
]


@pytest.fixture(scope="module")
def chat_export(tmp_path_factory: pytest.TempPathFactory):
    """A run without padded rows (llama.cpp may choose those; minillm never does) whose random
    weights end some greedy replies with <|end|> within 30 tokens."""
    root = tmp_path_factory.mktemp("gguf-chat")
    run_dir, _, _ = make_run(root, model=dict(vocab_size=300, tie_embeddings=False), seed=7)
    return run_dir, export_gguf(load_checkpoint(run_dir), root / "chat.gguf")


@needs_llama_cpp
def test_llama_cpp_chat_template_stops_at_end_with_minillm_chats_reply(chat_export) -> None:
    run_dir, path = chat_export
    llm = _llama(path, type_k=0, type_v=0)
    assert llm.chat_format == "chat_template.default"  # the embedded Jinja template, no guess
    runner = CliRunner()
    stopped = 0
    for messages in CHATS:
        got = llm.create_chat_completion(messages, temperature=0.0, max_tokens=30)["choices"][0]
        args = ["chat", "--ckpt", str(run_dir), "--temperature", "0", "--max-new-tokens", "30"]
        if messages[0]["role"] == "system":
            args += ["--system", messages[0]["content"]]
        result = runner.invoke(app, [*args, "--message", messages[-1]["content"]])
        assert result.exit_code == 0, result.output
        # Random weights emit bytes that are no UTF-8: minillm prints U+FFFD for each such
        # sequence, llama-cpp-python drops them (errors="ignore"); the tokens are the same.
        ours, theirs = result.stdout.replace("\ufffd", "")[:-1], got["message"]["content"]
        if got["finish_reason"] == "stop":  # at <|end|>, before max_tokens
            assert ours == theirs, messages
            stopped += 1
        else:  # out of tokens: llama-cpp-python goes on until a split character is whole
            assert theirs.startswith(ours), messages
    assert stopped == 4
    # Both also end a reply at <|endoftext|> (llama.cpp's eos; minillm's chat_stop_ids). The
    # reply to "Hi" has one after four tokens.
    got = llm.create_chat_completion(
        [{"role": "user", "content": "Hi"}], temperature=0.0, max_tokens=30
    )
    chat = ["chat", "--ckpt", str(run_dir), "--temperature", "0", "--message", "Hi"]
    result = runner.invoke(app, [*chat, "--max-new-tokens", "30"])
    theirs = got["choices"][0]["message"]["content"]
    assert got["choices"][0]["finish_reason"] == "stop" and theirs
    assert result.stdout.replace("\ufffd", "") == theirs + "\n"


@needs_llama_cpp
def test_llama_cpps_template_guesser_mistakes_ours_for_phi3() -> None:
    """Why the README sends users to the Jinja path: llama.cpp's C-level chat formatter (used
    without --jinja) recognises our template as Phi-3's and adds newlines the model never saw."""
    import ctypes

    import llama_cpp

    from minillm.tokenizer.chat_template import HF_CHAT_TEMPLATE

    chat = (llama_cpp.llama_chat_message * 2)(
        llama_cpp.llama_chat_message(b"system", b"Be terse."),
        llama_cpp.llama_chat_message(b"user", b"Hi"),
    )
    buf = ctypes.create_string_buffer(1024)
    n = llama_cpp.llama_chat_apply_template(HF_CHAT_TEMPLATE.encode(), chat, 2, True, buf, 1024)
    assert buf.raw[:n] == b"<|system|>\nBe terse.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"


# ----------------------------------------------------------------------------- bad input


def _export(args: list[str]):
    return CliRunner().invoke(app, ["export", *args])


def _one_error_line(result: Any) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ")
    return lines[0]


def test_cli_writes_the_file_and_refuses_bad_options_with_nothing_written(tmp_path: Path) -> None:
    run_dir, _, _ = make_run(tmp_path / "work")
    out = tmp_path / "out" / "tiny.gguf"
    ck = ["--ckpt", str(run_dir)]
    for args, says in [
        ([*ck, "--format", "gguf", "--out", str(out), "--dtype", "q4_0"], "--dtype: 'q4_0'"),
        ([*ck, "--format", "onnx", "--out", str(out)], "--format: 'onnx'"),
        ([*ck, "--out", str(tmp_path / "hf"), "--dtype", "f16"], "only with --format gguf"),
        ([*ck, "--format", "gguf", "--out", str(tmp_path / "out" / "tiny")], "ends in .gguf"),
        (
            [*ck, "--format", "gguf", "--out", str(run_dir / "checkpoints" / "x.gguf")],
            "overlaps the checkpoint",
        ),
    ]:
        assert says in _one_error_line(_export(args))
        assert not out.parent.exists() and not (tmp_path / "hf").exists()
        assert not (run_dir / "checkpoints" / "x.gguf").exists()

    result = _export([*ck, "--format", "gguf", "--out", str(out), "--dtype", "f16"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.Modelfile", "tiny.gguf"]

    out.write_bytes(b"mine")
    line = _one_error_line(_export([*ck, "--format", "gguf", "--out", str(out)]))
    assert "--force" in line and out.read_bytes() == b"mine"
    result = _export([*ck, "--format", "gguf", "--out", str(out), "--force"])
    assert result.exit_code == 0 and out.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.Modelfile", "tiny.gguf"]


def _spec(**changes: Any) -> dict[str, Any]:
    spec = json.loads(tiny_tokenizer().to_str())
    for key, value in changes.items():
        section, _, field = key.partition(".")
        if field:
            spec[section][field] = value
        else:
            spec[section] = value
    return spec


@pytest.mark.parametrize(
    "changes,key",
    [
        (dict(pre_tokenizer={"type": "Metaspace", "replacement": "▁"}), "pre_tokenizer"),
        (
            dict(
                pre_tokenizer={  # Llama 3's: its own regex, then ByteLevel without GPT-2's
                    "type": "Sequence",
                    "pretokenizers": [
                        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}},
                        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False},
                    ],
                }
            ),
            "pre_tokenizer",
        ),
        (
            {"pre_tokenizer.add_prefix_space": True},
            "pre_tokenizer.add_prefix_space",
        ),
        ({"pre_tokenizer.use_regex": False}, "pre_tokenizer"),
        (dict(normalizer={"type": "NFKC"}), "normalizer"),
        ({"model.ignore_merges": True}, "model.ignore_merges"),
        ({"model.byte_fallback": True}, "model.byte_fallback"),
    ],
)
def test_a_split_llama_cpp_cannot_reproduce_is_refused(changes: dict, key: str) -> None:
    assert llama_cpp_pre_tokenizer(_spec(), "tokenizer.json") == "gpt-2"
    with pytest.raises(CheckpointError, match=f"^tokenizer.json: {key}: .*no equivalent"):
        llama_cpp_pre_tokenizer(_spec(**changes), "tokenizer.json")


def test_export_of_a_metaspace_tokenizer_is_one_error_line_and_writes_nothing(
    tmp_path: Path,
) -> None:
    from tokenizers import Tokenizer, pre_tokenizers

    tok = Tokenizer.from_str(tiny_tokenizer().to_str())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    run_dir, _, _ = make_run(tmp_path / "work", tokenizer=tok)
    out = tmp_path / "out.gguf"
    line = _one_error_line(_export(["--ckpt", str(run_dir), "--format", "gguf", "--out", str(out)]))
    assert "tokenizer.json: pre_tokenizer:" in line and "Metaspace" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
