"""`minillm serve`: a real server in a subprocess, spoken to with the official `openai` client.

One server for the module (a tiny random model with a 1024-token context, an API key, 4 rows);
the references are what `minillm chat --message` and `minillm sample` print with the same
settings, and the model's own log-probabilities.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from typer.testing import CliRunner  # noqa: E402

from minillm.cli import app  # noqa: E402
from tests.helpers import ROOT, make_run, script_tokens  # noqa: E402

KEY = "test-key-123"
CONTEXT = 1024
MAX_BATCH = 4
CHROMIUM = "/usr/bin/chromium"


class Response:
    def __init__(self, status: int, headers: dict[str, str], text: str) -> None:
        self.status_code, self.headers, self.text = status, headers, text

    def json(self):  # noqa: ANN201
        return json.loads(self.text)


class Server:
    """The running server: its URL, an openai client with the key, and plain HTTP calls."""

    def __init__(self, proc: subprocess.Popen, url: str, run: Path) -> None:
        self.proc, self.url, self.run = proc, url, run
        self.port = int(url.rsplit(":", 1)[1])
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def request(
        self, method: str, path: str, body: bytes | None = None, key: str | None = KEY, **headers
    ) -> Response:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        if key is not None:
            headers.setdefault("Authorization", f"Bearer {key}")
        headers.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return Response(r.status, dict(r.getheaders()), r.read().decode())
        finally:
            conn.close()

    def post(self, path: str, body) -> Response:  # noqa: ANN001
        return self.request(
            "POST", path, body if isinstance(body, bytes) else json.dumps(body).encode()
        )

    @contextlib.contextmanager
    def stream(self, path: str, body: dict):  # noqa: ANN201
        """The response's `data: ` payloads as they come; leaving closes the connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        try:
            conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
            r = conn.getresponse()
            lines = (raw.decode().rstrip("\n") for raw in r)
            yield r, (line[6:] for line in lines if line.startswith("data: "))
        finally:
            conn.close()

    def health(self) -> dict:
        return self.request("GET", "/health", key=None).json()


@contextlib.contextmanager
def serving(root: Path, context: int):
    """`minillm serve` of a tiny run of this context in a process of its own."""
    run, _, _ = make_run(root, model={"max_seq_len": context})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINILLM_API_KEY": KEY}
    cmd = [sys.executable, "-m", "minillm", "serve", "--ckpt", str(run), "--port", "0"]
    cmd += ["--max-batch", str(MAX_BATCH), "--device", "cpu"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root
    )
    line = proc.stdout.readline()
    match = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
    if match is None:
        proc.kill()
        pytest.fail(f"no URL printed: {line!r} {proc.stderr.read()}")
    srv = Server(proc, match.group(1), run)
    for _ in range(100):
        try:
            if srv.health()["status"] == "ok":
                break
        except OSError:
            time.sleep(0.1)
    try:
        yield srv
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with serving(tmp_path_factory.mktemp("serve"), CONTEXT) as srv:
        yield srv


def cli(*args: str) -> str:
    """stdout of `minillm ARGS` (run in this process, as the command runs)."""
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def cli_chat(server: Server, message: str, *flags: str) -> str:
    return cli("chat", "--ckpt", str(server.run), "--message", message, "--device", "cpu", *flags)[
        :-1
    ]


def cli_sample(server: Server, prompt: str, *flags: str) -> str:
    out = cli("sample", "--ckpt", str(server.run), "--prompt", prompt, "--device", "cpu", *flags)
    assert out.startswith(prompt) and out.endswith("\n")
    return out[len(prompt) : -1]


def stream_chat(server: Server, **kwargs) -> tuple[str, str, list]:
    chunks = list(server.client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return text, reasons[-1], chunks


# ----------------------------------------------------------------------------- the protocol


def test_models_health_and_api_key(server: Server) -> None:
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["run"]
    assert server.health()["status"] == "ok"  # /health needs no key
    for key in (None, "wrong"):
        r = server.request("GET", "/v1/models", key=key)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="run", messages=[{"role": "user", "content": "hi"}])
    r = server.request("GET", "/v1/models", key=None, Authorization=KEY)  # no "Bearer"
    assert r.status_code == 401
    assert "<textarea" in server.request("GET", "/", key=None).text  # the static page is open


