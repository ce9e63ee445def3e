"""Decode speed of minillm's `generate` against Hugging Face `generate` on the same weights.

Batch 1, a 16-token prompt, 256 new tokens, greedy, end-of-text ignored (both run all 256
steps). Both models hold the same random weights (minillm/families/llama.py's mapping); the two
are timed alternately in one process, and the median of --repeats runs of each is reported with
their ratio. Decode tokens/s counts the generated tokens over the whole call (prefill included:
16 tokens, small). The table also times the matrix-vector products alone (same weights, same
order, back to back): a practical floor for any fp32 decoder of these weights here, and so a
ceiling on the ratio.

    python scripts/bench_sample.py                      # CPU: the small and the medium shape
    python scripts/bench_sample.py --shapes small --repeats 3 --profile
    python scripts/bench_sample.py --threads 1          # steadier on a shared machine
    python scripts/bench_sample.py --shapes medium --threads 1 --rows 8   # + 8 rows at once

--int8 adds minillm with `--quantize int8` (minillm.model.quantize: the same weights, int8 copies
of the linear layers) and the int8 matrix-vector products alone (its ceiling, as the fp32 one);
--llama-cpp adds llama.cpp through llama-cpp-python on `minillm export --format gguf --dtype
q8_0` of the same weights (its own greedy sampler, the same prompt ids and --threads threads, an
f32 KV cache), the weights saved with a 2,048-token BPE of the shipped Shakespeare (ids past it
are padding tokens of the GGUF: the random prompt is ids, not text). --rows with --int8 times
int8's N rows against one too.

    python scripts/bench_sample.py --shapes medium,published --threads 1 --int8 --llama-cpp

--pinned COMMIT adds minillm as it was at COMMIT (default PINNED, below), imported beside
today's in the same process (scripts/pinned.py) and run on the same weights, alternating with
today's: a regression shows as a ratio above 1 whatever the machine's pace that day.
tests/test_decode_speed.py fails when the small shape's decode is over 1.15x PINNED's.

    python scripts/bench_sample.py --shapes small,medium --pinned 8b9e546

--rows N also times minillm's decoding core stepping N rows (N different prompts, one batched
forward a step) against one row, in the same process: what continuous batching can give
`minillm serve` at most, before HTTP and prompt prefills between steps.

Timings on a shared machine drift; the load average is printed before and after, and a warning
when it exceeds the threads this process uses; the CPU-time ratio (process CPU seconds of HF over
ours) suffers less from other processes than the wall-clock one. Compare rows within one run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import transformers
from bench_train import build_models  # scripts/ is on sys.path when run as a script
from pinned import pinned_minillm

from minillm.config import ModelConfig
from minillm.infer.engine import SamplingParams, generate
from minillm.model import Transformer

SHAPES = {
    "small": ModelConfig(
        vocab_size=4096, d_model=256, n_layer=4, n_head=4, n_kv_head=4, max_seq_len=512
    ),
    "medium": ModelConfig(
        vocab_size=16384, d_model=512, n_layer=8, n_head=8, n_kv_head=4, max_seq_len=512
    ),
    # A published model's shape (SmolLM-135M's: 49k vocabulary, tied head, 30 narrow layers).
    "published": ModelConfig(
        vocab_size=49152,
        d_model=576,
        n_layer=30,
        n_head=9,
        n_kv_head=3,
        ffn_hidden=1536,
        max_seq_len=512,
        tie_embeddings=True,
    ),
}


def alternate(sides: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Wall seconds of each side's call, `repeats` rounds of one call per side in turn, so that
    the machine's drift falls on every side alike."""
    wall: dict[str, list[float]] = {label: [] for label in sides}
    for _ in range(repeats):
        for label, fn in sides.items():
            start = time.perf_counter()
            fn()
            wall[label].append(time.perf_counter() - start)
    return wall


# The commit the decode-speed guard compares with: the decode step of issue 49 (the head's
# transposed copy). Move it forward only on purpose, after measuring that a slower step is
# the price of something (and say so in the commit).
PINNED = "fdd4e5e3944b"


