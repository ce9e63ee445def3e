"""Move line links in README.md and docs/*.md back onto the code they name, after code moved.

    python scripts/fix_doc_links.py          # rewrite the links that drifted, print each change

A link like [`RMSNorm`](../minillm/model.py#L30-L45) is re-anchored at the line that defines
`RMSNorm` (`class RMSNorm` / `def RMSNorm`, else its first mention), keeping the span's length.
tests/test_docs.py checks every such link; this script is the quick way to mend them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[([^\]\[\n]*)\]\(([^)#\s]+\.py)#L(\d+)(?:-L(\d+))?\)")


def locate(lines: list[str], name: str) -> int | None:
    """1-based line that defines `name` (or first mentions it)."""
    short = name.split(".")[-1].rstrip("()")
    define = re.compile(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(short)}\b")
    assign = re.compile(rf"^\s*{re.escape(short)}\s*[:=]")
    for pattern in (define, assign):
        for i, line in enumerate(lines, 1):
            if pattern.search(line):
                return i
    for i, line in enumerate(lines, 1):
        if short in line:
            return i
    return None


def fix(doc: Path) -> int:
    text = doc.read_text()
    changes = 0

    def repl(m: re.Match) -> str:
        nonlocal changes
        label, target, a, b = m.group(1), m.group(2), int(m.group(3)), m.group(4)
        b = int(b) if b else a
        names = re.findall(r"`([^`]+)`", label)
        path = (doc.parent / target).resolve()
        if not names or not path.is_file():
            return m.group(0)
        lines = path.read_text().splitlines()
        span = lines[a - 1 : b]
        short = names[0].split(".")[-1].rstrip("()")
        if a <= len(lines) and any(short in line for line in span):
            return m.group(0)
        start = locate(lines, names[0])
        if start is None:
            print(f"{doc.name}: {names[0]} not found in {target}; left as is")
            return m.group(0)
        end = min(start + (b - a), len(lines))
        changes += 1
        new = f"[{label}]({target}#L{start}" + (f"-L{end})" if end != start else ")")
        print(f"{doc.relative_to(ROOT)}: {m.group(0)} -> {new}")
        return new

    text = LINK.sub(repl, text)
    if changes:
        doc.write_text(text)
    return changes


def main() -> int:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    total = sum(fix(doc) for doc in docs if doc.is_file())
    print(f"{total} link(s) moved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
