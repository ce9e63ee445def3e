"""`--quantize` applied while a checkpoint loads: each linear layer quantized as soon as its
weight is read, so a load's peak is the quantized model plus one layer in the load dtype, not
the whole model in it (an 8B bfloat16 folder sampled in NF4 needs ~5 GB of memory, not 16).

Offers `as_loaded(quantize, cfg, device)` (the `on_filled` hook of
minillm.checkpoint.lazy.fill_model for `nf4` or `int8`, or None: nothing to do while loading, and
the reason int8 cannot run where it cannot) and `finish(model, quantize, cfg)` (what only the
whole model can give: int8's tied head and MoE experts, and the check that something was
quantized; a model loaded whole, a LoRA run's merged one, is quantized here entirely).

The codes are those the whole-model quantizers give (`quantize_nf4`, `quantize_int8`): the same
layers, each quantized from the same tensor (in the load dtype, on the load's device: a layer
read onto a GPU is quantized there, as the model loaded whole then quantized was).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from minillm.config import ModelConfig
from minillm.errors import ConfigError

Hook = Callable[[str, nn.Module], nn.Module | None]

# The linear layers of a block int8 quantizes (minillm.model.quantize.quantize_int8): attention's
# (MLA's but wkv_b, whose float weight its decode absorbs) and a dense SwiGLU's.
_INT8_LAYERS = {
    "attn": {"wqkv", "wo", "wq", "wq_a", "wq_b", "wkv_a"},
    "ffn": {"w_gate_up", "w_down"},
}


def as_loaded(
    quantize: str, cfg: ModelConfig, device: str | torch.device
) -> tuple[Hook | None, str | None]:
    """(fill_model's `on_filled` for `quantize` on `device`, or None; why int8 cannot run here,
    or None). Without bitsandbytes, nf4 is a ConfigError naming --quantize, before any weight is
    read."""
    if quantize == "nf4":
        from minillm.families import fused_rows
        from minillm.model.nf4 import nf4_as_loaded

        return nf4_as_loaded(fused_rows(cfg), key="--quantize"), None
    if quantize == "int8":
        from minillm.model.quantize import int8_kernel_problem

        kind = torch.device(device).type
        if kind != "cpu":
            return None, f"the int8 kernel runs on the CPU and the model is on {kind}"
        problem = int8_kernel_problem()
        return (None, problem) if problem is not None else (_int8_as_loaded, None)
    return None, None


@torch.no_grad()
def _int8_as_loaded(name: str, module: nn.Module) -> nn.Module | None:
    """An Int8Linear for each layer quantize_int8 makes int8 (an untied head too), once read."""
    from minillm.model.quantize import Int8Linear

    if not isinstance(module, nn.Linear):
        return None
    path = name.split(".")
    in_block = len(path) == 4 and path[0] == "blocks" and path[3] in _INT8_LAYERS.get(path[2], ())
    if not in_block and name != "lm_head":
        return None
    # quantize_int8's bias: wqkv's (Qwen2's); no other layer it quantizes has one.
    return Int8Linear(module.weight, module.bias if path[-1] == "wqkv" else None)


def finish(model: nn.Module, quantize: str, cfg: ModelConfig) -> str | None:
    """`model` (loaded with as_loaded's hook, or whole) quantized to the end: int8's remaining
    layers (its tied head, an MoE's experts; all of a model loaded whole), or NF4's (all of a
    model loaded whole). Why int8 could not run (the model left in fp32), or None. A model
    with no linear layer to make NF4 is a ConfigError naming --quantize."""
    if quantize == "int8":
        from minillm.model.quantize import quantize_int8

        return quantize_int8(model)  # type: ignore[arg-type]
    if quantize == "nf4":
        from minillm.families import fused_rows
        from minillm.model.nf4 import NF4Linear, quantize_nf4

        quantize_nf4(model, fused_rows(cfg))  # type: ignore[arg-type]  # layers left in float
        if not any(isinstance(m, NF4Linear) for m in model.modules()):
            raise ConfigError("--quantize", "nf4: the model has no linear layers to quantize")
    return None


__all__ = ["as_loaded", "finish"]
