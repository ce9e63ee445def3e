"""Write the synthetic chat set of the chat demo: copy and reverse short letter sequences.

    python scripts/gen_chat_data.py   # data/tiny_chat.jsonl and data/tiny_chat_test.jsonl

A task a small model learns on a CPU in minutes, with an exact answer: "Reverse: k q m" ->
"m q k" (or "Copy: ..." -> the same letters). Letters are spaced, so each is one token of any
byte-level BPE, and the model has to attend to the prompt rather than memorise (17,576 letter
triples, so held-out prompts are new ones). A third of the
conversations open with a system message. The seed is fixed: the files are the same every time.
tiny_chat.jsonl (training, `data.text_field: messages`) and tiny_chat_test.jsonl (held out: the
conversation without its answer, and the answer: the exact-match task format of docs/design.md,
"Task files") share no prompt.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

SYSTEM = "You follow instructions exactly."
# Three letters: each answer letter then sits at a fixed distance from the token that predicts
# it, which a 1M-parameter model learns in a few hundred steps; 3 to 6 letters (tried first)
# left it at 0% exact match after 400 steps, though it had learned the answer's length.
LETTERS = 3


def conversation(rng: random.Random) -> tuple[list[dict[str, str]], str]:
    """One conversation (ending with the user's turn) and its answer."""
    letters = rng.choices(string.ascii_lowercase, k=LETTERS)
    task = rng.choice(("Copy", "Reverse"))
    answer = " ".join(letters if task == "Copy" else letters[::-1])
    messages = [{"role": "user", "content": f"{task}: {' '.join(letters)}"}]
    if rng.random() < 1 / 3:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    return messages, answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data"))
    parser.add_argument("--train", type=int, default=6000)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    seen: set[str] = set()
    train, test = [], []
    while len(test) < args.test or len(train) < args.train:
        messages, answer = conversation(rng)
        key = messages[-1]["content"]
        if key in seen:
            continue
        seen.add(key)
        if len(test) < args.test:
            test.append({"messages": messages, "answer": answer})
        else:
            train.append({"messages": [*messages, {"role": "assistant", "content": answer}]})
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("tiny_chat.jsonl", train), ("tiny_chat_test.jsonl", test)):
        with open(args.out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"wrote {args.out / name}: {len(rows)} conversations")


if __name__ == "__main__":
    main()
