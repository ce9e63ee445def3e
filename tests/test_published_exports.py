"""Exports of a published model's tokenizer (issue 41, item 5): a folder built by tests.published
(ChatML, Llama 3, Mistral, Gemma 3: a Gemma3ForCausalLM) and a LoRA fine-tune of one, exported as
a Hugging Face folder, peft adapters and a GGUF file.

hf: the exported folder's AutoTokenizer gives the original's `apply_chat_template` and
`tokenizer(text)` ids and special tokens, its generation_config.json the original's eos list, its
greedy `generate` the original's (replies that stop at the end of turn included). peft: the
adapters load onto the published folder itself. gguf: llama.cpp tokenizes as
`tokenizer(text)` (Llama 3's and Mistral's BOS added by add_bos_token), its greedy text and its
chat through the file's own template (llama-cpp-python's `create_chat_completion`) are `minillm
chat --message`'s; what llama.cpp cannot add is one error line. The llama.cpp tests skip, saying
so, without llama-cpp-python (`make interop`).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml
from typer.testing import CliRunner

from minillm.checkpoint.gguf_file import export_gguf, modelfile_path
from minillm.checkpoint.init_from import load_run_config
from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.data.tokenize_pass import write_shards
from minillm.infer.engine import SamplingParams, generate
from tests.helpers import QUICK_TRAIN, assert_same_function, error_line, run_trainer
from tests.published import (
    CONVERSATIONS,
    FAMILIES,
    family_folder,
    family_tokenizer,
    hf_tokenizer,
    usable,
)

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed; `make interop` builds it from source",
)
runner = CliRunner()
NAMES = ["chatml", "llama3", "mistral", "gemma3", "qwen1.5-moe", "qwen3-moe"]
TEXTS = ["Who art thou?", "First Citizen:\n  Grüße 🙂 1234 — end", ""]
# Single-turn prompts for `minillm chat --message` (Mistral's template has no system role).
CHATS = [
    [{"role": "user", "content": "Who art thou?"}],
    [{"role": "user", "content": "Speak."}],
    [{"role": "user", "content": "What news?"}],
    [{"role": "system", "content": "Speak as a herald."}, {"role": "user", "content": "Hail"}],
]


def _chats(name: str) -> list[list[dict[str, str]]]:
    return [m for m in CHATS if usable(name, m)]


def _conversations(name: str) -> list[list[dict[str, str]]]:
    return [m for m in CONVERSATIONS if usable(name, m)]


def _ids(value: Any) -> list[int]:
    return value if isinstance(value, list) else [value]


def published(root: Path, name: str, split: str = "gpt2", without: tuple[int, ...] = ()) -> Path:
    """family_folder without padded embedding rows (llama.cpp may pick those, minillm never
    does), whose head is edited so that the reply to the first chat ends at the end-of-turn
    token within a few tokens: its row becomes 1.05 x the row of the reply's third token."""
    from safetensors.torch import load_file, save_file

    vocab_size = family_tokenizer(name, split, without).get_vocab_size()
    folder = family_folder(root, name, split=split, without=without, vocab_size=vocab_size)
    conv = load_checkpoint(folder).conventions
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([conv.chat_ids(CHATS[0], True)])
    reply = model.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1] :]
    weights = load_file(folder / "model.safetensors")
    head = weights["lm_head.weight"]
    head[conv.turn_end] = 1.05 * head[int(reply[-1])]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module", params=NAMES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(name, the published folder, its hf export by the CLI, its GGUF export)."""
    root = tmp_path_factory.mktemp(f"published-{request.param}")
    folder = published(root, request.param)
    out = root / "hf"
    result = runner.invoke(app, ["export", "--ckpt", str(folder), "--out", str(out)])
    assert result.exit_code == 0, result.output
    gguf = root / "model.gguf"
    args = ["export", "--ckpt", str(folder), "--format", "gguf", "--out", str(gguf)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and "warning" not in result.stderr, result.output
    return request.param, folder, out, gguf


def _greedy_hf(model: Any, ids: list[int], n: int = 30) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


# ----------------------------------------------------------------------------- hf


def test_hf_export_keeps_the_tokenizer_template_and_special_tokens(family) -> None:
    name, folder, out, _ = family
    theirs, ours = hf_tokenizer(folder), hf_tokenizer(out)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        theirs.bos_token,
        theirs.eos_token,
        theirs.pad_token,
    )
    assert ours.chat_template == theirs.chat_template == FAMILIES[name]["template"]
    for messages in _conversations(name):
        for prompt in (True, False):
            if prompt and messages[-1]["role"] == "assistant":
                continue
            want = theirs.apply_chat_template(
                messages, add_generation_prompt=prompt, return_dict=False
            )
            got = ours.apply_chat_template(
                messages, add_generation_prompt=prompt, return_dict=False
            )
            assert got == want, (messages, prompt)
    for text in TEXTS:  # Llama 3's and Mistral's BOS from the post-processor, ChatML's nothing
        assert ours(text).input_ids == theirs(text).input_ids