def test_the_model_card_and_the_page_use_the_runs_sample_section(server: Server) -> None:
    """Issue 44: the chat page sent temperature 0.8 whatever the run's `sample` section said.
    /v1/models carries that section, and the page sends only what the user typed, so the server
    fills the rest from the run's defaults, as for any request."""
    card = server.request("GET", "/v1/models").json()["data"][0]
    assert card["max_model_len"] == CONTEXT
    assert card["sample"] == {"max_new_tokens": 20, "temperature": 0.8, "top_k": 0, "top_p": 1.0}
    page = server.request("GET", "/", key=None).text
    box = re.search(r'<input id="temperature"[^>]*>', page).group(0)
    assert "value=" not in box  # empty: the run's temperature, shown as the placeholder
    assert "body.temperature = Number(temperature)" in page and 'id="context"' in page


def test_chat_equals_minillm_chat(server: Server) -> None:
    message = "Hello there, friend"
    for flags, settings in (
        (("--temperature", "0"), dict(temperature=0)),
        (("--temperature", "0.9", "--top-k", "40", "--seed", "7"), dict(temperature=0.9, seed=7)),
    ):
        expected = cli_chat(server, message, "--max-new-tokens", "16", *flags)
        kwargs = dict(
            model="run",
            messages=[{"role": "user", "content": message}],
            max_tokens=16,
            extra_body={"top_k": 40} if "seed" in settings else {},
            **settings,
        )
        reply = server.client.chat.completions.create(**kwargs)
        assert reply.choices[0].message.content == expected
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 16
        assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
        text, reason, chunks = stream_chat(server, **kwargs)
        assert text == expected and reason == "length"
        assert chunks[0].choices[0].delta.role == "assistant"
        assert len({c.id for c in chunks}) == 1


