"""A published model's own tokenizer, chat template and stop tokens in every command (issue 41),
on folders built in the test (tests/published.py: ChatML, Qwen2.5's default system prompt,
Llama 3, Mistral's [INST]), compared with transformers' `tokenizer(text)`,
`apply_chat_template`, `return_assistant_tokens_mask` and `generate`."""

from __future__ import annotations

import asyncio
import hashlib
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
from minillm.infer.engine import Engine, SamplingParams
from minillm.tokenizer.bpe import load_tokenizer
from minillm.tokenizer.conventions import Conventions
from tests.helpers import script_tokens
from tests.published import (
    CONVERSATIONS,
    FAMILIES,
    VOCAB,
    family_folder,
    hf_tokenizer,
    usable,
)

runner = CliRunner()
PLAIN = ["Hello there, friend", "Grüße 🙂\n\nline two", "<|im_end|> written <s> in text"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    return {name: family_folder(root, name) for name in FAMILIES}


def conventions(folder: Path) -> Conventions:
    return Conventions.of(load_tokenizer(folder / "tokenizer.json"), folder)


def hf_ids(tok, messages: list[dict], generation: bool) -> list[int]:  # noqa: ANN001
    return list(tok.apply_chat_template(messages, add_generation_prompt=generation)["input_ids"])


def padding(model) -> list[int]:  # noqa: ANN001
    """The embedding rows past the tokenizer's vocabulary: no tokens, never sampled by minillm."""
    return list(range(VOCAB, model.config.vocab_size))


# ------------------------------------------------------------------ the conventions themselves


@pytest.mark.parametrize("name", list(FAMILIES))
def test_conversations_encode_as_apply_chat_template(folders: dict, name: str) -> None:
    conv, hf = conventions(folders[name]), hf_tokenizer(folders[name])
    assert conv.kind == ("sentencepiece" if "spm" in FAMILIES[name] else "byte-level")
    for messages in filter(lambda m: usable(name, m), CONVERSATIONS):
        for generation in (False, True):
            assert conv.chat_ids(messages, generation) == hf_ids(hf, messages, generation)


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_answer_only_masks_equal_transformers_with_and_without_markers(
    folders: dict, name: str
) -> None:
    """The marked template's masks are transformers' `return_assistant_tokens_mask`; the same
    template without markers gives the same masks, found from the template itself."""
    marked = hf_tokenizer(folders[f"{name}-marked"])
    for messages in CONVERSATIONS[1:]:
        theirs = marked.apply_chat_template(
            messages, return_dict=True, return_assistant_tokens_mask=True
        )
        for folder in (folders[f"{name}-marked"], folders[name]):
            ids, mask = conventions(folder).chat_targets(messages)
            assert ids == list(theirs["input_ids"])
            assert mask == [bool(m) for m in theirs["assistant_masks"]]
            assert any(mask) and not all(mask)


def test_qwen3_keeps_the_last_replys_reasoning_and_drops_the_earlier_ones(folders: dict) -> None:
    """Qwen3's template: a reply before the last user turn loses its <think> block, the last
    one keeps it (an empty one when it has none); the targets are what the model writes after
    `<|im_start|>assistant\n`: the reply, its reasoning where kept, and <|im_end|>."""
    conv, hf = conventions(folders["qwen3-moe"]), hf_tokenizer(folders["qwen3-moe"])
    messages = [
        {"role": "user", "content": "Which is a vowel: A or B?"},
        {"role": "assistant", "content": "<think>\nA is.\n</think>\n\nA"},
        {"role": "user", "content": "And now: C or E?"},
        {"role": "assistant", "content": "<think>\nE is.\n</think>\n\nE"},
    ]
    for history in (messages, messages[:3]):
        for generation in (False, True):
            assert conv.chat_ids(history, generation) == hf_ids(hf, history, generation)
    ids, mask = conv.chat_targets(messages)
    targets = conv.tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert "A is." not in conv.tok.decode(ids, skip_special_tokens=False)
    assert targets == "A<|im_end|><think>\nE is.\n</think>\n\nE<|im_end|>"


def test_a_template_whose_system_prompt_is_a_default_writes_it(folders: dict) -> None:
    conv = conventions(folders["qwen2.5"])
    text = conv.tok.decode(conv.chat_ids(CONVERSATIONS[0], True), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral"])
def test_plain_text_encodes_as_the_tokenizer_call(folders: dict, name: str) -> None:
    """transformers' tokenizer(text): Llama 3's and Mistral's BOS, special tokens written in
    the text recognised; never minillm's <|endoftext|> before it."""
    conv, hf = conventions(folders[name]), hf_tokenizer(folders[name])
    for text in PLAIN:
        assert conv.prompt_ids(text) == hf(text)["input_ids"]
    bos = FAMILIES[name]["bos"]
    assert conv.prompt_ids("x")[0] == (
        conv.tok.token_to_id(bos) if bos else hf("x")["input_ids"][0]
    )


def test_stops_are_the_eos_list_and_the_end_of_turn(folders: dict) -> None:
    conv = conventions(folders["llama3"])
    ids = {t: conv.tok.token_to_id(t) for t in ("<|end_of_text|>", "<|eot_id|>")}
    assert conv.stop_ids == set(ids.values()) and conv.turn_end == ids["<|eot_id|>"]
    # Documents end with a token no conversation holds: packing never cuts one at its turns.
    assert conv.doc_end == ids["<|end_of_text|>"]
    chatml = conventions(folders["chatml"])
    assert chatml.tok.id_to_token(chatml.doc_end) == "<|endoftext|>"
    assert chatml.tok.id_to_token(chatml.turn_end) == "<|im_end|>"


# ------------------------------------------------------------------ the commands


def test_chat_replies_as_generate_and_stops_at_any_eos_of_the_list(
    folders: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = folders["llama3"]
    hf_tok = hf_tokenizer(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = torch.tensor([hf_ids(hf_tok, messages, True)])
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, suppress_tokens=padding(model))
    out = out[0, prompt.shape[1] :]
    expected = hf_tok.decode(out, skip_special_tokens=True)
    args = ["chat", "--ckpt", str(folder), "--system", "Be brief.", "--message", "Hi"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "8", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout == expected + "\n"
    # A reply that emits <|end_of_text|> (the first eos of generation_config's list, not the
    # template's <|eot_id|>) ends there.
    tok = hf_tok
    words = tok("Fine words", add_special_tokens=False)["input_ids"]
    script_tokens(monkeypatch, [*words, tok.convert_tokens_to_ids("<|end_of_text|>"), *words * 3])
    result = runner.invoke(app, [*args, "--max-new-tokens", "12", "--temperature", "0"])
    assert result.stdout == "Fine words\n"


def test_sample_starts_with_the_models_bos_and_equals_generate(folders: dict) -> None:
    folder = folders["llama3"]
    hf_tok = hf_tokenizer(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = hf_tok("The king", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=10, do_sample=False, suppress_tokens=padding(model))
    out = out[0, ids.shape[1] :]
    expected = "The king" + hf_tok.decode(out, skip_special_tokens=True)
    args = ["sample", "--ckpt", str(folder), "--prompt", "The king", "--max-new-tokens", "10"]
    result = runner.invoke(app, [*args, "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout == expected + "\n"


def test_serve_uses_the_template_the_bos_and_special_token_stops(
    folders: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minillm.serve import protocol as P
    from minillm.serve.handlers import Handler
    from minillm.serve.worker import EngineThread
    from tests.test_serve import Connected

    folder = folders["chatml"]
    ckpt = load_checkpoint(folder)
    hf_tok = hf_tokenizer(folder)
    engine = EngineThread(ckpt.model, ckpt.tokenizer, max_batch=2, max_queue=4)
    handler = Handler(ckpt, "published", engine, 1 << 20, None)
    messages = [{"role": "user", "content": "What news?"}]
    job = P.parse_chat({"messages": messages, "max_tokens": 4}, handler.limits, handler.encode_chat)
    assert job.prompts == [hf_ids(hf_tok, messages, True)]
    # A ChatML string sent as a completion prompt is the tokenizer's ids, special tokens too.
    chatml = "<|im_start|>user\nWhat news?<|im_end|>\n<|im_start|>assistant\n"
    body = {"prompt": chatml, "max_tokens": 12, "temperature": 0, "stop": ["<|im_end|>"]}
    job = P.parse_completion(body, handler.limits, handler.encode_text, ckpt.tokenizer.decode)
    assert job.prompts == [hf_tok(chatml)["input_ids"]] == [hf_ids(hf_tok, messages, True)]
    # `stop` naming a special token stops there, with finish_reason "stop".
    words = hf_tok("Fair news", add_special_tokens=False)["input_ids"]
    end = hf_tok.convert_tokens_to_ids("<|im_end|>")
    nl = hf_tok("\nsystem\n", add_special_tokens=False)["input_ids"]
    script_tokens(monkeypatch, [*words, end, *nl * 4])
    monkeypatch.setattr(handler, "stops", {"completion": frozenset(), "chat": frozenset()})
    engine.start()
    try:
        answer = asyncio.run(handler.complete(Connected(), job))
    finally:
        engine.close()
    (choice,) = answer["choices"]
    assert choice["text"] == "Fair news" and choice["finish_reason"] == "stop"


def _config(tmp: Path, folder: Path, source: Path, field: str, **train: object) -> Path:
    cfg = {
        "data": {"source": str(source), "text_field": field, "out_dir": str(tmp / "tokens"),
                 "val_fraction": 0.25},
        "train": {"init_from": str(folder), "device": "cpu", "precision": "fp32",
                  "batch_size": 2, "seq_len": 48, "max_steps": 2, "eval_every": 2,
                  "eval_steps": 1, "ckpt_every": 2, "log_every": 1, "lr": 1e-3,
                  "out_dir": str(tmp / "run"), **train},
    }  # fmt: skip
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _shards(out_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray | None]:
    meta = json.loads((out_dir / "meta.json").read_text())
    files = sorted(out_dir.glob(f"{split}_*.bin"))
    ids = np.concatenate([np.fromfile(f, dtype=np.dtype(meta["dtype"])) for f in files])
    masks = sorted(out_dir.glob(f"{split}_*.mask"))
    mask = np.concatenate([np.fromfile(f, dtype=np.uint8) for f in masks]) if masks else None
    return ids, mask


@pytest.mark.slow
def test_tokenize_writes_template_ids_and_transformers_masks_and_leaves_the_folder(
    folders: dict, tmp_path: Path
) -> None:
    """Chat data through a published model's marked template: the shards hold each
    conversation's apply_chat_template ids and its end-of-document token, the mask is
    transformers' assistant mask; LoRA trains on them and `chat` answers from the run in the
    folder's template. The published folder is never written."""
    folder = folders["chatml-marked"]
    before = _digest(folder)
    rows = [m for m in CONVERSATIONS if m[-1]["role"] == "assistant"] * 4
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    config = _config(tmp_path, folder, source, "messages", lora={"rank": 2, "alpha": 4})
    result = runner.invoke(app, ["tokenize", str(config)])
    assert result.exit_code == 0, result.output
    hf_tok = hf_tokenizer(folder)
    conv = conventions(folder)
    expected = []
    for m in rows:
        out = hf_tok.apply_chat_template(m, return_dict=True, return_assistant_tokens_mask=True)
        expected.append(([*out["input_ids"], conv.doc_end], [*out["assistant_masks"], 0]))
    got = []
    for split in ("train", "val"):
        ids, mask = _shards(tmp_path / "tokens", split)
        cuts = [i + 1 for i, t in enumerate(ids.tolist()) if t == conv.doc_end]
        for a, b in zip([0, *cuts[:-1]], cuts):
            got.append((ids[a:b].tolist(), mask[a:b].tolist()))
    assert sorted(got) == sorted(expected)
    result = runner.invoke(app, ["train", str(config)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    assert (run / "tokenizer_config.json").read_bytes() == (
        folder / "tokenizer_config.json"
    ).read_bytes()
    loaded = load_checkpoint(run)
    assert loaded.conventions.kind == "byte-level"
    messages = [{"role": "user", "content": "Speak."}]
    assert loaded.conventions.chat_ids(messages, True) == hf_ids(hf_tok, messages, True)
    args = ["chat", "--ckpt", str(run), "--message", "Speak.", "--max-new-tokens", "4"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert _digest(folder) == before


@pytest.mark.slow
def test_plain_text_shards_are_tokenizer_calls_and_end_of_document(
    folders: dict, tmp_path: Path
) -> None:
    folder = folders["llama3"]
    before = _digest(folder)
    docs = [f"Document {i}: the king is come. " * (i + 1) for i in range(8)]
    source = tmp_path / "text.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    config = _config(tmp_path, folder, source, "text")
    result = runner.invoke(app, ["tokenize", str(config)])
    assert result.exit_code == 0, result.output
    hf_tok, conv = hf_tokenizer(folder), conventions(folder)
    train, _ = _shards(tmp_path / "tokens", "train")
    val, _ = _shards(tmp_path / "tokens", "val")
    expected = {tuple([*hf_tok(d)["input_ids"], conv.doc_end]) for d in docs}
    got = np.concatenate([train, val]).tolist()
    cuts = [i + 1 for i, t in enumerate(got) if t == conv.doc_end]
    pieces = {tuple(got[a:b]) for a, b in zip([0, *cuts[:-1]], cuts)}
    assert pieces == expected
    assert _digest(folder) == before


def test_exact_match_prompts_are_the_templates(
    folders: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = folders["llama3"]
    submitted = []
    submit = Engine.submit

    def spy(self: Engine, prompts: list, params: SamplingParams, *args, **kwargs) -> list:
        submitted.append((prompts, params.stop_ids))
        return submit(self, prompts, params, *args, **kwargs)

    monkeypatch.setattr(Engine, "submit", spy)
    examples = [[{"role": "system", "content": "Count."}, {"role": "user", "content": "1, 2?"}],
                [{"role": "user", "content": "Say no."}]]  # fmt: skip
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"messages": m, "answer": "3"}) + "\n" for m in examples))
    result = runner.invoke(app, ["eval", "--ckpt", str(folder), "--task", str(task)])
    assert result.exit_code == 0, result.output
    hf_tok = hf_tokenizer(folder)
    ((prompts, stops),) = submitted
    assert prompts == [hf_ids(hf_tok, m, True) for m in examples]
    assert stops == conventions(folder).stop_ids


def test_dpo_pairs_are_the_whole_conversation_with_the_replys_targets(folders: dict) -> None:
    from minillm.train.objectives.dpo import encode_pair, parse_pair

    folder = folders["llama3-marked"]
    hf_tok, conv = hf_tokenizer(folder), conventions(folder)
    user = [{"role": "user", "content": "say hi"}]
    pair = parse_pair({"prompt": user, "chosen": [{"role": "assistant", "content": "hi"}],
                       "rejected": [{"role": "assistant", "content": "ih"}]}, "x")  # fmt: skip
    e = encode_pair(conv, pair)
    for ids, mask, reply in ((e.chosen, e.chosen_mask, "hi"), (e.rejected, e.rejected_mask, "ih")):
        theirs = hf_tok.apply_chat_template(
            [*user, {"role": "assistant", "content": reply}],
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert ids == list(theirs["input_ids"])
        assert mask == [bool(m) for m in theirs["assistant_masks"]]


def test_grpo_prompts_and_stops_are_the_models(folders: dict, tmp_path: Path) -> None:
    """The objective GRPO builds from a task file of prompts, on a published model's run."""
    from minillm.checkpoint.init_from import load_run_config
    from minillm.train.distributed import DistInfo
    from minillm.train.objectives import open_objective
    from minillm.train.objectives.common import Setup

    folder = folders["chatml"]
    task = tmp_path / "prompts.jsonl"
    messages = [{"role": "user", "content": "Sort: b a"}]
    task.write_text(json.dumps({"messages": messages, "answer": "a b"}) + "\n")
    config = _config(tmp_path, folder, task, "messages", objective="grpo",
                     grpo={"group_size": 2, "max_new_tokens": 4,
                           "reward": "exact"})  # fmt: skip
    cfg = load_run_config(config)
    setup = Setup(cfg, DistInfo(), torch.device("cpu"), False, config.parent)
    grpo = open_objective(setup)
    assert grpo.prompts == [hf_ids(hf_tokenizer(folder), messages, True)]
    assert grpo.stops == conventions(folder).stop_ids


# Templates that use what published ones use: namespace() and reversed loops (Qwen3), {% break %}
# (loopcontrols), tojson, strftime_now and defaulted variables (Llama 3.1), trim, raise_exception.
FEATURES = [
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages[::-1] %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = messages|length - loop.index0 - 1 %}{%- break %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user %}{{- m.content | trim }}"
    "{%- else %}{{- m.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- endif %}{{- '<|im_start|>system\\nToday: ' + date_string + ' ' + {'k': 'ä'}|tojson }}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('bad role') }}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
]


@pytest.mark.parametrize("template", FEATURES, ids=["namespace-break", "date-tojson"])
def test_template_features_render_as_transformers(
    folders: dict, tmp_path: Path, template: str
) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((folders["chatml"] / "tokenizer.json").read_bytes())
    config = json.loads((folders["chatml"] / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    conv, hf = conventions(folder), hf_tokenizer(folder)
    for messages in CONVERSATIONS:
        for generation in (False, True):
            assert conv.chat_ids(messages, generation) == hf_ids(hf, messages, generation)
        ids, mask = conv.chat_targets(messages)
        assert ids == hf_ids(hf, messages, False)
        assert sum(mask) == (0 if messages[-1]["role"] == "user" else sum(mask)) and (
            any(mask) == any(m["role"] == "assistant" for m in messages)
        )


def test_a_template_that_refuses_a_conversation_is_one_error_line(folders: dict) -> None:
    result = runner.invoke(
        app, ["chat", "--ckpt", str(folders["mistral"]), "--system", "Be brief.", "--message", "Hi"]
    )
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: the model's chat template refused the conversation: Conversation roles must "
        "alternate user/assistant/user/assistant/..."
    ]


def test_named_templates_use_the_default_one(folders: dict, tmp_path: Path) -> None:
    folder = tmp_path / "named"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((folders["chatml"] / "tokenizer.json").read_bytes())
    config = json.loads((folders["chatml"] / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "{{ 'tools' }}"},
        {"name": "default", "template": config["chat_template"]},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    conv, hf = conventions(folder), hf_tokenizer(folder)
    messages = CONVERSATIONS[1]
    assert conv.chat_ids(messages, True) == hf_ids(hf, messages, True)


# Templates whose prompt for a reply is not a prefix of the conversation with the reply: Mistral
# v0.3 puts the system prompt in the last user turn; DeepSeek-R1's generation prompt opens a
# <think> its finished turns do not have. Each with its {% generation %} twin, for transformers.
MISTRAL_V3 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- endif %}{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}{%- else %}"
    "{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' }}@@{{- message['content'] + eos_token }}##"
    "{%- endif %}{%- endfor %}"
)
R1_STYLE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role == 'user' %}{{ '[INST]' + m.content }}"
    "{% else %}{{ '[/INST]' }}@@{{ m.content + eos_token }}##{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[/INST]<think>\\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", [MISTRAL_V3, R1_STYLE], ids=["mistral-v0.3", "r1"])
def test_masks_where_the_reply_prompt_is_not_a_prefix(
    folders: dict, tmp_path: Path, template: str
) -> None:
    marked = template.replace("@@", "{% generation %}").replace("##", "{% endgeneration %}")
    plain = template.replace("@@", "").replace("##", "")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "yes"},
        {"role": "assistant", "content": "no"},
    ]
    masks = []
    for name, text in (("marked", marked), ("plain", plain)):
        folder = tmp_path / name
        folder.mkdir()
        source = folders["mistral"]
        (folder / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
        config = json.loads((source / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": text}))
        masks.append(conventions(folder).chat_targets(messages))
    theirs = hf_tokenizer(tmp_path / "marked").apply_chat_template(
        messages, return_dict=True, return_assistant_tokens_mask=True
    )
    expected = (list(theirs["input_ids"]), [bool(m) for m in theirs["assistant_masks"]])
    assert masks[0] == expected and masks[1] == expected
    assert 0 < sum(expected[1]) < len(expected[1]) / 2


def test_a_template_that_is_not_jinja_fails_only_the_chat_commands(
    folders: dict, tmp_path: Path
) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    for f in folders["chatml"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] += "{% if add_generation_prompt %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    args = ["--ckpt", str(folder), "--max-new-tokens", "2"]
    assert runner.invoke(app, ["sample", *args, "--prompt", "Hi"]).exit_code == 0
    result = runner.invoke(app, ["chat", *args, "--message", "Hi"])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: the model's chat template is not valid Jinja: ")


def test_loss_on_all_needs_no_reply_in_the_template(folders: dict, tmp_path: Path) -> None:
    """A template that rewrites replies (here: upper case) has them found where it writes them
    (the span that changes with the reply); one that leaves them out has no answer-only mask,
    said in one line, and data.loss_on: all trains on every token of it."""
    rows = [m for m in CONVERSATIONS if m[-1]["role"] == "assistant"] * 4
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    for name, rewrite in [
        ("upper", "(message['content'] | upper)"),
        ("dropped", "('' if message['role'] == 'assistant' else message['content'])"),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        for f in folders["chatml"].iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = config["chat_template"].replace("message['content']", rewrite)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        (tmp_path / f"{name}-run").mkdir()
        config_path = _config(tmp_path / f"{name}-run", folder, source, "messages")
        result = runner.invoke(app, ["tokenize", str(config_path)])
        if name == "upper":
            assert result.exit_code == 0, result.output
            conv = conventions(folder)
            ids, mask = conv.chat_targets(CONVERSATIONS[2])
            targets = conv.tok.decode(
                [t for t, m in zip(ids, mask) if m], skip_special_tokens=False
            )
            assert targets == "I WILL.<|im_end|>"
            continue
        assert result.exit_code == 2
        assert "does not write assistant turn" in result.stderr
        result = runner.invoke(app, ["tokenize", str(config_path), "--set", "data.loss_on=all"])
        assert result.exit_code == 0, result.output


def test_mistral_chat_data_warns_that_its_eos_ends_turns_and_documents(
    folders: dict, tmp_path: Path
) -> None:
    conv = conventions(folders["mistral"])
    assert conv.splits_turns and conv.tok.id_to_token(conv.doc_end) == "</s>"
    assert not conventions(folders["chatml"]).splits_turns
    rows = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]] * 8
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    result = runner.invoke(
        app, ["tokenize", str(_config(tmp_path, folders["mistral"], source, "messages"))]
    )
    assert result.exit_code == 0, result.output
    assert "</s> ends each reply in this model's chat template" in result.stderr


def test_a_gpt2_style_folder_is_a_published_models_not_minillms(tmp_path: Path) -> None:
    """Issue 50, defect 7: a byte-level BPE whose only special token is <|endoftext|>, with no
    chat template (GPT-2's style), is recognised by its folder, not by its special tokens:
    prompts are `tokenizer(text)`, with no <|endoftext|> put before them as for minillm's own;
    minillm's own export of such a tokenizer stays minillm's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(["Hello there, friend. " * 50], trainer=trainer)
    folder = tmp_path / "gpt2-style"
    transformers.GPT2TokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    ).save_pretrained(folder)
    conv = conventions(folder)
    hf = hf_tokenizer(folder)
    assert conv.kind == "byte-level"
    for text in PLAIN:
        assert conv.prompt_ids(text) == hf(text)["input_ids"]
    # The same tokenizer with the tokenizer_config.json minillm's export writes: minillm's own.
    from minillm.tokenizer.conventions import hf_tokenizer_config

    ours = tmp_path / "ours"
    ours.mkdir()
    tok.save(str(ours / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    config = hf_tokenizer_config("<|endoftext|>", eot, 256)
    (ours / "tokenizer_config.json").write_text(json.dumps(config))
    assert conventions(ours).kind == "own"
    assert conventions(ours).prompt_ids("Hello")[0] == eot
