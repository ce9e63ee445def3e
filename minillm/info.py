"""`minillm info`: sizes, FLOPs and a training-memory estimate of a config, without allocating it.

Offers `model_info(cfg) -> dict` and `print_info(info)`. The model is built on the meta device, so
a 7B config costs no RAM. With train.lora the adapters are added, and the memory is that of a
LoRA run: gradients and optimizer state for the adapters only.
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.config import Config
from minillm.fits import fits_lines, fits_rows, memory_fits
from minillm.model import Transformer
from minillm.model.lora import add_lora, trainable_frozen
from minillm.model.param_groups import split_summary

GiB = 1024**3
MLA_WIDTHS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank")


def activation_bytes(cfg: Config, half: bool, checkpointing: bool) -> int:
    """Activation memory of one sequence of train.seq_len tokens in a training step.

    Tensors autograd keeps per token and layer: norms, q/k/v (and rotated q/k), attention output,
    the SwiGLU gate/up/product, residuals. Roughly 10 C + 3 K D + 4 F values; plus the logits and
    their gradient in fp32. With activation checkpointing only each block's input (fp32, the
    residual stream) is kept, and one block's activations live at a time during the recompute.
    A mixture of experts keeps 4 F for each of the k experts a token goes through and its k
    gathered inputs and weighted outputs (3 k C), and 4 S for a shared expert of width S (its
    dense blocks, model.moe_dense_layers, counted as MoE blocks). Latent attention (`_mla_values`)
    has its own widths in place of 3 K D. An estimate, good to about 20%.
    """
    m, t = cfg.model, cfg.train
    act = 2 if half else 4
    attention = _mla_values(m) if m.attention == "mla" else 3 * m.n_kv_head * m.head_dim
    per_token_layer = 10 * m.d_model + attention + 4 * m.ffn_hidden
    if m.n_experts:
        k = m.n_experts_per_token
        per_token_layer += 4 * (k * m.moe_ffn_hidden - m.ffn_hidden) + 3 * k * m.d_model
        per_token_layer += 4 * m.moe_shared_ffn_hidden
    blocks = (m.n_layer * 4 * m.d_model + per_token_layer * act) if checkpointing else (
        m.n_layer * per_token_layer * act
    )  # fmt: skip
    return t.seq_len * (blocks + 2 * m.vocab_size * 4)


def _mla_values(m: Any) -> int:
    """What latent attention keeps per token and layer beyond 10 C: its q and k, H (N + P) each,
    the k/v up-projected from the latent, H (N + V), the attention output H V, the latent before
    and after its norm and as wkv_b's input (3 R), the RoPE key and its rotation (2 P), and a
    query bottleneck's latent and its norm (2 Q). Not head_dim, which is P alone under MLA."""
    H, N, P, V = m.n_head, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    R, Q = m.kv_lora_rank, m.q_lora_rank or 0
    return 2 * H * (N + P) + H * (N + V) + H * V + 3 * R + 2 * P + 2 * Q


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


def runs_on(cfg: Config) -> str:
    """The device a run of cfg takes: train.device, and for `auto` this machine's (cuda, then
    mps, then cpu), as the run resolves it."""
    d = cfg.train.device
    if d != "auto":
        return d
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps and mps.is_available() else "cpu"


def model_info(
    cfg: Config, world_size: int = 1, run_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Parameter counts, FLOPs per token and an approximate per-device training-memory budget.

    With train.batch_size: auto the micro-batch is unknown until the run: memory is for one
    sequence, and the global batch is train.batch_tokens. `run_dtype`: the dtype sampling
    loads the weights in, which the fits' run row is sized at (None: training's, runs_half).
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
        # model.attention mla: head_dim is the RoPE width alone; the heads' widths are these
        "attention": m.attention,
        **{k: getattr(m, k) for k in MLA_WIDTHS},
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
        "fits": memory_fits(
            cfg, half, per_seq[t.activation_checkpointing], runs_on(cfg), run_dtype
        ),
    }


def _router_text(m: Any) -> str:
    """The sigmoid router's options for its row ("" for the softmax router)."""
    if m.moe_router != "sigmoid":
        return ""
    groups = f", {m.moe_topk_group} of {m.moe_n_group} groups" if m.moe_n_group > 1 else ""
    return f"sigmoid{groups}, weights x {m.moe_routed_scale:g}"


def _human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:g}{unit}"


