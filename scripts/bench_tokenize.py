"""Benchmark `minillm tokenize`: pipeline MB/s per worker count against raw `encode_batch_fast`,
and peak RSS as the corpus grows.

    .venv/bin/python scripts/bench_tokenize.py [--sizes-mb 10,100] [--repeats 3] [--num-proc 1,2]
                                               [--formats jsonl]   (jsonl,txt: both, twice as long)
                                               [--streaming]       (jsonl also read as a stream)

The corpus is the shipped Grimm stories (64 documents), repeated to each size, written either as
one JSONL file (loaded through `datasets`) or as a folder of .txt files (one document each). A
tokenizer (vocab 4096) is trained once beforehand, so every run measures loading, splitting,
encoding and writing shards, not BPE training.

- throughput, at the smallest size: the median over `--repeats` interleaved rounds of the
  pipeline (`prepare_data` in a fresh process with an empty datasets cache, so json -> arrow
  conversion included; imports excluded) for each `data.num_proc` in `--num-proc`, against raw
  `encode_batch` and `encode_batch_fast` (the tokenizer's own threads on every core) on the same
  documents already in memory, batched by ~1 MB like the pipeline. Ratios are medians of the
  per-round ratios. MB = 10^6 bytes of UTF-8 text.
- peak RSS, at every size and worker count: `prepare_data` in a fresh process, the peak RSS of
  the main process (ru_maxrss) and the largest RSS of a worker (sampled every 0.2 s). The main one
  includes a warm-up of ~40 MB (allocator arenas of the encoding threads) that is reached after
  ~15 MB of input and stays flat after that.

The machine's load is printed first: on a shared machine, numbers move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minillm.config import Config, config_from_dict  # noqa: E402
from minillm.tokenizer.bpe import load_tokenizer, save_tokenizer, train_tokenizer  # noqa: E402

STORIES = ROOT / "data" / "grimm_stories.jsonl"
VOCAB = 4096
RAW = ("raw encode_batch", "raw encode_batch_fast")


def make_corpus(folder: Path, size_mb: int, fmt: str) -> tuple[Path, list[str]]:
    """The stories repeated to at least size_mb MB, as one .jsonl or a folder of .txt files."""
    stories = [
        json.loads(line)["text"] for line in STORIES.read_text(encoding="utf-8").splitlines()
    ]
    docs, total = [], 0
    while total < size_mb * 1e6:
        for story in stories:
            docs.append(story)
            total += len(story.encode("utf-8"))
    if fmt == "jsonl":
        path = folder / f"corpus_{size_mb}mb.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
    else:
        path = folder / f"corpus_{size_mb}mb"
        path.mkdir()
        for i, doc in enumerate(docs):
            (path / f"{i:06d}.txt").write_bytes(doc.encode("utf-8"))
    return path, docs


def bench_config(source: Path, out_dir: Path, tokenizer: Path, keys: dict) -> Config:
    return config_from_dict(
        {
            "model": {"d_model": 64, "n_layer": 1, "n_head": 1},
            "data": {
                "source": str(source),
                "vocab_size": VOCAB,
                "out_dir": str(out_dir),
                "tokenizer": str(tokenizer),
                **keys,
            },
        }
    )


def child(source: str, out_dir: str, tokenizer: str, keys: str) -> None:
    """One pipeline run in this (fresh) process; prints its MB/s and peak RSS as JSON."""
    import datasets  # noqa: F401 - imported before the clock starts: an import is no throughput

    from minillm.data.tokenize_pass import write_shards as prepare_data

    worker_peak = [0.0]  # the largest VmRSS seen in a child process (a worker), in MB
    watching = threading.Event()

    def watch_workers() -> None:
        me = os.getpid()
        while not watching.wait(0.2):
            try:
                kids = Path(f"/proc/{me}/task/{me}/children").read_text().split()
            except OSError:
                return  # not Linux: no worker figure
            for kid in kids:
                try:
                    status = Path(f"/proc/{kid}/status").read_text()
                except OSError:
                    continue
                for line in status.splitlines():
                    if line.startswith("VmRSS:"):
                        worker_peak[0] = max(worker_peak[0], int(line.split()[1]) / 1024)

    watcher = threading.Thread(target=watch_workers, daemon=True)
    watcher.start()
    start = time.perf_counter()
    cfg = bench_config(Path(source), Path(out_dir), Path(tokenizer), json.loads(keys))
    summary = prepare_data(cfg)
    seconds = time.perf_counter() - start
    watching.set()
    total = summary["splits"]["total"]
    print(
        json.dumps(
            {
                "mb": total["bytes"] / 1e6,
                "mb_per_s": total["bytes"] / 1e6 / seconds,
                "pass_mb_per_s": total["mb_per_s"],
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "worker_rss_mb": worker_peak[0],
            }
        )
    )


def run_child(source: Path, out_dir: Path, tokenizer: Path, keys: dict) -> dict:
    """`child` in a fresh interpreter with its own (empty) datasets cache; the shards and the
    cache are deleted afterwards (a 1 GB corpus makes GBs of both)."""
    cache = out_dir.with_name(out_dir.name + "_hf")
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache))
    cmd = [sys.executable, __file__, "--child", str(source), str(out_dir), str(tokenizer)]
    done = subprocess.run([*cmd, json.dumps(keys)], env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"child failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def raw_mb_per_s(tok: object, docs: list[str], fast: bool) -> float:
    from minillm.data.encode_batches import BATCH_CHARS

    batches, batch, chars = [], [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= BATCH_CHARS:
            batches.append(batch)
            batch, chars = [], 0
    batches.append(batch)
    encode = tok.encode_batch_fast if fast else tok.encode_batch  # type: ignore[attr-defined]
    start = time.perf_counter()
    for b in batches:
        encode(b, add_special_tokens=False)
    seconds = time.perf_counter() - start
    return sum(len(d.encode("utf-8")) for d in docs) / 1e6 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="10,100", help="corpus sizes for peak RSS")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs (median)")
    parser.add_argument("--num-proc", default="1,2", help="data.num_proc values to compare")
    parser.add_argument("--formats", default="jsonl", help="jsonl and/or txt, e.g. jsonl,txt")
    parser.add_argument(
        "--streaming", action="store_true", help="also each num_proc with data.streaming (jsonl)"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    formats = args.formats.split(",")
    procs = [int(n) for n in args.num_proc.split(",")]

    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    print(f"cpus {os.cpu_count()}, load average {' '.join(load) or 'unknown'}")
    if load and float(load[0]) > 0.5 * (os.cpu_count() or 1):
        print("warning: the machine is busy; expect noisy numbers")

    with tempfile.TemporaryDirectory(prefix="bench_tokenize_") as tmp_name:
        tmp = Path(tmp_name)
        tokenizer = tmp / "tokenizer.json"
        text = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
        stories = STORIES.read_text(encoding="utf-8")
        save_tokenizer(train_tokenizer([text, stories], VOCAB), tokenizer)
        tok = load_tokenizer(tokenizer)

        rows = []
        for fmt in formats:
            source, docs = make_corpus(tmp, sizes[0], fmt)
            # Interleaved rounds, so that each ratio compares runs made under the same load.
            runs: dict[str, list[float]] = {}
            for i in range(args.repeats):
                # A stream needs its validation documents named: the first tenth of them.
                stream = {"streaming": True, "val_documents": len(docs) // 10}
                variants = [("", {})] + ([(", streamed", stream)] if args.streaming else [])
                for n in procs:
                    for name, keys in variants if fmt == "jsonl" else variants[:1]:
                        out = tmp / f"out_{fmt}_{i}_{n}{name and '_s'}"
                        child_run = run_child(source, out, tokenizer, {"num_proc": n, **keys})
                        runs.setdefault(f"pipeline, num_proc {n}{name}, whole call", []).append(
                            child_run["mb_per_s"]
                        )
                        runs.setdefault(f"pipeline, num_proc {n}{name}, encode pass", []).append(
                            child_run["pass_mb_per_s"]
                        )
                runs.setdefault(RAW[0], []).append(raw_mb_per_s(tok, docs, fast=False))
                runs.setdefault(RAW[1], []).append(raw_mb_per_s(tok, docs, fast=True))
            print(
                f"\nthroughput, {fmt}, {sizes[0]} MB, median of {args.repeats} interleaved rounds"
            )
            print("| what | MB/s | / raw encode_batch | / raw encode_batch_fast |")
            print("|---|---:|---:|---:|")
            for what, mb_s in runs.items():
                to_raw = [x / r for x, r in zip(mb_s, runs[RAW[0]])]
                to_fast = [x / r for x, r in zip(mb_s, runs[RAW[1]])]
                print(
                    f"| {what} | {statistics.median(mb_s):.2f} | "
                    f"{statistics.median(to_raw):.2f}x | {statistics.median(to_fast):.2f}x |"
                )
            del docs
            for size in sizes:
                if size != sizes[0]:
                    shutil.rmtree(source) if source.is_dir() else source.unlink()
                    source = make_corpus(tmp, size, fmt)[0]
                for n in procs:
                    out = tmp / f"rss_{fmt}_{size}_{n}"
                    run = run_child(source, out, tokenizer, {"num_proc": n})
                    rows.append((fmt, n, run))
                    print(f"  {fmt} {size} MB num_proc {n}: {run}", flush=True)

        print("\npeak RSS of prepare_data, each in a fresh process")
        print("| format | input MB | num_proc | MB/s | peak RSS MB, main | peak RSS MB, a worker |")
        print("|---|---:|---:|---:|---:|---:|")
        for fmt, n, r in rows:
            worker = f"{r['worker_rss_mb']:.0f}" if n > 1 else "-"
            print(
                f"| {fmt} | {r['mb']:.1f} | {n} | {r['mb_per_s']:.2f} | "
                f"{r['peak_rss_mb']:.0f} | {worker} |"
            )
        print(f"load average now {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
    else:
        main()
