"""What fits: the memory to run a model and to LoRA-, QLoRA- and fully fine-tune it, like the
"can I run it" tables (`minillm info`'s last rows and its `fits` key).

Offers `memory_fits(cfg, half, acts, device, run_dtype) -> dict` (nothing allocated: the model
is built on the meta device) and `fits_rows(fits)` (the table's rows). Bytes a process holds on
the device it runs on, per job, at train.seq_len tokens of context, batch 1; the training jobs
at the weights' dtype (`dtype`: bf16 where the run computes in half precision, else fp32), the
run at the dtype sampling loads the weights in (`run_dtype`: --dtype's; `dtype` when unknown):

- run: the weights (a tied head once) + the KV cache of one row at the context (2 x layers x
  kv heads x head dim per token; latent attention its kv_lora_rank + qk_rope_head_dim) + a
  prefill's working set (one layer's activations over the context and the last logits).
- lora: the frozen weights + the adapters (rank train.lora.rank, 16 if 0, on its targets) in
  fp32 with their gradients and AdamW's two moments (16 bytes each) + the activations of a
  training step (`minillm.info.activation_bytes`, with train.activation_checkpointing).
- qlora: as lora, but the blocks' linear layers (what `minillm.model.nf4` quantizes) at NF4's
  4 + 8/64 + 32/(64 x 256) bits a weight (codes, 8-bit block scales, their fp32 scales), the
  rest (embedding, head, norms) in the compute dtype (its breakdown line says how much), and
  one such layer dequantized at a time.
- full: minillm's mixed-precision training, fp32 weights, gradients and AdamW's moments (16
  bytes a parameter) + the activations; under bf16/fp16 autocast also its cast copy of the
  weights (2 bytes a parameter, kept for the backward; not measured: bf16 training stalls on
  this project's CPU). Off CUDA AdamW steps with foreach, whose sqrt of the second moments is
  a temporary of 4 bytes a parameter after the backward has freed the activations: the peak is
  the larger of the two, so `adamw_step` is what the temporary adds beyond them.
- framework, in every job: on a CPU the resident size of Python, torch and minillm imported and
  running (thread pools, kernels), measured as the peak RSS of the same job on a 2-layer d128
  model (torch 2.13, Linux, `scripts/bench_scale.py --shapes tiny`): 250 MiB to sample, 400
  MiB to train, 450 MiB for QLoRA (bitsandbytes imported too); on CUDA the CUDA context and
  its kernels, assumed 512 MiB (not measured here: no GPU), the host's memory not counted.

Checked against whole processes' peaks by `python scripts/bench_scale.py --info` (the
measured / estimate column; docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.config import Config, LoRAConfig
from minillm.model import Transformer
from minillm.model.lora import add_lora, trainable_frozen
from minillm.model.nf4 import BLOCK, linear_slots

# NF4 bytes per weight: 4-bit codes, a uint8 absmax per BLOCK weights, an fp32 scale per 256
# of those (bitsandbytes' double quantization).
NF4_BYTES = (4 + 8 / BLOCK + 32 / (BLOCK * 256)) / 8
ADAPTER_BYTES = 16  # fp32 weight, gradient and AdamW's two moments
GiB = 1024**3
# The framework's resident bytes on a CPU (module docstring: tiny jobs' measured peaks) and the
# CUDA context's assumed size on a GPU.
MiB = 1024**2
CPU_FRAMEWORK = {"run": 250 * MiB, "train": 400 * MiB}
CPU_BITSANDBYTES = 50 * MiB
CUDA_CONTEXT = 512 * MiB
# The dtypes a run may load its weights in (--dtype's), by the names the rows show.
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def kv_bytes_per_token(cfg: Config, weight_bytes: int) -> int:
    """One token's keys and values over every layer, in the weights' dtype."""
    m = cfg.model
    mla = m.attention == "mla"
    width = m.kv_lora_rank + m.qk_rope_head_dim if mla else 2 * m.n_kv_head * m.head_dim
    return m.n_layer * width * weight_bytes


def framework_bytes(device: str, job: str) -> int:
    """What a process of `job` (run, lora, qlora, full) holds beyond the model's own tensors on
    `device` (cpu, mps, cuda: the module docstring's framework term)."""
    if device.startswith("cuda"):
        return CUDA_CONTEXT
    base = CPU_FRAMEWORK["run" if job == "run" else "train"]
    return base + (CPU_BITSANDBYTES if job == "qlora" else 0)


def memory_fits(
    cfg: Config, half: bool, acts: int, device: str = "cpu", run_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Bytes to run, LoRA, QLoRA and fully fine-tune cfg's model on `device` (module docstring);
    `half`: training computes in bf16 (minillm.info.runs_half), so the frozen weights are held
    in 2 bytes; `acts`: a training step's activations of one sequence
    (minillm.info.activation_bytes); `run_dtype`: the dtype the run row's weights and KV cache
    are in (what `sample --dtype` loads; None: as training's, `half`)."""
    m, t = cfg.model, cfg.train
    wb = 2 if half else 4
    rb = wb if run_dtype is None else run_dtype.itemsize
    # Without train.lora: rank 16 where LoRA is built (an MoE's experts are not: attention only).
    default = ["wqkv", "wo"] if m.n_experts else t.lora.targets
    lora = t.lora if t.lora.rank else LoRAConfig(rank=16, targets=default)
    with torch.device("meta"):
        model = Transformer(m)
        params = model.param_count()
        quantized = sum(layer.weight.numel() for _, _, layer, _ in linear_slots(model))
        add_lora(model, lora)
        adapters, _ = trainable_frozen(model)
    T = t.seq_len
    widest = max((layer.in_features * layer.out_features for _, _, layer, _ in
                  linear_slots(model)), default=0)  # fmt: skip
    weights = params * wb
    run = {
        "weights": params * rb,
        "kv_cache": T * kv_bytes_per_token(cfg, rb),
        "activations": T * (4 * m.d_model + 2 * max(m.ffn_hidden, m.moe_ffn_hidden or 0)) * rb
        + m.vocab_size * 4,
    }
    tuned = {"adapters": adapters * ADAPTER_BYTES, "activations": acts}
    full = {"weights": params * ADAPTER_BYTES, "activations": acts}
    if half:  # autocast's cast copy of each weight, saved for the backward
        full["autocast_copies"] = params * 2
    if not device.startswith("cuda"):
        # AdamW's foreach step (minillm.train.optim, off CUDA) makes sqrt(v) for every parameter
        # at once: 4 bytes a parameter, when the step's activations are already freed.
        full["adamw_step"] = max(0, params * 4 - acts - full.get("autocast_copies", 0))
    jobs = {
        "run": run,
        "lora": {"weights": weights, **tuned},
        # The embedding, head and norms are never quantized: they stay in the compute dtype.
        "qlora": {
            "weights": round(quantized * NF4_BYTES + (params - quantized) * wb),
            **tuned,
            "dequantized": widest * wb,
        },
        "full": full,
    }
    for job, parts in jobs.items():
        parts["framework"] = framework_bytes(device, job)
        parts["total"] = sum(parts.values())
    return {
        "dtype": "bf16" if half else "fp32",
        # the run row's: the weights' dtype as sampling loads them (info --dtype)
        "run_dtype": ("bf16" if half else "fp32") if run_dtype is None else DTYPE_NAMES[run_dtype],
        "context": T,
        "lora_rank": lora.rank,
        "params": params,
        "params_nf4": quantized,
        "params_adapters": adapters,
        "device": "cuda" if device.startswith("cuda") else device,
        **jobs,
    }


def fits_rows(fits: dict[str, Any]) -> list[tuple[str, str]]:
    """The table rows of `memory_fits`: one per job, its total and the dtype it assumes (what
    it is made of, at which context: fits_lines)."""
    return [
        (f"fits: {short} ({dtype})", f"{fits[job]['total'] / GiB:.2f} GiB")
        for job, short, dtype, _ in _jobs(fits)
    ]


def fits_lines(fits: dict[str, Any]) -> list[str]:
    """One line per job of what its total is made of, printed below the table (a value a line
    at 80 columns: a breakdown in the table's cell would wrap)."""
    lines = []
    for job, short, _, detail in _jobs(fits):
        parts = ", ".join(
            f"{name.replace('_', ' ')} {value / GiB:.2f}"
            + (f" ({_unquantized(fits)})" if (job, name) == ("qlora", "weights") else "")
            for name, value in fits[job].items()
            if name != "total"
        )
        lines.append(f"{short} ({detail}): {parts} GiB")
    return lines


def _unquantized(fits: dict[str, Any]) -> str:
    """QLoRA's weights beyond the NF4 layers: the embedding, head and norms in the dtype."""
    b = (fits["params"] - fits["params_nf4"]) * (2 if fits["dtype"] == "bf16" else 4)
    return f"{fits['dtype']} embedding/head {b / GiB:.2f}"


def _jobs(fits: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(job, its row's label, the weights' dtype it assumes, what it assumes) of each job
    `memory_fits` sizes."""
    r, dtype, run = fits["lora_rank"], fits["dtype"], fits.get("run_dtype", fits["dtype"])
    autocast = ", bf16 autocast" if dtype == "bf16" else ""
    return [
        ("run", "run", run, f"{run}, {fits['context']:,} tokens, {fits['device']}"),
        ("lora", f"LoRA r{r}", f"{dtype} base", f"rank {r}, {dtype} base"),
        ("qlora", f"QLoRA r{r}", "NF4 base", f"rank {r}, NF4 base"),
        ("full", "full fine-tune", "fp32", f"AdamW, fp32 master weights{autocast}"),
    ]
