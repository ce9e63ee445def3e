"""Tool-call formats and the reply splitter on the three families' texts: parsed whole and in
pieces cut at every place (a marker split across two stream chunks never reaches `content`), the
format chosen from the real templates, and another format refused in one line naming it."""

from __future__ import annotations

import json

import pytest

from minillm.errors import UserError
from minillm.serve.reply import ReplySplitter, join_deltas
from minillm.serve.toolcalls import FORMATS, tool_format
from tests.helpers import ROOT

TEMPLATES = ROOT / "tests" / "templates"

HERMES = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA = (
    '{"name": "get_weather", "parameters": {"city": "Köln"}}; '
    '{"name": "get_time", "parameters": {}}'
)
LLAMA_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Köln"}}'
MISTRAL = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Köln"}}, '
    '{"name": "get_time", "arguments": {}}]'
)
BROKEN = 'x <tool_call>\n{"broken": \n</tool_call>'
TWO = [("get_weather", {"city": "Köln"}), ("get_time", {})]
CASES = [
    ("hermes", HERMES, "Let me look.", TWO),
    ("llama3_json", LLAMA, None, TWO),
    ("llama3_json", LLAMA_TAG, None, TWO[:1]),
    ("mistral", MISTRAL, None, TWO),
    ("hermes", "No call: <tool_ca is not <tool_call", "No call: <tool_ca is not <tool_call", []),
    ("hermes", BROKEN, BROKEN, []),
    ("llama3_json", "Plain {words}.", "Plain {words}.", []),
]  # fmt: skip


def _split(fmt: str, pieces: list[str]) -> tuple[dict, list[dict]]:
    splitter = ReplySplitter(FORMATS[fmt], thinking=False, in_thought=False)
    deltas = [d for p in pieces for d in splitter.push(p)] + splitter.finish()
    return join_deltas(deltas), deltas


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_calls_parse_whole_and_cut_anywhere(fmt: str, text: str, content, calls) -> None:
    whole, _ = _split(fmt, [text])
    assert whole["content"] == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.get(
        "tool_calls", [])]  # fmt: skip
    assert got == calls
    for c in whole.get("tool_calls", []):
        assert c["id"] and c["type"] == "function"
    for cut in range(1, len(text)):
        message, deltas = _split(fmt, [text[:cut], text[cut:]])
        for c in message.get("tool_calls", []):
            c["id"] = None
        expected = json.loads(json.dumps(whole))
        for c in expected.get("tool_calls", []):
            c["id"] = None
        assert message == expected, cut
        if calls:  # no piece of a marker (or of a call) is ever sent as content
            sent = "".join(d.get("content", "") for d in deltas)
            assert sent == (content or ""), cut


def test_each_call_streams_its_id_and_name_once_then_argument_fragments() -> None:
    """As vLLM: per call its id, type and name once, then its arguments as they are written."""
    _, deltas = _split("hermes", [HERMES[i : i + 3] for i in range(0, len(HERMES), 3)])
    parts = [p for d in deltas for p in d.get("tool_calls", [])]
    heads = [p for p in parts if "id" in p]
    assert [(p["index"], p["function"]) for p in heads] == [
        (0, {"name": "get_weather", "arguments": ""}),
        (1, {"name": "get_time", "arguments": ""}),
    ]
    assert heads[0]["id"] != heads[1]["id"]
    for index, args in ((0, '{"city": "Köln"}'), (1, "{}")):
        fragments = [
            p["function"]["arguments"] for p in parts if p["index"] == index and "id" not in p
        ]
        assert "".join(fragments) == args
    assert len([p for p in parts if p["index"] == 0]) > 3  # fragments, not one piece at the end
    assert parts.index(heads[1]) > max(i for i, p in enumerate(parts) if p["index"] == 0)


@pytest.mark.parametrize("in_thought", [False, True])
def test_reasoning_is_split_from_content_at_any_cut(in_thought: bool) -> None:
    text = ("" if in_thought else "<think>\n") + "Weigh it.\n</think>\n\nThe answer."
    for cut in range(0, len(text)):
        splitter = ReplySplitter(None, thinking=True, in_thought=in_thought)
        deltas = splitter.push(text[:cut]) + splitter.push(text[cut:]) + splitter.finish()
        message = join_deltas(deltas)
        assert message["reasoning_content"] == "Weigh it." and message["content"] == "The answer."
    plain = ReplySplitter(None, thinking=True, in_thought=False)
    assert join_deltas(plain.push("<thin") + plain.push("g>") + plain.finish())["content"] == (
        "<thing>"
    )


@pytest.mark.parametrize(
    "template, fmt",
    [
        ("Qwen-Qwen2.5-7B-Instruct", "hermes"),
        ("Qwen-Qwen3-0.6B", "hermes"),
        ("meta-llama-Llama-3.1-8B-Instruct", "llama3_json"),
        ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
    ],
)
def test_the_format_is_the_templates(template: str, fmt: str) -> None:
    assert tool_format((TEMPLATES / f"{template}.jinja").read_text()).name == fmt


def test_other_formats_and_no_tools_are_refused_in_words() -> None:
    kimi = "{% for tool in tools %}{{ tool }}{% endfor %}<|tool_call_begin|>"
    with pytest.raises(UserError, match="Kimi K2 format, which minillm does not parse"):
        tool_format(kimi)
    with pytest.raises(UserError, match="does not use `tools`"):
        tool_format("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(UserError, match="no chat template"):
        tool_format(None)