def pinned_copy(model: Transformer, commit: str) -> Any:
    """The same model (weights, config) built by minillm at `commit` (scripts/pinned.py)."""
    pkg = pinned_minillm(commit)
    fields = {f.name for f in dataclasses.fields(pkg.config.ModelConfig)}
    cfg = {k: v for k, v in dataclasses.asdict(model.cfg).items() if k in fields}
    # model.rope_scaling's keys the commit has (longrope's factors came later)
    rope = pkg.config.ModelConfig.__dataclass_fields__["rope_scaling"].default_factory()
    rope_fields = {f.name for f in dataclasses.fields(rope)}
    cfg["rope_scaling"] = {k: v for k, v in cfg["rope_scaling"].items() if k in rope_fields}
    old = pkg.model.Transformer(pkg.config.ModelConfig(**cfg)).eval()
    old.load_state_dict(model.state_dict())
    return old


def pinned_ratio(
    shape: ModelConfig, commit: str = PINNED, prompt_len: int = 16, new: int = 128, pairs: int = 9
) -> tuple[float, float, float]:
    """Today's batch-1 greedy decode time over `commit`'s on the same weights in this process:
    the median of `pairs` alternating (pinned, today) runs of `new` tokens, each pair's ratio
    taken alone (a pair runs within a second, so the machine's pace cancels). Returns (ratio,
    today's ms per token, pinned's), the token times the medians."""
    ours, _ = build_pair(shape)
    old = pinned_copy(ours, commit)
    old_engine = pinned_minillm(commit).infer.engine
    prompt = torch.randint(
        1, shape.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    sides = {
        "pinned": lambda: old_engine.generate(old, [prompt], old_engine.SamplingParams.greedy(new)),
        "today": lambda: generate(ours, [prompt], SamplingParams.greedy(new)),
    }
    outs = {label: fn() for label, fn in sides.items()}  # warm-up
    if outs["pinned"] != outs["today"]:
        raise AssertionError(f"commit {commit} and today's code decode different greedy tokens")
    wall = alternate(sides, pairs)
    ratio = statistics.median(t / p for t, p in zip(wall["today"], wall["pinned"]))
    ms = {k: statistics.median(v) / new * 1e3 for k, v in wall.items()}
    return ratio, ms["today"], ms["pinned"]


def step_threads(shape: ModelConfig, int8: bool, new: int, pairs: int) -> tuple[float, float]:
    """minillm's batch-1 decode with one-row steps on one thread (the decoding core's choice
    under OMP_WAIT_POLICY=PASSIVE, minillm.runtime.device.one_row_threads) against torch's
    threads, alternating in this process: (ms per token on one thread, on torch's)."""
    import minillm.infer.engine as engine

    model, _ = build_pair(shape)
    if int8:
        model = int8_copy(model)
    prompt = list(range(1, 17))
    chosen = engine.one_row_threads

    def run(threads: int | None) -> None:
        engine.one_row_threads = lambda *_: threads
        generate(model, [prompt], SamplingParams.greedy(new))

    sides = {"one": lambda: run(1), "torch's": lambda: run(None)}
    try:
        for fn in sides.values():
            fn()  # warm-up
        wall = alternate(sides, pairs)
    finally:
        engine.one_row_threads = chosen
    one, many = (statistics.median(wall[k]) / new * 1e3 for k in sides)
    return one, many


def build_pair(shape: ModelConfig) -> tuple[Transformer, transformers.LlamaForCausalLM]:
    """Ours and HF's Llama with the same weights, as bench_train.py builds them, in eval mode."""
    ours, hf = build_models(shape, torch.device("cpu"))
    return ours.eval(), hf.eval()


def loadavg() -> float:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return float("nan")


def time_call(fn: Callable[[], int]) -> tuple[float, float, int]:
    """Wall seconds, process CPU seconds (all threads) and the tokens generated."""
    start, cpu = time.perf_counter(), time.process_time()
    n = fn()
    return time.perf_counter() - start, time.process_time() - cpu, n


def int8_copy(model: Transformer) -> Transformer:
    """`--quantize int8` of a copy of model (minillm.model.quantize)."""
    from minillm.model.quantize import quantize_int8

    int8 = copy.deepcopy(model)
    problem = quantize_int8(int8)
    if problem is not None:
        raise SystemExit(f"error: --int8: {problem}")
    return int8


def llama_cpp_q8(model: Transformer, folder: Path, threads: int, n_ctx: int) -> Any:
    """llama-cpp-python's Llama on `minillm export --format gguf --dtype q8_0` of model."""
    from llama_cpp import Llama

    from minillm.checkpoint.gguf_file import export_gguf
    from minillm.config import Config
    from minillm.tokenizer.bpe import train_tokenizer
    from minillm.tokenizer.conventions import Conventions

    root = Path(__file__).resolve().parent.parent
    text = (root / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:300_000]
    tokenizer = train_tokenizer([text], 2048)
    loaded = SimpleNamespace(  # what export_gguf reads of a loaded checkpoint
        path=folder,
        config=Config(model=model.cfg),
        model=model,
        tokenizer=tokenizer,
        tokenizer_path=None,  # not saved: the special ids come from the conventions alone
        conventions=Conventions.of_own(tokenizer),
    )
    gguf = export_gguf(loaded, folder / "model-q8_0.gguf", "q8_0", force=True)
    return Llama(
        model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
        type_k=0, type_v=0, verbose=False,
    )  # fmt: skip


def bench_shape(
    name: str,
    shape: ModelConfig,
    prompt_len: int,
    new: int,
    repeats: int,
    int8: bool = False,
    llama_cpp: bool = False,
) -> dict:
    ours, hf = build_pair(shape)
    prompt = torch.randint(
        1, shape.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1)
    )

    def run_ours() -> int:
        out = generate(ours, [prompt[0].tolist()], SamplingParams.greedy(new))
        return len(out[0])

    def run_hf() -> int:
        with torch.inference_mode():
            out = hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out.shape[1] - prompt_len

    # Same weights, same greedy tokens: a check that the comparison is fair.
    got = generate(ours, [prompt[0].tolist()], SamplingParams.greedy(32))
    with torch.inference_mode():
        ref = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None)
    same = got[0] == ref[0, prompt_len:].tolist()

    # The matrix-vector products of `new` tokens and nothing else: what decoding costs at best
    # with these weights in fp32 on this machine (both sides compute these products; HF splits
    # q/k/v and gate/up into more, smaller calls). Each in its fastest layout here, the
    # Decoder's: x @ W^T from a contiguous W^T for a layer wider than its input (q/k/v,
    # gate/up, the head), F.linear(x, W) for the others (minillm.model.decode._projection).
    weights = [
        w
        for b in ours.blocks
        for w in (b.attn.wqkv.weight, b.attn.wo.weight, b.ffn.w_gate_up.weight, b.ffn.w_down.weight)
    ]
    weights.append(ours.head_weight)
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    products = [
        partial(torch.mm, inputs[w.shape[1]], w.detach().t().contiguous())
        if w.shape[0] > w.shape[1]
        else partial(torch.nn.functional.linear, inputs[w.shape[1]], w)
        for w in weights
    ]

    @torch.inference_mode()
    def run_matvecs() -> int:
        for _ in range(new):
            for product in products:
                product()
        return new

    sides = {"minillm": run_ours, "hf": run_hf, "matvecs": run_matvecs}
    extra: dict[str, object] = {}
    if int8:
        quantized = int8_copy(ours)
        layers = [
            m for m in quantized.modules() if type(m).__name__ == "Int8Linear"
        ]  # every linear layer and the head
        inputs8 = {m.in_features: torch.randn(1, m.in_features) for m in layers}

        def run_int8() -> int:
            return len(generate(quantized, [prompt[0].tolist()], SamplingParams.greedy(new))[0])

        @torch.inference_mode()
        def run_int8_matvecs() -> int:
            for _ in range(new):
                for m in layers:
                    m(inputs8[m.in_features])
            return new

        sides.update(int8=run_int8, int8_matvecs=run_int8_matvecs)
        # A long prompt's prefill (the context's whole length, one forward): a matrix product
        # of T rows, where fp32's sgemm is compute-bound and int8 gains less or loses.
        long = torch.randint(1, shape.vocab_size, (1, shape.max_seq_len))
        for label, model in (("prefill_fp32", ours), ("prefill_int8", quantized)):

            @torch.inference_mode()
            def run_prefill(model: Transformer = model) -> int:
                model(long, last_only=True)
                return new

            sides[label] = run_prefill
        got8 = generate(quantized, [prompt[0].tolist()], SamplingParams.greedy(32))[0]
        extra["int8_agree"] = next(
            (i for i, (a, b) in enumerate(zip(got8, got[0])) if a != b), len(got8)
        )
    if llama_cpp:
        tmp = tempfile.TemporaryDirectory(prefix="bench-sample-")
        llm = llama_cpp_q8(ours, Path(tmp.name), torch.get_num_threads(), prompt_len + new + 8)
        ids = prompt[0].tolist()

        def run_llama() -> int:
            llm.reset()
            return len(list(itertools.islice(llm.generate(ids, temp=0.0), new)))

        sides["llama_cpp"] = run_llama
    for fn in sides.values():
        fn()  # warm-up
    wall: dict[str, list[float]] = {label: [] for label in sides}
    cpu: dict[str, list[float]] = {label: [] for label in sides}
    for _ in range(repeats):
        for label, fn in sides.items():
            seconds, cpu_seconds, n = time_call(fn)
            assert n == new, f"{label} generated {n} tokens, not {new}"
            wall[label].append(seconds)
            cpu[label].append(cpu_seconds)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    params = sum(p.numel() for p in ours.parameters())
    if llama_cpp:
        llm.close()
        tmp.cleanup()
    for label in ("int8", "int8_matvecs", "llama_cpp"):
        if label in med:
            extra[label] = new / med[label]
    if int8:
        extra["prefill_ms"] = (med["prefill_fp32"] * 1e3, med["prefill_int8"] * 1e3)
    return {
        **extra,
        "shape": name,
        "params": params,
        "minillm": new / med["minillm"],
        "hf": new / med["hf"],
        "matvecs": new / med["matvecs"],
        "ratio": med["hf"] / med["minillm"],
        "cpu_ratio": med_cpu["hf"] / med_cpu["minillm"],
        "same_tokens": same,
    }


