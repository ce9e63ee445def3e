"""Task scores: multiple-choice accuracy and exact match of greedy chat replies.

Offers `choice_ids`, `encode_multiple_choice`, `score_continuations`, `pick`,
`multiple_choice_metrics`, `score_multiple_choice`; `extract_number`, `answer_matches`,
`score_exact_match`; `evaluate_tasks` (what `minillm eval --task` runs), `eval_report`,
`format_tasks` and `format_details`. Task files are read by `minillm.infer.task_format`, an
exact-match prompt is the model's chat template (minillm.tokenizer.conventions).

The multiple-choice contract (docs/design.md, "Task files"), so that other tools reproduce the
numbers: a choice's ids are encode(context) + encode(ending), each encoded alone without special
tokens; longer than the model's context (model.max_seq_len, HF's max_position_embeddings) they lose
tokens of the context from the left. Its score is the sum of the log-probabilities of the ending's
tokens under the full softmax. `accuracy` counts argmax(score) == label, `accuracy_norm` counts
argmax(score / len(ending in characters)) == label, as lm-evaluation-harness normalises; ties go to
the lowest index. Batches are right-padded: causal attention never lets a real position see the
padding after it, so a batch gives each choice its one-at-a-time score.

Shape legend: B choices in a batch, T longest choice of the batch, V vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
import time
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any, TextIO

import torch

from minillm.errors import UserError
from minillm.infer.conversation import warn_if_text_model
from minillm.infer.task_format import MultipleChoice, Task
from minillm.runtime.device import sum_dtype
from minillm.runtime.progress import Progress

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from minillm.checkpoint.store import LoadedCheckpoint
    from minillm.tokenizer.conventions import Conventions

# A choice: its token ids and how many of the last ones are the ending's (the scored tokens).
Choice = tuple[list[int], int]

# ----------------------------------------------------------------------------- multiple choice


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def choice_ids(tokenizer: Tokenizer, context: str, ending: str, max_len: int) -> Choice | None:
    """The ids of one choice, the context cut from the left to fit max_len, and the ending's
    token count; None when the ending alone leaves no room for one context token."""
    ctx, end = _encode(tokenizer, context), _encode(tokenizer, ending)
    if len(end) >= max_len:
        return None
    return (ctx + end)[-max_len:], len(end)


def encode_multiple_choice(tokenizer: Tokenizer, task: Task, max_len: int) -> list[list[Choice]]:
    """Every example's choices, encoded once (the trainer reuses them at each evaluation).
    Special tokens written in a task's text are text for minillm's own tokenizers and tokens
    for a published model's (as its conventions set `tokenizer`: minillm.tokenizer.conventions)."""
    encoded = []
    for ex in task.examples:
        choices = []
        for i, ending in enumerate(ex.endings):
            choice = choice_ids(tokenizer, ex.context, ending, max_len)
            if choice is None:
                raise UserError(
                    f"{task.path}: line {ex.line}: endings[{i}]: longer than the "
                    f"model's context of {max_len} tokens"
                )
            choices.append(choice)
        encoded.append(choices)
    return encoded


@torch.no_grad()
def score_continuations(
    model: torch.nn.Module,
    choices: list[Choice],
    batch_size: int,
    device: torch.device | str = "cpu",
    autocast: contextlib.AbstractContextManager | None = None,
    progress: Progress | None = None,
) -> list[float]:
    """Summed log-probability of the last n tokens of each (ids, n), in float64 (nats).

    Longest first, so a batch holds similar lengths; right-padded with token 0, which no scored
    position can see. no_grad rather than inference_mode: the trainer's model trains on after.
    """
    order = sorted(range(len(choices)), key=lambda i: -len(choices[i][0]))
    scores = [0.0] * len(choices)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            T = len(choices[rows[0]][0])
            x = torch.zeros(len(rows), T, dtype=torch.long)  # (B, T)
            y = torch.full((len(rows), T), -1, dtype=torch.long)  # (B, T) target of position t
            for r, i in enumerate(rows):
                ids, n = choices[i]
                x[r, : len(ids)] = torch.tensor(ids)
                # Position t predicts token t + 1: the ending's tokens are predicted from
                # positions len - n - 1 .. len - 2.
                y[r, len(ids) - n - 1 : len(ids) - 1] = torch.tensor(ids[len(ids) - n :])
            x, y = x.to(device), y.to(device)
            with autocast or contextlib.nullcontext():
                logits, _ = model(x)  # (B, T, V)
            logp = torch.log_softmax(logits.float(), dim=-1)
            picked = logp.gather(-1, y.clamp(min=0)[..., None])[..., 0]  # (B, T)
            picked = picked.to(sum_dtype(picked.device))
            sums = picked.masked_fill(y < 0, 0.0).sum(dim=1).tolist()
            for r, i in enumerate(rows):
                scores[i] = sums[r]
            if progress is not None:
                progress.advance()
    finally:
        model.train(was_training)
    return scores


