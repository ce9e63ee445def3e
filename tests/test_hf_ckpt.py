"""`--ckpt` takes a Hugging Face Llama folder (issue 36): eval, sample, chat, eval --task and export
read one made by transformers (random weights: tied and untied, grouped-query attention, sharded)
with transformers' numbers, and what minillm cannot compute exactly is one error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from minillm.checkpoint.hf_export import export_checkpoint
from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.config import ModelConfig
from minillm.families import hf_config_dict
from minillm.tokenizer.bpe import EOT
from tests.helpers import (
    SHAKESPEARE,
    VOCAB,
    assert_same_function,
    error_line,
    legacy_tokenizer_json,
    make_run,
    spread_weights_,
    tiny_tokenizer,
)

runner = CliRunner()
CONTEXT = 64  # max_position_embeddings of the folders: eval's windows
TEXT = SHAKESPEARE.read_text(encoding="utf-8")[:700] + "Grüße, 日本語 🙂 <|endoftext|> the end.\n"


def llama_folder(
    root: Path,
    tie: bool = False,
    n_kv_head: int = 2,
    tokenizer: Tokenizer | None = None,
    **save_kw,
) -> tuple[Path, transformers.LlamaForCausalLM]:
    """A tiny LlamaForCausalLM with random weights, saved by transformers, and a tokenizer.json
    (ours unless given). Weights are spread wider than HF's init so that greedy choices are far
    apart (robust to float noise) and norms are not all ones."""
    tok = tokenizer or tiny_tokenizer()
    eot = tok.token_to_id(EOT)
    cfg = ModelConfig(vocab_size=VOCAB + 20, d_model=64, n_layer=2, n_head=4, n_kv_head=n_kv_head,
                      ffn_hidden=96, max_seq_len=CONTEXT, tie_embeddings=tie, rope_theta=500.0,
                      norm_eps=1e-5)  # fmt: skip
    hf_cfg = hf_config_dict(cfg, bos_id=eot, eos_id=eot)
    for key in ("architectures", "model_type", "torch_dtype"):
        hf_cfg.pop(key)
    torch.manual_seed(3)
    hf = spread_weights_(transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg)).eval())
    folder = root / "hf"
    hf.save_pretrained(folder, **save_kw)
    tok.save(str(folder / "tokenizer.json"))
    return folder, hf


def hf_loss(hf: transformers.LlamaForCausalLM, ids: list[int]) -> tuple[float, int]:
    """transformers' mean NLL over `ids` in eval's windows: inputs i .. i+T-1, targets
    i+1 .. i+T for i = 0, T, 2T, ... (every token after the first predicted once)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, CONTEXT):
            y = torch.tensor(ids[start + 1 : start + CONTEXT + 1])
            x = torch.tensor([ids[start : start + len(y)]])
            total += F.cross_entropy(hf(x).logits[0].double(), y, reduction="sum").item()
            n += len(y)
    return total / n, n


