"""Move line links in README.md and docs/*.md back onto the code they name, after code moved.

    python scripts/fix_doc_links.py          # rewrite the links that drifted, print each change

A link like [`RMSNorm`](../minillm/model.py#L30-L45) is re-anchored on the definition of
`RMSNorm` (`class RMSNorm` / `def RMSNorm`; for `Class.method` the method inside that class),
its span covering the whole definition. A link to a name that is not defined (`self.wo`,
`masked_fill`) stays while its span mentions the name, else moves to the nearest mention.
A link into a file that moved (MOVED, the package split by stage) follows its name to the new
file that defines or mentions it. tests/test_docs.py checks every such link; this script is the
quick way to mend them.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[([^\]\[\n]*)\]\(([^)#\s]+\.py)#L(\d+)(?:-L(\d+))?\)")

# Old module -> where its code lives now (the split into packages by stage).
MOVED = {
    "minillm/model.py": ["minillm/model/transformer.py", "minillm/model/kv_cache.py",
                         "minillm/model/decode.py", "minillm/model/kernels_cpu.py"],
    "minillm/hf.py": ["minillm/model/hf_names.py"],
    "minillm/config.py": ["minillm/config/schema.py", "minillm/config/loading.py"],
    "minillm/data.py": ["minillm/data/meta.py", "minillm/data/batches.py",
                        "minillm/data/shard_writer.py"],
    "minillm/corpus.py": ["minillm/data/corpus.py"],
    "minillm/text.py": ["minillm/data/text.py"],
    "minillm/tokenizer.py": ["minillm/data/tokenizer.py"],
    "minillm/shards.py": ["minillm/data/shard_writer.py"],
    "minillm/checkpoint.py": ["minillm/checkpoint/store.py", "minillm/checkpoint/rundir.py"],
    "minillm/rundir.py": ["minillm/checkpoint/rundir.py"],
    "minillm/generate.py": ["minillm/infer/generate.py"],
    "minillm/evaluate.py": ["minillm/infer/evaluate.py"],
    "minillm/export.py": ["minillm/checkpoint/hf_folder.py"],
    "minillm/trainer.py": ["minillm/train/trainer.py", "minillm/train/setup.py"],
    "minillm/optim.py": ["minillm/train/optim.py"],
    "minillm/distributed.py": ["minillm/train/distributed.py"],
    "minillm/parallel.py": ["minillm/train/parallel.py"],
    "minillm/monitor.py": ["minillm/train/monitor.py", "minillm/runtime/progress.py"],
    "minillm/diagnostics.py": ["minillm/train/diagnostics.py"],
    "minillm/runtime.py": ["minillm/runtime/device.py", "minillm/runtime/perf.py"],
    "minillm/fsutil.py": ["minillm/runtime/files.py"],
    "minillm/progress.py": ["minillm/runtime/progress.py"],
    "minillm/perf.py": ["minillm/runtime/perf.py"],
}  # fmt: skip


def moved_target(doc: Path, target: str, name: str) -> str | None:
    """The link target that `name` of the moved file `target` has now (relative to `doc`)."""
    old = (doc.parent / target).resolve().relative_to(ROOT).as_posix()
    candidates = [ROOT / c for c in MOVED.get(old, [])]
    literal = re.compile(rf"(?<!\w){re.escape(name.removesuffix('()').split('.')[-1])}\b")
    for test in (lambda lines: find_definition(lines, name) is not None,
                 lambda lines: any(literal.search(line) for line in lines)):  # fmt: skip
        for path in candidates:
            if test(path.read_text().splitlines()):
                return os.path.relpath(path, doc.parent)
    return None


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
        if names and not path.is_file():
            target = moved_target(doc, target, names[0]) or target
            path = (doc.parent / target).resolve()
        if not names or not path.is_file():
            return m.group(0)
        lines = path.read_text().splitlines()
        span = anchor(lines, names[0], a, b)
        if span is None:
            print(f"{doc.name}: {names[0]} not found in {target}; left as is")
            return m.group(0)
        if span == (a, b) and target == m.group(2):
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
