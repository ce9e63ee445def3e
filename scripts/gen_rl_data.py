"""Write the data of the RL demo (`make rl-demo`): sort four letters, with a checkable answer.

    python scripts/gen_rl_data.py   # data/rl_sort_*.jsonl, the same files every time

"Sort: q d m k" -> "d k m q". Letters are spaced (one token each) and distinct. After a brief
SFT a 1M-parameter model sorts some prompts but not reliably, and its sampled replies
(temperature 1) are right less often than its greedy ones: the room that GRPO and DPO use.
Four files, no prompt in two of them:
- rl_sort_sft.jsonl: SFT conversations (`data.text_field: messages`);
- rl_sort_prompts.jsonl: GRPO prompts, `{"messages": [...], "answer": "..."}` (eval --task's
  exact-match format);
- rl_sort_test.jsonl: held-out prompts in the same format (no prompt of the three others);
- rl_sort_pairs.jsonl: DPO pairs in TRL's standard format, `{"prompt", "chosen", "rejected"}`:
  the sorted letters against a near miss (the sorted order with two letters swapped).
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

LETTERS = 4
SIZES = {"test": 200, "sft": 1500, "prompts": 1000, "pairs": 1000}  # in the order they are drawn


def prompt_and_answer(rng: random.Random) -> tuple[str, str]:
    letters = rng.sample(string.ascii_lowercase, k=LETTERS)
    return f"Sort: {' '.join(letters)}", " ".join(sorted(letters))


def near_miss(answer: str, rng: random.Random) -> str:
    """The answer with two of its letters swapped: wrong, but close (what an SFT model gets)."""
    letters = answer.split()
    i, j = rng.sample(range(len(letters)), k=2)
    letters[i], letters[j] = letters[j], letters[i]
    return " ".join(letters)


def generate(seed: int = 0, sizes: dict[str, int] = SIZES) -> dict[str, list[dict]]:
    """Each file's rows, keyed by file name; no prompt repeats across or within files."""
    rng = random.Random(seed)
    seen: set[str] = set()
    files: dict[str, list[dict]] = {}
    for part, n in sizes.items():
        rows: list[dict] = []
        while len(rows) < n:
            prompt, answer = prompt_and_answer(rng)
            if prompt in seen:
                continue
            seen.add(prompt)
            user = [{"role": "user", "content": prompt}]
            if part == "sft":
                rows.append({"messages": [*user, {"role": "assistant", "content": answer}]})
            elif part == "pairs":
                rejected = near_miss(answer, rng)
                rows.append({"prompt": prompt, "chosen": answer, "rejected": rejected})
            else:
                rows.append({"messages": user, "answer": answer})
        files[f"rl_sort_{part}.jsonl"] = rows
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in generate(args.seed).items():
        with open(args.out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"wrote {args.out / name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