def test_hf_export_keeps_the_eos_list_and_generates_the_same(family) -> None:
    name, folder, out, _ = family
    original = json.loads((folder / "generation_config.json").read_text())
    exported = json.loads((out / "generation_config.json").read_text())
    assert _ids(exported["eos_token_id"]) == _ids(original["eos_token_id"])
    assert exported["bos_token_id"] == original["bos_token_id"]
    assert exported["do_sample"] is False  # the folder's own, exported as it is
    config = {
        k: json.loads((d / "config.json").read_text()) for k, d in (("o", folder), ("e", out))
    }
    for key in ("bos_token_id", "eos_token_id"):
        assert _ids(config["e"][key]) == _ids(config["o"][key]), key
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert _ids(ours.generation_config.eos_token_id) == _ids(theirs.generation_config.eos_token_id)
    tok = hf_tokenizer(out)
    stopped = 0
    for messages in _chats(name):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        got = _greedy_hf(ours, ids)
        assert got == _greedy_hf(theirs, ids)
        stopped += got[-1] in _ids(theirs.generation_config.eos_token_id) and len(got) < 30
    assert stopped >= 1  # the edited head ends the first reply at the end of turn
    for text in TEXTS[:2]:
        ids = tok(text).input_ids
        assert _greedy_hf(ours, ids) == _greedy_hf(theirs, ids)


