"""Continuous batching in `minillm serve`: N concurrent streaming clients against one at a time,
and llama.cpp's own server on the GGUF of the same weights, side by side.

The same prompts go to a running server once one at a time, then from N = 1, 4, 8, 16
concurrent streaming clients (each client sends its next prompt when its stream ends). For each
it prints generated tokens/s over the whole run (the fastest of --rounds interleaved rounds),
time to first token and per-token latency (a stream's time from its first to its last token
over its tokens after the first: median and p95 over the streams), the throughput ratio to one
at a time, and whether every stream's text equals its one-at-a-time text (greedy, so it must).

    python scripts/bench_serve.py                       # builds and serves a tiny.yaml model
    python scripts/bench_serve.py --shape medium        # bench_sample's 33.6M shape
    python scripts/bench_serve.py --ckpt runs/tiny      # serves a checkpoint of yours
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --api-key KEY   # a running server
    python scripts/bench_serve.py --no-llama-cpp        # minillm's rows only
    python scripts/bench_serve.py --shape medium --quantize none,int8 --gguf-dtype q8_0
    python scripts/bench_serve.py --shape medium --quantize int8 --gguf-dtype q8_0 \
        --llama-server PATH/llama-server                # llama.cpp's C++ server, 8 slots

--quantize none,int8 serves the checkpoint twice, `minillm serve` without and with `--quantize
int8`, one server after the other in the same rounds (each server's texts compared with its own
one-at-a-time texts; llama.cpp's with the first's). --gguf-dtype q8_0 gives llama.cpp 8-bit
weights too (default f32). --llama-server PATH runs llama.cpp's own C++ server instead of
llama-cpp-python's (`-np` parallel slots = the most clients, continuous batching, the same
threads, an f32 KV cache; built from the llama.cpp sources inside llama-cpp-python's sdist:
`cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-server`).

Without --url it starts `minillm serve --max-batch 16` on a free port itself and stops it at the
end; without --ckpt the model has configs/tiny.yaml's shape with random weights (drawn with a
wide spread, so that greedy choices are not near-ties) and a tokenizer trained on the shipped
Shakespeare. The load average is printed: on a shared machine, compare rows of one run.

The llama.cpp rows (on by default when llama-cpp-python and its `[server]` extra import; `make
interop` builds the first, `pip install 'llama-cpp-python[server]==VERSION'` adds the second):
the checkpoint goes through `minillm export --format gguf --dtype f32`, and llama-cpp-python's
OpenAI server (`python -m llama_cpp.server`) serves it with an f32 KV cache (llama.cpp's default
is f16), a context of the model's max_seq_len and --interrupt_requests False (by default it
cancels the running stream when another request arrives). It gets the same streamed
/v1/completions, greedy, with repeat_penalty 1 (its default is 1.1) and the prompt after
`<|endoftext|>` (minillm serve starts every completion prompt with it; llama.cpp adds nothing,
the GGUF says add_bos false). That server decodes one request at a time behind a lock: N
concurrent clients queue, so its rows show queueing, not batching. Its stream carries no usage,
so each prompt's token count comes from one non-streamed pass before the timed ones (which also
warms it up). Its texts are compared with minillm's one-at-a-time texts after dropping U+FFFD
(bytes that are no UTF-8: minillm prints U+FFFD, llama-cpp-python drops them); "longer" means
it ran past max_tokens to finish a character split across tokens, as it does.

Both servers get the same --threads CPU threads (default: every CPU this process may use): torch's
intra-op threads (OMP_NUM_THREADS) for minillm serve, which alone would take one fewer to leave
a core to its event loop, and --n_threads / --n_threads_batch for llama.cpp.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
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
    # bench_sample.py's published shape (SmolLM-135M's): 49k vocabulary, tied, 30 layers.
    "published": [
        "model.d_model=576",
        "model.n_layer=30",
        "model.n_head=9",
        "model.n_kv_head=3",
        "model.ffn_hidden=1536",
        "model.max_seq_len=512",
        "model.vocab_size=49152",
        "model.tie_embeddings=true",
        "train.seq_len=512",
    ],
}


def make_checkpoint(root: Path, shape: str = "tiny") -> Path:
    """A run of configs/tiny.yaml's model (or --shape medium) with random weights; its folder."""
    import torch

    from minillm.checkpoint.store import save_checkpoint
    from minillm.config import config_to_dict, load_config
    from minillm.model import Transformer
    from minillm.tokenizer.bpe import save_tokenizer, train_tokenizer

    text = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:300_000]
    tok_path = root / "tokenizer.json"
    tokenizer = train_tokenizer([text], 2048)
    save_tokenizer(tokenizer, tok_path)
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
        # Rows past the tokenizer's (medium pads 2048 tokens to 16384) get zero logits, as weight
        # decay leaves a trained model's: minillm never picks them, llama.cpp would.
        for p in model.parameters():  # tok_emb and lm_head (None when tied)
            if p.shape[0] == cfg.model.vocab_size:
                p[tokenizer.get_vocab_size() :] = 0.0
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