def bench_rows(
    shape: ModelConfig, prompt_len: int, new: int, repeats: int, rows: int, int8: bool = False
) -> dict:
    """minillm's decoding core on `rows` prompts at once against the first of them alone (int8:
    the model's `--quantize int8` copy)."""
    ours, _ = build_pair(shape)
    if int8:
        ours = int8_copy(ours)
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(1, shape.vocab_size, (prompt_len,), generator=gen).tolist()
        for _ in range(rows)
    ]
    sides = {
        "one": lambda: generate(ours, prompts[:1], SamplingParams.greedy(new)),
        "many": lambda: generate(ours, prompts, SamplingParams.greedy(new)),
    }
    outs = {label: fn() for label, fn in sides.items()}  # warm-up, and the equality check
    wall = alternate(sides, repeats)
    one, many = (statistics.median(wall[k]) for k in ("one", "many"))
    return {
        "one": new / one,
        "many": rows * new / many,
        "step_ratio": many / one,
        "same": outs["many"][0] == outs["one"][0],
    }


def profile_ours(shape: ModelConfig, prompt_len: int, new: int) -> None:
    """Where minillm's decode time goes: the top operators of one generate call."""
    ours, _ = build_pair(shape)
    prompt = list(range(1, prompt_len + 1))
    generate(ours, [prompt], SamplingParams.greedy(8))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        generate(ours, [prompt], SamplingParams.greedy(new))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="small,medium", help=f"from {', '.join(SHAPES)}")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="profile minillm's decode loop")
    parser.add_argument(
        "--rows", type=int, default=0, help="also minillm with this many rows at once against one"
    )
    parser.add_argument("--int8", action="store_true", help="also minillm --quantize int8")
    parser.add_argument(
        "--llama-cpp", action="store_true", help="also llama-cpp-python on the q8_0 GGUF"
    )
    parser.add_argument(
        "--pinned",
        nargs="?",
        const=PINNED,
        default=None,
        help=f"also minillm at this commit, same process and weights (default {PINNED})",
    )
    parser.add_argument(
        "--step-threads",
        action="store_true",
        help="also one-row steps on one thread against torch's threads (fp32, and int8 with "
        "--int8)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0 = torch's default); 1 is "
        "steadier on a busy machine, where threads wait on each other",
    )
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    before = loadavg()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {threads} threads, "
        f"{os.cpu_count()} cores; loadavg {before:.2f}"
    )
    if before > threads:
        print(f"warning: load average {before:.2f} > {threads} threads: timings will be noisy")
    rows = []
    batched = {}
    pinned: dict[str, tuple[float, float, float]] = {}
    threaded: dict[str, tuple[float, float]] = {}
    for name in args.shapes.split(","):
        row = bench_shape(
            name,
            SHAPES[name],
            args.prompt_len,
            args.new_tokens,
            args.repeats,
            args.int8,
            args.llama_cpp,
        )
        rows.append(row)
        if args.rows > 1:
            batched[name] = bench_rows(
                SHAPES[name], args.prompt_len, args.new_tokens, args.repeats, args.rows
            )
            if args.int8:
                batched[f"{name} int8"] = bench_rows(
                    SHAPES[name], args.prompt_len, args.new_tokens, args.repeats, args.rows, True
                )
        if args.step_threads:
            for int8 in (False, True) if args.int8 else (False,):
                label = f"{name} int8" if int8 else name
                threaded[label] = step_threads(SHAPES[name], int8, args.new_tokens, args.repeats)
        if args.pinned:
            pinned[name] = pinned_ratio(
                SHAPES[name], args.pinned, args.prompt_len, args.new_tokens, max(args.repeats, 5)
            )
        if args.profile:
            profile_ours(SHAPES[name], args.prompt_len, args.new_tokens)
    after = loadavg()
    print(
        f"\nbatch 1, prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, "
        f"median of {args.repeats}; loadavg {before:.2f} -> {after:.2f}\n"
    )
    print(
        "| shape | params | minillm tok/s | HF generate tok/s | ratio | CPU-time ratio | same "
        "| matvecs alone tok/s | = HF x |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['params'] / 1e6:.1f}M | {r['minillm']:.0f} | {r['hf']:.0f} | "
            f"{r['ratio']:.2f}x | {r['cpu_ratio']:.2f}x | {'yes' if r['same_tokens'] else 'NO'} | "
            f"{r['matvecs']:.0f} | {r['matvecs'] / r['hf']:.2f}x |"
        )
    print(
        "\nmatvecs alone: only the fp32 matrix-vector products of each token (every linear layer "
        "and the head, back to back), no attention, norms or framework: a practical ceiling for "
        "any decoder of these weights here, and its ratio to HF one for the speed-up."
    )
    if args.int8 or args.llama_cpp:
        print(
            "\nint8 and llama.cpp, batch 1, same prompt ids and threads (int8 agrees: the "
            "greedy tokens of 32 equal to fp32's before the first difference):\n"
        )
        print(
            "| shape | minillm fp32 tok/s | minillm int8 tok/s | int8 / fp32 | int8 agrees "
            "| llama.cpp q8_0 tok/s | int8 / llama.cpp | HF generate tok/s | int8 matvecs alone "
            "tok/s | prefill of max_seq_len tokens fp32 / int8 ms |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            i8, lc, fp = r.get("int8"), r.get("llama_cpp"), r["minillm"]
            cells = [
                f"{fp:.0f}",
                f"{i8:.0f}" if i8 else "-",
                f"{i8 / fp:.2f}x" if i8 else "-",
                f"{r['int8_agree']} of 32" if i8 else "-",
                f"{lc:.0f}" if lc else "-",
                f"{i8 / lc:.2f}x" if i8 and lc else "-",
                f"{r['hf']:.0f}",
                f"{r['int8_matvecs']:.0f}" if i8 else "-",
                "{:.0f} / {:.0f}".format(*r["prefill_ms"]) if i8 else "-",
            ]
            print(f"| {r['shape']} | " + " | ".join(cells) + " |")
    if threaded:
        print(
            f"\none-row steps on one thread against {threads} (batch 1, greedy, "
            f"{args.new_tokens} tokens, median of {args.repeats} alternating pairs):\n"
        )
        print(f"| shape | 1 thread ms/token | {threads} threads ms/token | 1 / {threads} |")
        print("|---|---:|---:|---:|")
        for label, (one, many) in threaded.items():
            print(f"| {label} | {one:.3f} | {many:.3f} | {one / many:.2f}x |")
    if pinned:
        print(
            f"\ntoday's decode against commit {args.pinned}'s, same weights, alternating in this "
            f"process (batch 1, greedy, {args.new_tokens} tokens; median of the pairs' ratios):\n"
        )
        print(f"| shape | today ms/token | {args.pinned} ms/token | today / {args.pinned} |")
        print("|---|---:|---:|---:|")
        for name, (ratio, today, old) in pinned.items():
            print(f"| {name} | {today:.3f} | {old:.3f} | {ratio:.3f}x |")
    if batched:
        print(
            f"\nminillm's decoding core, {args.rows} different prompts at once against the first "
            f"alone (median of {args.repeats}):\n"
        )
        print(
            f"| shape | 1 row tok/s | {args.rows} rows tok/s | throughput ratio "
            "| step cost ratio | row 0 same |"
        )
        print("|---|---:|---:|---:|---:|---|")
        for name, r in batched.items():
            print(
                f"| {name} | {r['one']:.0f} | {r['many']:.0f} | {r['many'] / r['one']:.2f}x | "
                f"{r['step_ratio']:.2f}x | {'yes' if r['same'] else 'NO'} |"
            )


if __name__ == "__main__":
    main()