@pytest.mark.parametrize(
    "tie, n_kv_head, shards",
    [(True, 2, False), (False, 1, False), (False, 4, True)],
    ids=["tied-gqa", "untied-mqa", "untied-mha-sharded"],
)
def test_eval_data_gives_the_loss_transformers_computes(
    tmp_path: Path, tie: bool, n_kv_head: int, shards: bool
) -> None:
    save_kw = {"max_shard_size": "60KB"} if shards else {}
    folder, hf = llama_folder(tmp_path, tie=tie, n_kv_head=n_kv_head, **save_kw)
    assert (folder / "model.safetensors.index.json").is_file() == shards
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    result = runner.invoke(app, ["eval", "--ckpt", str(folder), "--data", str(data), "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    tok = tiny_tokenizer()
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" in the file is text
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    want, n = hf_loss(hf, ids)
    assert n > 2 * CONTEXT  # several windows: the context is the model's, not a default
    assert got["tokens"] == n
    assert got["loss"] == pytest.approx(want, rel=1e-5)


def test_sample_greedy_equals_transformers_generate(tmp_path: Path) -> None:
    folder, hf = llama_folder(tmp_path, tie=False, n_kv_head=2)
    prompt = "First Citizen:\nBefore we"
    args = ["sample", "--ckpt", str(folder), "--prompt", prompt, "--temperature", "0"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    tok = tiny_tokenizer()
    eot = tok.token_to_id(EOT)
    ids = [eot, *tok.encode(prompt, add_special_tokens=False).ids]  # a fresh document
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                          eos_token_id=eot, pad_token_id=eot)  # fmt: skip
    new = out[0, len(ids) :].tolist()
    new = new[: new.index(eot)] if eot in new else new
    assert len(new) >= 4  # enough tokens to tell two models apart
    assert result.stdout == prompt + tok.decode(new) + "\n"


def test_the_loader_gives_transformers_logits_and_the_folders_defaults(tmp_path: Path) -> None:
    """What chat and serve load too: the model (GQA, tied), the config eval and sample read."""
    folder, hf = llama_folder(tmp_path, tie=True, n_kv_head=1)
    loaded = load_checkpoint(folder)
    assert loaded.hf_folder and loaded.path == folder
    cfg = loaded.config
    assert (cfg.model.n_kv_head, cfg.model.tie_embeddings, cfg.model.rope_theta) == (1, True, 500.0)
    assert cfg.train.seq_len == CONTEXT and cfg.data.vocab_size == VOCAB
    assert cfg.sample.temperature == 0.0  # transformers' generation_config: greedy
    assert not list(Path(cfg.data.out_dir).glob("*.bin"))  # no shards of some other run
    idx = torch.randint(0, VOCAB + 20, (2, 40))
    with torch.no_grad():
        assert_same_function(loaded.model(idx)[0], hf(idx).logits)


def test_an_exported_folder_keeps_its_runs_sample_defaults(tmp_path: Path) -> None:
    run_dir, _, net = make_run(tmp_path, sample=dict(temperature=0.7, top_k=20, top_p=0.9))
    out = export_checkpoint(load_checkpoint(run_dir), tmp_path / "export")
    run, folder = load_checkpoint(run_dir), load_checkpoint(out)
    assert folder.config.sample == run.config.sample
    assert folder.config.model == run.config.model
    assert folder.tokenizer.to_str() == run.tokenizer.to_str()
    idx = torch.randint(0, VOCAB, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(folder.model(idx)[0], run.model(idx)[0], atol=0, rtol=0)


def test_export_gguf_and_hf_from_an_hf_folder(tmp_path: Path) -> None:
    import gguf

    folder, hf = llama_folder(tmp_path, tie=False, n_kv_head=2)
    out = tmp_path / "m.gguf"
    result = runner.invoke(
        app, ["export", "--ckpt", str(folder), "--out", str(out), "--format", "gguf"]
    )
    assert result.exit_code == 0, result.output
    reader = gguf.GGUFReader(out)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "llama"
    assert len(reader.tensors) == 2 + 9 * 2 + 1  # embedding, norm, head; 9 per block
    again = tmp_path / "again"
    result = runner.invoke(app, ["export", "--ckpt", str(folder), "--out", str(again)])
    assert result.exit_code == 0, result.output
    copy = transformers.AutoModelForCausalLM.from_pretrained(again, dtype=torch.float32).eval()
    idx = torch.randint(0, VOCAB, (1, 30))
    with torch.no_grad():
        assert_same_function(copy(idx).logits, hf(idx).logits)


def test_eval_task_and_chat_on_an_hf_folder(tmp_path: Path) -> None:
    folder, _ = llama_folder(tmp_path)  # our tokenizer: it has the chat tokens
    task = tmp_path / "mc.jsonl"
    rows = [{"context": "To be, or", "endings": [" not to be", " the end"], "label": 0}] * 3
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = runner.invoke(app, ["eval", "--ckpt", str(folder), "--task", str(task), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tasks"]["mc"]["examples"] == 3
    args = ["chat", "--ckpt", str(folder), "--message", "Hello", "--temperature", "0"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output


def _trained(specials: list[str], pre: object, decoder: object, model: object) -> Tokenizer:
    tok = Tokenizer(model)
    tok.pre_tokenizer, tok.decoder = pre, decoder
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False)
    tok.train_from_iterator([SHAKESPEARE.read_text(encoding="utf-8")[:6000]], trainer)
    return tok


def _sentencepiece_style() -> Tokenizer:
    """A BPE with Metaspace words and byte fallback whose decoder cannot decode the byte tokens
    (Llama 2's has ByteFallback: tests/test_sentencepiece.py)."""
    return _trained(
        [EOT], pre_tokenizers.Metaspace(), decoders.Metaspace(), models.BPE(byte_fallback=True)
    )


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **changes}))


GEMMA = dict(architectures=["GemmaForCausalLM"], model_type="gemma")
LONGROPE = dict(rope_type="longrope", factor=8.0, original_max_position_embeddings=32,
                short_factor=[1.0] * 8, long_factor=[2.0] * 8)  # fmt: skip


@pytest.mark.parametrize(
    "case, where, message",
    [
        ("gemma", "config.json", "model_type: a 'gemma' model (GemmaForCausalLM), not one of "
         "the architectures minillm reads (LlamaForCausalLM, MixtralForCausalLM, "
         "Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, Gemma3ForCausalLM, "
         "Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM, Phi3ForCausalLM)"),
        ("rope-scaling", "config.json", "rope_scaling: rope_type 'longrope' is not supported "
         "(minillm: linear, dynamic, yarn, llama3; longrope in Phi-3 only)"),
        ("attention-bias", "config.json", "attention_bias: True is not supported (minillm needs "
         "False)"),
        ("sentencepiece", "tokenizer.json", "decoder: Metaspace without ByteFallback: its <0xNN> "
         "tokens would decode as that text, not as bytes; minillm applies only sentencepiece-style "
         "BPEs whose decoder has ByteFallback"),
    ],
)  # fmt: skip
def test_what_minillm_cannot_compute_is_one_error_line(
    tmp_path: Path, case: str, where: str, message: str
) -> None:
    tokenizer = {"sentencepiece": _sentencepiece_style}.get(case)
    if tokenizer is not None:
        folder, _ = llama_folder(tmp_path, tokenizer=tokenizer())
    else:
        folder, _ = llama_folder(tmp_path)
        changes = {"gemma": GEMMA, "rope-scaling": {"rope_scaling": LONGROPE},
                   "attention-bias": {"attention_bias": True}}[case]  # fmt: skip
        _edit_config(folder, **changes)
    for command in (["sample", "--prompt", "x"], ["export", "--out", str(tmp_path / "o.gguf"),
                    "--format", "gguf"]):  # fmt: skip
        result = runner.invoke(app, [command[0], "--ckpt", str(folder), *command[1:]])
        assert error_line(result) == f"error: {folder / where}: {message}"
    assert not (tmp_path / "o.gguf").exists()


def test_eval_of_a_folder_needs_data_or_a_task(tmp_path: Path) -> None:
    folder, _ = llama_folder(tmp_path)
    line = error_line(runner.invoke(app, ["eval", "--ckpt", str(folder)]))
    assert line == (
        f"error: {folder}: --data: a Hugging Face folder has no validation shards to evaluate; "
        "pass --data FILE (text or a dataset file) or --task FILE"
    )
    line = error_line(runner.invoke(app, ["sample", "--ckpt", str(folder), "--best"]))
    assert line == f"error: {folder}: --best takes a run directory, not a Hugging Face folder"


def test_chat_with_a_folder_without_chat_tokens_says_so(tmp_path: Path) -> None:
    legacy = Tokenizer.from_str(legacy_tokenizer_json())
    folder, _ = llama_folder(tmp_path, tokenizer=legacy)
    line = error_line(runner.invoke(app, ["chat", "--ckpt", str(folder), "--message", "Hi"]))
    assert line == (
        f"error: {folder / 'tokenizer.json'}: no <|system|>, <|user|>, <|assistant|>, <|end|> "
        "and no chat template: `minillm chat` has no template to talk in; `minillm sample` "
        "continues text"
    )


def test_a_tied_config_with_a_stored_head_computes_with_that_head(tmp_path: Path) -> None:
    """Issue 50, defect 6: tie_word_embeddings true and an lm_head.weight stored as well (and
    different): transformers leaves them untied and uses the stored head; so does minillm."""
    from safetensors.torch import load_file, save_file

    folder, hf = llama_folder(tmp_path, tie=True)
    weights = folder / "model.safetensors"
    sd = load_file(str(weights))
    assert "lm_head.weight" not in sd
    torch.manual_seed(5)
    sd["lm_head.weight"] = torch.randn_like(sd["model.embed_tokens.weight"])
    save_file(sd, str(weights), metadata={"format": "pt"})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = load_checkpoint(folder).model
    assert not ours.cfg.tie_embeddings
    x = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        want = theirs(x).logits
        assert not torch.allclose(want, hf(x).logits, atol=1e-3)  # the stored head matters
        assert_same_function(ours(x)[0], want)
