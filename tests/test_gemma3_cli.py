"""Gemma 3 (Gemma3ForCausalLM) through the commands, on a folder built by
scripts/make_published_folder.py (`gemma3`: random weights, local and global layers with a window
of 16, a byte-level BPE carrying Gemma 3's special tokens and its chat template): `info`,
`sample`, `chat` and serve's chat completions against transformers' `apply_chat_template` and
`generate` with prompts longer than the window; then a chat SFT (`tokenize`, LoRA `train`),
`eval`, and the run exported as a Hugging Face folder (the same class and logits), PEFT adapters
(loaded onto the folder) and GGUF (llama.cpp's gemma3: its greedy continuation is minillm's)."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.infer.engine import SamplingParams, generate
from tests.helpers import assert_same_function
from tests.published import CONVERSATIONS, family_folder, family_tokenizer, hf_tokenizer
from tests.test_published_models import _config, _shards, hf_ids

runner = CliRunner()
LONG = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gemma3")
    vocab = family_tokenizer("gemma3").get_vocab_size()  # no padded rows: llama.cpp's greedy
    return family_folder(root, "gemma3", "Gemma3ForCausalLM", vocab_size=vocab)


def _hf(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _greedy(model: transformers.PreTrainedModel, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_info_counts_the_folders_parameters_as_transformers(folder: Path) -> None:
    result = runner.invoke(app, ["info", "--ckpt", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["params"] == sum(p.numel() for p in _hf(folder).parameters())


def test_sample_and_chat_equal_transformers_past_the_window(folder: Path) -> None:
    model, tok = _hf(folder), hf_tokenizer(folder)
    ids = tok(LONG)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<bos>") and len(ids) > 16  # past the window
    want = LONG + tok.decode(_greedy(model, ids, 24), skip_special_tokens=True)
    args = ["sample", "--ckpt", str(folder), "--prompt", LONG, "--max-new-tokens", "24"]
    result = runner.invoke(app, [*args, "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout == want + "\n"
    result = runner.invoke(app, [*args, "--temperature", "0", "--quantize", "int8"])
    assert result.exit_code == 0 and result.stdout.startswith(LONG), result.output
    prompt = hf_ids(tok, CHAT, True)
    assert tok.decode(prompt).startswith("<bos><start_of_turn>user\nBe brief.\n\nFirst")
    reply = _greedy(model, prompt, 12)  # generation_config stops at <eos> or <end_of_turn>
    args = ["chat", "--ckpt", str(folder), "--system", "Be brief.", "--message", LONG]
    result = runner.invoke(app, [*args, "--max-new-tokens", "12", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout == tok.decode(reply, skip_special_tokens=True) + "\n"


def test_serve_renders_gemmas_template_and_replies_as_chat(folder: Path) -> None:
    from minillm.serve import protocol as P
    from minillm.serve.handlers import Handler
    from minillm.serve.worker import EngineThread
    from tests.test_serve import Connected

    ckpt = load_checkpoint(folder)
    engine = EngineThread(ckpt.model, ckpt.tokenizer, max_batch=2, max_queue=4)
    handler = Handler(ckpt, "gemma3", engine, 1 << 20, None)
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0}
    job = P.parse_chat(body, handler.limits, handler.encode_chat)
    tok = hf_tokenizer(folder)
    assert job.prompts == [hf_ids(tok, CHAT, True)]
    engine.start()
    try:
        answer = asyncio.run(handler.complete(Connected(), job))
    finally:
        engine.close()
    reply = _greedy(_hf(folder), job.prompts[0], 12)
    assert answer["choices"][0]["message"]["content"] == tok.decode(reply, skip_special_tokens=True)


@pytest.mark.slow
def test_chat_sft_with_lora_then_eval_and_every_export(folder: Path, tmp_path: Path) -> None:
    rows = [m for m in CONVERSATIONS if m[-1]["role"] == "assistant"] * 4
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    lora = {"rank": 4, "alpha": 8, "targets": ["wqkv", "wo", "w_gate_up", "w_down"]}
    config = _config(tmp_path, folder, source, "messages", lora=lora, lr=5e-2, max_steps=4)
    result = runner.invoke(app, ["tokenize", str(config)])
    assert result.exit_code == 0, result.output
    tok = hf_tokenizer(folder)
    ids, mask = _shards(tmp_path / "tokens", "train")
    # The targets are the replies and their <end_of_turn>, nothing of the user turns.
    targets = tok.decode(ids[mask == 1].tolist())
    assert "<end_of_turn>" in targets and "user" not in targets and "Who art" not in targets
    assert "He sleeps." in targets or "I will." in targets
    result = runner.invoke(app, ["train", str(config)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    result = runner.invoke(app, ["eval", "--ckpt", str(run), "--data", str(source), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["loss"] > 0
    loaded = load_checkpoint(run)
    idx = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        ours = loaded.model(idx)[0]
        assert (ours - _hf(folder)(idx).logits).abs().max() > 1e-2  # the adapters matter

    out = tmp_path / "hf"
    result = runner.invoke(app, ["export", "--ckpt", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    exported = _hf(out)
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        assert_same_function(exported(idx).logits, ours)

    peft = pytest.importorskip("peft")
    adapter = tmp_path / "adapter"
    args = ["export", "--ckpt", str(run), "--format", "peft", "--out", str(adapter)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    tuned = peft.PeftModel.from_pretrained(_hf(folder), adapter).eval()
    with torch.no_grad():
        assert_same_function(tuned(idx).logits, ours)

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    from llama_cpp import Llama

    gguf = tmp_path / "model.gguf"
    args = ["export", "--ckpt", str(run), "--format", "gguf", "--out", str(gguf)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    prompt = loaded.conventions.chat_ids(CHAT, True)
    mine = generate(loaded.model, [prompt], SamplingParams.greedy(20))[0]
    llm = Llama(model_path=str(gguf), n_ctx=128, n_threads=2, verbose=False)
    assert llm.tokenize(LONG.encode(), add_bos=True, special=False) == tok(LONG)["input_ids"]
    cpp = list(itertools.islice(llm.generate(prompt, temp=0.0, repeat_penalty=1.0), 20))
    assert cpp == mine


@pytest.mark.parametrize(
    "key, value",
    [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
     ("layer_types", ["full_attention", "sliding_attention"])],
)  # fmt: skip
def test_what_minillm_cannot_honour_is_one_line_naming_the_key(
    folder: Path, tmp_path: Path, key: str, value: object
) -> None:
    import shutil

    from tests.helpers import error_line

    copy = tmp_path / "gemma3"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config[key] = value
    (copy / "config.json").write_text(json.dumps(config))
    for args in (["sample", "--prompt", "x"], ["info"]):
        result = runner.invoke(app, [args[0], "--ckpt", str(copy), *args[1:]])
        assert error_line(result).startswith(f"error: {copy / 'config.json'}: {key}: ")
