"""Task evaluation: the multiple-choice contract against a hand computation, batching, exact match,
the CLI and its errors, the trainer's TensorBoard tags, and transformers on the export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minillm.checkpoint.store import load_checkpoint
from minillm.cli import app
from minillm.errors import UserError
from minillm.infer.engine import SamplingParams, generate
from minillm.infer.task_format import ExactMatch, MultipleChoice, Task, read_task
from minillm.infer.task_scoring import (
    answer_matches,
    choice_ids,
    encode_multiple_choice,
    extract_number,
    multiple_choice_metrics,
    score_continuations,
    score_exact_match,
)
from minillm.tokenizer.bpe import eot_id
from minillm.tokenizer.conventions import Conventions
from tests.helpers import FP32_REL, make_run, run_trainer, tiny_tokenizer

runner = CliRunner()
CONTEXT = "First Citizen:\nBefore we proceed any further, hear me"
ENDINGS = (" speak.", " hear me speak, all of you.", " 日本語 🙂", "\nAll:")
MC_ROWS = [
    {"context": CONTEXT, "endings": list(ENDINGS), "label": 0},
    {"context": "All:\nSpeak,", "endings": [" speak.", " run away!", " Köln"], "label": 1},
    {"context": "MENENIUS:\nEither you must", "endings": [" confess", " go", " be"], "label": 2},
]


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def hand_score(model: torch.nn.Module, ids: list[int], n: int) -> float:
    """The definition, one prefix at a time: sum over the last n tokens of log P(token | before)."""
    total = 0.0
    for p in range(len(ids) - n, len(ids)):
        with torch.no_grad():
            logits = model(torch.tensor([ids[:p]]))[0][0, -1].double()
        total += torch.log_softmax(logits, dim=-1)[ids[p]].item()
    return total


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("tasks")
    run_dir, _, model = make_run(root)
    return run_dir, model


# ----------------------------------------------------------------------------- the contract


def test_score_is_the_sum_of_the_ending_log_probs(run) -> None:
    _, model = run
    tok = tiny_tokenizer()
    task = Task("t", Path("t.jsonl"), "multiple_choice", [MultipleChoice(CONTEXT, ENDINGS, 0, 1)])
    (choices,) = encode_multiple_choice(tok, task, model.cfg.max_seq_len)
    for (ids, n), ending in zip(choices, ENDINGS):
        assert ids == enc(tok, CONTEXT) + enc(tok, ending)  # each encoded alone
        assert n == len(enc(tok, ending))
    scores = score_continuations(model, choices, batch_size=4)
    assert scores == pytest.approx([hand_score(model, ids, n) for ids, n in choices], rel=1e-5)


def test_accuracy_and_length_normalisation_worked_by_hand() -> None:
    examples = [
        # raw -10 > -12 picks 0; per character -10/2 = -5 < -12/8 = -1.5 picks 1 (the label)
        MultipleChoice("c", ("ab", "abcdefgh"), 1),
        # a tie, raw and normalised: the lowest index, 0, the label
        MultipleChoice("c", ("a", "b"), 0),
        # raw tie picks 0; normalised -2/2 = -1 > -2/1 picks 0: wrong both ways
        MultipleChoice("c", ("xx", "y"), 1),
        # normalised tie (-4/2 = -2/1) picks 0, raw picks 1
        MultipleChoice("c", ("pq", "r"), 1),
    ]
    scores = [-10.0, -12.0, -3.0, -3.0, -2.0, -2.0, -4.0, -2.0]
    got = multiple_choice_metrics(examples, scores)
    assert got == {"accuracy": 2 / 4, "accuracy_norm": 2 / 4, "examples": 4}


def test_a_long_context_is_cut_from_the_left(run) -> None:
    _, model = run
    tok = tiny_tokenizer()
    context = "First Citizen:\nBefore we proceed any further, hear me speak. " * 8
    full = enc(tok, context) + enc(tok, " speak.")
    assert len(full) > 64
    ids, n = choice_ids(tok, context, " speak.", max_len=64)
    assert ids == full[-64:] and n == len(enc(tok, " speak."))
    (score,) = score_continuations(model, [(ids, n)], batch_size=1)
    assert score == pytest.approx(hand_score(model, ids, n), rel=1e-5)
    ending = " hear me speak" * 8  # 32 tokens or more: no room for a context token in 16
    assert choice_ids(tok, "x", ending, max_len=16) is None
    task = Task("t", Path("t.jsonl"), "multiple_choice", [MultipleChoice("x", ("a", ending), 0, 7)])
    with pytest.raises(UserError, match=r"t.jsonl: line 7: endings\[1\]: longer than"):
        encode_multiple_choice(tok, task, 16)


def test_batched_scores_equal_one_at_a_time(run) -> None:
    _, model = run
    gen = torch.Generator().manual_seed(0)
    choices = []
    for _ in range(23):
        length = int(torch.randint(2, 64, (), generator=gen))
        ids = torch.randint(0, 300, (length,), generator=gen).tolist()
        choices.append((ids, int(torch.randint(1, length, (), generator=gen))))
    one = score_continuations(model, choices, batch_size=1)
    for batch_size in (5, 23):
        # A score is a sum of log-probabilities, all of one sign: its rounding is relative to it.
        assert score_continuations(model, choices, batch_size) == pytest.approx(one, rel=FP32_REL)


# ----------------------------------------------------------------------------- exact match


@pytest.mark.parametrize(
    "text, number",
    [
        ("The answer is 72.", "72"),
        ("1,234 apples, then 5", "5"),
        ("so #### 1,000", "1000"),
        ("it fell to -3.5 degrees", "-3.5"),
        ("no digits here", None),
    ],
)
def test_extract_number_takes_the_last_number(text: str, number: str | None) -> None:
    assert extract_number(text) == number


def test_answer_matches() -> None:
    assert answer_matches("  72 \n", "72")
    assert not answer_matches("72 apples", "72")
    assert answer_matches("72 apples, so 18 + 54 = 72.0", "72", number=True)
    assert answer_matches("that makes 1,200", "1200", number=True)
    assert not answer_matches("18 + 54 = 71", "72", number=True)
    assert not answer_matches("seventy-two", "72", number=True)


def chat_tokenizer():
    """The test tokenizer: every minillm tokenizer has the chat tokens."""
    tok = tiny_tokenizer()
    assert tok.token_to_id("<|end|>") is not None
    return tok


def test_chat_prompt_follows_the_template() -> None:
    tok = chat_tokenizer()
    eot = eot_id(tok)
    names = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    t = {name: tok.token_to_id(name) for name in names}
    ids = Conventions.of_own(tok).chat_prompt((("system", "Be brief."), ("user", "Speak, speak.")))
    assert eot not in ids  # a conversation starts at position 0, as apply_chat_template's
    assert ids == [
        *[t["<|system|>"], *enc(tok, "Be brief."), t["<|end|>"]],
        *[t["<|user|>"], *enc(tok, "Speak, speak."), t["<|end|>"]],
        t["<|assistant|>"],
    ]


def test_exact_match_scores_greedy_replies_to_the_end_token(run) -> None:
    _, model = run
    tok = chat_tokenizer()
    end, eot = tok.token_to_id("<|end|>"), eot_id(tok)
    questions = ["Speak, speak.", "Who is there?", "Grüße aus Köln", "hear me", "All:"]
    examples = []
    for i, q in enumerate(questions):
        prompt = Conventions.of_own(tok).chat_prompt((("user", q),))
        params = SamplingParams.greedy(6, stop_ids=frozenset([end]))
        (reply,) = generate(model, [prompt], params, vocab_limit=tok.get_vocab_size())
        stop = [k for k, t in enumerate(reply) if t in (end, eot)]
        text = tok.decode(reply[: stop[0]] if stop else reply)
        # Even rows expect the greedy reply (with whitespace around it), odd rows something else.
        answer = f"  {text}\n" if i % 2 == 0 else text + " no"
        examples.append(ExactMatch((("user", q),), answer, i + 1))
    task = Task("em", Path("em.jsonl"), "exact_match", examples)
    got = score_exact_match(model, Conventions.of_own(tok), task, batch_size=2, max_new_tokens=6)
    assert got == {"exact_match": 3 / 5, "examples": 5}


def test_replies_cut_to_the_context_say_what_and_whether_it_matters_once(run) -> None:
    """The note names the setting cut, the prompt that forces it, and whether any answer needs
    more room; a run scoring at every evaluation (`noted`) says it once (issue 44: 10 times)."""
    import io

    _, model = run
    tok = chat_tokenizer()
    long_q = "Speak, speak. " * 3
    prompt_tokens = len(Conventions.of_own(tok).chat_prompt((("user", long_q),)))
    room = model.cfg.max_seq_len - prompt_tokens + 1
    short, too_long = "hear me", "Who is there? " * 10
    n_long = len(tok.encode(too_long).ids) + 1
    assert n_long > room > len(tok.encode(short).ids) + 1
    examples = [ExactMatch((("user", long_q),), short, 1), ExactMatch((("user", "?"),), short, 2)]
    task = Task("em", Path("em.jsonl"), "exact_match", examples)
    err, noted = io.StringIO(), set()
    for _ in range(2):
        score_exact_match(
            model, Conventions.of_own(tok), task, 2, 200, err=err, limit_name="x.limit", noted=noted
        )
    head = (
        f"note: em: replies limited to {room} tokens, not x.limit=200: the longest prompt "
        f"(line 1, {prompt_tokens} tokens) leaves {room} of the model's "
        f"{model.cfg.max_seq_len}-token context"
    )
    n_short = len(tok.encode(short).ids) + 1
    assert err.getvalue() == f"{head}; every answer fits ({n_short} tokens at most, with <|end|>)\n"
    task = Task(
        "em",
        Path("em.jsonl"),
        "exact_match",
        [*examples, ExactMatch((("user", "?"),), too_long, 3)],
    )
    err = io.StringIO()
    score_exact_match(model, Conventions.of_own(tok), task, 2, 200, err=err, limit_name="x.limit")
    assert err.getvalue() == (
        f"{head}; 1 of 3 answers need more (up to {n_long} tokens with <|end|>): their replies "
        "are cut and scored wrong\n"
    )


# ----------------------------------------------------------------------------- the CLI


def test_eval_exact_match_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import helpers

    chat_json = chat_tokenizer().to_str()
    monkeypatch.setattr(helpers, "tokenizer_json", lambda: chat_json)  # a run of a chat model
    run_dir, cfg, model = helpers.make_run(tmp_path)
    tok = load_checkpoint(run_dir).tokenizer
    end, eot = tok.token_to_id("<|end|>"), eot_id(tok)
    messages = (("system", "Be brief."), ("user", "Speak, speak."))
    prompt = Conventions.of_own(tok).chat_prompt(messages)
    params = SamplingParams.greedy(cfg.sample.max_new_tokens, stop_ids=frozenset([end]))
    (reply,) = generate(model, [prompt], params, vocab_limit=tok.get_vocab_size())
    stop = [k for k, t in enumerate(reply) if t in (end, eot)]
    text = tok.decode(reply[: stop[0]] if stop else reply)
    turns = [{"role": r, "content": c} for r, c in messages]
    rows = [{"messages": turns, "answer": text}, {"messages": turns, "answer": text + "!"}]
    task = write_jsonl(tmp_path / "em.jsonl", rows)
    for extra, expected in (([], 0.5), (["--extract-number"], None)):
        argv = ["eval", "--ckpt", str(run_dir), "--task", str(task), "--json", *extra]
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, result.output
        got = json.loads(result.stdout)["tasks"]["em"]
        assert set(got) == {"exact_match", "examples"} and got["examples"] == 2
        if expected is not None:
            assert got["exact_match"] == expected


def test_eval_task_json(run, tmp_path: Path) -> None:
    run_dir, model = run
    task = write_jsonl(tmp_path / "cloze.jsonl", MC_ROWS)
    result = runner.invoke(app, ["eval", "--ckpt", str(run_dir), "--task", str(task), "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert set(got) == {"tasks"}  # no loss without --data
    tok = tiny_tokenizer()
    encoded = encode_multiple_choice(tok, read_task(task), model.cfg.max_seq_len)
    scores = [hand_score(model, ids, n) for choices in encoded for ids, n in choices]
    expected = multiple_choice_metrics(read_task(task).examples, scores)
    assert got["tasks"] == {"cloze": expected}

    text = tmp_path / "doc.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 4)
    argv = ["eval", "--ckpt", str(run_dir), "--task", str(task), "--data", str(text), "--json"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert {"loss", "bits_per_byte", "tasks"} <= set(got) and got["tasks"]["cloze"] == expected


GOOD = MC_ROWS[1]
BAD_FILES = [
    ("not json\n", "line 1: not JSON"),
    ("[1, 2]\n", "line 1: expected a JSON object"),
    (json.dumps({**GOOD, "endings": ["b"]}), "line 1: endings: expected a list of at least 2"),
    (json.dumps({**GOOD, "label": 3}), "line 1: label: 3 is not an index of the 3 endings"),
    (json.dumps({**GOOD, "label": "1"}), "line 1: label: expected an integer"),
    (json.dumps({**GOOD, "endings": ["b", 3]}), "line 1: endings[1]: expected a string"),
    (json.dumps({**GOOD, "endings": ["b", ""]}), "line 1: endings[1]: empty"),
    (json.dumps({**GOOD, "context": ""}), "line 1: context: empty"),
    (json.dumps({"question": "?"}), "line 1: neither multiple choice"),
    (
        json.dumps(GOOD)
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "?"}], "answer": "1"}),  # fmt: skip
        "line 3: an exact-match example in a multiple-choice file",
    ),
    (
        json.dumps({"messages": [{"role": "assistant", "content": "x"}], "answer": "1"}),
        "line 1: messages: the last message must be a user turn",
    ),
    (json.dumps({"messages": [{"role": "user", "content": 1}], "answer": "1"}), "content"),
    (
        json.dumps({"messages": [{"role": "user", "content": "?"}]}),
        "line 1: answer: missing (an exact-match row is messages and answer)",
    ),
    (
        json.dumps({"messages": [{"role": "user", "content": "?"}], "answer": 1}),
        "line 1: answer: expected a string, got 1",
    ),
    ("\n", "no examples"),
]


@pytest.mark.parametrize("content, message", BAD_FILES)
def test_bad_task_file_is_one_error_line(run, tmp_path: Path, content: str, message: str) -> None:
    run_dir, _ = run
    task = tmp_path / "bad.jsonl"
    task.write_text(content, encoding="utf-8")
    result = runner.invoke(app, ["eval", "--ckpt", str(run_dir), "--task", str(task), "--json"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {task}: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.output and result.stdout == ""


def test_task_options_refused_with_one_line(run, tmp_path: Path) -> None:
    run_dir, _ = run
    mc = write_jsonl(tmp_path / "mc.jsonl", MC_ROWS)
    (tmp_path / "other").mkdir()
    twin = write_jsonl(tmp_path / "other" / "mc.jsonl", MC_ROWS)
    cases = [
        (["--task", str(tmp_path / "nope.jsonl")], "nope.jsonl: no such task file"),
        (["--task", str(mc), "--extract-number"], "--extract-number: applies to exact-match"),
        (["--task", str(mc), "--task", str(twin)], "have the same name 'mc'"),
    ]
    for argv, message in cases:
        result = runner.invoke(app, ["eval", "--ckpt", str(run_dir), *argv])
        assert result.exit_code == 2, (argv, result.output)
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert message in lines[0], lines[0]


def test_exact_match_on_a_model_without_chat_tokens_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests import helpers

    monkeypatch.setattr(helpers, "tokenizer_json", helpers.legacy_tokenizer_json)
    run_dir, _, _ = helpers.make_run(tmp_path)
    em = write_jsonl(tmp_path / "em.jsonl", [{"messages": [{"role": "user", "content": "Hi"}],
                                              "answer": "1"}])  # fmt: skip
    result = runner.invoke(app, ["eval", "--ckpt", str(run_dir), "--task", str(em)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {em}: the tokenizer has no chat tokens")


# ----------------------------------------------------------------------------- training


def test_trainer_logs_task_scores_and_samples(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.helpers import prepared_config

    task = write_jsonl(tmp_path / "cloze.jsonl", MC_ROWS)
    train = dict(max_steps=4, eval_every=2, ckpt_every=0, eval_tasks=[str(task)], sample_every=2,
                 sample_prompts=["ROMEO:", "All:"], sample_max_new_tokens=5)  # fmt: skip
    cfg = prepared_config(tmp_path, train=train)
    run_trainer(cfg)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    for tag in ("val/tasks/cloze/accuracy_norm", "val/tasks/cloze/accuracy"):
        assert [e.step for e in acc.Scalars(tag)] == [2, 4], tag
    texts = set(acc.Tags()["tensors"])
    for tag in ("samples/greedy", "samples/sampled"):
        events = acc.Tensors(f"{tag}/text_summary")
        assert [e.step for e in events] == [2, 4], texts
        first = events[0].tensor_proto.string_val[0].decode()
        assert "ROMEO:" in first and "All:" in first


@pytest.mark.parametrize(
    "row, message",
    [
        ({**GOOD, "label": 9}, r"bad.jsonl: line 1: label: 9"),
        ({"messages": [{"role": "user", "content": "?"}], "answer": "1"}, "has no chat tokens"),
    ],
)
def test_trainer_refuses_a_bad_task_file_before_training(tmp_path: Path, row, message) -> None:
    from tests import helpers
    from tests.helpers import make_trainer, prepared_config

    task = write_jsonl(tmp_path / "bad.jsonl", [row])
    (tmp_path / "tokens").mkdir()  # a tokenizer from before the chat tokens, reused by tokenize
    (tmp_path / "tokens" / "tokenizer.json").write_text(helpers.legacy_tokenizer_json())
    cfg = prepared_config(tmp_path, train=dict(eval_tasks=[str(task)]))
    with pytest.raises(UserError, match=message):
        make_trainer(cfg, verbose=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


# ----------------------------------------------------------------------------- transformers


def test_transformers_on_the_export_gives_the_same_numbers(run, tmp_path: Path) -> None:
    """The contract written out for transformers, as a maintainer would, on the exported folder."""
    transformers = pytest.importorskip("transformers")
    from minillm.checkpoint.hf_export import export_checkpoint

    run_dir, _ = run
    out = export_checkpoint(load_checkpoint(run_dir), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    max_len = hf.config.max_position_embeddings
    rows = [*MC_ROWS, {**MC_ROWS[0], "context": CONTEXT * 6, "label": 1}]  # one cut context
    correct = correct_norm = 0
    hf_scores = []
    for row in rows:
        scores = []
        for ending in row["endings"]:
            ctx = tok(row["context"], add_special_tokens=False).input_ids
            end = tok(ending, add_special_tokens=False).input_ids
            ids = (ctx + end)[-max_len:]
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
            scores.append(
                sum(logp[p - 1, ids[p]].item() for p in range(len(ids) - len(end), len(ids)))
            )
        hf_scores += scores
        norm = [s / len(e) for s, e in zip(scores, row["endings"])]
        correct += max(range(len(scores)), key=scores.__getitem__) == row["label"]
        correct_norm += max(range(len(norm)), key=norm.__getitem__) == row["label"]
    task = write_jsonl(tmp_path / "cloze.jsonl", rows)
    result = runner.invoke(app, ["eval", "--ckpt", str(run_dir), "--task", str(task), "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)["tasks"]["cloze"]
    assert got == {"accuracy": correct / 4, "accuracy_norm": correct_norm / 4, "examples": 4}
    loaded = load_checkpoint(run_dir)
    encoded = encode_multiple_choice(loaded.tokenizer, read_task(task), max_len)
    ours = score_continuations(loaded.model, [c for cs in encoded for c in cs], batch_size=5)
    assert ours == pytest.approx(hf_scores, rel=FP32_REL)  # sums of one sign: relative


# ----------------------------------------------------------------------------- the shipped file


def test_shipped_task_file_is_what_its_script_writes() -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "make_next_line_task.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shipped_task_file_scores_through_the_cli(run) -> None:
    run_dir, _ = run
    shipped = Path(__file__).resolve().parent.parent / "data" / "shakespeare_next_line.jsonl"
    task = read_task(shipped)
    assert len(task.examples) == 250 and all(len(ex.endings) == 4 for ex in task.examples)
    argv = ["eval", "--ckpt", str(run_dir), "--task", str(shipped), "--batch-size", "32", "--json"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)["tasks"]["shakespeare_next_line"]
    assert got["examples"] == 250 and 0.0 <= got["accuracy_norm"] <= 1.0
