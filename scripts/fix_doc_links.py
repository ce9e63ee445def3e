"""Move line links in README.md and docs/*.md back onto the code they name, after code moved.

    python scripts/fix_doc_links.py          # rewrite the links that drifted, print each change

A link like [`RMSNorm`](../minillm/model.py#L30-L45) is re-anchored at the line that defines
`RMSNorm` (`class RMSNorm` / `def RMSNorm`; for `Class.method` the method inside that class),
else its first assignment or mention; a span then covers the whole definition (else it keeps
its length). A link to a name that is not defined (`self.wo`, `masked_fill`) stays while its
span still mentions the name.
tests/test_docs.py checks every such link; this script is the quick way to mend them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[([^\]\[\n]*)\]\(([^)#\s]+\.py)#L(\d+)(?:-L(\d+))?\)")


def definition(name: str) -> re.Pattern:
    return re.compile(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b")


def locate(lines: list[str], name: str) -> int | None:
    """1-based line that defines `name` (`Class.method`: the method inside that class), else the
    first line that assigns or mentions it."""
    parts = name.rstrip("()").split(".")
    short, start = parts[-1], 0
    if len(parts) > 1:  # Class.method: look from the class on
        owner = definition(parts[-2])
        start = next((i for i, line in enumerate(lines) if owner.search(line)), 0)
    assign = re.compile(rf"^\s*{re.escape(short)}\s*[:=]")
    mention = re.compile(rf"(?<!\w){re.escape('.'.join(parts))}\b")
    for pattern in (definition(short), assign, mention):
        for i in range(start, len(lines)):
            if pattern.search(lines[i]):
                return i + 1
    return None


def block_end(lines: list[str], start: int) -> int:
    """1-based last line of the def/class that starts at line `start`."""
    indent = len(lines[start - 1]) - len(lines[start - 1].lstrip())
    end = start
    for i in range(start, len(lines)):
        line = lines[i]
        if line.strip():
            if len(line) - len(line.lstrip()) <= indent and not line.lstrip().startswith(")"):
                break
            end = i + 1
    return end


def still_right(lines: list[str], name: str, a: int, b: int) -> bool:
    """Whether lines a..b still show `name`: start at its definition, or mention it."""
    found = locate(lines, name)
    if found is not None and definition(name.rstrip("()").split(".")[-1]).search(lines[found - 1]):
        return found == a
    literal = re.compile(rf"(?<!\w){re.escape(name.rstrip('()'))}\b")
    return any(literal.search(line) for line in lines[a - 1 : b])


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
        if a <= len(lines) and still_right(lines, names[0], a, b):
            return m.group(0)
        start = locate(lines, names[0])
        if start is None:
            print(f"{doc.name}: {names[0]} not found in {target}; left as is")
            return m.group(0)
        if definition(names[0].rstrip("()").split(".")[-1]).search(lines[start - 1]):
            end = block_end(lines, start) if b > a else start
        else:
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
