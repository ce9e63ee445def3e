"""The mixture-of-experts families on Llama's block: Mixtral (`MixtralForCausalLM`), Qwen2-MoE
(`Qwen2MoeForCausalLM`: a shared expert, model.moe_norm_topk, model.moe_dense_layers, q/k/v
biases) and Qwen3-MoE (`Qwen3MoeForCausalLM`: qk_norm).

Offers `Mixtral`, `Qwen2Moe`, `Qwen3Moe` and `moe_family_name`.

Mixtral's experts are written under the names of its published checkpoints
(block_sparse_moe.experts.N.w1, w2, w3), which every transformers version loads, and read from
those or from transformers 5's in-memory stacks (mlp.experts.gate_up_proj, down_proj: our
layout); the Qwen MoEs' likewise (mlp.experts.N.gate_proj, up_proj, down_proj, as Qwen publishes
them). config.json's router_aux_loss_coef and output_router_logits are not read: they change no
logit, only transformers' training loss; a run's coefficient is its train.moe_aux_loss, which
the export writes as router_aux_loss_coef.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minillm.config import ModelConfig
from minillm.errors import ConfigError
from minillm.families.base import (
    Named,
    Tensor,
    arch_named,
    experts_from_hf,
    experts_to_hf,
    gguf_refusal,
    swiglu_from_hf,
    swiglu_to_hf,
)
from minillm.families.llama import LLAMA_DEFAULTS, Llama


def moe_family_name(cfg: ModelConfig) -> str:
    """The MoE family of `cfg` (n_experts > 0): Qwen3-MoE has qk_norm and no shared expert,
    Qwen2-MoE a shared expert and no qk_norm (its own sliding-window pattern is not ours),
    Mixtral neither, its top-k renormalised in every layer."""
    if cfg.moe_router == "sigmoid":
        raise ConfigError(
            "model.moe_router",
            "sigmoid without model.attention mla: DeepSeek-V3, the family that routes so, has "
            "latent attention",
        )
    if cfg.qk_norm:
        if cfg.moe_shared_ffn_hidden:
            raise ConfigError(
                "model.moe_shared_ffn_hidden",
                f"{cfg.moe_shared_ffn_hidden} with model.qk_norm: no transformers family has "
                "both (Qwen3-MoE has no shared expert)",
            )
        return "qwen3_moe"
    if cfg.moe_shared_ffn_hidden:
        if cfg.sliding_window is not None:
            raise ConfigError(
                "model.sliding_window",
                f"{cfg.sliding_window} with a shared expert (Qwen2-MoE): its window is in "
                "alternate layers only",
            )
        return "qwen2_moe"
    for key, used in (
        ("attention_bias", cfg.attention_bias),
        ("moe_norm_topk", not cfg.moe_norm_topk),
        ("moe_dense_layers", cfg.moe_dense_layers),
    ):
        if used:
            raise ConfigError(
                f"model.{key}",
                f"{getattr(cfg, key)!r} on a mixture of experts needs a shared expert "
                "(Qwen2-MoE) or model.qk_norm (Qwen3-MoE): Mixtral has neither",
            )
    return "mixtral"


class Mixtral(Llama):
    """MixtralForCausalLM: every block's FFN top-k of experts, renormalised."""

    name = model_type = "mixtral"
    hf_class = "MixtralForCausalLM"
    defaults = {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "num_key_value_heads": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2}  # fmt: skip
    expert_names = ("w1", "w3", "w2")  # gate, up, down as published

    def dense_width(self, hf: dict[str, Any]) -> int:
        return hf["intermediate_size"]  # its experts' width: no dense layer

    def moe_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        return dict(
            n_experts=hf["num_local_experts"],
            n_experts_per_token=hf["num_experts_per_tok"],
            moe_ffn_hidden=hf["intermediate_size"],
        )

    def window_from_hf(self, hf: dict[str, Any], where: str) -> int | None:
        return hf.get("sliding_window")

    def hf_intermediate_size(self, cfg: ModelConfig) -> int:
        return cfg.moe_ffn_hidden  # Mixtral's is its experts' width

    def family_keys(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        return {
            "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.n_experts_per_token,
            "router_aux_loss_coef": router_aux_loss_coef,
            "output_router_logits": False,
            "router_jitter_noise": 0.0,
            "sliding_window": cfg.sliding_window,
        }

    def moe_prefix(self, src: Mapping[str, Tensor] | None, theirs: str) -> str:
        """Where one layer's router and experts live: Mixtral's published block_sparse_moe (or
        transformers 5's mlp, with stacks)."""
        if src is not None and theirs + "mlp.experts.gate_up_proj" in src:
            return theirs + "mlp."
        return theirs + "block_sparse_moe."

    def ffn_from_hf(
        self, cfg: ModelConfig, src: Mapping[str, Tensor], theirs: str, ours: str, i: int
    ) -> Named:
        if i in cfg.moe_dense_layers:
            yield from swiglu_from_hf(src, theirs + "mlp.", ours)
            return
        if cfg.moe_shared_ffn_hidden:
            shared = theirs + "mlp.shared_expert."
            yield from swiglu_from_hf(src, shared, ours + "shared.")
            yield ours + "shared.gate.weight", src[theirs + "mlp.shared_expert_gate.weight"]
        moe = self.moe_prefix(src, theirs)
        yield ours + "router.weight", src[moe + "gate.weight"]
        yield from experts_from_hf(src, moe, ours, self.expert_names, cfg.n_experts)

    def ffn_to_hf(
        self, cfg: ModelConfig, sd: Mapping[str, Tensor], ours: str, theirs: str, i: int
    ) -> Named:
        if ours + "router.weight" not in sd:
            yield from swiglu_to_hf(sd, ours, theirs + "mlp.")
            return
        moe = self.moe_prefix(None, theirs)
        yield moe + "gate.weight", sd[ours + "router.weight"]
        yield from experts_to_hf(sd, ours, moe, self.expert_names, cfg.n_experts)
        if cfg.moe_shared_ffn_hidden:
            yield from swiglu_to_hf(sd, ours + "shared.", moe + "shared_expert.")
            yield moe + "shared_expert_gate.weight", sd[ours + "shared.gate.weight"]

    # llama.cpp: its graph renormalises the top k (or not), and makes every block sparse.
    gguf_renormalises = True

    def gguf_graph(self, cfg: ModelConfig) -> Any:
        """llama.cpp's graph for a mixture of experts: `qwen3moe` (qk_norm; top-k renormalised),
        `qwen2moe` (a gated shared expert, q/k/v biases; softmax weights kept) or `llama`
        (Mixtral: renormalised). model.moe_dense_layers has no equivalent."""
        import gguf

        if cfg.moe_dense_layers:
            raise gguf_refusal(
                "moe_dense_layers", f"{cfg.moe_dense_layers} (its MoE graphs have none)"
            )
        arch = arch_named(self.llama_cpp_arch)
        if cfg.moe_norm_topk != self.gguf_renormalises:
            does = "renormalises" if self.gguf_renormalises else "does not renormalise"
            name = gguf.MODEL_ARCH_NAMES[arch]
            raise gguf_refusal(
                "moe_norm_topk", f"{cfg.moe_norm_topk} (its {name} {does} the top k)"
            )
        return arch

    def add_gguf_keys(self, w: Any, cfg: ModelConfig) -> None:
        super().add_gguf_keys(w, cfg)
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.n_experts_per_token)

    def gguf_feed_forward(self, cfg: ModelConfig) -> int:
        return cfg.moe_ffn_hidden


