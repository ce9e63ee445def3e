"""Move line links in README.md and docs/*.md back onto the code they name, after code moved.

    python scripts/fix_doc_links.py          # rewrite the links that drifted, print each change

A link like [`RMSNorm`](../minillm/model.py#L30-L45) is re-anchored on the definition of
`RMSNorm` (`class RMSNorm` / `def RMSNorm`; for `Class.method` the method inside that class),
its span covering the whole definition. A link to a name that is not defined (`self.wo`,
`masked_fill`) stays while its span mentions the name, else moves to the nearest mention.
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


def block_end(lines: list[str], start: int) -> int:
    """1-based last line of the def/class whose header is line `start` (1-based)."""
    indent = len(lines[start - 1]) - len(lines[start - 1].lstrip())
    end = start
    for i in range(start, len(lines)):
        line = lines[i]
        if line.strip():
            if len(line) - len(line.lstrip()) <= indent and not line.lstrip().startswith(")"):
                break
            end = i + 1
    return end


def find_definition(lines: list[str], name: str) -> int | None:
    """1-based line of `def name` / `class name`; for `Class.method`, inside that class."""
    parts = name.removesuffix("()").split(".")
    lo, hi = 0, len(lines)
    if len(parts) > 1 and parts[-2][:1].isupper():
        owner = definition(parts[-2])
        cls = next((i for i, line in enumerate(lines) if owner.search(line)), None)
        if cls is None:
            return None
        lo, hi = cls, block_end(lines, cls + 1)
    pattern = definition(parts[-1])
    return next((i + 1 for i in range(lo, hi) if pattern.search(lines[i])), None)


def anchor(lines: list[str], name: str, a: int, b: int) -> tuple[int, int] | None:
    """The span lines a..b of a link to `name` should have now, or None if `name` is not there.

    A definition: its whole body from its decorators (or only its header line, for a one-line
    link). Another name (`self.wo`, `masked_fill`): kept while the span mentions it, else its
    mention nearest line a, with the span's length.
    """
    header = find_definition(lines, name)
    if header is not None:
        first = header
        while first > 1 and lines[first - 2].lstrip().startswith("@"):
            first -= 1
        end = block_end(lines, header)
        if b == a:
            return (a, a) if a in (first, header) else (header, header)
        return (a, b) if a in (first, header) and b == end else (first, end)
    literal = re.compile(rf"(?<!\w){re.escape(name.removesuffix('()'))}\b")
    if a <= len(lines) and any(literal.search(line) for line in lines[a - 1 : b]):
        return (a, b)
    hits = [i + 1 for i, line in enumerate(lines) if literal.search(line)]
    if not hits:
        return None
    near = min(hits, key=lambda i: abs(i - a))
    return (near, min(near + (b - a), len(lines)))


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
        span = anchor(lines, names[0], a, b)
        if span is None:
            print(f"{doc.name}: {names[0]} not found in {target}; left as is")
            return m.group(0)
        if span == (a, b):
            return m.group(0)
        start, end = span
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