# ----------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory):
    """A LoRA SFT run on a published Llama 3 folder (init_from the folder, its tokenizer and
    template as they are), at a high lr so that the adapters matter."""
    root = tmp_path_factory.mktemp("published-lora")
    folder = published(root, "llama3")
    rows = [{"messages": m} for m in CONVERSATIONS[1:]] * 10
    (root / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    raw = {
        "data": {"source": str(root / "sft.jsonl"), "text_field": "messages",
                 "out_dir": str(root / "tokens")},
        "train": {"init_from": str(folder), "out_dir": str(root / "run"),
                  **{**QUICK_TRAIN, "lr": 5e-2, "max_steps": 4},
                  "lora": {"rank": 4, "alpha": 8,
                           "targets": ["wqkv", "wo", "w_gate_up", "w_down"]}},
        "sample": {"temperature": 0.0, "max_new_tokens": 40},
    }  # fmt: skip
    (root / "lora.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    cfg = load_run_config(root / "lora.yaml")
    write_shards(cfg)
    run_trainer(cfg)
    return folder, root / "run"


def test_hf_export_of_a_lora_fine_tune_keeps_the_published_tokenizer(lora_run, tmp_path) -> None:
    folder, run = lora_run
    out = tmp_path / "hf"
    result = runner.invoke(app, ["export", "--ckpt", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    theirs, ours = hf_tokenizer(folder), hf_tokenizer(out)
    for messages in CONVERSATIONS:
        want = theirs.apply_chat_template(messages, add_generation_prompt=False, return_dict=False)
        assert (
            ours.apply_chat_template(messages, add_generation_prompt=False, return_dict=False)
            == want
        )
    gen = json.loads((out / "generation_config.json").read_text())
    original = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == original["eos_token_id"] == [1, 4]  # <|end_of_text|>, <|eot_id|>
    assert (gen["do_sample"], gen["max_new_tokens"]) == (False, 40)  # the run's sample section
    loaded = load_checkpoint(run)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for messages in CHATS:
        ids = ours.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        mine = generate(
            loaded.model, [ids], SamplingParams.greedy(30, stop_ids=loaded.conventions.stop_ids)
        )[0]
        assert _greedy_hf(model, ids) == mine
    idx = torch.randint(0, 400, (2, 24))
    with torch.no_grad():
        assert (base(idx).logits - model(idx).logits).abs().max() > 1e-2  # the adapters matter


def test_peft_export_of_a_lora_fine_tune_loads_onto_the_published_folder(
    lora_run, tmp_path
) -> None:
    peft = pytest.importorskip("peft")
    folder, run = lora_run
    out = tmp_path / "adapter"
    result = runner.invoke(
        app, ["export", "--ckpt", str(run), "--format", "peft", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder.resolve())  # transformers loads it
    base = transformers.AutoModelForCausalLM.from_pretrained(
        config["base_model_name_or_path"], dtype=torch.float32
    )
    model = peft.PeftModel.from_pretrained(base, out).eval()
    idx = torch.randint(0, 400, (2, 24))
    with torch.no_grad():
        assert_same_function(model(idx).logits, load_checkpoint(run).model(idx)[0])


# ----------------------------------------------------------------------------- gguf


def _kv(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    return {name: field.contents() for name, field in GGUFReader(path).fields.items()}


def test_gguf_holds_the_models_special_ids_template_and_add_bos(family) -> None:
    from gguf import TokenType

    name, folder, _, path = family
    kv = _kv(path)
    tok = family_tokenizer(name)
    ids = {t: tok.token_to_id(t) for t in FAMILIES[name]["specials"]}
    bos, eos, eot = {  # and add_bos: the family's post-processor adds its BOS
        "chatml": ("<|endoftext|>", "<|im_end|>", "<|im_end|>"),
        "qwen1.5-moe": ("<|endoftext|>", "<|im_end|>", "<|im_end|>"),
        "qwen3-moe": ("<|endoftext|>", "<|im_end|>", "<|im_end|>"),
        "llama3": ("<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
        "mistral": ("<s>", "</s>", "</s>"),
        "gemma3": ("<bos>", "<eos>", "<end_of_turn>"),
    }[name]
    want = (ids[bos], ids[eos], ids[eot], FAMILIES[name]["bos"] is not None)
    keys = ("bos_token_id", "eos_token_id", "eot_token_id", "add_bos_token")
    got = tuple(kv[f"tokenizer.ggml.{k}"] for k in keys)
    assert got == want
    assert kv["tokenizer.ggml.add_eos_token"] is False
    assert kv["tokenizer.chat_template"] == FAMILIES[name]["template"]
    types = kv["tokenizer.ggml.token_type"]
    assert all(types[i] == TokenType.CONTROL for i in ids.values())
    assert len(types) == tok.get_vocab_size()
    text = modelfile_path(path).read_text()
    from tests.test_ollama import EXPECTED

    if EXPECTED[name] is None:  # said in the file; Ollama matches the Jinja one to its own
        assert "# No TEMPLATE: the model's chat template is none of the formats" in text
        assert not [line for line in text.splitlines() if line.startswith("TEMPLATE")]
    else:  # the Jinja template's format, in Ollama's Go form
        assert f"# TEMPLATE: the model's chat template ({EXPECTED[name]}) in Go form" in text
        assert [line for line in text.splitlines() if line.startswith('TEMPLATE """')]
    stops = {line.split('"')[1] for line in text.splitlines() if line.startswith("PARAMETER stop")}
    assert stops == set(FAMILIES[name]["eos"])


@needs_llama_cpp
def test_llama_cpp_tokenizes_and_continues_as_the_model(family) -> None:
    name, folder, _, path = family
    loaded = load_checkpoint(folder)
    conv = loaded.conventions
    theirs = hf_tokenizer(folder)
    llm = _llama(path)
    for text in TEXTS:
        # llama.cpp's add_bos is the model's: its tokenize(add_bos=True) is tokenizer(text)
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == theirs(text).input_ids
    # The special tokens are single CONTROL tokens when parsed, text when not.
    rendered = theirs.apply_chat_template(CONVERSATIONS[2], tokenize=False)
    assert llm.tokenize(rendered.encode(), add_bos=False, special=True) == conv.chat_ids(
        CONVERSATIONS[2], False
    )
    for text in TEXTS[:2]:
        ids = conv.prompt_ids(text)
        mine = generate(loaded.model, [ids], SamplingParams.greedy(30, stop_ids=conv.stop_ids))[0]
        cpp = list(itertools.islice(llm.generate(ids, temp=0.0, repeat_penalty=1.0), 30))
        assert cpp[: len(mine)] == mine


def _llama(path: Path, **kw: Any) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=128, n_batch=128, n_ubatch=128, n_threads=2,
                 n_threads_batch=2, verbose=False, type_k=0, type_v=0, **kw)  # fmt: skip


@needs_llama_cpp
def test_llama_cpp_renders_the_files_template_as_minillm(family) -> None:
    """llama-cpp-python's Jinja formatter over the file's template, bos and eos gives the ids of
    minillm's conversations (system prompts, several turns)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    name, folder, _, path = family
    conv = load_checkpoint(folder).conventions
    llm = _llama(path, vocab_only=True)
    kv = _kv(path)
    text = lambda i: llm._model.token_get_text(i)  # noqa: E731
    formatter = Jinja2ChatFormatter(
        kv["tokenizer.chat_template"],
        eos_token=text(kv["tokenizer.ggml.eos_token_id"]),
        bos_token=text(kv["tokenizer.ggml.bos_token_id"]),
    )
    for messages in _conversations(name):
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        prompt = formatter(messages=messages).prompt
        got = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        assert got == conv.chat_ids(messages, True), messages


def _chats_as_minillm(llm: Any, ckpt: Path, chats: Any = None, stops: int = 1) -> None:
    """llama-cpp-python's chat through the file's template replies as `minillm chat`, at least
    `stops` replies ending at the end of turn."""
    stopped = 0
    for messages in CHATS if chats is None else chats:
        got = llm.create_chat_completion(messages, temperature=0.0, max_tokens=30)["choices"][0]
        args = ["chat", "--ckpt", str(ckpt), "--temperature", "0", "--max-new-tokens", "30"]
        if messages[0]["role"] == "system":
            args += ["--system", messages[0]["content"]]
        result = runner.invoke(app, [*args, "--message", messages[-1]["content"]])
        assert result.exit_code == 0, result.output
        # Random weights emit bytes that are no UTF-8: minillm prints U+FFFD for each such
        # sequence, llama-cpp-python drops them; the tokens are the same.
        ours, theirs = result.stdout.replace("\ufffd", "")[:-1], got["message"]["content"]
        if got["finish_reason"] == "stop":
            assert ours == theirs, messages
            stopped += 1
        else:  # out of tokens: llama-cpp-python goes on until a split character is whole
            assert theirs.startswith(ours), messages
    assert stopped >= stops  # published()'s head ends the first reply at the end of turn


@needs_llama_cpp
def test_llama_cpp_chat_replies_as_minillm_chat(family) -> None:
    name, folder, _, path = family
    llm = _llama(path, chat_format="chat_template.default")  # the file's own Jinja template
    _chats_as_minillm(llm, folder, _chats(name))
    if name == "chatml":  # why chat_format is given: the guesser swaps in its own ChatML
        assert _llama(path, vocab_only=True).chat_format == "chatml"


# ----------------------------------------------------------------------------- tokenizers


def _edited_folder(root: Path, name: str, edit: Any) -> Path:
    """A published folder whose tokenizer.json is `edit`(parsed tokenizer.json)."""
    folder = published(root, name)
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    edit(spec)
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return folder


def _drop_non_utf8_bytes(spec: dict[str, Any]) -> None:
    """Remove the tokens of the 13 bytes UTF-8 never has (0xC0, 0xC1, 0xF5-0xFF): the ids of
    the rest are kept (a vocabulary with holes, as real ones trained without them)."""
    from minillm.checkpoint.gguf_tokens import NOT_UTF8_BYTES
    from minillm.tokenizer.bpe import byte_alphabet

    gone = {byte_alphabet()[b] for b in NOT_UTF8_BYTES}
    vocab = spec["model"]["vocab"]
    spec["model"]["merges"] = [
        m
        for m in spec["model"]["merges"]
        if not set(m if isinstance(m, list) else m.split(" ")) & gone
    ]
    for char in gone:
        vocab.pop(char, None)


def test_a_vocabulary_without_the_bytes_utf8_never_has_exports(tmp_path: Path) -> None:
    folder = _edited_folder(tmp_path, "llama3", _drop_non_utf8_bytes)
    loaded = load_checkpoint(folder)
    path = export_gguf(loaded, tmp_path / "holes.gguf")
    tokens = _kv(path)["tokenizer.ggml.tokens"]
    assert sum(t.startswith("[PAD") for t in tokens) == 13  # the holes, as unused rows
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (make interop)")
    llm = _llama(path, vocab_only=True)
    text = "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά.\n" + TEXTS[1]
    assert llm.tokenize(text.encode(), add_bos=True) == loaded.conventions.prompt_ids(text)


def _two_before(spec: dict[str, Any]) -> None:
    post = spec["post_processor"]
    post["single"].insert(0, post["single"][0])


def _unk_after(spec: dict[str, Any]) -> None:
    spec["post_processor"]["single"].append({"SpecialToken": {"id": "<unk>", "type_id": 0}})
    spec["post_processor"]["special_tokens"]["<unk>"] = {
        "id": "<unk>",
        "ids": [0],
        "tokens": ["<unk>"],
    }


@pytest.mark.parametrize(
    "name, edit, message",
    [
        ("mistral", _two_before,
         "post_processor: adds <s> <s> before the text; llama.cpp adds at most one"),
        ("mistral", _unk_after,
         "post_processor: adds <unk> after the text, which is not the eos token </s>"),
    ],
)  # fmt: skip
def test_a_tokenizer_llama_cpp_cannot_follow_is_one_error_line(
    tmp_path: Path, name: str, edit: Any, message: str
) -> None:
    folder = _edited_folder(tmp_path, name, edit)
    out = tmp_path / "m.gguf"
    result = runner.invoke(
        app, ["export", "--ckpt", str(folder), "--format", "gguf", "--out", str(out)]
    )
    line = error_line(result)
    assert message in line and "not exported" in line, line
    assert not out.exists() and not modelfile_path(out).exists()


def test_a_post_processor_that_adds_nothing_is_no_bos(tmp_path: Path) -> None:
    """A TemplateProcessing of `$A` alone (what some ChatML tokenizers carry) adds nothing."""

    def bare_template(spec: dict[str, Any]) -> None:
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {},
        }

    folder = _edited_folder(tmp_path, "chatml", bare_template)
    kv = _kv(export_gguf(load_checkpoint(folder), tmp_path / "m.gguf"))
    assert kv["tokenizer.ggml.add_bos_token"] is False


def test_gguf_warns_when_llama_cpp_would_stop_elsewhere(tmp_path: Path, capsys) -> None:
    """A stop id GGUF cannot mark (a third one, no text llama.cpp knows) is named in a warning."""
    folder = published(tmp_path, "llama3")
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [*gen["eos_token_id"], 2]  # <|start_header_id|>
    (folder / "generation_config.json").write_text(json.dumps(gen))
    export_gguf(load_checkpoint(folder), tmp_path / "m.gguf")
    err = capsys.readouterr().err
    assert "warning: llama.cpp does not stop at <|start_header_id|>" in err
