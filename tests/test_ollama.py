"""The Ollama Modelfile's TEMPLATE (issue 62): the Go form of the formats Ollama ships, found by
what the model's Jinja template renders; a template of no such format gets no TEMPLATE, a
comment saying so and one warning."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minillm.checkpoint.ollama import FORMATS, modelfile_text, ollama_format
from minillm.config import SampleConfig
from minillm.tokenizer import jinja_chat
from tests.published import CONVERSATIONS, FAMILIES, usable

EXPECTED = {
    "chatml": "ChatML", "chatml-marked": "ChatML", "qwen2.5": "ChatML", "qwen1.5-moe": "ChatML",
    "qwen3-moe": "ChatML", "llama3": "Llama 3", "llama3-marked": "Llama 3",
    "mistral": "Mistral [INST]", "mistral-spm": "Mistral [INST]", "llama2": "Llama 2 [INST]",
    "gemma3": "Gemma", "phi3-mini": "Phi-3", "phi4-mini": "Phi-4", "deepseek-v3": None,
}  # fmt: skip


def special(name: str) -> dict[str, str]:
    return {"bos_token": FAMILIES[name]["bos"] or "", "eos_token": FAMILIES[name]["eos"][0]}


def test_every_family_is_covered() -> None:
    assert set(EXPECTED) == set(FAMILIES)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_format_is_recognised_by_what_the_template_renders(name: str) -> None:
    found = ollama_format(FAMILIES[name]["template"], special(name), adds_bos=True)
    assert (found and found.name) == EXPECTED[name]
    if found is None:
        return
    # Qwen2.5 and Qwen1.5 fill in a system message where a chat has none: Ollama's SYSTEM
    default = name in ("qwen2.5", "qwen1.5-moe")
    assert found.system == ("You are a helpful assistant." if default else None)
    fmt = next(f for f in FORMATS if f.name == found.name)
    # The format's text is the Jinja template's on the tests' conversations too, each up to a
    # user turn (a prompt; Qwen3 writes an empty <think> block into a last reply), content
    # without surrounding spaces (Llama 3's, Gemma's and Llama 2's templates trim it, Go not).
    bos = special(name)["bos_token"]
    prompts = [c[: i + 1] for c in CONVERSATIONS for i, m in enumerate(c) if m["role"] == "user"]
    for messages in prompts:
        messages = [dict(m, content=m["content"].strip()) for m in messages]
        if not usable(name, messages) or (found.system and messages[0]["role"] != "system"):
            continue
        text, _ = jinja_chat.render(FAMILIES[name]["template"], messages, True, special(name))
        assert text.removeprefix(bos) == fmt.text(messages)


def test_a_bos_the_tokenizer_does_not_add_is_written_by_the_template() -> None:
    found = ollama_format(FAMILIES["llama3"]["template"], special("llama3"), adds_bos=False)
    assert found is not None and found.template.startswith("<|begin_of_text|>{{- range")


def _modelfile(template: str | None, name: str = "chatml") -> str:
    ids = SimpleNamespace(template=template, add_bos=True, stops=["<|im_end|>"])
    return modelfile_text("m.gguf", ids, SampleConfig(), 64, special(name))


def test_the_modelfile_writes_the_template_and_the_default_system(capsys) -> None:
    text = _modelfile(FAMILIES["qwen2.5"]["template"], "qwen2.5")
    lines = text.splitlines()
    assert lines[1] == "FROM ./m.gguf"
    assert "# TEMPLATE: the model's chat template (ChatML) in Go form" in lines
    go = next(f.go for f in FORMATS if f.name == "ChatML")
    assert f'TEMPLATE """{go}"""' in text
    assert 'SYSTEM """You are a helpful assistant."""' in lines
    assert capsys.readouterr().err == ""


def test_a_template_of_no_known_format_is_said_plainly(capsys) -> None:
    text = _modelfile(FAMILIES["deepseek-v3"]["template"], "deepseek-v3")
    assert "TEMPLATE " not in text.replace("# No TEMPLATE", "")
    assert "# No TEMPLATE: the model's chat template is none of the formats" in text
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: m.gguf: the Modelfile has no TEMPLATE")
