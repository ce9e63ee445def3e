"""`minillm info`: sizes, FLOPs and a training-memory estimate of a config, without allocating it.

Offers `model_info(cfg) -> dict` and `print_info(info)`. The model is built on the meta device, so
a 7B config costs no RAM. With train.lora the adapters are added, and the memory is that of a
LoRA run: gradients and optimizer state for the adapters only.
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.config import Config
from minillm.fits import fits_rows, memory_fits
from minillm.model import Transformer
from minillm.model.lora import add_lora, trainable_frozen
from minillm.model.param_groups import split_summary

GiB = 1024**3


def activation_bytes(cfg: Config, half: bool, checkpointing: bool) -> int:
    """Activation memory of one sequence of train.seq_len tokens in a training step.

    Tensors autograd keeps per token and layer: norms, q/k/v (and rotated q/k), attention output,
    the SwiGLU gate/up/product, residuals. Roughly 10 C + 3 K D + 4 F values; plus the logits and
    their gradient in fp32. With activation checkpointing only each block's input (fp32, the
    residual stream) is kept, and one block's activations live at a time during the recompute.
    A mixture of experts keeps 4 F for each of the k experts a token goes through and its k
    gathered inputs and weighted outputs (3 k C), and 4 S for a shared expert of width S (its
    dense blocks, model.moe_dense_layers, counted as MoE blocks). An estimate, good to about 20%.
    """
    m, t = cfg.model, cfg.train
    act = 2 if half else 4
    per_token_layer = 10 * m.d_model + 3 * m.n_kv_head * m.head_dim + 4 * m.ffn_hidden
    if m.n_experts:
        k = m.n_experts_per_token
        per_token_layer += 4 * (k * m.moe_ffn_hidden - m.ffn_hidden) + 3 * k * m.d_model
        per_token_layer += 4 * m.moe_shared_ffn_hidden
    blocks = (m.n_layer * 4 * m.d_model + per_token_layer * act) if checkpointing else (
        m.n_layer * per_token_layer * act
    )  # fmt: skip
    return t.seq_len * (blocks + 2 * m.vocab_size * 4)


def static_bytes(
    params: int, optimizers: list[dict[str, Any]], trainable: int | None = None
) -> dict[str, int]:
    """fp32 master weights (also under autocast), gradients and the optimizers' fp32 state:
    AdamW keeps two moments per parameter, Muon one momentum buffer (`split_summary` rows).
    Gradients only for the `trainable` parameters (train.lora: the adapters; default all)."""
    state = sum((4 if o["optimizer"] == "muon" else 8) * o["params"] for o in optimizers)
    grads = params if trainable is None else trainable
    return {"weights": 4 * params, "grads": 4 * grads, "optimizer_state": state}


def runs_half(cfg: Config) -> bool:
    """Whether activations are 16-bit. `auto` is bf16 on a GPU and fp32 on a CPU; where the run
    will happen is unknown here, so it counts as a GPU run when this machine has one."""
    p = cfg.train.precision
    return p in ("bf16", "fp16") or (p == "auto" and torch.cuda.is_available())


def model_info(cfg: Config, world_size: int = 1) -> dict[str, Any]:
    """Parameter counts, FLOPs per token and an approximate per-device training-memory budget.

    With train.batch_size: auto the micro-batch is unknown until the run: memory is for one
    sequence, and the global batch is train.batch_tokens.
    """
    with torch.device("meta"):
        model = Transformer(cfg.model)
        if cfg.train.lora.rank:
            add_lora(model, cfg.train.lora)
    m, t = cfg.model, cfg.train
    params = model.param_count()
    trainable, frozen = trainable_frozen(model)
    half = runs_half(cfg)
    micro = 1 if t.batch_size == "auto" else t.batch_size
    per_seq = {ck: activation_bytes(cfg, half, ck) for ck in (False, True)}
    optimizers = split_summary(model, t)
    memory = static_bytes(params, optimizers, trainable)
    memory["activations"] = micro * per_seq[t.activation_checkpointing]
    memory["total"] = sum(memory.values())
    flops_token = model.flops_per_token(t.seq_len)
    if t.batch_size == "auto":
        global_batch = t.batch_tokens // t.seq_len
    else:
        global_batch = t.batch_size * t.grad_accum * world_size
    return {
        "params": params,
        "params_non_embedding": model.param_count(non_embedding=True),
        # A mixture of experts: the parameters one token uses (its k experts of E); FLOPs too.
        "params_active": model.active_param_count(),
        "n_experts": m.n_experts,
        "n_experts_per_token": m.n_experts_per_token if m.n_experts else 0,
        "moe_ffn_hidden": m.moe_ffn_hidden,
        "moe_shared_ffn_hidden": m.moe_shared_ffn_hidden,
        "moe_dense_layers": list(m.moe_dense_layers),
        # model.moe_router sigmoid (DeepSeekMoE): "" for the softmax router
        "moe_router": _router_text(m),
        # train.lora: the adapters train, the base (and every other parameter) is frozen
        "params_trainable": trainable,
        "params_frozen": frozen,
        "lora_rank": t.lora.rank,
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
        "batch_size": t.batch_size,
        "activation_checkpointing": t.activation_checkpointing,
        "optimizers": optimizers,
        "memory_bytes": memory,
        # Per micro-batch of the config (one sequence under auto), without and with checkpointing.
        "activation_bytes": {"full": micro * per_seq[False], "checkpointed": micro * per_seq[True]},
        # What it takes to run it, LoRA, QLoRA and fully fine-tune it (minillm.fits).
        "fits": memory_fits(cfg, half, per_seq[t.activation_checkpointing]),
    }


def _router_text(m: Any) -> str:
    """The sigmoid router's options for the shape line ("" for the softmax router)."""
    if m.moe_router != "sigmoid":
        return ""
    groups = f", {m.moe_topk_group} of {m.moe_n_group} groups" if m.moe_n_group > 1 else ""
    return f"(sigmoid router{groups}, weights x {m.moe_routed_scale:g})"


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
    if info["n_experts"]:
        table.add_row(
            "active parameters per token",
            f"{info['params_active']:,} ({_human(info['params_active'])}: "
            f"{info['n_experts_per_token']} of {info['n_experts']} experts)",
        )
    if info["lora_rank"]:
        table.add_row(
            f"LoRA rank {info['lora_rank']}",
            f"{info['params_trainable']:,} trainable (the adapters), "
            f"{info['params_frozen']:,} frozen",
        )
    shape = (
        f"d_model {info['d_model']}, {info['n_layer']} layers, {info['n_head']} heads "
        f"({info['n_kv_head']} kv), head dim {info['head_dim']}, ffn {info['ffn_hidden']}, "
        f"vocab {info['vocab_size']}"
    )
    if info["n_experts"]:
        shape = shape.replace(
            f"ffn {info['ffn_hidden']}",
            f"{info['n_experts']} experts of ffn {info['moe_ffn_hidden']}, "
            f"top-{info['n_experts_per_token']}"
            + (f" {r}" if (r := info.get("moe_router")) else "")
            + (f", a shared expert of ffn {s}" if (s := info["moe_shared_ffn_hidden"]) else "")
            + (
                f", dense blocks {d} of ffn {info['ffn_hidden']}"
                if (d := info["moe_dense_layers"])
                else ""
            ),
        )
    table.add_row("shape", shape)
    flops = "FLOPs per token (train" + (", active parameters)" if info["n_experts"] else ")")
    table.add_row(flops, _human(info["flops_per_token"]))
    table.add_row(
        "tokens per step",
        f"{info['tokens_per_step']:,} (batch x accum x world = {info['global_batch']} seqs "
        f"of {info['seq_len']})",
    )
    table.add_row("FLOPs per step", _human(info["flops_per_step"]))
    if info["batch_size"] == "auto":
        table.add_row("micro-batch", "auto: found at the start of training; memory for 1 seq")
    for o in info["optimizers"]:
        table.add_row(
            f"optimizer: {o['optimizer']}",
            f"{_human(o['params'])} params in {o['tensors']} tensors: {o['what']} "
            f"(lr {o['lr']:g}, weight decay {o['weight_decay']:g})",
        )
    for name, value in info["memory_bytes"].items():
        if name == "activations":
            name += " (checkpointed)" if info["activation_checkpointing"] else ""
        table.add_row(f"memory: {name.replace('_', ' ')}", f"{value / GiB:.2f} GiB")
    act = info["activation_bytes"]
    table.add_row(
        "activations without / with checkpointing",
        f"{act['full'] / GiB:.2f} / {act['checkpointed'] / GiB:.2f} GiB",
    )
    for row in fits_rows(info["fits"]):
        table.add_row(*row)
    Console(markup=False).print(table)  # the title is the config's path: text, not markup
