"""The model families through every command (issue 50), on a published-model folder each
(tests.published.MODEL_FAMILIES: a random-weight model of the family's transformers class and a
byte-level or sentencepiece tokenizer with its real special tokens and chat template): `sample`,
`chat` and `eval` of the folder equal transformers' generate and loss; `tokenize` writes its chat
data as apply_chat_template does, with the replies as targets; `train` fine-tunes it with LoRA; the
run chats, evaluates and serves; `export` writes it back as the same class (same logits), as peft
adapters on the folder (same logits) and as GGUF, which llama.cpp decodes as minillm does.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.infer.engine import SamplingParams, generate
from tests.helpers import assert_same_function
from tests.published import CONVERSATIONS, FAMILIES, MODEL_FAMILIES, family_folder, hf_tokenizer

runner = CliRunner()
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak."


def _invoke(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.stdout


def _hf(folder: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _greedy(model: transformers.PreTrainedModel, ids: list[int], n: int, vocab: int) -> list[int]:
    """transformers' greedy continuation, never a padding row (minillm never samples one)."""
    padding = list(range(vocab, model.config.vocab_size))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             suppress_tokens=padding or None)  # fmt: skip
    return out[0, len(ids) :].tolist()


def streamed(folder: Path, prompt: list[int], ids: list[int]) -> str:
    """The text `sample` prints for transformers' `ids` after `prompt`: its tokenizer's decode,
    but where the ids spell invalid UTF-8 (a random model's byte tokens), minillm's streamed
    pieces, which hold back and replace such bytes otherwise (as vLLM's detokenizer does)."""
    from tokenizers import Tokenizer

    from minillm.infer.text_stream import TextStreamer, continuation

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    whole = continuation(tok, prompt, ids)
    if "\ufffd" not in whole:
        return whole
    stream = TextStreamer(tok, prompt)
    return "".join(stream.push(t) for t in ids) + stream.flush()


