"""Exact-match accuracy of a chat checkpoint on held-out conversations (the chat demo's score).

    python scripts/chat_exact_match.py --ckpt runs/tiny-chat [--data data/tiny_chat_test.jsonl]

Each row is `{"messages": [...], "answer": str}` (DESIGN.md's exact-match task format); the
greedy reply to the messages, rendered by minillm's chat template and stopped at `<|end|>` (what
`minillm chat --message` prints), counts when it equals the answer after stripping whitespace.
All prompts run as one left-padded batch through `minillm.infer.generate.generate`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from minillm.checkpoint.store import load_checkpoint
from minillm.data.chat import chat_ids, check_messages, encode_prompt
from minillm.infer.generate import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="A run directory or a checkpoint.")
    parser.add_argument("--data", type=Path, default=Path("data/tiny_chat_test.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=100, help="Prompts per generate call.")
    parser.add_argument("--show", type=int, default=3, help="Print this many replies.")
    args = parser.parse_args()
    loaded = load_checkpoint(args.ckpt)
    tok = loaded.tokenizer
    ids = chat_ids(tok, args.ckpt)
    rows = [json.loads(line) for line in args.data.read_text(encoding="utf-8").splitlines()]
    prompts = [
        encode_prompt(tok, check_messages(r["messages"], str(args.data), i, need_assistant=False))
        for i, r in enumerate(rows, 1)
    ]
    replies = []
    for first in range(0, len(prompts), args.batch):
        new = generate(
            loaded.model,
            prompts[first : first + args.batch],
            max_new_tokens=args.max_new_tokens,
            temperature=0.0,
            eot_id=ids["end"],
            vocab_limit=tok.get_vocab_size(),
        )
        replies += [tok.decode(n[:-1] if n and n[-1] == ids["end"] else n) for n in new]
    right = [reply.strip() == row["answer"].strip() for reply, row in zip(replies, rows)]
    for row, reply in list(zip(rows, replies))[: args.show]:
        print(f"{row['messages'][-1]['content']!r} -> {reply!r} (answer {row['answer']!r})")
    print(f"exact match: {sum(right)}/{len(rows)} = {sum(right) / len(rows):.1%} ({args.data})")


if __name__ == "__main__":
    main()