def _blocks(numbers: list[int]) -> str:
    """Block numbers as ranges ("0-2, 5"); past 24 characters, how many and the first."""
    runs: list[list[int]] = []
    for i in sorted(numbers):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
    return text if len(text) <= 24 else f"{len(numbers)}, from {min(numbers)}"


def _shape_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    """The model's shape, a row per part: each value short enough for one line at 80 columns."""
    rows = [("layers", f"{info['n_layer']} (d_model {info['d_model']})")]
    if info.get("attention") == "mla":
        H, N, P, V = (info[k] for k in ("n_head", *MLA_WIDTHS[:3]))
        rows.append(("attention", f"MLA, {H} heads, q/k {N + P} ({P} RoPE), v {V}"))
        q = f", q {info['q_lora_rank']}" if info["q_lora_rank"] else ""
        rows.append(("MLA latents", f"kv {info['kv_lora_rank']}{q}"))
    else:
        heads = f"{info['n_head']} heads ({info['n_kv_head']} kv)"
        rows.append(("attention", f"{heads}, head dim {info['head_dim']}"))
    if not info["n_experts"]:
        rows.append(("ffn", f"{info['ffn_hidden']}"))
    else:
        E, k = info["n_experts"], info["n_experts_per_token"]
        rows.append(("ffn", f"{E} experts of ffn {info['moe_ffn_hidden']}, top-{k}"))
        if info.get("moe_router"):
            rows.append(("router", info["moe_router"]))
        if info["moe_shared_ffn_hidden"]:
            rows.append(("shared expert", f"ffn {info['moe_shared_ffn_hidden']}"))
        if info["moe_dense_layers"]:
            dense = _blocks(info["moe_dense_layers"])
            rows.append(("dense blocks", f"{dense}, ffn {info['ffn_hidden']}"))
    rows.append(("vocab", f"{info['vocab_size']}"))
    return rows


def print_info(info: dict[str, Any], title: str = "model") -> None:
    """`minillm info`'s table: every value one line at 80 columns; the optimizers' rules, prose,
    as lines below it."""
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("parameters", f"{info['params']:,} ({_human(info['params'])})")
    table.add_row("without embeddings", f"{info['params_non_embedding']:,}")
    if info["n_experts"]:
        active = info["params_active"]
        k, E = info["n_experts_per_token"], info["n_experts"]
        table.add_row("active parameters per token", f"{active:,} ({_human(active)})")
        table.add_row("active experts per token", f"{k} of {E} experts")
    if info["lora_rank"]:
        lora = f"LoRA rank {info['lora_rank']}"
        table.add_row(f"{lora}: adapters", f"{info['params_trainable']:,} trainable")
        table.add_row(f"{lora}: the base", f"{info['params_frozen']:,} frozen")
    for row in _shape_rows(info):
        table.add_row(*row)
    flops = "FLOPs per token (train" + (", active)" if info["n_experts"] else ")")
    table.add_row(flops, _human(info["flops_per_token"]))
    table.add_row("tokens per step", f"{info['tokens_per_step']:,}")
    table.add_row(
        "sequences per step", f"{info['global_batch']} of {info['seq_len']} (batch x accum x world)"
    )
    table.add_row("FLOPs per step", _human(info["flops_per_step"]))
    if info["batch_size"] == "auto":
        table.add_row("micro-batch", "auto: found when training starts")
    for o in info["optimizers"]:
        table.add_row(
            f"optimizer: {o['optimizer']}", f"{_human(o['params'])} params, {o['tensors']} tensors"
        )
        table.add_row("lr, weight decay", f"{o['lr']:g}, {o['weight_decay']:g}")
    for name, value in info["memory_bytes"].items():
        if name == "activations":
            name += " (checkpointed)" if info["activation_checkpointing"] else ""
            name += " (1 seq)" if info["batch_size"] == "auto" else ""
        table.add_row(f"memory: {name.replace('_', ' ')}", f"{value / GiB:.2f} GiB")
    act = info["activation_bytes"]
    table.add_row(
        "activations: full / ckpt", f"{act['full'] / GiB:.2f} / {act['checkpointed'] / GiB:.2f} GiB"
    )
    for row in fits_rows(info["fits"]):
        table.add_row(*row)
    console = Console(markup=False)  # the title is the config's path: text, not markup
    console.print(title)  # a line of its own: a long path is not wrapped to the table's width
    console.print(table)
    for o in info["optimizers"]:
        console.print(f"{o['optimizer']} trains {o['what']}")
    for line in fits_lines(info["fits"]):
        console.print(f"fits: {line}")
