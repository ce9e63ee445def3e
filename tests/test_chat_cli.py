"""`minillm chat`: one reply to --message, replies per piped line, and its one-line errors."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.infer.conversation import chat_checkpoint
from minillm.infer.engine import SamplingParams, generate
from minillm.tokenizer.bpe import eot_id
from minillm.tokenizer.chat_template import chat_ids
from tests import helpers
from tests.helpers import make_run

runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    run_dir, _, _ = helpers.make_run(tmp_path_factory.mktemp("chat"))
    return run_dir, load_checkpoint(run_dir)


def greedy_reply(loaded, messages: list[dict[str, str]], max_new: int) -> str:
    """The reply by hand: the template's prompt, greedy generate, stop at <|end|> or
    <|endoftext|>."""
    tok = loaded.tokenizer
    prompt = loaded.conventions.chat_ids(messages, add_generation_prompt=True)
    stops = frozenset([chat_ids(tok)["end"], eot_id(tok)])
    params = SamplingParams.greedy(max_new, stop_ids=stops)
    # vocab_limit: the padded embedding rows are no tokens
    new = generate(loaded.model, [prompt], params, vocab_limit=tok.get_vocab_size())[0]
    return tok.decode(new[:-1] if new and new[-1] in stops else new)


def test_chat_message_prints_only_the_reply(run) -> None:
    run_dir, loaded = run
    args = ["chat", "--ckpt", str(run_dir), "--message", "Hello there", "--temperature", "0"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "12", "--system", "Be brief."])
    assert result.exit_code == 0, result.output
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    assert result.stdout == greedy_reply(loaded, messages, 12) + "\n"


def test_piped_lines_are_turns_of_one_conversation(run) -> None:
    _, loaded = run
    out = io.StringIO()
    params = SamplingParams.greedy(6)
    chat_checkpoint(loaded, params, stdin=io.StringIO("first\n\nsecond\n"), out=out)
    lines = out.getvalue().split("\n")[:-1]
    assert len(lines) == 2  # the empty line is no turn
    first = greedy_reply(loaded, [{"role": "user", "content": "first"}], 6)
    assert lines[0] == first.replace("\n", " ")
    history = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "second"},
    ]
    assert lines[1] == greedy_reply(loaded, history, 6).replace("\n", " ")


def test_a_reply_stops_at_end_of_text_as_at_end_of_turn(run, monkeypatch) -> None:
    """A reply drawn as "Hi there", <|endoftext|>, more text is "Hi there": a chat reply ends
    at the end of the document as at the end of its turn (the conventions' stop_ids)."""
    run_dir, loaded = run
    tok = loaded.tokenizer
    assert loaded.conventions.stop_ids == {chat_ids(tok)["end"], eot_id(tok)}
    words = tok.encode("Hi there", add_special_tokens=False).ids
    more = tok.encode(" and then some more", add_special_tokens=False).ids
    helpers.script_tokens(monkeypatch, [*words, eot_id(tok), *more * 4])
    args = ["chat", "--ckpt", str(run_dir), "--message", "Hello", "--temperature", "0"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hi there\n"


def test_a_long_history_keeps_to_the_context(run) -> None:
    _, loaded = run
    out = io.StringIO()
    lines = "".join(f"turn number {i} of a long talk\n" for i in range(12))
    chat_checkpoint(loaded, SamplingParams.greedy(8), stdin=io.StringIO(lines), out=out)
    assert len(out.getvalue().split("\n")[:-1]) == 12


def test_a_checkpoint_without_chat_tokens_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(helpers, "tokenizer_json", helpers.legacy_tokenizer_json)
    run_dir, _, _ = helpers.make_run(tmp_path)
    result = runner.invoke(app, ["chat", "--ckpt", str(run_dir), "--message", "hi"])
    assert result.exit_code == 2, result.output
    assert "has no chat tokens" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--message", " "], "--message: empty message"),
        (["--message", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--message", "x", "--max-new-tokens", "64"], "leaves no room for a prompt"),
    ],
)
def test_chat_bad_input_is_one_line_and_exit_2(run, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["chat", "--ckpt", str(run[0]), *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_eval_on_a_chat_file_scores_each_conversation_alone(run, tmp_path: Path) -> None:
    import json
    import math

    import torch

    from minillm.infer.evaluate import evaluate_checkpoint
    from minillm.tokenizer.chat_template import encode_conversation

    _, loaded = run
    rows = [
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello, friend."},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye!"},
        ],
    ]
    path = tmp_path / "talk.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows), encoding="utf-8")
    result = evaluate_checkpoint(loaded, data=path, batch_size=1)
    tok, total, count = loaded.tokenizer, 0.0, 0
    seq_len = loaded.config.train.seq_len  # 16: the second conversation is cut to 17 tokens
    for messages in rows:  # by hand: each conversation alone, the loss on its targets
        ids, target = encode_conversation(tok, messages)
        ids, target = ids[: seq_len + 1], target[: seq_len + 1]
        with torch.no_grad():
            logits, _ = loaded.model(torch.tensor([ids[:-1]]))
        logp = torch.log_softmax(logits[0].double(), dim=-1)
        for t in range(len(ids) - 1):
            if target[t + 1]:
                total -= float(logp[t, ids[t + 1]])
                count += 1
    answer_bytes = len("4") + len("Hello, friend.") + len("Bye!")
    assert result["tokens"] == count > 2 and result["bytes"] == answer_bytes
    assert math.isclose(result["loss"], total / count, rel_tol=1e-5)
    assert math.isclose(result["bits_per_byte"], total / math.log(2) / answer_bytes, rel_tol=1e-5)

    rows[1][2]["role"] = "bot"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows), encoding="utf-8")
    bad = runner.invoke(app, ["eval", "--ckpt", str(run[0]), "--data", str(path)])
    assert bad.exit_code == 2
    assert r"talk.jsonl: --text-field: line 2: messages[2].role: 'bot'" in bad.stderr