class Qwen3Moe(Mixtral):
    """Qwen3MoeForCausalLM: qk_norm, no shared expert, dense layers where configured."""

    name = model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    defaults = {**LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 4,
                "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "norm_topk_prob": False, "decoder_sparse_step": 1,
                "intermediate_size": 6144}  # fmt: skip
    expert_names = ("gate_proj", "up_proj", "down_proj")
    llama_cpp_arch = "qwen3moe"
    gguf_pairs = False

    def dense_width(self, hf: dict[str, Any]) -> int:
        return hf["intermediate_size"]  # the dense layers' (mlp_only_layers)

    def moe_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """model.n_experts and the other MoE keys: a block is dense where transformers' decoder
        layer makes it so, in mlp_only_layers or off every decoder_sparse_step-th."""
        n_layer, E, step = hf["num_hidden_layers"], hf["num_experts"], hf["decoder_sparse_step"]
        if not isinstance(step, int) or step < 1:
            raise ConfigError("decoder_sparse_step", f"{step!r} must be a whole number >= 1", where)
        if not isinstance(E, int) or E < 2:
            raise ConfigError("num_experts", f"{E!r}: minillm needs 2 or more experts", where)
        k = hf["num_experts_per_tok"]
        if not isinstance(k, int) or not 1 <= k <= E:
            raise ConfigError("num_experts_per_tok", f"{k!r} must be 1 to num_experts={E}", where)
        only = hf.get("mlp_only_layers") or []
        dense = [i for i in range(n_layer) if i in only or (i + 1) % step]
        if len(dense) == n_layer:
            key = "mlp_only_layers" if only else "decoder_sparse_step"
            raise ConfigError(key, "makes every block dense: no expert is used", where)
        return dict(
            n_experts=E,
            n_experts_per_token=k,
            moe_ffn_hidden=hf["moe_intermediate_size"],
            moe_norm_topk=bool(hf["norm_topk_prob"]),
            moe_dense_layers=dense,
        )

    def window_from_hf(self, hf: dict[str, Any], where: str) -> int | None:
        return hf.get("sliding_window") if hf.get("use_sliding_window") else None

    def hf_intermediate_size(self, cfg: ModelConfig) -> int:
        return cfg.ffn_hidden  # that of its dense layers

    def family_keys(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        return {
            "num_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.n_experts_per_token,
            "moe_intermediate_size": cfg.moe_ffn_hidden,
            "norm_topk_prob": cfg.moe_norm_topk,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.moe_dense_layers),
            "router_aux_loss_coef": router_aux_loss_coef,
            "output_router_logits": False,
            "use_sliding_window": cfg.sliding_window is not None,
            "sliding_window": cfg.sliding_window,
            "max_window_layers": cfg.n_layer,
            "attention_bias": False,
        }

    def moe_prefix(self, src: Mapping[str, Tensor] | None, theirs: str) -> str:
        return theirs + "mlp."

    def add_gguf_keys(self, w: Any, cfg: ModelConfig) -> None:
        super().add_gguf_keys(w, cfg)
        w.add_expert_feed_forward_length(cfg.moe_ffn_hidden)

    def gguf_feed_forward(self, cfg: ModelConfig) -> int:
        return cfg.ffn_hidden