def pick(scores: list[float]) -> int:
    """The index of the largest score, the lowest index on a tie (max keeps the first)."""
    return max(range(len(scores)), key=scores.__getitem__)


def multiple_choice_metrics(
    examples: list[MultipleChoice], scores: list[float], details: list[dict] | None = None
) -> dict[str, Any]:
    """accuracy, accuracy_norm and examples from every choice's score, example after example;
    with a `details` list, one record per example is appended to it (`eval --show`)."""
    correct = correct_norm = k = 0
    for ex in examples:
        s = scores[k : k + len(ex.endings)]
        k += len(ex.endings)
        chosen = pick(s)
        correct += chosen == ex.label
        # Per character of the ending as written (Python len), as lm-evaluation-harness divides
        # by its choice's characters (which it counts without the leading space it adds).
        chosen_norm = pick([v / len(e) for v, e in zip(s, ex.endings)])
        correct_norm += chosen_norm == ex.label
        if details is not None:
            details.append(
                {
                    "line": ex.line,
                    "prompt": ex.context,
                    "expected": ex.endings[ex.label],
                    "output": ex.endings[chosen],
                    "correct": chosen == ex.label,
                    "output_norm": ex.endings[chosen_norm],
                    "correct_norm": chosen_norm == ex.label,
                }
            )
    n = len(examples)
    return {"accuracy": correct / n, "accuracy_norm": correct_norm / n, "examples": n}


