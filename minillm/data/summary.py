"""The summary `minillm tokenize` returns and prints: per split and in total.

Offers `split_summary(documents, bytes, tokens, seconds)`, `pass_splits` (every split's and the
total's, as minillm.data.tokenize_pass returns them) and `print_summary(summary)`.
"""

from __future__ import annotations

from typing import Any

from minillm.data.meta import SPLITS


def split_summary(documents: int, nbytes: int, tokens: int, seconds: float) -> dict[str, Any]:
    return {
        "documents": documents,
        "bytes": nbytes,
        "tokens": tokens,
        "bytes_per_token": nbytes / tokens if tokens else 0.0,
        "seconds": seconds,
        "mb_per_s": nbytes / 1e6 / seconds if seconds > 0 else 0.0,
    }


def pass_splits(
    stats: dict[str, dict[str, Any]],
    tokens: dict[str, int],
    shards: dict[str, int],
    pass_seconds: float,
    resumed_bytes: int,
) -> dict[str, dict[str, Any]]:
    """Per split and in total: documents, bytes, tokens, shards, pace, and the documents with
    invalid UTF-8 replaced or skipped. A split's seconds are
    its encoding time; the total's are the pass's, and its pace counts only the bytes this pass
    encoded, not those of the run it resumed (`resumed_bytes`)."""
    splits = {
        s: split_summary(stats[s]["documents"], stats[s]["bytes"], tokens[s], stats[s]["seconds"])
        for s in SPLITS
    }
    for s in SPLITS:
        splits[s]["shards"] = shards[s]
        # Documents with invalid UTF-8 (data.decode_errors): read with U+FFFD, or left out.
        splits[s]["replaced"], splits[s]["skipped"] = stats[s]["replaced"], stats[s]["skipped"]
    splits["total"] = split_summary(
        *(sum(splits[s][k] for s in SPLITS) for k in ("documents", "bytes", "tokens")),
        pass_seconds,
    )
    for k in ("shards", "replaced", "skipped"):
        splits["total"][k] = sum(splits[s][k] for s in SPLITS)
    encoded = splits["total"]["bytes"] - resumed_bytes
    splits["total"]["mb_per_s"] = encoded / 1e6 / max(pass_seconds, 1e-9)
    return splits


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
    console = Console(highlight=False, markup=False)  # paths are text: `out/[ab]` stays
    console.print(table)
    console.print(
        f"MB/s: per split, encoding only (one worker's pace when data.num_proc > 1); total, "
        f"the whole pass (read, encode, write). "
        f"Tokenizer {tok['path']} {how}; {summary['seconds']:.1f}s in all."
    )
    total = summary["splits"]["total"]
    if total.get("replaced") or total.get("skipped"):
        console.print(
            f"Documents with invalid UTF-8 (data.decode_errors): {total['replaced']:,} read with "
            f"U+FFFD in place of those bytes, {total['skipped']:,} left out."
        )
