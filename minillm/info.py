"""`minillm info`: sizes, FLOPs and a training-memory estimate of a config, without allocating it.

Offers `model_info(cfg) -> dict` and `print_info(info)`. The model is built on the meta device, so
a 7B config costs no RAM.
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.config import Config
from minillm.model import Transformer
from minillm.model.param_groups import split_summary

GiB = 1024**3


def model_info(cfg: Config, world_size: int = 1) -> dict[str, Any]:
    """Parameter counts, FLOPs per token and an approximate per-device training-memory budget."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    m, t = cfg.model, cfg.train
    params = model.param_count()
    # `auto` is bf16 on a GPU and fp32 on a CPU; where the run will happen is unknown here, so
    # it counts as a GPU run when this machine has one.
    half = t.precision in ("bf16", "fp16") or (t.precision == "auto" and torch.cuda.is_available())
    act_bytes = 2 if half else 4
    # Tensors autograd keeps per token and layer: norms, q/k/v (and rotated q/k), attention output,
    # the SwiGLU gate/up/product, residuals. Roughly 10 C + 3 K D + 4 F values; plus the logits and
    # their gradient in fp32. An estimate, good to about 20%.
    per_token_layer = 10 * m.d_model + 3 * m.n_kv_head * m.head_dim + 4 * m.ffn_hidden
    tokens = t.batch_size * t.seq_len
    activations = tokens * (m.n_layer * per_token_layer * act_bytes + 2 * m.vocab_size * 4)
    optimizers = split_summary(model, t)
    # fp32 state: AdamW keeps two moments per parameter, Muon one momentum buffer.
    state_bytes = sum((4 if o["optimizer"] == "muon" else 8) * o["params"] for o in optimizers)
    memory = {
        "weights": 4 * params,  # fp32 master weights, also under autocast
        "grads": 4 * params,
        "optimizer_state": state_bytes,
        "activations": activations,
    }
    memory["total"] = sum(memory.values())
    flops_token = model.flops_per_token(t.seq_len)
    global_batch = t.batch_size * t.grad_accum * world_size
    return {
        "params": params,
        "params_non_embedding": model.param_count(non_embedding=True),
        "flops_per_token": flops_token,
        "flops_per_step": flops_token * global_batch * t.seq_len,
        "tokens_per_step": global_batch * t.seq_len,
        "global_batch": global_batch,
        "world_size": world_size,
        "d_model": m.d_model,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_kv_head": m.n_kv_head,
        "head_dim": m.head_dim,
        "ffn_hidden": m.ffn_hidden,
        "vocab_size": m.vocab_size,
        "seq_len": t.seq_len,
        "optimizers": optimizers,
        "memory_bytes": memory,
    }


def _human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:g}{unit}"


def print_info(info: dict[str, Any], title: str = "model") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("parameters", f"{info['params']:,} ({_human(info['params'])})")
    table.add_row("parameters without embeddings", f"{info['params_non_embedding']:,}")
    shape = (
        f"d_model {info['d_model']}, {info['n_layer']} layers, {info['n_head']} heads "
        f"({info['n_kv_head']} kv), head dim {info['head_dim']}, ffn {info['ffn_hidden']}, "
        f"vocab {info['vocab_size']}"
    )
    table.add_row("shape", shape)
    table.add_row("FLOPs per token (train)", _human(info["flops_per_token"]))
    table.add_row(
        "tokens per step",
        f"{info['tokens_per_step']:,} (batch x accum x world = {info['global_batch']} seqs "
        f"of {info['seq_len']})",
    )
    table.add_row("FLOPs per step", _human(info["flops_per_step"]))
    for o in info["optimizers"]:
        table.add_row(
            f"optimizer: {o['optimizer']}",
            f"{_human(o['params'])} params in {o['tensors']} tensors: {o['what']} "
            f"(lr {o['lr']:g}, weight decay {o['weight_decay']:g})",
        )
    for name, value in info["memory_bytes"].items():
        table.add_row(f"memory: {name.replace('_', ' ')}", f"{value / GiB:.2f} GiB")
    Console().print(table)
