"""DeepSeek-V3 (DeepseekV3ForCausalLM) through the commands, on a folder built by
scripts/make_published_folder.py (`deepseek-v3`: random weights, latent attention with a q
bottleneck, a dense block then DeepSeekMoE, yarn with mscale, a byte-level BPE carrying
DeepSeek-V3's special tokens and its chat template): `sample` and `chat` against transformers'
`generate` and `apply_chat_template` (decoded through the latent KV cache), `--quantize int8`,
`export` back to the same class and logits; then a chat SFT with LoRA (`tokenize`, `train`),
and the run chats and evaluates."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from tests.helpers import assert_same_function
from tests.published import CONVERSATIONS, family_folder, family_tokenizer, hf_tokenizer
from tests.test_published_models import _config, _shards, hf_ids

runner = CliRunner()
TEXT = "First Citizen: Before we proceed any further, hear me speak."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What news?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("deepseek")
    vocab = family_tokenizer("deepseek-v3").get_vocab_size()  # no padded rows to suppress
    return family_folder(root, "deepseek-v3", vocab_size=vocab)


def _hf(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _greedy(model: transformers.PreTrainedModel, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def _invoke(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_sample_chat_and_export_equal_transformers(folder: Path, tmp_path: Path) -> None:
    model, tok = _hf(folder), hf_tokenizer(folder)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<｜begin▁of▁sentence｜>")
    want = TEXT + tok.decode(_greedy(model, ids, 20), skip_special_tokens=True)
    args = ["sample", "--ckpt", str(folder), "--prompt", TEXT, "--max-new-tokens", "20"]
    assert _invoke([*args, "--temperature", "0"]) == want + "\n"
    int8 = _invoke([*args, "--temperature", "0", "--quantize", "int8"])
    assert int8.startswith(TEXT)

    prompt = hf_ids(tok, CHAT, True)
    assert tok.decode(prompt) == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>What news?<｜Assistant｜>"
    )
    stop = tok.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    reply = list(itertools.takewhile(lambda t: t != stop, _greedy(model, prompt, 12)))
    args = ["chat", "--ckpt", str(folder), "--system", "Be brief.", "--message", "What news?"]
    got = _invoke([*args, "--max-new-tokens", "12", "--temperature", "0"])
    assert got == tok.decode(reply, skip_special_tokens=True) + "\n"

    out = tmp_path / "hf"
    _invoke(["export", "--ckpt", str(folder), "--out", str(out)])
    back = _hf(out)
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    idx = torch.randint(0, len(tok), (2, 40))
    with torch.no_grad():
        assert_same_function(back(idx).logits, model(idx).logits)


def test_gguf_export_tokenizes_and_decodes_in_llama_cpp_as_transformers(
    folder: Path, tmp_path: Path
) -> None:
    """llama.cpp's deepseek2 on the exported file (tests/test_gguf_deepseek.py: its logits):
    DeepSeek-V3's tokenizer gives transformers' ids, and greedy text is `generate`'s."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")
    gguf = tmp_path / "model.gguf"
    _invoke(["export", "--ckpt", str(folder), "--format", "gguf", "--out", str(gguf)])
    model, tok = _hf(folder), hf_tokenizer(folder)
    ids = tok(TEXT)["input_ids"]
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=128, n_threads=2, verbose=False,
                          type_k=0, type_v=0)  # fmt: skip
    try:
        assert llm.tokenize(TEXT.encode(), add_bos=True) == ids
        cpp = list(itertools.islice(llm.generate(ids, temp=0.0, repeat_penalty=1.0), 20))
    finally:
        llm.close()
    assert cpp == _greedy(model, ids, 20)


def test_serve_batches_two_chats_on_the_latent_cache(folder: Path) -> None:
    """Two chat completions at once (continuous batching: rows of different lengths in one
    latent cache), each the reply transformers generates alone."""
    from minillm.serve import protocol as P
    from minillm.serve.handlers import Handler
    from minillm.serve.worker import EngineThread
    from tests.test_serve import Connected

    ckpt = load_checkpoint(folder)
    engine = EngineThread(ckpt.model, ckpt.tokenizer, max_batch=2, max_queue=4)
    handler = Handler(ckpt, "deepseek-v3", engine, 1 << 20, None)
    chats = [CHAT, [{"role": "user", "content": TEXT}]]
    jobs = [
        P.parse_chat(
            {"messages": m, "max_tokens": 10, "temperature": 0}, handler.limits, handler.encode_chat
        )  # fmt: skip
        for m in chats
    ]

    async def both() -> list[dict]:
        return list(await asyncio.gather(*(handler.complete(Connected(), j) for j in jobs)))

    engine.start()
    try:
        answers = asyncio.run(both())
    finally:
        engine.close()
    tok, model = hf_tokenizer(folder), _hf(folder)
    stop = tok.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    for job, answer in zip(jobs, answers):
        reply = list(itertools.takewhile(lambda t: t != stop, _greedy(model, job.prompts[0], 10)))
        assert answer["choices"][0]["message"]["content"] == tok.decode(
            reply, skip_special_tokens=True
        )


@pytest.mark.slow
def test_chat_sft_with_lora_then_chat_and_eval(folder: Path, tmp_path: Path) -> None:
    rows = [m for m in CONVERSATIONS if m[-1]["role"] == "assistant"] * 4
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    lora = {"rank": 4, "alpha": 8, "targets": ["wqkv", "wo"]}  # MLA's projections
    config = _config(tmp_path, folder, source, "messages", lora=lora, lr=5e-2, max_steps=3)
    _invoke(["tokenize", str(config)])
    tok = hf_tokenizer(folder)
    ids, mask = _shards(tmp_path / "tokens", "train")
    targets = tok.decode(ids[mask == 1].tolist())  # the replies and their end, no user turn
    assert "<｜end▁of▁sentence｜>" in targets and "<｜User｜>" not in targets
    assert "Who art" not in targets and ("He sleeps." in targets or "I will." in targets)
    _invoke(["train", str(config)])
    run = tmp_path / "run"
    loaded = load_checkpoint(run)
    idx = torch.randint(0, len(tok), (2, 40))
    with torch.no_grad():
        ours = loaded.model(idx)[0]
        assert (ours - _hf(folder)(idx).logits).abs().max() > 1e-2  # the adapters matter
    got = json.loads(_invoke(["eval", "--ckpt", str(run), "--data", str(source), "--json"]))
    assert got["loss"] > 0
    args = ["chat", "--ckpt", str(run), "--message", "Who art thou?", "--max-new-tokens", "6"]
    _invoke([*args, "--temperature", "0"])
    out = tmp_path / "hf"
    _invoke(["export", "--ckpt", str(run), "--out", str(out)])  # merged, DeepSeek's names
    with torch.no_grad():
        assert_same_function(_hf(out)(idx).logits, ours)
    result = runner.invoke(app, ["export", "--ckpt", str(run), "--format", "peft", "--out",
                                 str(tmp_path / "adapter")])  # fmt: skip
    assert result.exit_code == 2 and "model.attention: mla" in result.output
