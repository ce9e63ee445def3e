"""Training-step throughput of minillm's Transformer against Hugging Face's LlamaForCausalLM.

Both models get the same shape and the same weights (minillm/families/llama.py's mapping), the
same batch and the same optimizer, and their full training steps (forward with loss, backward,
clip_grad_norm_, AdamW, zero_grad) are timed alternately in one process: warm-up, then the
median of --steps steps each. MFU is model FLOPs (model.flops_per_token) over a square-matmul
peak probed between the steps of the same run (see minillm/runtime/perf.py).

    python scripts/bench_train.py                          # CPU fp32: two shapes, eager + compiled
    python scripts/bench_train.py --shapes small --compile no --profile
    python scripts/bench_train.py --shapes small,124m      # on a GPU: bf16 autocast, compiled too
    python scripts/bench_train.py --shapes large --compile no --checkpointing both   # memory

--checkpointing both adds a row per minillm row with train.activation_checkpointing on: the
peak memory column shows what it saves, tokens/s what the recompute costs.

--moe E,k adds a mixture-of-experts row (eager): E experts, each token through k of them, each
expert of width ffn_hidden / k, so its active parameters are the dense minillm row's (plus the
router); it trains with a load-balancing loss of 0.01. "vs dense" compares it to that row.

    python scripts/bench_train.py --shapes small --compile no --moe 8,2

Timings on a shared machine drift between runs; compare rows within one run, not across runs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import transformers

from minillm.config import ModelConfig
from minillm.families import from_hf_state_dict, hf_config_dict, to_hf_state_dict
from minillm.model import Transformer, use_cpu_kernels
from minillm.model.moe import load_balancing_loss, router_stats
from minillm.runtime.device import enable_tf32
from minillm.runtime.perf import (
    known_peak_flops,
    measure_matmul_peak,
    mfu,
    step_peak_bytes,
    synchronize,
)


@dataclasses.dataclass
class Shape:
    vocab: int
    d_model: int
    n_layer: int
    n_head: int
    seq: int
    batch: int
    gpu_batch: int  # a GPU has room for more tokens per step

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab,
            d_model=self.d_model,
            n_layer=self.n_layer,
            n_head=self.n_head,
            max_seq_len=self.seq,
            tie_embeddings=True,
        )


SHAPES = {
    "tiny": Shape(256, 64, 2, 4, 32, batch=2, gpu_batch=2),  # for the smoke test only
    "small": Shape(4096, 256, 4, 4, 256, batch=8, gpu_batch=64),
    # batch 2 on CPU keeps the default run to a few minutes (~1 s per step).
    "large": Shape(4096, 512, 8, 8, 512, batch=2, gpu_batch=32),
    # GPT-2-small-class: 124M parameters with a tied head (d 768, 12 layers, SwiGLU 2048).
    "124m": Shape(50304, 768, 12, 12, 1024, batch=1, gpu_batch=16),
}


@dataclasses.dataclass
class Row:
    """One model under test: its training step, and its timings."""

    name: str
    step: Callable[[], float]
    times: list[float] = dataclasses.field(default_factory=list)
    clean: list[float] = dataclasses.field(default_factory=list)  # steps not slowed by others
    first_loss: float = float("nan")
    warmup_s: float = 0.0
    peak_mem: float | None = None
    model: torch.nn.Module | None = None  # its own model (--moe): its parameters and FLOPs


def build_models(cfg: ModelConfig, device: torch.device) -> tuple[Transformer, torch.nn.Module]:
    """Our Transformer and an HF LlamaForCausalLM (sdpa) of shape cfg, same weights, fp32."""
    torch.manual_seed(0)
    ours = Transformer(cfg)  # our init (scaled residual projections), copied into HF
    hf_cfg = hf_config_dict(cfg, bos_id=0, eos_id=0)
    for key in ("architectures", "model_type", "torch_dtype"):
        hf_cfg.pop(key)
    hf_cfg["attn_implementation"] = "sdpa"
    hf_cfg["pad_token_id"] = None  # else nn.Embedding(padding_idx=0) drops a row's gradient
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours.state_dict(), cfg), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied: lm_head is embed_tokens
    assert not missing and not unexpected, (missing, unexpected)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))  # round trip: same weights
    return ours.to(device), hf.to(device)


def make_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; fused where torch has it (CUDA; CPU >= 2.4)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)


def make_step(
    model: torch.nn.Module,
    call: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    idx: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    autocast: bool,
) -> Callable[[], float]:
    """One full training step of `model`; returns the loss (a sync point, as a trainer's log)."""
    opt = make_optimizer(model, device)
    params = [p for p in model.parameters() if p.requires_grad]
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()

    def step() -> float:
        with ctx:
            loss = call(model, idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def call_ours(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(idx, targets)[1]


def call_hf(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # shift_labels: the loss of logits[t] against targets[t], as ours (no shift inside HF).
    return model(input_ids=idx, labels=targets, shift_labels=targets).loss


def static_bytes(model: torch.nn.Module) -> int:
    """Parameters and AdamW state (two moments) in bytes; gradients are transient (set_to_none)."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


# Operator name fragments -> the category a profile summary files them under (first match wins).
_CATEGORIES = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention (SDPA)", ("scaled_dot_product",)),
    ("optimizer + clipping", ("adam", "_foreach_", "vector_norm", "Optimizer.")),
    ("compiled fused kernels", ("CompiledFxGraph", "cpp_fused", "triton_")),
    ("loss", ("softmax", "nll_loss", "logsumexp", "CrossEntropy")),
)


def _category(name: str) -> str:
    for category, keys in _CATEGORIES:
        if any(k in name for k in keys):
            return category
    return "other (elementwise, copies, framework)"


def profile_rows(rows: list[Row], steps: int, top: int, device: torch.device) -> None:
    """Print where each row's step time goes: self time by category and by operator.

    The rows take turns, one profiled step each, `steps` times, and each operator's time is the
    minimum over its row's steps: this filters out other processes and, as the rows alternate,
    the machine's drift. CPU self time on CPU; on CUDA, device self time.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    bests: list[dict[str, tuple[float, int]]] = [{} for _ in rows]
    for _ in range(steps):
        for row, best in zip(rows, bests):
            with profile(activities=activities) as prof:
                row.step()
                synchronize(device)
            for e in prof.key_averages():
                us = e.self_device_time_total if cuda else e.self_cpu_time_total
                if e.key not in best or us < best[e.key][0]:
                    best[e.key] = (us, e.count)
    for row, best in zip(rows, bests):
        total = sum(us for us, _ in best.values())
        by_cat: dict[str, float] = {}
        for name, (us, _) in best.items():
            by_cat[_category(name)] = by_cat.get(_category(name), 0.0) + us
        print(f"\nprofile: {row.name}: {total / 1e3:.1f} ms/step of self time (per-op minima "
              f"over {steps} steps)")  # fmt: skip
        for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
            print(f"  {cat:40} {us / 1e3:8.1f} ms {us / total:6.1%}")
        print(f"  top {top} operators:")
        for name, (us, count) in sorted(best.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {name[:52]:52} {count:4d}x {us / 1e3:8.1f} ms {us / total:6.1%}")


class OtherLoad:
    """Share of the machine's CPUs that other processes used during an interval (Linux only).

    On a shared machine a step that another process slowed down says nothing about the model;
    such steps are counted, and re-run when possible (see --max-other).
    """

    def __init__(self) -> None:
        self.ok = os.path.exists("/proc/stat")
        self.hz = os.sysconf("SC_CLK_TCK") if self.ok else 100
        self.cpus = os.cpu_count() or 1

    def _snap(self) -> tuple[int, int, float]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        mine = int(fields[11]) + int(fields[12])  # utime + stime of all our threads
        return sum(ticks) - ticks[3] - ticks[4], mine, time.perf_counter()

    def start(self) -> tuple[int, int, float] | None:
        return self._snap() if self.ok else None

    def share(self, since: tuple[int, int, float] | None) -> float:
        if since is None:
            return 0.0
        busy, mine, t = self._snap()
        other = (busy - since[0]) - (mine - since[1])
        return max(0.0, other / self.hz / (self.cpus * (t - since[2])))


def bench_shape(name: str, args: argparse.Namespace, device: torch.device) -> None:
    shape = SHAPES[name]
    if args.batch:
        shape = dataclasses.replace(shape, batch=args.batch, gpu_batch=args.batch)
    batch = shape.gpu_batch if device.type == "cuda" else shape.batch
    cfg = shape.model_config()
    autocast = device.type == "cuda" and args.dtype == "bf16"

    ours, hf = build_models(cfg, device)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (batch, shape.seq + 1), generator=gen).to(device)
    idx, targets = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    flops = ours.flops_per_token(shape.seq)
    tokens = batch * shape.seq

    rows = [Row("HF Llama (sdpa)", make_step(hf, call_hf, idx, targets, device, autocast))]
    variants = [False, True] if args.checkpointing == "both" else [args.checkpointing == "yes"]
    for recompute in variants:
        suffix = " +ckpt" if recompute else ""
        # Each row trains its own copy: rows must not share weights or optimizer state.
        model = use_cpu_kernels(copy.deepcopy(ours))  # as the trainer builds it
        model.activation_checkpointing = recompute
        if args.compile in ("no", "both"):
            eager = copy.deepcopy(model) if args.compile == "both" else model
            step = make_step(eager, call_ours, idx, targets, device, autocast)
            rows.append(Row("minillm" + suffix, step))
        if args.compile in ("yes", "both"):
            compiled = torch.compile(model, mode=args.compile_mode)
            step = make_step(compiled, call_ours, idx, targets, device, autocast)
            rows.append(Row("minillm compiled" + suffix, step))

    if args.moe:
        E, k = (int(v) for v in args.moe.split(","))
        moe_cfg = dataclasses.replace(
            cfg, n_experts=E, n_experts_per_token=k, moe_ffn_hidden=cfg.ffn_hidden // k
        )
        torch.manual_seed(0)
        moe = use_cpu_kernels(Transformer(moe_cfg)).to(device)

        def call_moe(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor):
            loss = model(idx, targets)[1]
            return loss + 0.01 * load_balancing_loss(router_stats(model), E)  # of that forward

        rows.append(Row(f"minillm MoE {E}x{moe_cfg.moe_ffn_hidden} top-{k}",
                        make_step(moe, call_moe, idx, targets, device, autocast),
                        model=moe))  # fmt: skip

    if args.doc_mask:
        # Packed documents of 1..seq/4 tokens (mean ~seq/8): attention kept inside each one.
        lengths = torch.randint(1, max(2, shape.seq // 4), (batch, shape.seq), generator=gen)
        starts = torch.zeros(batch, shape.seq, dtype=torch.long)
        for r in range(batch):
            pos = torch.cumsum(lengths[r], 0)
            starts[r, pos[pos < shape.seq]] = 1
        doc_ids = torch.cumsum(starts, dim=1).to(device)  # (B, T)

        def call_doc(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor):
            return model(idx, targets, doc_ids=doc_ids)[1]

        doc_model = copy.deepcopy(ours)
        rows.append(Row("minillm doc_mask", make_step(doc_model, call_doc, idx, targets, device,
                                                      autocast)))  # fmt: skip

    dtype_name = "bf16 autocast" if autocast else "fp32"
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    print(
        f"\n== {name}: vocab {cfg.vocab_size}, d {cfg.d_model}, {cfg.n_layer} layers, "
        f"{cfg.n_head} heads, seq {shape.seq}, batch {batch} | {ours.param_count() / 1e6:.2f}M "
        f"params, {flops / 1e6:.1f} MFLOP/token | {device.type} {dtype_name}{threads}",
        flush=True,
    )

    for row in rows:  # warm-up (compiles), and the first loss of each: same model, same loss
        t0 = time.perf_counter()
        row.first_loss = float(row.step())
        for _ in range(args.warmup - 1):
            row.step()
        synchronize(device)
        row.warmup_s = time.perf_counter() - t0

    # Alternate the rows, rotating their order so that none always goes first, with a matmul peak
    # probe in each round: the peak is sampled over the same minutes as the steps. On CPU, a step
    # or probe during which other processes used more than --max-other of the CPUs is set aside,
    # and rounds continue (up to 3x --steps) until every row has --steps clean steps.
    load = OtherLoad() if device.type == "cpu" else None
    peak_dtype = _peak_dtype(args, device)
    probes, probes_clean = [], []
    for i in range(3 * args.steps):
        if i >= args.steps and all(len(r.clean) >= args.steps for r in rows):
            break
        order = rows[i % len(rows) :] + rows[: i % len(rows)]
        for row in order:
            synchronize(device)
            since = load.start() if load else None
            t0 = time.perf_counter()
            float(row.step())
            synchronize(device)
            dt = time.perf_counter() - t0
            row.times.append(dt)
            if load is None or load.share(since) <= args.max_other:
                row.clean.append(dt)
        since = load.start() if load else None
        probes.append(measure_matmul_peak(args.peak_seconds, peak_dtype, device))
        if load is None or load.share(since) <= args.max_other:
            probes_clean.append(probes[-1])
    for row in rows:
        model = row.model or (hf if row is rows[0] else ours)
        row.peak_mem = step_peak_bytes(row.step, device, static_bytes(model))

    peak = statistics.median(probes_clean or probes)
    datasheet = known_peak_flops(device, peak_dtype)
    n_all = len(rows[0].times)
    print(
        f"matmul peak (measured): {peak / 1e9:,.1f} GFLOP/s, the median of {len(probes_clean)} "
        f"clean probes of {args.peak_seconds:g} s, one per round"
        + (f"; datasheet {datasheet / 1e12:,.0f} TFLOP/s" if datasheet else "")
    )
    if load:
        dirty = sum(len(r.times) - len(r.clean) for r in rows)
        print(
            f"steps with other processes above {args.max_other:.0%} of the CPUs: {dirty} of "
            f"{n_all * len(rows)} (set aside; rows with fewer than 3 clean steps use all)"
        )
    ref = _typical(rows[0])
    header = (
        f"{'':22} {'ms/step':>8} {'min':>7} {'clean':>6} {'tokens/s':>9} {'vs HF':>6} "
        f"{'GFLOP/s':>8} {'MFU':>6}"
        + (f" {'MFU(ds)':>7}" if datasheet else "")
        + f" {'peak MiB':>9} {'warm-up s':>9} {'loss@0':>8}"
    )
    print(header)
    for row in rows:
        med = _typical(row)
        tps = tokens / med
        fl = row.model.flops_per_token(shape.seq) if row.model is not None else flops
        print(
            f"{row.name:22} {med * 1e3:8.1f} {min(row.times) * 1e3:7.1f} "
            f"{len(row.clean):>3}/{len(row.times):<2} {tps:9,.0f} {ref / med:5.2f}x "
            f"{fl * tps / 1e9:8.1f} {mfu(fl, tps, peak):6.1%}"
            + (f" {mfu(fl, tps, datasheet):7.1%}" if datasheet else "")
            + f" {row.peak_mem / 2**20:9.0f} {row.warmup_s:9.1f} {row.first_loss:8.5f}",
            flush=True,
        )

    dense = next((r for r in rows if r.name == "minillm"), None)
    for row in rows:
        if row.model is not None and dense is not None:
            params = f"{row.model.param_count() / 1e6:.2f}M params, "
            active = f"{row.model.active_param_count() / 1e6:.2f}M active"
            print(f"{row.name}: {params}{active}; vs dense "
                  f"(minillm, {ours.param_count() / 1e6:.2f}M): "
                  f"{_typical(dense) / _typical(row):.2f}x tokens/s, "
                  f"{row.peak_mem / dense.peak_mem:.2f}x peak memory")  # fmt: skip

    if args.profile:
        profile_rows(rows, args.profile_steps, args.profile_top, device)
    del rows, ours, hf
    gc.collect()


def _typical(row: Row) -> float:
    """The median step time: of the clean steps when there are at least 3, else of all."""
    return statistics.median(row.clean if len(row.clean) >= 3 else row.times)


def _peak_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" and args.dtype == "bf16" else torch.float32


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="small,large", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu or cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="on CUDA only")
    p.add_argument("--compile", choices=["both", "no", "yes"], default="both")
    p.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode, e.g. max-autotune-no-cudagraphs (default: inductor's default)",
    )
    p.add_argument(
        "--checkpointing",
        choices=["no", "yes", "both"],
        default="no",
        help="activation checkpointing in the minillm rows (both: a row with and one without)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per row first")
    p.add_argument("--batch", type=int, default=0, help="override the shape's batch size")
    p.add_argument("--threads", type=int, default=2, help="torch threads on CPU (0 = leave)")
    p.add_argument("--peak-seconds", type=float, default=0.25, help="per matmul peak probe")
    p.add_argument(
        "--max-other",
        type=float,
        default=0.1,
        help="CPU share of other processes above which a step is set aside",
    )
    p.add_argument(
        "--moe",
        default="",
        help="E,k: add a mixture-of-experts row, E experts of width ffn_hidden/k, top-k",
    )
    p.add_argument(
        "--doc-mask", action="store_true", help="add a row with train.doc_mask's packed documents"
    )
    p.add_argument("--profile", action="store_true", help="print an operator profile per row")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--profile-top", type=int, default=20)
    args = p.parse_args(argv)

    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    enable_tf32(device)  # as the trainer does
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python "
          f"{sys.version.split()[0]}; load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for name in args.shapes.split(","):
        bench_shape(name.strip(), args, device)


if __name__ == "__main__":
    main()
