"""`minillm eval --task --temperature T --samples N`: sampled replies on the decoding core, their
mean exact match and pass@N (minillm/infer/task_scoring.py)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from minillm.cli import app
from minillm.infer.engine import SamplingParams, generate
from minillm.infer.task_scoring import answer_matches
from minillm.tokenizer.bpe import eot_id, load_tokenizer
from minillm.tokenizer.chat_template import chat_ids
from minillm.tokenizer.conventions import Conventions
from tests.helpers import error_line, make_run

runner = CliRunner()


def test_sampled_replies_give_their_mean_accuracy_and_pass_at_n(tmp_path: Path) -> None:
    run_dir, cfg, net = make_run(tmp_path)
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    questions = [[("user", f"say {w}")] for w in ("a", "bb", "ccc", "dddd")]
    prompts = [Conventions.of_own(tok).chat_prompt(tuple(q)) for q in questions]
    stops = frozenset([chat_ids(tok)["end"], eot_id(tok)])
    n = 3
    # The replies the core samples for seed 5, drawn here on their own: sample k of example j
    # is row j * n + k.
    params = SamplingParams(cfg.sample.max_new_tokens, 1.0, 0, 1.0, seed=5, stop_ids=stops)
    rows = generate(net, prompts, params, tokenizer=tok, n=n)
    texts = [tok.decode([t for t in r if t not in stops]) for r in rows]
    # Examples 0-2 expect one of their own samples; example 3 an answer no sample gives.
    answers = [texts[j * n + j % n] for j in range(3)] + ["never said"]
    task = tmp_path / "qa.jsonl"
    task.write_text("".join(
        json.dumps({"messages": [{"role": r, "content": c} for r, c in q], "answer": a}) + "\n"
        for q, a in zip(questions, answers, strict=True)
    ))  # fmt: skip
    args = ["eval", "--ckpt", str(run_dir), "--task", str(task), "--json"]
    result = runner.invoke(app, [*args, "--temperature", "1", "--samples", str(n), "--seed", "5"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)["tasks"]["qa"]
    right = [answer_matches(texts[j * n + k], answers[j]) for j in range(4) for k in range(n)]
    solved = sum(any(right[j * n : (j + 1) * n]) for j in range(4))
    assert got == {"exact_match": sum(right) / 12, "examples": 4, "pass_at_n": solved / 4,
                   "samples": n, "temperature": 1.0}  # fmt: skip
    assert solved == 3 and sum(right) >= 3
    greedy = json.loads(runner.invoke(app, args).stdout)["tasks"]["qa"]
    assert set(greedy) == {"exact_match", "examples"}  # greedy: the keys as before
    line = error_line(runner.invoke(app, [*args, "--samples", "2"]))
    assert line == ("error: --samples: 2 greedy replies would all be the same; give --temperature "
                    "T > 0 too")  # fmt: skip
