"""Build data/shakespeare_next_line.jsonl: which of four lines comes next in this speech?

A multiple-choice task file (docs/design.md, "Task files") from the shipped Shakespeare, for the
demo and the tests. Each example is a speech's speaker and first lines (the context) and four
endings: the speech's true next line and three lines of other speeches; chance is 25%. Only the last
9% of data/tinyshakespeare.txt is used, inside the validation split of every shipped config
(data.val_fraction 0.1 holds out the last 10% of the bytes), so a model trained on the rest has
never seen these lines. The context ends in a lone newline and an ending starts with a word, so
encoding the two apart gives the ids of encoding them together (as lm-evaluation-harness does).

python scripts/make_next_line_task.py            # (re)write the file; a fixed seed, same bytes
python scripts/make_next_line_task.py --check    # exit 1 if the file is not what this writes
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "data" / "tinyshakespeare.txt"
OUT = ROOT / "data" / "shakespeare_next_line.jsonl"
TAIL = 0.09  # the share of the text used, from its end
SEED = 1337
EXAMPLES = 250
CHOICES = 4
MIN_CHARS = 12  # shorter lines ("Why", "My lord,") say too little to choose between


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker line, lines of speech) of each blank-line-separated block of the text."""
    out = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line.strip()]
        if len(lines) >= 2 and lines[0].endswith(":"):
            out.append((lines[0], lines[1:]))
    return out


def build(text: str, seed: int = SEED, n: int = EXAMPLES) -> list[dict]:
    """The examples: one per speech of at least 3 lines (cut at random), at most n, in order."""
    tail = text[len(text) - int(len(text) * TAIL) :]
    blocks = speeches(tail[tail.index("\n\n") + 2 :])  # from the first whole speech
    rng = random.Random(seed)
    pool = [(b, line) for b, (_, lines) in enumerate(blocks) for line in lines]
    pool = [(b, line) for b, line in pool if len(line) >= MIN_CHARS]
    # Where a speech may be cut: after at least one of its lines, before one as long as the
    # distractors may be (a short true line would give itself away by its length).
    cuts = {b: [i for i in range(1, len(lines)) if len(lines[i]) >= MIN_CHARS]
            for b, (_, lines) in enumerate(blocks) if len(lines) >= 3}  # fmt: skip
    candidates = [b for b, c in cuts.items() if c]
    chosen = sorted(rng.sample(candidates, min(n, len(candidates))))
    examples = []
    for b in chosen:
        speaker, lines = blocks[b]
        cut = rng.choice(cuts[b])
        answer = lines[cut]
        distractors: list[str] = []
        while len(distractors) < CHOICES - 1:
            other, line = rng.choice(pool)
            if other != b and line != answer and line not in distractors:
                distractors.append(line)
        label = rng.randrange(CHOICES)
        endings = distractors[:label] + [answer] + distractors[label:]
        context = speaker + "\n" + "\n".join(lines[:cut]) + "\n"
        examples.append({"context": context, "endings": endings, "label": label})
    return examples


def render(examples: list[dict]) -> str:
    return "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in examples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    args = parser.parse_args()
    text = render(build(SOURCE.read_text(encoding="utf-8")))
    if args.check:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is stale: run python scripts/make_next_line_task.py")
            return 1
        print(f"{OUT} is up to date")
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}: {text.count(chr(10))} examples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