def test_chat_data_with_a_tokenizer_without_chat_tokens_is_one_line_exit_2(tmp_path: Path) -> None:
    """A tokenizer from before the chat tokens, reused for chat data: the template cannot apply."""
    import json

    import yaml

    (tmp_path / "old.json").write_text(helpers.legacy_tokenizer_json())
    rows = [[{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]
            for i in range(10)]  # fmt: skip
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    cfg = {
        "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 32},
        "train": {"seq_len": 16},
        "data": {"source": str(tmp_path / "c.jsonl"), "text_field": "messages",
                 "vocab_size": 300, "tokenizer": str(tmp_path / "old.json"),
                 "out_dir": str(tmp_path / "tok")},
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    result = runner.invoke(app, ["tokenize", str(tmp_path / "c.yaml")])
    assert result.exit_code == 2, result.output
    assert "data.tokenizer: the tokenizer has no chat tokens" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_terminal_conversation_streams_resets_and_leaves(run, monkeypatch) -> None:
    _, loaded = run

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    typed = iter(["hello", "/reset", "hello", "again"])

    def fake_input(prompt: str) -> str:
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None  # Ctrl-D

    monkeypatch.setattr("builtins.input", fake_input)
    out, err = io.StringIO(), io.StringIO()
    chat_checkpoint(loaded, SamplingParams.greedy(5), stdin=Terminal(), out=out, err=err)
    replies = out.getvalue().split("assistant> ")[1:]
    assert len(replies) == 3 and "a new conversation" in err.getvalue()
    first = greedy_reply(loaded, [{"role": "user", "content": "hello"}], 5)
    assert replies[0] == first + "\n" and replies[1] == first + "\n"  # /reset forgot the first
    history = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "again"},
    ]
    assert replies[2] == greedy_reply(loaded, history, 5) + "\n"


def test_chat_on_a_model_trained_on_text_warns_once(tmp_path: Path) -> None:
    # The README's tour chats with runs/tiny: say that its replies are likely nonsense, once
    # per session (not per reply), as eval --task does.
    from tests.helpers import write_shards

    run_dir, cfg, _ = make_run(tmp_path)
    write_shards(cfg, ["To be, or not to be, that is the question. " * 3] * 20)
    args = ["chat", "--ckpt", str(run_dir), "--temperature", "0", "--max-new-tokens", "4"]
    result = runner.invoke(app, args, input="hello\nagain\n")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "trained on text, not chat" in warnings[0], result.stderr
    assert len(result.stdout.splitlines()) == 2  # both replies still come
