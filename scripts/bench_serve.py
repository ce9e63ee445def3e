"""Continuous batching in `minillm serve`: N concurrent streaming clients against one at a time.

The same prompts go to a running server once one at a time, then from N = 1, 4, 8, 16
concurrent streaming clients (each client sends its next prompt when its stream ends). For each
it prints generated tokens/s over the whole run (the fastest of --rounds interleaved rounds),
time to first token and per-token latency (a stream's time from its first to its last token
over its tokens after the first: median and p95 over the streams), the throughput ratio to one
at a time, and whether every stream's text
equals its one-at-a-time text (greedy, so it must).

    python scripts/bench_serve.py                       # builds and serves a tiny.yaml model
    python scripts/bench_serve.py --shape medium        # bench_sample's 33.6M shape
    python scripts/bench_serve.py --ckpt runs/tiny      # serves a checkpoint of yours
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --api-key KEY   # a running server

Without --url it starts `minillm serve --max-batch 16` on a free port itself and stops it at the
end; without --ckpt the model has configs/tiny.yaml's shape with random weights (drawn with a
wide spread, so that greedy choices are not near-ties) and a tokenizer trained on the shipped
Shakespeare. The load average is printed: on a shared machine, compare rows of one run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
LINES = [
    line.strip()
    for line in (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8").splitlines()
    if len(line.strip()) > 20
]


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


# --shape: the demo model (configs/tiny.yaml, overhead-bound per token on 2 cores) or
# bench_sample.py's 33.6M medium shape, whose weights do not fit in cache, so a token is
# memory-bound and batching rows amortises reading the weights.
SHAPES = {
    "tiny": [],
    "medium": [
        "model.d_model=512",
        "model.n_layer=8",
        "model.n_head=8",
        "model.n_kv_head=4",
        "model.ffn_hidden=null",
        "model.max_seq_len=512",
        "model.vocab_size=16384",
        "train.seq_len=512",
    ],
}


def make_checkpoint(root: Path, shape: str = "tiny") -> Path:
    """A run of configs/tiny.yaml's model (or --shape medium) with random weights; its folder."""
    import torch

    from minillm.checkpoint.store import save_checkpoint
    from minillm.config import config_to_dict, load_config
    from minillm.data.tokenizer import save_tokenizer, train_tokenizer
    from minillm.model import Transformer

    text = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:300_000]
    tok_path = root / "tokenizer.json"
    save_tokenizer(train_tokenizer([text], 2048), tok_path)
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"data.tokenizer={tok_path}",
            f"train.out_dir={root / shape}",
            "train.device=cpu",
            *SHAPES[shape],
        ],
    )
    torch.manual_seed(0)
    model = Transformer(cfg.model).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    run = Path(cfg.train.out_dir)
    save_checkpoint(
        run,
        step=1,
        model_state=model.state_dict(),
        trainer_state={"step": 1},
        state={"config": config_to_dict(cfg), "tokens_seen": 0, "val_loss": 0.0},
        tokenizer_file=tok_path,
    )
    return run


