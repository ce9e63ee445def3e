"""Gemma 3's text model (`Gemma3ForCausalLM`, model_type gemma3_text): Llama's block with
model.qk_norm, sandwich_norm, ffn_activation gelu_tanh, embed_scale, query_pre_attn_scalar and
local layers (sliding_window, sliding_window_pattern, rope_local_theta).

Offers `Gemma3` and `has_gemma_option`.

Gemma's RMSNorm multiplies by (1 + w) where HF stores w: our norms hold 1 + w, so the 1 is added
on reading (in float32: a bfloat16 1 + w would round w away) and taken off on writing. llama.cpp's
gemma3 takes the norms as (1 + w), as its converter writes them: ours as they are.
"""

from __future__ import annotations

from typing import Any

from minillm.config import ModelConfig
from minillm.errors import ConfigError
from minillm.families.base import (
    Tensor,
    arch_named,
    gguf_refusal,
    hf_rope_scaling,
    refuse_values,
    rope_from_hf,
)
from minillm.families.llama import Llama, check_gguf_rope

# The options that make a model Gemma 3's block, each its transformers config's.
_GEMMA_OPTIONS = ("qk_norm", "sandwich_norm", "embed_scale")


def has_gemma_option(cfg: ModelConfig) -> bool:
    """Whether `cfg` has an option only Gemma 3's block has."""
    gemma = cfg.sandwich_norm or cfg.embed_scale or cfg.ffn_activation != "silu"
    gemma = gemma or cfg.query_pre_attn_scalar is not None or cfg.rope_local_theta is not None
    return gemma or cfg.sliding_window_pattern > 0


