"""The summary `minillm tokenize` returns and prints: per split and in total.

Offers `split_summary(documents, bytes, tokens, seconds)` and `print_summary(summary)`.
"""

from __future__ import annotations

from typing import Any


def split_summary(documents: int, nbytes: int, tokens: int, seconds: float) -> dict[str, Any]:
    return {
        "documents": documents,
        "bytes": nbytes,
        "tokens": tokens,
        "bytes_per_token": nbytes / tokens if tokens else 0.0,
        "seconds": seconds,
        "mb_per_s": nbytes / 1e6 / seconds if seconds > 0 else 0.0,
    }


def print_summary(summary: dict[str, Any]) -> None:
    """The table `minillm tokenize` prints: per split and in total, then what the numbers mean."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{summary['out_dir']} ({summary['dtype']}, vocab {summary['vocab_size']})")
    for name in ("split", "documents", "bytes", "tokens", "bytes/token", "shards", "MB/s"):
        table.add_column(name, justify="left" if name == "split" else "right")
    for name, s in summary["splits"].items():
        table.add_row(
            name,
            f"{s['documents']:,}",
            f"{s['bytes']:,}",
            f"{s['tokens']:,}",
            f"{s['bytes_per_token']:.2f}",
            f"{s.get('shards', 0):,}",
            f"{s['mb_per_s']:.1f}",
        )
    tok = summary["tokenizer"]
    how = f"trained in {tok['seconds']:.1f}s" if tok["trained"] else "reused"
    if tok.get("by_interrupted_run"):
        how = "trained by the interrupted run"
    if summary.get("resumed_documents"):
        how += f"; resumed after {summary['resumed_documents']:,} documents"
    console = Console(highlight=False)
    console.print(table)
    console.print(
        f"MB/s: per split, encoding only (one worker's pace when data.num_proc > 1); total, "
        f"the whole pass (read, encode, write). "
        f"Tokenizer {tok['path']} {how}; {summary['seconds']:.1f}s in all."
    )