def score_multiple_choice(
    model: torch.nn.Module,
    task: Task,
    encoded: list[list[Choice]],
    batch_size: int,
    device: torch.device | str = "cpu",
    autocast: contextlib.AbstractContextManager | None = None,
    progress: bool = False,
    details: list[dict] | None = None,
) -> dict[str, Any]:
    """accuracy, accuracy_norm and examples of a multiple-choice task (choices from
    `encode_multiple_choice`); all choices of all examples go through the model as one list.
    details: a list that gets one record per example (multiple_choice_metrics)."""
    flat = [c for choices in encoded for c in choices]
    bar = Progress(task.name, -(-len(flat) // batch_size), enabled=progress, stderr=True)
    try:
        scores = score_continuations(model, flat, batch_size, device, autocast, bar)
    finally:
        bar.close()
    return multiple_choice_metrics(task.examples, scores, details)


# ----------------------------------------------------------------------------- exact match

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_number(text: str) -> str | None:
    """The last number in text, commas dropped ("1,234.5" -> "1234.5"), as GSM8K is scored."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def answer_matches(reply: str, answer: str, number: bool = False) -> bool:
    """Whether a reply is the answer: equal after stripping whitespace; with `number`, the last
    number of the reply equals the answer as a number ("72.0" is "72")."""
    if not number:
        return reply.strip() == answer.strip()
    got, want = extract_number(reply), extract_number(answer) or answer.strip()
    if got is None:
        return False
    try:
        return Decimal(got) == Decimal(want)
    except InvalidOperation:
        return got == want


def reply_room_note(
    task: Task,
    longest: int,
    prompt_tokens: int,
    context: int,
    room: int,
    limit: str,
    answers: list[int],
) -> str:
    """What a cut of the replies' length means: which setting was cut and why (the longest
    prompt, example `longest`, leaves `room` tokens of the context), and whether it matters:
    `answers`, each answer's tokens with its <|end|>, all fit in the room or some do not."""
    ex = task.examples[longest]
    head = (
        f"note: {task.name}: replies limited to {room} tokens, not {limit}: the longest prompt "
        f"(line {ex.line}, {prompt_tokens} tokens) leaves {room} of the model's {context}-token "
        "context"
    )
    over = [n for n in answers if n > room]
    if not over:
        return f"{head}; every answer fits ({max(answers)} tokens at most, with <|end|>)"
    return (
        f"{head}; {len(over)} of {len(answers)} answers need more (up to {max(over)} tokens "
        "with <|end|>): their replies are cut and scored wrong"
    )


def score_exact_match(
    model: torch.nn.Module,
    conv: Conventions,
    task: Task,
    batch_size: int,
    max_new_tokens: int,
    number: bool = False,
    progress: bool = False,
    err: TextIO | None = None,
    details: list[dict] | None = None,
    temperature: float = 0.0,
    samples: int = 1,
    seed: int = 0,
    limit_name: str = "sample.max_new_tokens",
    noted: set[str] | None = None,
) -> dict[str, Any]:
    """exact_match and examples of an exact-match task: greedy replies to the prompts the
    model's chat template writes, stopped at its stop set (conv.stop_ids: minillm's own
    <|end|> or <|endoftext|>).

    With a temperature > 0, `samples` replies per example, sampled on the decoding core
    (sample k of example j seeded from (seed, k), as `minillm sample`): exact_match is then
    the mean accuracy of all the replies, and pass_at_n the share of examples with at least
    one right (an unbiased pass@n, n = samples, as every reply is drawn independently).

    max_new_tokens is cut, with a note on `err` (`reply_room`), to what the longest prompt
    leaves of the context, for every example alike: a reply then does not depend on its batch.
    limit_name: the setting max_new_tokens came from, for the note; noted: the notes already
    printed (a run scoring its tasks at every evaluation says each once). details: a list that
    gets one record per example (its last user turn, the answer, the reply, the hit).
    """
    from minillm.infer.engine import Engine, SamplingParams

    tokenizer = conv.tok
    conv.check_chat(str(task.path))
    prompts = [conv.chat_prompt(ex.messages) for ex in task.examples]
    stops = conv.stop_ids
    context = model.cfg.max_seq_len
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    room = context - len(prompts[longest]) + 1
    if room < 1:
        raise UserError(
            f"{task.path}: line {task.examples[longest].line}: messages: "
            f"{len(prompts[longest])} tokens, more than the model's context of "
            f"{context}"
        )
    if max_new_tokens > room:
        # + the end-of-turn token
        answers = [len(tokenizer.encode(ex.answer, add_special_tokens=False).ids) + 1
                   for ex in task.examples]  # fmt: skip
        note = reply_room_note(task, longest, len(prompts[longest]), context, room,
                               f"{limit_name}={max_new_tokens}", answers)  # fmt: skip
        if noted is None or note not in noted:
            print(note, file=err or sys.stderr)
            if noted is not None:
                noted.add(note)
        max_new_tokens = room
    # The rows run on the decoding core, batch_size at a time, each joining as one leaves.
    engine = Engine(model, tokenizer, max_batch=batch_size)
    if temperature > 0:
        params = SamplingParams(max_new_tokens, temperature, 0, 1.0, seed=seed, stop_ids=stops)
    else:
        params = SamplingParams.greedy(max_new_tokens, stop_ids=stops)
    rows = engine.submit(prompts, params, n=samples)
    bar = Progress(task.name, len(rows), enabled=progress, stderr=True)
    try:
        engine.run(lambda event: bar.advance() if event.finish_reason else None)
    finally:
        bar.close()
    hits = solved = 0
    for j, ex in enumerate(task.examples):
        texts = []
        for row in rows[j * samples : (j + 1) * samples]:
            reply = row.tokens
            cut = [i for i, t in enumerate(reply) if t in stops]
            texts.append(tokenizer.decode(reply[: cut[0]] if cut else reply))
        right = [answer_matches(text, ex.answer, number) for text in texts]
        hits += sum(right)
        solved += any(right)
        if details is not None:
            record = {"line": ex.line, "prompt": ex.messages[-1][1], "expected": ex.answer}
            details.append({**record, "output": texts[0], "correct": right[0]})
            if samples > 1:
                details[-1].update(outputs=texts, right=sum(right))
    result = {"exact_match": hits / len(rows), "examples": len(prompts)}
    if temperature > 0:
        result.update(pass_at_n=solved / len(prompts), samples=samples, temperature=temperature)
    return result


# ----------------------------------------------------------------------------- the command


def evaluate_tasks(
    ckpt: LoadedCheckpoint,
    tasks: list[Task],
    batch_size: int | None = None,
    extract_number: bool = False,
    progress: bool = False,
    details: bool = False,
    temperature: float = 0.0,
    samples: int = 1,
    seed: int = 0,
    max_new_tokens: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Score a LoadedCheckpoint on task files: {name: {accuracy, accuracy_norm, examples}} for
    multiple choice, {name: {exact_match, examples}} for exact match. batch_size: choices (or
    prompts) per forward pass, default the run's train.batch_size. details: each result also
    holds `details`, one record per example (`eval --show`, `--details`). temperature,
    samples, seed: exact-match replies sampled (`--temperature`, `--samples`, `--seed`).
    max_new_tokens: the longest exact-match reply (`--max-new-tokens`), default the run's
    sample.max_new_tokens."""
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise UserError(f"--max-new-tokens: must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not math.isfinite(temperature):
        raise UserError(f"--temperature: must be >= 0, got {temperature}")
    if samples < 1:
        raise UserError(f"--samples: must be >= 1, got {samples}")
    if samples > 1 and temperature == 0:
        raise UserError(f"--samples: {samples} greedy replies would all be the same; give "
                        "--temperature T > 0 too")  # fmt: skip
    model, tok, cfg = ckpt.model, ckpt.tokenizer, ckpt.config
    batch_size = batch_size or cfg.train.batch_size
    limit, limit_name = cfg.sample.max_new_tokens, "sample.max_new_tokens"
    if max_new_tokens is not None:
        limit_name = "--max-new-tokens"
    device = next(model.parameters()).device
    if any(t.kind == "exact_match" for t in tasks):
        warn_if_text_model(ckpt)
    results = {}
    for task in tasks:
        start = time.perf_counter()
        records: list[dict] | None = [] if details else None
        if task.kind == "multiple_choice":
            encoded = encode_multiple_choice(tok, task, model.cfg.max_seq_len)
            result = score_multiple_choice(
                model, task, encoded, batch_size, device, progress=progress, details=records
            )
        else:
            result = score_exact_match(
                model, ckpt.conventions, task, batch_size, max_new_tokens or limit,
                extract_number, progress, details=records, temperature=temperature,
                samples=samples, seed=seed, limit_name=limit_name,
            )  # fmt: skip
        if records is not None:
            result["details"] = [{"task": task.name, **r} for r in records]
        result["seconds"] = time.perf_counter() - start
        results[task.name] = result
    return results


def format_details(records: list[dict[str, Any]]) -> str:
    """`eval --show`: one block per example, right or wrong, what was asked, expected, given."""
    lines = []
    for r in records:
        mark = "right" if r["correct"] else "WRONG"
        lines.append(f"{r['task']} line {r['line']}: {mark}")
        for key in ("prompt", "expected", "output"):
            lines.append(f"  {key + ':':9} {r[key]!r}")
    return "\n".join(lines)


def eval_report(result: dict[str, Any], as_json: bool) -> str:
    """What `minillm eval` prints: the loss keys (when the loss was evaluated) and `tasks`."""
    from minillm.infer.evaluate import JSON_KEYS, format_result

    tasks = result.get("tasks", {})
    if as_json:
        out: dict[str, Any] = {k: result[k] for k in JSON_KEYS if k in result}
        if tasks:
            out["tasks"] = {
                n: {k: v for k, v in r.items() if k not in ("seconds", "details")}
                for n, r in tasks.items()
            }
        return json.dumps(out)
    lines = [format_result(result)] if "loss" in result else []
    return "\n".join(lines + ([format_tasks(tasks)] if tasks else []))


def format_tasks(results: dict[str, dict[str, Any]]) -> str:
    """One human line per task."""
    lines = []
    for name, r in results.items():
        if "pass_at_n" in r:
            n, t = r["samples"], r["temperature"]
            score = (f"exact_match {r['exact_match']:.4f} (mean of {n} replies at temperature "
                     f"{t:g})   pass@{n} {r['pass_at_n']:.4f}")  # fmt: skip
        elif "exact_match" in r:
            score = f"exact_match {r['exact_match']:.4f}"
        else:
            score = f"accuracy {r['accuracy']:.4f}   accuracy_norm {r['accuracy_norm']:.4f}"
        lines.append(f"{name}: {score}   {r['examples']:,} examples, {r['seconds']:.1f}s")
    return "\n".join(lines)