def start_server(
    ckpt: Path, max_batch: int, threads: int, quantize: str = "none"
) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "minillm", "serve", "--ckpt", str(ckpt), "--port", "0"]
    cmd += ["--max-batch", str(max_batch), "--max-queue", "256", "--device", "cpu"]
    cmd += ["--quantize", quantize]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
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


# llama-cpp-python's `[server]` extra: the modules `python -m llama_cpp.server` imports.
LLAMA_SERVER_MODULES = [
    "fastapi",
    "uvicorn",
    "sse_starlette",
    "starlette_context",
    "pydantic_settings",
]


def llama_cpp_missing() -> str | None:
    """Why llama.cpp's server cannot run here (None: it can)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (`make interop` builds it)"
    missing = [m for m in LLAMA_SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        from importlib.metadata import version

        pin = f"llama-cpp-python[server]=={version('llama_cpp_python')}"
        extra = ", ".join(missing)
        return f"llama-cpp-python's [server] extra is missing ({extra}): pip install '{pin}'"
    return None


def export_gguf(ckpt: Path, out: Path, dtype: str = "f32") -> int:
    """`minillm export --format gguf --dtype DTYPE` of `ckpt` to `out`; the model's context."""
    cmd = [sys.executable, "-m", "minillm", "export", "--ckpt", str(ckpt), "--format", "gguf"]
    cmd += ["--dtype", dtype, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(done.stderr.strip() or f"error: {out}: minillm export failed")
    from gguf import GGUFReader

    return int(GGUFReader(out).fields["llama.context_length"].contents())


def start_llama_cpp(
    gguf: Path, n_ctx: int, threads: int, log: Path
) -> tuple[subprocess.Popen, str]:
    """llama-cpp-python's OpenAI server on `gguf`, on a free port; its output goes to `log`."""
    with socket.socket() as sock:  # a free port (released before the server binds it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--n_ctx", str(n_ctx), "--n_batch", str(n_ctx)]
    cmd += ["--n_ubatch", str(n_ctx), "--n_threads", str(threads)]
    cmd += ["--n_threads_batch", str(threads), "--type_k", "0", "--type_v", "0"]  # 0: f32
    cmd += ["--interrupt_requests", "False", "--verbose", "False"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    return wait_ready(proc, url, log, "llama_cpp.server", "/v1/models", lambda answer: True)


def start_llama_server(
    binary: Path, gguf: Path, n_ctx: int, threads: int, slots: int, log: Path
) -> tuple[subprocess.Popen, str]:
    """llama.cpp's own C++ server on `gguf` with `slots` parallel slots (continuous batching),
    each slot the model's whole context, an f32 KV cache; on a free port, output to `log`."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", str(n_ctx * slots), "-np", str(slots), "-t", str(threads), "-tb", str(threads)]
    cmd += ["-ctk", "f32", "-ctv", "f32", "--no-warmup"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    return wait_ready(
        proc, url, log, "llama-server", "/health", lambda answer: answer.get("status") == "ok"
    )


def wait_ready(
    proc: subprocess.Popen, url: str, log: Path, name: str, path: str, ready: Callable[[dict], bool]
) -> tuple[subprocess.Popen, str]:
    """(proc, url) once GET `path` answers and `ready(answer)` holds; a server that exits, or
    has not answered in a minute, ends the benchmark with one line (its log's last lines)."""
    for _ in range(600):
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            sys.exit(f"error: {name} exited ({proc.returncode}): " + " | ".join(tail))
        try:
            if ready(request(url, "GET", path, None, None)):
                return proc, url
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"error: {name} did not answer {path}")


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


def stream(url: str, key: str | None, body: dict, tokens: int = 0) -> dict:
    """One streaming completion: its text, tokens, time to first token and token latency.
    `tokens`: the count when the stream carries no usage (llama.cpp's)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    start = time.perf_counter()
    first = last = None
    text: list[str] = []
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


def run_clients(
    url: str, key: str | None, bodies: list[dict], clients: int, tokens: list[int] | None = None
) -> dict:
    """Every body once, by `clients` threads each streaming one at a time; `tokens`: each
    body's token count where the stream does not say it."""
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
                results[i] = stream(url, key, bodies[i], tokens[i] if tokens else 0)
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


def same_text(ours: str, theirs: str, llama: bool) -> str:
    """'yes' when equal; for llama.cpp after dropping minillm's U+FFFD, and 'longer' when it ran
    past max_tokens to finish a split character; 'NO' otherwise."""
    if not llama:
        return "yes" if theirs == ours else "NO"
    ours = ours.replace("\ufffd", "")
    return "yes" if theirs == ours else "longer" if theirs.startswith(ours) else "NO"


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
    ap.add_argument(
        "--llama-cpp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also llama.cpp's server on the f32 GGUF (default: when llama-cpp-python and its "
        "[server] extra import; with --url it needs --ckpt, the served checkpoint)",
    )
    ap.add_argument(
        "--quantize",
        default="none",
        help="minillm serve --quantize values to run, comma-separated (none,int8: both)",
    )
    ap.add_argument("--gguf-dtype", default="f32", choices=["f32", "f16", "q8_0"])
    ap.add_argument(
        "--llama-server",
        type=Path,
        help="llama.cpp's C++ llama-server binary: run it (slots = the most clients) instead of "
        "llama-cpp-python's server",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2,
        help="CPU threads for each server (default: the CPUs this process may use)",
    )
    args = ap.parse_args()

    missing = None if args.llama_server else llama_cpp_missing()
    if args.llama_cpp and missing:
        sys.exit(f"error: --llama-cpp: {missing}")
    if args.llama_cpp and args.url and args.ckpt is None:
        sys.exit("error: --llama-cpp: with --url, give --ckpt (the served checkpoint) to export")
    if args.llama_cpp is None:
        args.llama_cpp = missing is None and not (args.url and args.ckpt is None)
        if missing:
            print(f"note: no llama.cpp rows: {missing}")

    procs: list[subprocess.Popen] = []
    tmp = tempfile.TemporaryDirectory(prefix="bench-serve-")
    url = args.url
    try:
        ckpt = args.ckpt
        if ckpt is None and (url is None or args.llama_cpp):
            ckpt = make_checkpoint(Path(tmp.name), args.shape)
        quantize = args.quantize.split(",")
        urls = {}
        if url is None:
            for q in quantize:
                proc, urls[q] = start_server(ckpt, max_batch=16, threads=args.threads, quantize=q)
                procs.append(proc)
            url = urls[quantize[0]]
        else:
            urls = {quantize[0]: url}
        model = request(url, "GET", "/v1/models", None, args.api_key)["data"][0]["id"]
        prompts = [LINES[(37 * i) % len(LINES)] for i in range(args.requests)]
        bodies = [
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for prompt in prompts
        ]
        # (label, url, key, bodies, token counts when the stream has none)
        servers: list[tuple[str, str, str | None, list[dict], list[int] | None]] = [
            (f"minillm {q}" if len(urls) > 1 or q != "none" else "minillm", u, args.api_key,
             bodies, None)
            for q, u in urls.items()
        ]  # fmt: skip
        print(f"{url}: model {model}, {args.requests} prompts x {args.max_tokens} tokens, greedy")
        if args.llama_cpp:
            from minillm.tokenizer.bpe import EOT

            gguf = Path(tmp.name) / f"model-{args.gguf_dtype}.gguf"
            n_ctx = export_gguf(ckpt, gguf, args.gguf_dtype)
            log = Path(tmp.name) / "log"
            slots = max(int(c) for c in args.clients.split(","))
            if args.llama_server:
                proc, llama_url = start_llama_server(
                    args.llama_server, gguf, n_ctx, args.threads, slots, log
                )
            else:
                proc, llama_url = start_llama_cpp(gguf, n_ctx, args.threads, log)
            procs.append(proc)
            llama_bodies = [
                {
                    "prompt": EOT + prompt,  # minillm serve's prompt ids, special token parsed
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "repeat_penalty": 1.0,
                    "stream": True,
                }
                for prompt in prompts
            ]
            # Its token counts (no usage in its stream): one non-streamed pass, also a warm-up.
            counts = [
                request(llama_url, "POST", "/v1/completions", {**b, "stream": False}, None)[
                    "usage"
                ]["completion_tokens"]
                for b in llama_bodies
            ]
            if args.llama_server:
                servers.append(("llama-server", llama_url, None, llama_bodies, counts))
                print(
                    f"{llama_url}: llama.cpp's llama-server on {gguf.name} ({args.gguf_dtype} "
                    f"weights, f32 KV cache, {slots} slots of n_ctx {n_ctx}, continuous batching)"
                )
            else:
                servers.append(("llama-cpp-python", llama_url, None, llama_bodies, counts))
                print(
                    f"{llama_url}: llama-cpp-python's server on {gguf.name} ({args.gguf_dtype} "
                    f"weights, f32 KV cache, n_ctx {n_ctx}); one request at a time, the rest queue"
                )
        print(f"each server: {args.threads} CPU threads")
        print(f"load average before: {loadavg()} ({os.cpu_count()} CPUs)")
        for _, u, key, bs, counts in servers:
            run_clients(u, key, bs[:2], 1, counts)  # warm-up
        clients = [int(c) for c in args.clients.split(",")]
        # Rounds interleave the settings (and the servers), so that a burst of load from other
        # processes hits them alike; each setting keeps its fastest round. Client count 0: one
        # at a time (one client; minillm's are the reference texts).
        best: dict[tuple[str, int], dict] = {}
        # (prompts whose text differs, llama.cpp's that ran on), the most over the rounds
        same: dict[tuple[str, int], tuple[int, int]] = {}
        # Each minillm server's one-at-a-time texts are its reference; llama.cpp's is the first's.
        references: dict[str, list[str]] = {}
        for _ in range(args.rounds):
            for label, u, key, bs, counts in servers:
                for n in [0, *clients]:
                    got = run_clients(u, key, bs, max(n, 1), counts)
                    texts = [r["text"] for r in got["results"]]
                    llama = not label.startswith("minillm")
                    if not llama:
                        references.setdefault(label, texts)
                    reference = references[label if not llama else servers[0][0]]
                    verdicts = [same_text(o, t, llama) for o, t in zip(reference, texts)]
                    nos, longer = same.get((label, n), (0, 0))
                    same[(label, n)] = (
                        max(nos, verdicts.count("NO")),
                        max(longer, verdicts.count("longer")),
                    )
                    if "NO" in verdicts and (label, n) not in best:
                        i = verdicts.index("NO")
                        print(
                            f"note: {label}, {n or 'one at a time'} clients: prompt {i} gives "
                            f"{texts[i][:60]!r}, minillm one at a time {reference[i][:60]!r}"
                        )
                    setting = (label, n)
                    if setting not in best or got["tokens"] / got["wall"] > (
                        best[setting]["tokens"] / best[setting]["wall"]
                    ):
                        best[setting] = got
        first = servers[0][0]
        base = best[(first, 0)]["tokens"] / best[(first, 0)]["wall"]
        print(
            f"\n| server | clients | tokens/s | vs {first} one at a time | vs its own one at a "
            "time | TTFT median / p95 (ms) | per-token median / p95 (ms) | texts equal |"
            "\n|---|---|---|---|---|---|---|---|"
        )
        for label, *_ in servers:
            own = best[(label, 0)]["tokens"] / best[(label, 0)]["wall"]
            for n in [0, *clients]:
                r = best[(label, n)]
                ttft = [x["ttft"] * 1e3 for x in r["results"]]
                per = [x["per_token"] * 1e3 for x in r["results"]]
                rate = r["tokens"] / r["wall"]
                nos, longer = same[(label, n)]
                verdict = f"NO: {nos} of {len(prompts)}" if nos else "yes"
                verdict += f" ({longer} of {len(prompts)} longer)" if longer else ""
                print(
                    f"| {label} | {f'{n} concurrent' if n else 'one at a time'} | {rate:.0f} | "
                    f"{rate / base:.2f}x | {rate / own:.2f}x | "
                    f"{statistics.median(ttft):.1f} / {quantile(ttft, 0.95):.1f} | "
                    f"{statistics.median(per):.2f} / {quantile(per, 0.95):.2f} | {verdict} |"
                )
        print(f"\nload average after: {loadavg()}")
        if any(same[(label, n)][0] for label, *_ in servers[: len(urls)] for n in [0, *clients]):
            sys.exit("error: a minillm stream's text differs from its one-at-a-time text")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        tmp.cleanup()


if __name__ == "__main__":
    main()