class Gemma3(Llama):
    """Gemma3ForCausalLM: sandwich norms, GeGLU, scaled embeddings, local layers."""

    name = "gemma3"
    model_type = "gemma3_text"
    hf_class = "Gemma3ForCausalLM"
    llama_cpp_arch = "gemma3"
    defaults = {"rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
                "sliding_window": 4096, "rope_local_base_freq": 10000.0,
                "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
                "tie_word_embeddings": True}  # fmt: skip
    gguf_pairs = False

    def check_options(self, cfg: ModelConfig) -> None:
        """A ConfigError naming what a model with some of Gemma's options lacks of the rest."""
        for key in _GEMMA_OPTIONS:
            if not getattr(cfg, key):
                raise ConfigError(
                    f"model.{key}",
                    "false: Gemma 3, the family of this model's other options, has it",
                )
        if cfg.ffn_activation != "gelu_tanh":
            raise ConfigError("model.ffn_activation", "silu: Gemma 3's FFN is a GeGLU (gelu_tanh)")
        for key in ("attention_bias", "n_experts"):
            if getattr(cfg, key):
                raise ConfigError(f"model.{key}", "not in Gemma 3, the family of the others")

    def config_from_hf(self, hf: dict[str, Any], where: str) -> ModelConfig:
        refuse_values(
            hf,
            [
                ("hidden_activation", "gelu_pytorch_tanh"),
                ("attention_bias", False),
                ("final_logit_softcapping", None),
                ("attn_logit_softcapping", None),
                ("use_bidirectional_attention", False),
            ],
            where,
        )
        params = hf.get("rope_parameters")
        local_theta = hf["rope_local_base_freq"]
        if isinstance(params, dict) and "full_attention" in params:  # transformers 5's own
            local = params.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ConfigError(
                    "rope_parameters.sliding_attention.rope_type",
                    f"{local['rope_type']!r} is not supported (minillm: default)",
                    where,
                )
            local_theta = local.get("rope_theta", local_theta)
            hf = {**hf, "rope_parameters": params["full_attention"], "rope_scaling": None}
        rope_theta, scaling = rope_from_hf(hf, where)
        if scaling.get("type") == "dynamic":
            raise ConfigError(
                "rope_scaling", "dynamic with Gemma 3's local layers is not supported", where
            )
        n_layer, window = hf["num_hidden_layers"], hf["sliding_window"]
        layer_types = hf.get("layer_types")
        if layer_types is None:
            N = hf["sliding_window_pattern"]
            layer_types = [
                "sliding_attention" if (i + 1) % N else "full_attention" for i in range(n_layer)
            ]
        window, pattern = _layers(layer_types, window, n_layer, where)
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layer=n_layer,
            n_head=hf["num_attention_heads"],
            n_kv_head=hf["num_key_value_heads"],
            head_dim=hf["head_dim"],
            qk_norm=True,
            sandwich_norm=True,
            ffn_activation="gelu_tanh",
            embed_scale=True,
            query_pre_attn_scalar=int(hf["query_pre_attn_scalar"]),
            sliding_window=window,
            sliding_window_pattern=pattern,
            rope_local_theta=float(local_theta),
            rope_scaling=scaling,
            ffn_hidden=hf["intermediate_size"],
            max_seq_len=hf["max_position_embeddings"],
            rope_theta=rope_theta,
            norm_eps=float(hf["rms_norm_eps"]),
            tie_embeddings=bool(hf["tie_word_embeddings"]),
            family=self.name,
        )

    def config_to_hf(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        """A Gemma3TextConfig's config.json in the keys of the published folders (rope_theta,
        rope_local_base_freq, rope_scaling), which transformers 4 and 5 both read."""
        local_theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        if cfg.rope_local_theta is None and cfg.sliding_window is not None:
            if cfg.rope_scaling.type != "none":  # Gemma's sliding layers take plain RoPE
                raise ConfigError(
                    "model.rope_local_theta",
                    "null with rope_scaling: Gemma 3's sliding layers take plain RoPE at their "
                    "own base; set it",
                )
        kinds = ("full_attention", "sliding_attention")
        pattern = cfg.sliding_window_pattern
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_hidden,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_head,
            "head_dim": cfg.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
            # No sliding layer reads it then; Gemma3TextConfig wants a number.
            "sliding_window": cfg.sliding_window or cfg.max_seq_len,
            **({"sliding_window_pattern": pattern} if pattern else {}),
            "layer_types": [kinds[cfg.local_layer(i)] for i in range(cfg.n_layer)],
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_local_base_freq": local_theta,
            "rope_scaling": hf_rope_scaling(cfg),
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "attention_bias": False,
            "tie_word_embeddings": cfg.tie_embeddings,
        }

    def norm_from_hf(self, w: Tensor) -> Tensor:
        return w.float() + 1.0  # in float32: a bfloat16 1 + w would round w away

    def norm_to_hf(self, w: Tensor) -> Tensor:
        return w - 1.0

    def gguf_arch(self, cfg: ModelConfig) -> Any:
        """llama.cpp's gemma3, for what its graph computes: Gemma's softmax scale
        (1/sqrt(head_dim); 27B's d_model/n_head), plain or linear RoPE on the global layers."""

        check_gguf_rope(cfg)
        if cfg.rope_scaling.type not in ("none", "linear"):
            raise gguf_refusal("rope_scaling.type", f"{cfg.rope_scaling.type} in a gemma3 model")
        # llama.cpp's gemma3 scales by head_dim, or by d_model / n_head when it takes the model
        # for Gemma 3 27B (62 layers); it reads no key for it.
        theirs = cfg.d_model // cfg.n_head if cfg.n_layer == 62 else cfg.head_dim
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        if scalar != theirs:
            raise gguf_refusal(
                "query_pre_attn_scalar", f"{scalar} (llama.cpp's gemma3 here: {theirs})"
            )
        return arch_named(self.llama_cpp_arch)

    def add_gguf_keys(self, w: Any, cfg: ModelConfig) -> None:
        super().add_gguf_keys(w, cfg)
        # its local layers: window, which ones, their base
        w.add_sliding_window(cfg.sliding_window or cfg.max_seq_len)
        w.add_sliding_window_pattern([cfg.local_layer(i) for i in range(cfg.n_layer)])
        local = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
        w.add_rope_freq_base_swa(local)

    def gguf_tensor(self, cfg: ModelConfig, hf_name: str, w: Tensor) -> list[tuple[str, Tensor]]:
        if hf_name.endswith("norm.weight"):  # (1 + w), as its converter writes them
            w = w + 1.0
        return [(hf_name, w)]


def _layers(
    layer_types: list[str], window: int, n_layer: int, where: str
) -> tuple[int | None, int]:
    """model.sliding_window and sliding_window_pattern of Gemma 3's layer_types: none sliding,
    all, or all but every N-th; another arrangement is a ConfigError naming layer_types."""
    kinds = {"sliding_attention": True, "full_attention": False}
    if len(layer_types) != n_layer or any(t not in kinds for t in layer_types):
        raise ConfigError("layer_types", f"{layer_types!r}: want {n_layer} of {list(kinds)}", where)
    local = [kinds[t] for t in layer_types]
    if not any(local):
        return None, 0
    if all(local):
        return window, 0
    for N in range(2, n_layer + 1):
        if local == [bool((i + 1) % N) for i in range(n_layer)]:
            return window, N
    raise ConfigError("layer_types", "global layers other than every N-th are not supported", where)