def start_server(ckpt: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "minillm", "serve", "--ckpt", str(ckpt), "--port", "0"]
    cmd += ["--max-batch", str(max_batch), "--max-queue", "256", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    match = re.search(r"at (http://[^ ]+:\d+)", line)
    if match is None:
        proc.kill()
        sys.exit(f"error: the server printed no URL: {line!r}")
    url = match.group(1)
    for _ in range(300):
        try:
            request(url, "GET", "/health", None, None)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    sys.exit("error: the server did not answer /health")


def request(url: str, method: str, path: str, body: dict | None, key: str | None) -> dict:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, json.dumps(body).encode() if body else None, headers)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def stream(url: str, key: str | None, body: dict) -> dict:
    """One streaming completion: its text, tokens, time to first token and token latency."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    start = time.perf_counter()
    first = last = None
    text, tokens = [], 0
    try:
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), headers)
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                if c["text"]:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    text.append(c["text"])
    finally:
        conn.close()
    first = first if first is not None else time.perf_counter()
    last = last if last is not None else first
    per_token = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return {"text": "".join(text), "tokens": tokens, "ttft": first - start, "per_token": per_token}


def run_clients(url: str, key: str | None, bodies: list[dict], clients: int) -> dict:
    """Every body once, by `clients` threads each streaming one at a time."""
    results: list[dict | None] = [None] * len(bodies)
    nxt = iter(range(len(bodies)))
    lock = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            try:
                results[i] = stream(url, key, bodies[i])
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(str(e))
                return

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        sys.exit(f"error: {errors[0]}")
    done = [r for r in results if r is not None]
    return {"wall": wall, "results": done, "tokens": sum(r["tokens"] for r in done)}


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running minillm serve (default: start one)")
    ap.add_argument("--api-key", default=os.environ.get("MINILLM_API_KEY"))
    ap.add_argument("--ckpt", type=Path, help="serve this checkpoint (default: a tiny.yaml model)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="without --ckpt")
    ap.add_argument("--requests", type=int, default=32, help="prompts per run")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per completion")
    ap.add_argument("--clients", default="1,4,8,16", help="concurrent clients to try")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best counts")
    args = ap.parse_args()

    proc, tmp = None, None
    url = args.url
    if url is None:
        ckpt = args.ckpt
        if ckpt is None:
            tmp = tempfile.TemporaryDirectory(prefix="bench-serve-")
            ckpt = make_checkpoint(Path(tmp.name), args.shape)
        proc, url = start_server(ckpt, max_batch=16)
    try:
        model = request(url, "GET", "/v1/models", None, args.api_key)["data"][0]["id"]
        bodies = [
            {
                "model": model,
                "prompt": LINES[(37 * i) % len(LINES)],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for i in range(args.requests)
        ]
        print(f"{url}: model {model}, {args.requests} prompts x {args.max_tokens} tokens, greedy")
        print(f"load average before: {loadavg()} ({os.cpu_count()} CPUs)")
        run_clients(url, args.api_key, bodies[:2], 1)  # warm-up
        counts = [int(c) for c in args.clients.split(",")]
        # Rounds interleave the settings, so that a burst of load from other processes hits
        # them alike; each setting keeps its fastest round.
        best: dict[int, dict] = {}
        for _ in range(args.rounds):
            for n in [0, *counts]:  # 0: one at a time (one client, the reference texts)
                got = run_clients(url, args.api_key, bodies, max(n, 1))
                if (
                    n not in best
                    or got["tokens"] / got["wall"] > best[n]["tokens"] / best[n]["wall"]
                ):
                    best[n] = got
                texts = [r["text"] for r in best[0]["results"]]
                got["same"] = [r["text"] for r in got["results"]] == texts
        base = best[0]["tokens"] / best[0]["wall"]
        rows = [("one at a time", best[0], True)]
        rows += [(f"{n} concurrent", best[n], best[n]["same"]) for n in counts]
        print(
            "\n| clients | tokens/s | vs one at a time | TTFT median / p95 (ms) | "
            "per-token median / p95 (ms) | texts equal |\n|---|---|---|---|---|---|"
        )
        for name, r, same in rows:
            ttft = [x["ttft"] * 1e3 for x in r["results"]]
            per = [x["per_token"] * 1e3 for x in r["results"]]
            rate = r["tokens"] / r["wall"]
            print(
                f"| {name} | {rate:.0f} | {rate / base:.2f}x | "
                f"{statistics.median(ttft):.1f} / {quantile(ttft, 0.95):.1f} | "
                f"{statistics.median(per):.2f} / {quantile(per, 0.95):.2f} | "
                f"{'yes' if same else 'NO'} |"
            )
        print(f"\nload average after: {loadavg()}")
        if not all(same for _, _, same in rows):
            sys.exit("error: a stream's text differs from its one-at-a-time text")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