def test_stream_usage_and_done(server: Server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with server.stream("/v1/chat/completions", body) as (r, data):
        assert r.getheader("content-type").startswith("text/event-stream")
        events = list(data)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert all(json.loads(e)["usage"] is None for e in events[:-2])
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"


def test_completion_equals_minillm_sample(server: Server) -> None:
    prompt = "ROMEO: What say"
    for flags, settings in (
        (("--temperature", "0"), dict(temperature=0)),
        (("--temperature", "1.0", "--top-p", "0.9", "--seed", "3"), dict(top_p=0.9, seed=3)),
    ):
        expected = cli_sample(server, prompt, "--max-new-tokens", "20", "--top-k", "0", *flags)
        kwargs = dict(model="run", prompt=prompt, max_tokens=20, extra_body={"top_k": 0})
        kwargs.update(temperature=settings.pop("temperature", 1.0), **settings)
        done = server.client.completions.create(**kwargs)
        assert done.choices[0].text == expected
        streamed = "".join(
            c.choices[0].text for c in server.client.completions.create(stream=True, **kwargs)
        )
        assert streamed == expected


def test_n_samples_equal_num_samples(server: Server) -> None:
    out = cli(
        "sample", "--ckpt", str(server.run), "--prompt", "Ab", "--num-samples", "3",
        "--max-new-tokens", "8", "--seed", "11", "--temperature", "1", "--top-k", "0",
    )  # fmt: skip
    expected = [part.strip("\n")[2:] for part in out.split("-" * 40)]
    done = server.client.completions.create(
        model="run", prompt="Ab", max_tokens=8, n=3, seed=11, temperature=1, extra_body={"top_k": 0}
    )
    assert [c.text for c in sorted(done.choices, key=lambda c: c.index)] == expected
    assert len(set(expected)) > 1


def test_echo_logprobs_equal_the_model(server: Server) -> None:
    from minillm.checkpoint.store import load_checkpoint
    from minillm.infer.evaluate import evaluate_tokens
    from minillm.tokenizer.bpe import eot_id

    prompt = "Grüße, ROMEO: to be or not"
    done = server.client.completions.create(
        model="run", prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    lp = done.choices[0].logprobs
    assert done.choices[0].text == prompt and done.choices[0].finish_reason == "length"
    ckpt = load_checkpoint(server.run)
    ids = [eot_id(ckpt.tokenizer), *ckpt.tokenizer.encode(prompt, add_special_tokens=False).ids]
    assert len(lp.token_logprobs) == len(ids) - 1 == done.usage.prompt_tokens - 1
    with torch.no_grad():
        logits, _ = ckpt.model(torch.tensor([ids]))
    own = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp.token_logprobs == pytest.approx(own.tolist(), abs=1e-4)
    total, count = evaluate_tokens(ckpt.model, torch.tensor(ids), len(ids), 1)
    assert count == len(ids) - 1 and -sum(lp.token_logprobs) == pytest.approx(total, rel=1e-5)
    # Each token is at most as likely as the best alternative (two alternatives may share a
    # string: bytes of an unfinished character); offsets point into the echoed text.
    assert all(
        1 <= len(t) <= 2 and max(t.values()) >= v - 1e-6
        for t, v in zip(lp.top_logprobs, lp.token_logprobs)
    )
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    whole = [(t, o) for t, o in zip(lp.tokens, lp.text_offset) if "\ufffd" not in t]
    assert len(whole) > 5 and all(prompt[o : o + len(t)] == t for t, o in whole)

    # Token ids are taken as sent: the first has no context (null), as OpenAI's.
    raw = server.post(
        "/v1/completions",
        {"prompt": ids[1:], "max_tokens": 2, "echo": True, "logprobs": 0, "temperature": 0},
    ).json()
    got = raw["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == len(ids) - 1 + 2


def test_stop_strings_cut_the_text(server: Server) -> None:
    base = dict(model="run", prompt="ROMEO: What", max_tokens=30, temperature=0)
    full = server.client.completions.create(**base).choices[0].text
    stop = full[10:13]
    cut = full[: full.index(stop)]
    done = server.client.completions.create(stop=[stop, "never-there"], **base)
    assert done.choices[0].text == cut and done.choices[0].finish_reason == "stop"
    streamed = list(server.client.completions.create(stop=stop, stream=True, **base))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_concurrent_streams_each_equal_alone(server: Server) -> None:
    jobs = [
        dict(prompt=f"Speak {i}: " + "ab" * i, max_tokens=24 + 5 * i, temperature=0.8 * (i % 2))
        for i in range(7)
    ]
    for i, job in enumerate(jobs):
        job.update(model="run", seed=100 + i, extra_body={"top_k": 0})
    alone = [server.client.completions.create(**job).choices[0].text for job in jobs]
    steps = server.health()["steps"]
    results: dict[int, str] = {}

    def go(i: int) -> None:
        chunks = server.client.completions.create(stream=True, **jobs[i])
        results[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(len(jobs))] == alone
    # They shared steps: fewer batched steps than tokens generated.
    assert server.health()["steps"] - steps < sum(j["max_tokens"] for j in jobs) * 0.7


def test_disconnect_frees_the_slot(server: Server) -> None:
    before = server.health()["generated_tokens"]
    body = {"prompt": "Long", "max_tokens": 1000, "temperature": 0, "stream": True}
    for _ in range(MAX_BATCH):  # every row taken, then each client hangs up
        with server.stream("/v1/completions", body) as (_, data):
            next(data)
    start = time.monotonic()
    while server.health()["active"] and time.monotonic() - start < 10:
        time.sleep(0.02)
    assert server.health()["active"] == 0
    # The rows left long before their 1000 tokens: the engine stopped working for them.
    assert server.health()["generated_tokens"] - before < MAX_BATCH * 500
    start = time.monotonic()
    done = server.client.completions.create(model="run", prompt="Next", max_tokens=4)
    assert done.choices[0].finish_reason == "length" and time.monotonic() - start < 10


# ----------------------------------------------------------------------------- bad requests

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD = [
    # (path, body (raw bytes or JSON), status, param)
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, {"model": "run"}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": MSG, "temperature": 7}, 400, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_k": -5}, 400, "top_k"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 10**6}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": True}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "n": 100}, 400, "n"),
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (CHAT, {"messages": MSG, "presence_penalty": 1.0}, 400, "presence_penalty"),
    (CHAT, {"messages": MSG, "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": [{"role": "user", "content": "x " * 2000}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}, 413, None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "prompt[0]"),
    ("/v1/completions", {"prompt": "a", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "max_tokens": CONTEXT}, 400, "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_request_is_an_openai_error(server: Server, path, body, status, param) -> None:
    r = server.post(path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if param == "messages" and status == 400 and "x " in str(body):
        assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    # ... and the server goes on serving.
    ok = server.client.chat.completions.create(model="run", messages=MSG, max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_openai_client_sees_the_error(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client.chat.completions.create(model="run", messages=MSG, temperature=9)
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        server.client.chat.completions.create(model="gpt-4", messages=MSG)


# ----------------------------------------------------------------------------- the engine alone


def test_engine_queue_limit_and_failure_of_one_request(tmp_path: Path) -> None:
    from minillm.checkpoint.store import load_checkpoint
    from minillm.infer.engine import SamplingParams
    from minillm.serve.worker import EngineThread, QueueFull

    run, _, _ = make_run(tmp_path)
    ckpt = load_checkpoint(run)
    engine = EngineThread(ckpt.model, ckpt.tokenizer, max_batch=2, max_queue=3)
    events: dict[str, list] = {"bad": [], "good": []}
    three = SamplingParams.greedy(3)
    bad = engine.submit([[1, 10**6]], three, 1, events["bad"].append)
    good = engine.submit([[1, 2, 3]], three, 2, events["good"].append)
    with pytest.raises(QueueFull):  # three rows wait; the engine is not started yet
        engine.submit([[1]], SamplingParams.greedy(1), 1, lambda e: None)
    engine.start()
    deadline = time.monotonic() + 30
    while (len(events["good"]) < 6 or not events["bad"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.close()
    assert [e.error is not None for e in events["bad"]] == [True]  # an id past the embedding
    assert [e.finish_reason for e in events["good"]].count("length") == 2
    assert all(e.error is None for e in events["good"]) and bad.cancelled is False
    assert len(good.rows) == 2 and all(len(r.tokens) == 3 for r in good.rows)


class Connected:
    """The one thing Handler.complete asks of its request: whether the client left."""

    async def is_disconnected(self) -> bool:
        return False


def test_every_chat_reply_stops_at_one_set_end_of_turn_and_end_of_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Serve's chat completions, `minillm chat` and `eval --task` submit the same stop ids,
    the conventions' stop_ids: <|end|> and <|endoftext|>. A reply drawn as "Hi there",
    <|endoftext|>, more text is "Hi there" with finish_reason "stop" over the API, and in the
    other two."""
    import asyncio
    import io

    from minillm.checkpoint.store import load_checkpoint
    from minillm.infer.conversation import chat_checkpoint
    from minillm.infer.engine import Engine, SamplingParams
    from minillm.infer.task_format import read_task
    from minillm.infer.task_scoring import score_exact_match
    from minillm.serve import protocol as P
    from minillm.serve.handlers import Handler
    from minillm.serve.worker import EngineThread
    from minillm.tokenizer.bpe import eot_id
    from minillm.tokenizer.chat_template import chat_ids

    run, _, _ = make_run(tmp_path)
    ckpt = load_checkpoint(run)
    tok = ckpt.tokenizer
    stops = ckpt.conventions.stop_ids
    assert stops == {chat_ids(tok)["end"], eot_id(tok)}
    submitted = []
    submit = Engine.submit

    def spy(self: Engine, prompts: list, params: SamplingParams, *args, **kwargs) -> list:
        submitted.append(params.stop_ids)
        return submit(self, prompts, params, *args, **kwargs)

    monkeypatch.setattr(Engine, "submit", spy)
    words = tok.encode("Hi there", add_special_tokens=False).ids
    more = tok.encode(" and then some more", add_special_tokens=False).ids
    reply = [*words, eot_id(tok), *more * 4]

    script_tokens(monkeypatch, reply)
    engine = EngineThread(ckpt.model, tok, max_batch=2, max_queue=4)
    handler = Handler(ckpt, "run", engine, 1 << 20, None)
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12, "temperature": 0}
    job = P.parse_chat(body, handler.limits, handler.encode_chat)
    engine.start()
    try:
        answer = asyncio.run(handler.complete(Connected(), job))
    finally:
        engine.close()
    (choice,) = answer["choices"]
    assert choice["message"]["content"] == "Hi there" and choice["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == len(words) + 1  # the stop token counts

    script_tokens(monkeypatch, reply)
    out = io.StringIO()
    chat_checkpoint(ckpt, SamplingParams.greedy(12), message="Hello", out=out)
    assert out.getvalue() == "Hi there\n"

    script_tokens(monkeypatch, reply)
    task = tmp_path / "qa.jsonl"
    task.write_text(json.dumps({"messages": body["messages"], "answer": "Hi there"}) + "\n")
    assert (
        score_exact_match(ckpt.model, ckpt.conventions, read_task(task), 1, 12)["exact_match"]
        == 1.0
    )
    assert submitted == [stops] * 3


# ----------------------------------------------------------------------------- the chat page


def test_chat_page_streams_a_reply(server: Server) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"needs Debian's chromium at {CHROMIUM} (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    expected = cli_chat(server, "Hello page", "--temperature", "0", "--max-new-tokens", "12")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
            ],
        )
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.fill("#key", KEY)
            page.dispatch_event("#key", "change")
            page.wait_for_function("document.getElementById('model').textContent === 'run'")
            assert page.input_value("#max_tokens") == ""  # the server fits its default
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "12")
            page.fill("#input", "Hello page")
            page.press("#input", "Enter")
            page.wait_for_selector(".assistant[data-state=done]", timeout=30_000)
            assert page.inner_text(".user") == "Hello page"
            assert page.eval_on_selector(".assistant", "e => e.textContent") == expected
            page.click("#reset")
            assert page.query_selector_all(".msg") == []
        finally:
            browser.close()


@pytest.mark.slow
def test_chat_page_fits_a_long_conversation_in_a_small_context(tmp_path: Path) -> None:
    # The README's tiny-chat model has a 64-token context: the page sends no max_tokens of its
    # own (the server cuts its default to what the context leaves), and a conversation that
    # outgrows the context loses its oldest turns, with a note, rather than failing.
    if not Path(CHROMIUM).exists():
        pytest.skip(f"needs Debian's chromium at {CHROMIUM} (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with serving(tmp_path, 64) as srv, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page()
            page.goto(srv.url + "/")
            page.fill("#key", KEY)
            page.dispatch_event("#key", "change")
            page.wait_for_function("document.getElementById('model').textContent === 'run'")
            # no max_tokens of 200 that the context cannot hold: the server fits the reply
            assert page.input_value("#max_tokens") == ""
            assert page.get_attribute("#max_tokens", "placeholder") == "auto"  # not cut off
            assert page.inner_text("#context") == "64-token context"
            assert page.get_attribute("#temperature", "placeholder") == "0.8"  # the run's
            assert page.title() == "minillm chat: run"
            page.fill("#temperature", "0")
            finished = "es => es.filter(e => e.dataset.state !== 'streaming').length"
            for i in range(5):
                page.fill("#input", f"Message {i}: tell me more about the sea, the ships and you")
                page.press("#input", "Enter")
                page.wait_for_function(
                    f"document.querySelectorAll('.assistant:not([data-state=streaming])')"
                    f".length === {i + 1}",
                    timeout=30_000,
                )
            states = page.eval_on_selector_all(".assistant", "es => es.map(e => e.dataset.state)")
            assert states == ["done"] * 5, page.inner_text("#log")
            assert page.query_selector_all(".error") == [] and finished
            notes = page.eval_on_selector_all(".note", "es => es.map(e => e.textContent)")
            assert notes and "context of 64 tokens" in notes[0]
        finally:
            browser.close()


# ----------------------------------------------------------------------------- shutdown (last)


def test_sigterm_shuts_down_cleanly(server: Server) -> None:
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(20)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        pytest.fail("the server did not stop within 20 s of SIGTERM")
    err = server.proc.stderr.read()
    assert "Traceback" not in err, err
    assert "server stopped" in err


def test_serve_without_fastapi_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_serve(name, *args, **kwargs):
        if name == "minillm.serve.server":
            raise ImportError("No module named 'fastapi'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_serve)
    result = CliRunner().invoke(app, ["serve", "--ckpt", "nowhere"])
    assert result.exit_code == 2
    assert "pip install 'minillm[serve]'" in result.output
