"""Phi-3 and Phi-4-mini (Phi3ForCausalLM) through the commands, on folders built by
scripts/make_published_folder.py (`phi3-mini`: Llama 2's sentencepiece with Phi-3's tokens and
template, every dimension rotated; `phi4-mini`: a byte-level BPE with the same tokens, 3/4 of each
head rotated, a tied head; both LongRoPE with an original length of 256 in a context of 1024):
`info`, `sample` past the original length and `chat` against transformers, serve's chat
completions; then a chat SFT with LoRA on every projection (`tokenize`, `train`), `eval`, `sample`
of the run and its hf, peft and gguf exports. tests/test_family_commands.py takes both families
through every command too; tests/test_phi3.py pins the model to transformers'."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.infer.engine import Engine, SamplingParams, generate
from tests.helpers import assert_same_function, error_line
from tests.published import CONVERSATIONS, family_folder, hf_tokenizer
from tests.test_family_commands import streamed
from tests.test_published_models import _config, _shards, hf_ids

runner = CliRunner()
LONG = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}]
ORIGINAL = 256  # the folders' original_max_position_embeddings


@pytest.fixture(scope="module", params=["phi4-mini", "phi3-mini"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family_folder(tmp_path_factory.mktemp(request.param), request.param)


def _hf(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _greedy(
    model: transformers.PreTrainedModel, ids: list[int], n: int, cache: bool = True
) -> list[int]:
    """transformers' greedy continuation, never a padding row (minillm samples none); without
    its cache across the original length, where its cached generate is not its full forward."""
    vocab = len(hf_tokenizer(Path(model.name_or_path)))
    padding = list(range(vocab, model.config.vocab_size))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             suppress_tokens=padding or None, use_cache=cache)  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_info_counts_the_folders_parameters_as_transformers(folder: Path) -> None:
    result = runner.invoke(app, ["info", "--ckpt", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["params"] == sum(p.numel() for p in _hf(folder).parameters())


def test_sample_past_the_original_length_and_chat_equal_transformers(folder: Path) -> None:
    """A prompt of 240 tokens and 32 new ones: the decode crosses 256, where minillm refills the
    row with the long factors, which is transformers' forward of the whole sequence."""
    model, tok = _hf(folder), hf_tokenizer(folder)
    text = " ".join([LONG] * 12)
    ids = tok(text)["input_ids"][:240]
    text = tok.decode(ids, skip_special_tokens=True)
    assert tok(text)["input_ids"] == ids
    want = text + streamed(folder, ids, _greedy(model, ids, 32, cache=False))
    args = ["sample", "--ckpt", str(folder), "--prompt", text, "--max-new-tokens", "32"]
    result = runner.invoke(app, [*args, "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout == want + "\n"
    prompt = hf_ids(tok, CHAT, True)
    assert tok.decode(prompt).replace(" \n", "\n").startswith("<|system|>")
    reply = _greedy(model, prompt, 12)  # generation_config stops at <|end|> or <|endoftext|>
    args = ["chat", "--ckpt", str(folder), "--system", "Be brief.", "--message", LONG]
    result = runner.invoke(app, [*args, "--max-new-tokens", "12", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout == tok.decode(reply, skip_special_tokens=True) + "\n"


def test_serve_renders_phis_template_and_replies_as_chat(folder: Path) -> None:
    from minillm.serve import protocol as P
    from minillm.serve.handlers import Handler
    from minillm.serve.worker import EngineThread
    from tests.test_serve import Connected

    ckpt = load_checkpoint(folder)
    engine = EngineThread(ckpt.model, ckpt.tokenizer, max_batch=2, max_queue=4)
    handler = Handler(ckpt, "phi", engine, 1 << 20, None)
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
def test_chat_sft_with_lora_then_eval_sample_and_every_export(folder: Path, tmp_path: Path) -> None:
    rows = [m for m in CONVERSATIONS if m[-1]["role"] == "assistant"] * 4
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    lora = {"rank": 4, "alpha": 8, "targets": ["wqkv", "wo", "w_gate_up", "w_down"]}
    config = _config(tmp_path, folder, source, "messages", lora=lora, lr=5e-2, max_steps=4)
    result = runner.invoke(app, ["tokenize", str(config)])
    assert result.exit_code == 0, result.output
    tok = hf_tokenizer(folder)
    ids, mask = _shards(tmp_path / "tokens", "train")
    # The targets are the replies and their <|end|>, nothing of the user turns.
    targets = tok.decode(ids[mask == 1].tolist())
    assert "<|end|>" in targets and "<|user|>" not in targets and "Who art" not in targets
    assert "He sleeps." in targets or "I will." in targets
    result = runner.invoke(app, ["train", str(config)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    result = runner.invoke(app, ["eval", "--ckpt", str(run), "--data", str(source), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["loss"] > 0
    loaded = load_checkpoint(run)
    prompt = tok("The king")["input_ids"]
    engine = Engine(loaded.model, loaded.tokenizer)  # as sample: never a padding row
    row = engine.submit(
        [prompt], SamplingParams.greedy(12, stop_ids=loaded.conventions.text_stops)
    )[0]
    engine.run(lambda event: None)
    mine = row.tokens
    args = ["sample", "--ckpt", str(run), "--prompt", "The king", "--max-new-tokens", "12"]
    result = runner.invoke(app, [*args, "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "The king" + streamed(folder, prompt, mine) + "\n"
    idx = torch.randint(0, len(tok), (2, 40))
    with torch.no_grad():
        ours = loaded.model(idx)[0]
        assert (ours - _hf(folder)(idx).logits).abs().max() > 1e-2  # the adapters matter

    out = tmp_path / "hf"
    result = runner.invoke(app, ["export", "--ckpt", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    exported = _hf(out)
    assert type(exported).__name__ == "Phi3ForCausalLM"
    with torch.no_grad():
        assert_same_function(exported(idx).logits, ours)

    peft = pytest.importorskip("peft")
    adapter = tmp_path / "adapter"
    args = ["export", "--ckpt", str(run), "--format", "peft", "--out", str(adapter)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    modules = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert sorted(modules) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
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
    # n_ctx 256: llama.cpp's short factors, as ours below the original length
    llm = Llama(model_path=str(gguf), n_ctx=ORIGINAL, n_threads=2, verbose=False,
                type_k=0, type_v=0)  # fmt: skip
    cpp = list(itertools.islice(llm.generate(prompt, temp=0.0, repeat_penalty=1.0), 20))
    assert cpp == mine


@pytest.mark.parametrize(
    "key, value",
    [("partial_rotary_factor", 0.7), ("rope_scaling", {"rope_type": "longrope",
                                                        "short_factor": [1.0],
                                                        "long_factor": [1.0]}),
     ("hidden_act", "gelu")],
)  # fmt: skip
def test_what_minillm_cannot_honour_is_one_line_naming_the_key(
    folder: Path, tmp_path: Path, key: str, value: object
) -> None:
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config[key] = value
    config.pop("rope_parameters", None) if key == "rope_scaling" else None
    if key == "partial_rotary_factor":  # transformers 5 writes it in rope_parameters too
        for params in (config.get("rope_parameters"), config.get("rope_scaling")):
            if isinstance(params, dict):
                params.pop("partial_rotary_factor", None)
    (copy / "config.json").write_text(json.dumps(config))
    named = {"partial_rotary_factor": "model.partial_rotary",
             "rope_scaling": "model.rope_scaling.short_factor"}.get(key, key)  # fmt: skip
    for args in (["sample", "--prompt", "x"], ["info"]):
        result = runner.invoke(app, [args[0], "--ckpt", str(copy), *args[1:]])
        assert error_line(result).startswith(f"error: {copy / 'config.json'}: {named}: ")
