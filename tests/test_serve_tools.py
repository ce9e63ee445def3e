"""`minillm serve` for agents: tools, tool_choice, response_format and reasoning, spoken to with
the `openai` client, on random-weight folders whose tokenizers carry the families' real special
tokens and real chat templates (tests/templates: Qwen2.5, Qwen3, Llama 3.1, Mistral Nemo, as
llama.cpp's repository keeps them).

A random model writes a valid call or a schema-true JSON only under the grammar's mask, so every
parse and validation below is a test of the constrained decoding; the renderings are compared
with transformers' `apply_chat_template(tools=...)`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from fastapi.testclient import TestClient  # noqa: E402

from minillm.checkpoint.store import load_checkpoint  # noqa: E402
from minillm.serve import protocol as P  # noqa: E402
from minillm.serve.app import create_app  # noqa: E402
from minillm.serve.handlers import Handler  # noqa: E402
from minillm.serve.worker import EngineThread  # noqa: E402
from tests.helpers import ROOT, script_tokens  # noqa: E402
from tests.published import _script, family_folder, hf_tokenizer  # noqa: E402

TEMPLATES = ROOT / "tests" / "templates"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Köln", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                      "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def _families() -> dict[str, dict]:
    """Families with tool-calling templates (registered while their folders are built)."""
    s = _script()
    fams = s.FAMILIES
    qwen = {k: v for k, v in fams["qwen2.5"].items() if k != "model"}
    return {
        "qwen2.5-tools": {**qwen, "added": ["<tool_call>", "</tool_call>"],
                          "template": _template("Qwen-Qwen2.5-7B-Instruct")},
        "qwen3-tools": {**qwen, "added": ["<think>", "</think>", "<tool_call>", "</tool_call>"],
                        "template": _template("Qwen-Qwen3-0.6B")},
        "llama3.1-tools": {**fams["llama3"], "specials": [*s.LLAMA3_SPECIALS, "<|python_tag|>",
                                                         "<|eom_id|>"],
                           "template": _template("meta-llama-Llama-3.1-8B-Instruct")},
        "r1-distill": {**fams["deepseek-v3"], "added": ["<think>", "</think>"],
                       "template": _template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")},
        "mistral-tools": {**fams["mistral"], "specials": [*s.MISTRAL_SPECIALS, "[TOOL_CALLS]",
                                                          "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                                          "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                          "template": _template("mistralai-Mistral-Nemo-Instruct-2407")},
    }  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    fams = _script().FAMILIES
    extra = _families()
    fams.update(extra)
    extra["r1-distill"].pop("model", None)  # a Llama: the DeepSeek-V3 class is not the point here
    try:
        root = tmp_path_factory.mktemp("tools")
        return {name: family_folder(root, name, max_position_embeddings=4096) for name in extra}
    finally:
        for name in extra:
            del fams[name]


@contextlib.contextmanager
def serving(folder: Path):
    """The app in this process, and an openai client that talks to it."""
    app = create_app(load_checkpoint(folder), "m", max_batch=4)
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http), http


@pytest.fixture(scope="module")
def qwen(folders: dict[str, Path]):
    with serving(folders["qwen2.5-tools"]) as pair:
        yield pair


def load_checkpoint_tokenizer(served) -> object:
    """The tokenizer of the model an app serves."""
    _, http = served
    return http.app.state.handler.tok


def _check_calls(calls, names: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ----------------------------------------------------------------------------- tools


def test_named_tool_choice_forces_a_valid_call(qwen) -> None:
    client, _ = qwen
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Köln?"}], tools=TOOLS,
        tool_choice=named, temperature=1.0, seed=5, n=3, max_tokens=200,
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        _check_calls([call], {"get_weather"})


def test_required_calls_one_of_the_tools_maybe_several(qwen) -> None:
    client, _ = qwen
    for seed in range(3):  # one call each: parallel_tool_calls false
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Go."}], tools=TOOLS,
            tool_choice="required", temperature=1.0, seed=seed, max_tokens=300,
            parallel_tool_calls=False,
        )  # fmt: skip
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, set(SCHEMAS))
    # Parallel calls: blocks one after another until the model ends them (or max_tokens does).
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Go."}], tools=TOOLS,
        tool_choice="required", temperature=1.0, seed=11, max_tokens=500,
    )  # fmt: skip
    (choice,) = r.choices
    assert choice.finish_reason in ("tool_calls", "length")
    calls = choice.message.tool_calls
    _check_calls(calls, set(SCHEMAS))
    assert len({c.id for c in calls}) == len(calls)


def test_streamed_call_reassembles_to_the_whole_one(qwen) -> None:
    client, _ = qwen
    kwargs = dict(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        tool_choice="required", temperature=0, max_tokens=300, parallel_tool_calls=False,
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    reasons, content = [], ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasons.append(choice.finish_reason)
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                if part.id is not None:
                    assert call["id"] is None, "an id is sent once"
                    call["id"] = part.id
                    call["name"] = part.function.name
                elif part.function.name:
                    pytest.fail("a name after the call's first delta")
                call["arguments"] += part.function.arguments or ""
    assert content == "" and reasons[-1] == "tool_calls"
    got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"] for c in calls.values())


def test_tool_round_trip_renders_as_transformers(folders: dict[str, Path], qwen) -> None:
    client, _ = qwen
    first = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        tool_choice="required", temperature=0, max_tokens=300, parallel_tool_calls=False,
    ).choices[0].message  # fmt: skip
    results = [{"role": "tool", "tool_call_id": c.id, "content": '{"temp": 21}'}
               for c in first.tool_calls]  # fmt: skip
    # The reply's message object goes back as it came (README's example does so).
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}, first, *results],
        tools=TOOLS, max_tokens=5, temperature=0,
    )  # fmt: skip
    history = [{"role": "user", "content": "Weather?"}, first.model_dump(exclude_none=True)]
    history += results
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    _assert_renders_as_transformers(folders["qwen2.5-tools"], history)


def _assert_renders_as_transformers(folder: Path, history: list[dict], **extra) -> None:
    """minillm's prompt for `history` with TOOLS is transformers' (arguments as objects)."""
    ckpt = load_checkpoint(folder)
    handler = Handler(ckpt, "m", EngineThread(ckpt.model, ckpt.tokenizer), 1 << 20, None)
    body = {"messages": history, "tools": TOOLS, "max_tokens": 4, **extra}
    job = P.parse_chat(body, handler.limits, handler.encode_chat, handler)
    hf_history = [dict(m) for m in history]
    for m in hf_history:
        if "tool_calls" in m and m.get("content") is None:
            m["content"] = ""  # the server reads a null content beside calls as ""
        for call in m.get("tool_calls", []):
            args = call["function"]["arguments"]
            call["function"] = {**call["function"], "arguments": json.loads(args)}
    hf = hf_tokenizer(folder).apply_chat_template(
        hf_history, tools=TOOLS, add_generation_prompt=True, tokenize=True,
        **extra.get("chat_template_kwargs", {}),
    )  # fmt: skip
    hf = hf["input_ids"] if isinstance(hf, dict) or hasattr(hf, "keys") else hf
    assert job.prompts == [list(hf)]


@pytest.mark.parametrize("name", ["llama3.1-tools", "mistral-tools", "qwen3-tools"])
def test_other_families_call_and_render(folders: dict[str, Path], name: str) -> None:
    """Llama 3.1's JSON and Mistral's [TOOL_CALLS] (and Qwen3's Hermes): a forced call parses
    and validates, and the round trip renders as transformers renders it."""
    with serving(folders[name]) as (client, _):
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            temperature=0, max_tokens=200,
        )  # fmt: skip
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    if name == "mistral-tools":
        assert len(call.id) == 9 and call.id.isalnum()  # what Mistral's template demands
    history = [
        {"role": "user", "content": "Weather?"},
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'},
    ]
    _assert_renders_as_transformers(folders[name], history)


# ----------------------------------------------------------------------------- response_format


def test_json_schema_with_enums_bounds_and_nested_arrays(qwen) -> None:
    client, _ = qwen
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "level": {"type": "integer", "minimum": -3, "maximum": 40},
            "kind": {"enum": ["a", "b", "c"]},
            "grid": {"type": "array", "maxItems": 3,
                     "items": {"type": "array", "maxItems": 3,
                               "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "level", "kind", "grid", "ok"],
        "additionalProperties": False,
    }  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "A record."}], response_format=fmt,
        temperature=1.0, seed=1, n=4, max_tokens=300,
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_is_any_object(qwen, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any JSON object: a random model's strings never end, so the draw here is a coin between
    a closing character and any token the mask allows (the mask alone decides which exist)."""
    from minillm.infer import engine

    tok = load_checkpoint_tokenizer(qwen)
    closers = torch.tensor([tok.token_to_id(c) for c in ("}", "]", '"')])
    gen = torch.Generator().manual_seed(0)

    def coin(logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        allowed = torch.isfinite(logits)
        picks = []
        for row in allowed:
            close = closers[row[closers]]
            if len(close) and torch.rand((), generator=gen) < 0.4:
                picks.append(int(close[torch.randint(len(close), (), generator=gen)]))
            else:
                ids = row.nonzero().flatten()
                picks.append(int(ids[torch.randint(len(ids), (), generator=gen)]))
        return torch.tensor(picks)

    monkeypatch.setattr(engine, "sample_next", coin)
    client, _ = qwen
    for _ in range(3):
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Any."}],
            response_format={"type": "json_object"}, max_tokens=400,
        )  # fmt: skip
        (choice,) = r.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_a_free_row_beside_a_constrained_one_stays_free(folders: dict[str, Path]) -> None:
    """The mask is per row: a plain request alongside a schema request answers as alone."""
    from minillm.infer.engine import Engine, SamplingParams
    from minillm.infer.grammar import Grammar, grammar_tokenizer, json_schema_grammar

    ckpt = load_checkpoint(folders["qwen2.5-tools"])
    tok = ckpt.tokenizer
    grammar = Grammar.compile(grammar_tokenizer(tok, {2}), json_schema_grammar(WEATHER))
    prompt = tok.encode("Hello there").ids
    free = SamplingParams.greedy(12)
    alone = Engine(ckpt.model, tok)
    (row,) = alone.submit([prompt], free)
    alone.run()
    both = Engine(ckpt.model, tok)
    (plain,) = both.submit([prompt], free)
    (ruled,) = both.submit([prompt], SamplingParams.greedy(200, grammar=grammar))
    both.run()
    assert plain.tokens == row.tokens
    assert ruled.tokens != row.tokens
    assert ruled.finish_reason == "stop", tok.decode(ruled.tokens)
    jsonschema.validate(json.loads(tok.decode(ruled.tokens)), WEATHER)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"frobnicate": 1}, "frobnicate", "unrecognized request argument"),
        ({"functions": []}, "functions", "send `tools`"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
         "response_format.json_schema.schema", "not"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_object"}, "logprobs": True}, "logprobs",
         "response_format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", '"nope"'),
        ({"tool_choice": "required"}, "tool_choice", "without tools"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "server"),
    ],
)  # fmt: skip
def test_every_field_is_honoured_or_refused_by_name(qwen, body, param, words) -> None:
    _, http = qwen
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **body}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_unknown_completion_field_and_tools_on_a_template_without_them(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    from tests.published import family_folder as build

    r_args = {"model": "m", "prompt": "x", "frobnicate": 1}
    with serving(folders["qwen2.5-tools"]) as (_, http):
        r = http.post("/v1/completions", json=r_args)
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
        r = http.post("/v1/completions", json={"prompt": "x", "tools": TOOLS})
        assert r.status_code == 400 and "send it to /v1/chat/completions" in r.text
    plain = build(tmp_path, "chatml")
    with serving(plain) as (_, http):
        body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert "does not use `tools`" in r.json()["error"]["message"]


# ----------------------------------------------------------------------------- reasoning


def test_reasoning_is_split_from_content_and_streamed_likewise(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = folders["qwen3-tools"]
    tok = hf_tokenizer(folder)
    reply = "<think>\nThe user greets.\n</think>\n\nHail, friend."
    ids = [
        *tok(reply, add_special_tokens=False)["input_ids"],
        tok.convert_tokens_to_ids("<|im_end|>"),
    ]
    messages = [{"role": "user", "content": "Hail!"}]
    with serving(folder) as (client, _):
        script_tokens(monkeypatch, ids * 3)
        whole = client.chat.completions.create(model="m", messages=messages, max_tokens=50)
        logprobs = []  # each token's, also where the splitter holds its text back
        for chunk in client.chat.completions.create(
            model="m", messages=messages, max_tokens=50, stream=True, logprobs=True
        ):
            for choice in chunk.choices:
                logprobs += choice.logprobs.content if choice.logprobs else []
        parts = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(
            model="m", messages=messages, max_tokens=50, stream=True
        ):
            for choice in chunk.choices:
                delta = choice.delta.model_dump()
                for key in parts:
                    parts[key] += delta.get(key) or ""
    message = whole.choices[0].message.model_dump()
    assert message["reasoning_content"] == "The user greets."
    assert message["content"] == "Hail, friend."
    assert parts == {"reasoning_content": "The user greets.", "content": "Hail, friend."}
    assert len(logprobs) == len(ids)
    # max_tokens counts the reasoning too: the usage is every token of the reply.
    assert whole.usage.completion_tokens == len(ids)
    # enable_thinking: false reaches the template (an empty think block opens the reply).
    _assert_renders_as_transformers(
        folder, messages, chat_template_kwargs={"enable_thinking": False}
    )


# ----------------------------------------------------------------------------- the CLI


def test_sample_and_chat_json_schema_use_the_same_path(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from minillm.cli import app
    from tests.helpers import error_line

    folder = folders["qwen2.5-tools"]
    schema = tmp_path / "weather.json"
    schema.write_text(json.dumps(WEATHER))
    runner = CliRunner()
    common = ["--ckpt", str(folder), "--json-schema", str(schema), "--max-new-tokens", "200"]
    result = runner.invoke(app, ["sample", *common, "--prompt", "Weather: ", "--seed", "3"])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(result.stdout.removeprefix("Weather: ")), WEATHER)
    result = runner.invoke(app, ["chat", *common, "--message", "Weather?", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(result.stdout), WEATHER)
    # A schema the engine cannot compile, or no JSON at all: one line naming the file, exit 2.
    schema.write_text(json.dumps({"type": "object", "not": {"type": "string"}}))
    result = runner.invoke(app, ["sample", *common, "--prompt", "x"])
    assert result.exit_code == 2
    assert f"--json-schema {schema}" in error_line(result) and "not" in error_line(result)
    schema.write_text("{oops")
    result = runner.invoke(app, ["chat", *common, "--message", "x"])
    assert result.exit_code == 2 and "not JSON" in error_line(result)


def test_auto_switches_the_grammar_on_at_the_trigger(qwen, monkeypatch: pytest.MonkeyPatch) -> None:
    """tool_choice auto: free text, then `<tool_call>`; from there the mask holds the call to
    the tools' schemas (a uniform draw over what it allows), and after `</tool_call>` the row is
    free again (here it ends)."""
    from minillm.infer import engine

    tok = load_checkpoint_tokenizer(qwen)
    open_, close, end = (tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>", "<|im_end|>"))
    words = tok.encode("Let me see.", add_special_tokens=False).ids
    gen = torch.Generator().manual_seed(4)
    drawn: list[int] = []

    def draw(logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        row = logits[0]
        if len(drawn) < len(words):
            pick = words[len(drawn)]
        elif len(drawn) == len(words):
            pick = open_
        elif close in drawn:
            pick = end
        else:  # inside the call: anything the mask leaves, uniformly
            allowed = torch.isfinite(row).nonzero().flatten()
            assert len(allowed) < len(row) // 2, "the mask is on inside the call"
            pick = int(allowed[torch.randint(len(allowed), (), generator=gen)])
        if len(drawn) <= len(words):  # free text: every token of the vocabulary may come
            assert int(torch.isfinite(row).sum()) == tok.get_vocab_size()
        drawn.append(pick)
        return torch.tensor([pick])

    monkeypatch.setattr(engine, "sample_next", draw)
    client, _ = qwen
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        max_tokens=300,
    )  # fmt: skip
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me see."
    _check_calls(choice.message.tool_calls, set(SCHEMAS))


def test_masks_beside_the_forward_equal_masks_after_it() -> None:
    """The GPU path (masks on a worker thread while the forward runs) masks as the CPU's."""
    from minillm.infer.grammar import Grammar, Masks, grammar_tokenizer, json_schema_grammar
    from tests.published import family_tokenizer

    tok = family_tokenizer("chatml")
    grammar = Grammar.compile(grammar_tokenizer(tok, {2}), json_schema_grammar(WEATHER))
    rows = [grammar.start(), None, grammar.start()]
    rows[2].advance(tok.token_to_id("{"))
    logits = torch.randn(3, tok.get_vocab_size() + 16, generator=torch.Generator().manual_seed(0))
    out = {}
    for overlap in (True, False):
        masks, got = Masks(overlap=overlap), logits.clone()
        masks.apply(rows, got, masks.start(rows), tok.get_vocab_size())
        out[overlap] = got
    assert torch.equal(out[True], out[False])
    assert torch.equal(out[True][1], logits[1])  # a free row is untouched
    allowed = torch.isfinite(out[True][0]).nonzero().flatten().tolist()
    assert allowed and all('{"city":'.startswith(tok.decode([t])) for t in allowed)
    assert torch.isinf(out[True][2, tok.get_vocab_size() :]).all()


def test_a_value_not_honoured_is_refused_in_words(qwen) -> None:
    _, http = qwen
    body = {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "presence_penalty: repetition penalties are not implemented (only 0)"
    )


def test_a_prompt_that_opens_the_think_block_starts_the_reply_in_reasoning(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-R1 distills: the generation prompt ends in `<think>\\n` (here with
    enable_thinking, which llama.cpp's copy of the template reads), so the reply is reasoning up
    to `</think>`; its tool calls are a format minillm names and refuses."""
    folder = folders["r1-distill"]
    tok = hf_tokenizer(folder)
    reply = "Weigh it.\n</think>\n\nThe answer."
    ids = [*tok(reply, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}}
    with serving(folder) as (client, http):
        script_tokens(monkeypatch, ids)
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Why?"}], extra_body=kwargs
        )
        body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
        refused = http.post("/v1/chat/completions", json=body)
    message = r.choices[0].message.model_dump()
    assert message["reasoning_content"] == "Weigh it." and message["content"] == "The answer."
    assert refused.status_code == 400
    assert (
        "DeepSeek V3/R1 format, which minillm does not parse" in refused.json()["error"]["message"]
    )