class Qwen2Moe(Qwen3Moe):
    """Qwen2MoeForCausalLM: a gated shared expert, q/k/v biases (transformers 5's qkv_bias;
    4.x: always biased), softmax weights kept."""

    name = model_type = "qwen2_moe"
    hf_class = "Qwen2MoeForCausalLM"
    defaults = {**LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 16,
                "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                "decoder_sparse_step": 1, "qkv_bias": True, "intermediate_size": 5632}  # fmt: skip
    reads_attention_bias = True
    llama_cpp_arch = "qwen2moe"
    gguf_renormalises = False

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        return bool(hf["qkv_bias"])

    def moe_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        moe = super().moe_from_hf(hf, where)
        shared = hf["shared_expert_intermediate_size"]
        if not isinstance(shared, int) or shared < 1:
            raise ConfigError(
                "shared_expert_intermediate_size", f"{shared!r} must be a width >= 1", where
            )
        return {**moe, "moe_shared_ffn_hidden": shared}

    def window_from_hf(self, hf: dict[str, Any], where: str) -> int | None:
        n_layer = hf["num_hidden_layers"]
        layer_types = hf.get("layer_types") or [  # transformers' pattern: alternate layers
            "sliding_attention"
            if (i + 1) % 2 and i < hf.get("max_window_layers", 28) and hf.get("use_sliding_window")
            else "full_attention"
            for i in range(n_layer)
        ]
        if "sliding_attention" in layer_types:
            key = "layer_types" if hf.get("layer_types") else "use_sliding_window"
            raise ConfigError(key, "Qwen2-MoE's sliding-window attention is not supported", where)
        return None

    def family_keys(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        keys = super().family_keys(cfg, router_aux_loss_coef)
        del keys["attention_bias"]
        return {
            **keys,
            "shared_expert_intermediate_size": cfg.moe_shared_ffn_hidden,
            "qkv_bias": cfg.attention_bias,
        }

    def gguf_graph(self, cfg: ModelConfig) -> Any:
        if not cfg.attention_bias:
            raise gguf_refusal(
                "attention_bias", "false with a shared expert (its qwen2moe has biases)"
            )
        return super().gguf_graph(cfg)

    def add_gguf_keys(self, w: Any, cfg: ModelConfig) -> None:
        super().add_gguf_keys(w, cfg)
        w.add_expert_shared_feed_forward_length(cfg.moe_shared_ffn_hidden)

    def gguf_tensor(self, cfg: ModelConfig, hf_name: str, w: Tensor) -> list[tuple[str, Tensor]]:
        if hf_name.endswith("shared_expert_gate.weight"):  # (1, C): llama.cpp reads (C,)
            w = w.reshape(-1)
        out = [(hf_name, w)]
        if cfg.tie_embeddings and hf_name == "model.embed_tokens.weight":
            out.append(("lm_head.weight", w))  # its loader has no tied head: a copy
        return out