def _config(tmp: Path, folder: Path, source: Path) -> Path:
    cfg = {
        "data": {"source": str(source), "text_field": "messages", "out_dir": str(tmp / "tokens"),
                 "val_fraction": 0.25},
        "train": {"init_from": str(folder), "device": "cpu", "precision": "fp32",
                  "batch_size": 2, "seq_len": 64, "max_steps": 2, "eval_every": 2,
                  "eval_steps": 1, "ckpt_every": 2, "log_every": 1, "lr": 1e-2,
                  "lora": {"rank": 2, "alpha": 4, "targets": ["wqkv", "wo"]},
                  "out_dir": str(tmp / "run")},
    }  # fmt: skip
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_FAMILIES)
def test_a_family_goes_through_every_command(tmp_path: Path, name: str) -> None:
    folder = family_folder(tmp_path, name)
    model_class = FAMILIES[name]["model"][0]
    hf, hf_tok = _hf(folder), hf_tokenizer(folder)
    assert type(hf).__name__ == model_class
    vocab = len(hf_tok)

    # The folder: sample, chat and eval are transformers' generate and loss.
    ids = hf_tok("The king")["input_ids"]
    want = "The king" + streamed(folder, ids, _greedy(hf, ids, 10, vocab))
    args = ["sample", "--ckpt", str(folder), "--prompt", "The king", "--max-new-tokens", "10"]
    assert _invoke([*args, "--temperature", "0"]) == want + "\n"
    messages = [{"role": "user", "content": "Hi"}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    reply = _greedy(hf, ids, 8, vocab)
    stops = set(hf.generation_config.eos_token_id)
    reply = list(itertools.takewhile(lambda t: t not in stops, reply))
    args = ["chat", "--ckpt", str(folder), "--message", "Hi", "--max-new-tokens", "8"]
    assert _invoke([*args, "--temperature", "0"]) == streamed(folder, ids, reply) + "\n"
    data = tmp_path / "short.txt"
    data.write_text(TEXT, encoding="utf-8")
    x = torch.tensor([hf_tok(TEXT)["input_ids"]])
    with torch.no_grad():
        loss = hf(x, labels=x).loss.item()
    got = json.loads(_invoke(["eval", "--ckpt", str(folder), "--data", str(data), "--json"]))
    assert got["loss"] == pytest.approx(loss, rel=1e-5)

    # tokenize: the conversations as apply_chat_template, the replies and their end as targets
    rows = [m for m in CONVERSATIONS if m[-1]["role"] == "assistant"] * 4
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    config = _config(tmp_path, folder, source)
    _invoke(["tokenize", str(config)])
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    shards = sorted((tmp_path / "tokens").glob("*_*.bin"))
    tokens = np.concatenate([np.fromfile(f, dtype=np.dtype(meta["dtype"])) for f in shards])
    mask = np.concatenate([np.fromfile(f.with_suffix(".mask"), dtype=np.uint8) for f in shards])
    end = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    docs = np.split(tokens, np.flatnonzero(tokens == end) + 1)[:-1]
    docs_mask = np.split(mask, np.flatnonzero(tokens == end) + 1)[:-1]
    want_docs = sorted(
        [*hf_tok.apply_chat_template(m, return_dict=False), end] for m in rows
    )  # fmt: skip
    assert sorted(d.tolist() for d in docs) == want_docs
    for doc, targets in zip(docs, docs_mask):
        text = hf_tok.decode(doc[targets.astype(bool)].tolist())
        conversation = next(m for m in rows if [*hf_tok.apply_chat_template(
            m, return_dict=False), end] == doc.tolist())  # fmt: skip
        end_of_turn = FAMILIES[name]["eos"][0]  # <|im_end|>, Phi's <|end|>
        replies = [m["content"] + end_of_turn for m in conversation if m["role"] == "assistant"]
        if name == "qwen3-moe":  # the last reply's (empty) <think> block is the model's to write:
            replies[-1] = "<think>\n\n</think>\n\n" + replies[-1]  # the prompt ends before it
        assert text == "".join(replies)

    # train LoRA; the run chats, evaluates and serves as one model
    _invoke(["train", str(config)])
    run = tmp_path / "run"
    loaded = load_checkpoint(run)
    spm = "spm" in FAMILIES[name]
    assert loaded.conventions.kind == ("sentencepiece" if spm else "byte-level")
    params = SamplingParams.greedy(8, stop_ids=loaded.conventions.stop_ids)
    mine = generate(loaded.model, [ids], params)[0]
    text = streamed(folder, ids, [t for t in mine if t not in stops])
    args = ["chat", "--ckpt", str(run), "--message", "Hi", "--max-new-tokens", "8"]
    assert _invoke([*args, "--temperature", "0"]) == text + "\n"
    got = json.loads(_invoke(["eval", "--ckpt", str(run), "--data", str(data), "--json"]))
    with torch.no_grad():
        tuned_loss = loaded.model(x[:, :-1], x[:, 1:])[1].item()
    assert got["loss"] == pytest.approx(tuned_loss, rel=1e-5)
    assert abs(tuned_loss - loss) > 1e-5  # the adapters changed the model
    assert _serve_chat(loaded, messages) == text

    # export: the same class back, peft adapters on the folder, GGUF in llama.cpp
    out = tmp_path / "hf"
    _invoke(["export", "--ckpt", str(run), "--out", str(out)])
    again = _hf(out)
    assert type(again).__name__ == model_class
    idx = torch.randint(0, vocab, (2, 24))
    with torch.no_grad():
        assert_same_function(again(idx).logits, loaded.model(idx)[0])
    peft = pytest.importorskip("peft")
    adapter = tmp_path / "adapter"
    _invoke(["export", "--ckpt", str(run), "--format", "peft", "--out", str(adapter)])
    tuned = peft.PeftModel.from_pretrained(_hf(folder), adapter).eval()
    with torch.no_grad():
        assert_same_function(tuned(idx).logits, loaded.model(idx)[0])
    gguf = tmp_path / "model.gguf"
    _invoke(["export", "--ckpt", str(run), "--format", "gguf", "--out", str(gguf)])
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=128, n_threads=2, verbose=False, type_k=0, type_v=0)
    prompt = hf_tok("The king")["input_ids"]
    ours = generate(loaded.model, [prompt], SamplingParams.greedy(20))[0]
    cpp = list(itertools.islice(llm.generate(prompt, temp=0.0, repeat_penalty=1.0), 20))
    assert cpp == ours


def _serve_chat(loaded, messages: list[dict[str, str]]) -> str:  # noqa: ANN001
    """`minillm serve`'s reply to a greedy chat completion (its handler on its engine thread)."""
    from minillm.serve import protocol as P
    from minillm.serve.handlers import Handler
    from minillm.serve.worker import EngineThread
    from tests.test_serve import Connected

    engine = EngineThread(loaded.model, loaded.tokenizer, max_batch=2, max_queue=4)
    handler = Handler(loaded, "family", engine, 1 << 20, None)
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    job = P.parse_chat(body, handler.limits, handler.encode_chat)
    engine.start()
    try:
        answer = asyncio.run(handler.complete(Connected(), job))
    finally:
        engine.close()
    return answer["choices"][0]["message"]["content"]
