"""Llama (`LlamaForCausalLM`) and the families that are its block with an option: Qwen2
(`Qwen2ForCausalLM`, model.attention_bias), Qwen3 (`Qwen3ForCausalLM`, model.qk_norm) and
Mistral (`MistralForCausalLM`, model.sliding_window); each takes model.rope_scaling and
model.head_dim. The MoE families, Gemma 3 and Phi-3 build on `Llama`'s reader, writer and
adapter (minillm.families.moe, gemma3, phi3).

Offers `Llama`, `Qwen2`, `Qwen3`, `Mistral`, `LLAMA_DEFAULTS`, `rope_pairs_permute` and
`check_gguf_rope`.

Both models use RoPE's "rotate half" layout, so q/k weights need no permutation; only our fused
projections (wqkv, w_gate_up) are joined from, or split into, HF's separate ones. llama.cpp's
`llama` graph rotates adjacent pairs, so for it the rows of wq and wk are permuted per head as its
converter does (`rope_pairs_permute`); its qwen2 and qwen3 graphs rotate halves, as we do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from minillm.config import ModelConfig
from minillm.errors import ConfigError
from minillm.families.base import (
    Family,
    Named,
    Tensor,
    arch_named,
    gguf_refusal,
    hf_rope_scaling,
    refuse_values,
    rope_from_hf,
    swiglu_from_hf,
    swiglu_to_hf,
)

# What transformers' config classes (4.x and 5.x) give a key config.json leaves out, per family
# (tests/test_hf_families.py checks them against the classes).
LLAMA_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}


class Llama(Family):
    """LlamaForCausalLM: the block every option of minillm's model starts from."""

    name = model_type = "llama"
    hf_class = "LlamaForCausalLM"
    defaults = LLAMA_DEFAULTS
    llama_cpp_arch = "llama"
    gguf_pairs = True  # llama.cpp's graph rotates adjacent pairs

    # ------------------------------------------------------------------------- config.json

    def config_from_hf(self, hf: dict[str, Any], where: str) -> ModelConfig:
        hf, partial = self.normalized(hf, where)
        refused: list[tuple[str, Any]] = [("mlp_bias", False), ("hidden_act", "silu")]
        if not self.reads_attention_bias:  # its attention_bias biases o_proj too
            refused.append(("attention_bias", False))
        refuse_values(hf, refused, where)
        rope_theta, scaling = rope_from_hf(hf, where)
        n_head = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or self.default_head_dim(hf)
        max_len = hf["max_position_embeddings"]
        if scaling.get("type") == "dynamic":  # reads past it: the length its factor reaches
            max_len = int(max_len * scaling["factor"])
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layer=hf["num_hidden_layers"],
            n_head=n_head,
            n_kv_head=hf.get("num_key_value_heads") or n_head,
            head_dim=head_dim,
            attention_bias=self.attention_bias(hf),
            qk_norm=self.name in ("qwen3", "qwen3_moe"),
            sliding_window=self.window_from_hf(hf, where),
            rope_scaling=scaling,
            ffn_hidden=self.dense_width(hf),
            max_seq_len=max_len,
            rope_theta=rope_theta,
            norm_eps=float(hf["rms_norm_eps"]),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            partial_rotary=partial,
            family=self.name,
            **self.moe_from_hf(hf, where),
        )

    reads_attention_bias = False

    def normalized(self, hf: dict[str, Any], where: str) -> tuple[dict[str, Any], float]:
        """config.json as this reader takes it, and its partial_rotary (Phi-3's)."""
        return hf, 1.0

    def default_head_dim(self, hf: dict[str, Any]) -> int:
        """head_dim where config.json has none: d_model / n_head (Qwen3's is 128)."""
        return hf["hidden_size"] // hf["num_attention_heads"]

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        return False

    def dense_width(self, hf: dict[str, Any]) -> int:
        """model.ffn_hidden: the dense SwiGLU's width."""
        return hf["intermediate_size"]

    def moe_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """model.n_experts and its keys (none here)."""
        return {}

    def window_from_hf(self, hf: dict[str, Any], where: str) -> int | None:
        """model.sliding_window (Llama has none)."""
        return None

    def config_to_hf(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        # transformers' dynamic NTK scales past max_position_embeddings: our original length.
        dynamic = cfg.rope_scaling.type == "dynamic"
        max_len = cfg.rope_scaling.original_max_position_embeddings if dynamic else cfg.max_seq_len
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": self.hf_intermediate_size(cfg),
            **self.family_keys(cfg, router_aux_loss_coef),
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_head,
            "head_dim": cfg.head_dim,
            "max_position_embeddings": max_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": hf_rope_scaling(cfg),
            "tie_word_embeddings": cfg.tie_embeddings,
            "hidden_act": "silu",
        }

    def hf_intermediate_size(self, cfg: ModelConfig) -> int:
        return cfg.ffn_hidden

    def family_keys(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        """config.json's keys of this family beside the shared ones."""
        return {"attention_bias": False, "mlp_bias": False}

    # ------------------------------------------------------------------------- weights

    def from_hf(self, cfg: ModelConfig, src: Mapping[str, Tensor]) -> Named:
        yield "tok_emb.weight", src["model.embed_tokens.weight"]
        yield "norm.weight", self.norm_from_hf(src["model.norm.weight"])
        if not cfg.tie_embeddings:
            yield "lm_head.weight", src["lm_head.weight"]
        for i in range(cfg.n_layer):
            yield from self.layer_from_hf(cfg, src, f"model.layers.{i}.", f"blocks.{i}.", i)

    def norm_from_hf(self, w: Tensor) -> Tensor:
        """Our norm weight from HF's (Gemma's holds w of (1 + w))."""
        return w

    def norm_to_hf(self, w: Tensor) -> Tensor:
        return w

    def qkv_from_hf(self, cfg: ModelConfig, src: Mapping[str, Tensor], attn: str) -> Tensor:
        """Our fused wqkv of one layer: HF's q, k and v rows."""
        return torch.cat([src[attn + f"{n}_proj.weight"] for n in ("q", "k", "v")], dim=0)

    def layer_from_hf(
        self, cfg: ModelConfig, src: Mapping[str, Tensor], theirs: str, ours: str, i: int
    ) -> Named:
        attn, norm = theirs + "self_attn.", self.norm_from_hf
        yield ours + "attn_norm.weight", norm(src[theirs + "input_layernorm.weight"])
        yield ours + "attn.wqkv.weight", self.qkv_from_hf(cfg, src, attn)
        yield ours + "attn.wo.weight", src[attn + "o_proj.weight"]
        if cfg.sandwich_norm:  # Gemma's names: post_attention_layernorm is the attention's own
            yield (
                ours + "attn_post_norm.weight",
                norm(src[theirs + "post_attention_layernorm.weight"]),
            )
            yield ours + "ffn_norm.weight", norm(src[theirs + "pre_feedforward_layernorm.weight"])
            yield (
                ours + "ffn_post_norm.weight",
                norm(src[theirs + "post_feedforward_layernorm.weight"]),
            )
        else:
            yield ours + "ffn_norm.weight", norm(src[theirs + "post_attention_layernorm.weight"])
        if cfg.attention_bias:  # Qwen2's q/k/v biases
            bias = [src[attn + f"{n}_proj.bias"] for n in ("q", "k", "v")]
            yield ours + "attn.wqkv.bias", torch.cat(bias, dim=0)
        if cfg.qk_norm:  # Qwen3's per-head norms
            yield ours + "attn.q_norm.weight", norm(src[attn + "q_norm.weight"])
            yield ours + "attn.k_norm.weight", norm(src[attn + "k_norm.weight"])
        yield from self.ffn_from_hf(cfg, src, theirs, ours + "ffn.", i)

    def ffn_from_hf(
        self, cfg: ModelConfig, src: Mapping[str, Tensor], theirs: str, ours: str, i: int
    ) -> Named:
        yield from swiglu_from_hf(src, theirs + "mlp.", ours)

    def to_hf(self, cfg: ModelConfig, sd: Mapping[str, Tensor]) -> Named:
        yield "model.embed_tokens.weight", sd["tok_emb.weight"]
        yield "model.norm.weight", self.norm_to_hf(sd["norm.weight"])
        if not cfg.tie_embeddings:
            yield "lm_head.weight", sd["lm_head.weight"]
        H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        norm = self.norm_to_hf
        for i in range(cfg.n_layer):
            ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
            yield theirs + "input_layernorm.weight", norm(sd[ours + "attn_norm.weight"])
            yield from self.qkv_to_hf(cfg, sd[ours + "attn.wqkv.weight"], theirs + "self_attn.")
            yield theirs + "self_attn.o_proj.weight", sd[ours + "attn.wo.weight"]
            if cfg.sandwich_norm:
                yield (
                    theirs + "post_attention_layernorm.weight",
                    norm(sd[ours + "attn_post_norm.weight"]),
                )
                yield (
                    theirs + "pre_feedforward_layernorm.weight",
                    norm(sd[ours + "ffn_norm.weight"]),
                )
                yield (
                    theirs + "post_feedforward_layernorm.weight",
                    norm(sd[ours + "ffn_post_norm.weight"]),
                )
            else:
                yield theirs + "post_attention_layernorm.weight", norm(sd[ours + "ffn_norm.weight"])
            if cfg.attention_bias:  # split as the rows are
                for n, b in zip("qkv", sd[ours + "attn.wqkv.bias"].split((H * D, K * D, K * D))):
                    yield theirs + f"self_attn.{n}_proj.bias", b
            if cfg.qk_norm:
                yield theirs + "self_attn.q_norm.weight", norm(sd[ours + "attn.q_norm.weight"])
                yield theirs + "self_attn.k_norm.weight", norm(sd[ours + "attn.k_norm.weight"])
            yield from self.ffn_to_hf(cfg, sd, ours + "ffn.", theirs, i)

    def qkv_to_hf(self, cfg: ModelConfig, wqkv: Tensor, attn: str) -> Named:
        H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        for n, w in zip("qkv", wqkv.split((H * D, K * D, K * D), dim=0)):
            yield attn + f"{n}_proj.weight", w

    def ffn_to_hf(
        self, cfg: ModelConfig, sd: Mapping[str, Tensor], ours: str, theirs: str, i: int
    ) -> Named:
        yield from swiglu_to_hf(sd, ours, theirs + "mlp.")

    # ------------------------------------------------------------------------- GGUF

    def gguf_arch(self, cfg: ModelConfig) -> Any:
        import gguf

        check_gguf_rope(cfg)
        check_gguf_window(cfg)
        arch = self.gguf_graph(cfg)
        if cfg.rope_scaling.type == "llama3" and arch != gguf.MODEL_ARCH.LLAMA:
            # only its llama graph reads the rope_freqs tensor
            raise gguf_refusal(
                "rope_scaling.type", f"llama3 in a {gguf.MODEL_ARCH_NAMES[arch]} model"
            )
        return arch

    def gguf_graph(self, cfg: ModelConfig) -> Any:
        return arch_named(self.llama_cpp_arch)

    def gguf_feed_forward(self, cfg: ModelConfig) -> int:
        """llama.cpp's feed_forward_length: the dense FFN's width (Mixtral's: its experts')."""
        return cfg.ffn_hidden

    def add_gguf_keys(self, w: Any, cfg: ModelConfig) -> None:
        w.add_feed_forward_length(self.gguf_feed_forward(cfg))
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(cfg.n_kv_head)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)

    def gguf_tensor(self, cfg: ModelConfig, hf_name: str, w: Tensor) -> list[tuple[str, Tensor]]:
        if self.gguf_pairs and hf_name.endswith("q_proj.weight"):
            w = rope_pairs_permute(w, cfg.n_head)
        elif self.gguf_pairs and hf_name.endswith("k_proj.weight"):
            w = rope_pairs_permute(w, cfg.n_kv_head)
        return [(hf_name, w)]


class Qwen2(Llama):
    """Qwen2ForCausalLM: q/k/v biases (model.attention_bias)."""

    name = model_type = "qwen2"
    hf_class = "Qwen2ForCausalLM"
    defaults = {**LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 32}
    reads_attention_bias = True
    llama_cpp_arch = "qwen2"
    gguf_pairs = False

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        return True

    def window_from_hf(self, hf: dict[str, Any], where: str) -> int | None:
        """Qwen's window where every layer slides (layer_types, or use_sliding_window from
        max_window_layers 0 on); some layers only is a ConfigError naming the key."""
        window, n_layer = hf.get("sliding_window"), hf["num_hidden_layers"]
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first = hf.get("max_window_layers", 28) if hf.get("use_sliding_window") else n_layer
            layer_types = [
                "sliding_attention" if window is not None and i >= first else "full_attention"
                for i in range(n_layer)
            ]
        if len(set(layer_types)) > 1:
            raise ConfigError(
                "layer_types",
                "sliding-window attention in some layers only is not supported",
                where,
            )
        return window if layer_types and layer_types[0] == "sliding_attention" else None

    def family_keys(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        # every layer slides (max_window_layers 0) or none does
        window = cfg.sliding_window is not None
        kind = "sliding_attention" if window else "full_attention"
        return {
            "use_sliding_window": window,
            "sliding_window": cfg.sliding_window,
            "max_window_layers": 0 if window else cfg.n_layer,
            "layer_types": [kind] * cfg.n_layer,
        }


class Qwen3(Qwen2):
    """Qwen3ForCausalLM: per-head q/k norms (model.qk_norm); head_dim 128 unless set."""

    name = model_type = "qwen3"
    hf_class = "Qwen3ForCausalLM"
    reads_attention_bias = False
    llama_cpp_arch = "qwen3"

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        return False

    def default_head_dim(self, hf: dict[str, Any]) -> int:
        return 128  # Qwen3Config's own default, whatever the width

    def family_keys(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        return {**super().family_keys(cfg, router_aux_loss_coef), "attention_bias": False}


class Mistral(Llama):
    """MistralForCausalLM: Llama with a sliding window in every layer (or none)."""

    name = model_type = "mistral"
    hf_class = "MistralForCausalLM"
    defaults = {**LLAMA_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096,
                "num_key_value_heads": 8}  # fmt: skip
    accepts = ("llama",)  # Mistral v0.2 on: sliding_window null

    def window_from_hf(self, hf: dict[str, Any], where: str) -> int | None:
        return hf.get("sliding_window")

    def family_keys(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        return {"sliding_window": cfg.sliding_window}


# ----------------------------------------------------------------------------- GGUF rules


def rope_pairs_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q or k projection (n_head * D, C) from rotate-half to adjacent-pair order.

    Per head, row i < D/2 and row i + D/2 form one RoPE pair here; llama.cpp wants them as
    rows 2i and 2i + 1. convert_hf_to_gguf.py's LlamaModel.permute, in torch.
    """
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).transpose(1, 2).reshape(rows, cols)


def check_yarn_ranges(s: Any) -> None:
    """YaRN's correction range as llama.cpp computes it: beta 32 and 1, truncated."""
    for key, value, want in (("beta_fast", s.beta_fast, 32.0), ("beta_slow", s.beta_slow, 1.0)):
        if value is not None and not math.isclose(value, want, rel_tol=1e-6):
            raise gguf_refusal(f"rope_scaling.{key}", f"{value} (llama.cpp's YaRN uses {want:g})")
    if not s.truncate:
        raise gguf_refusal("rope_scaling.truncate", "false (llama.cpp rounds the correction range)")


def check_gguf_rope(cfg: ModelConfig) -> None:
    """The RoPE scalings llama.cpp's llama, qwen, gemma3 and phi3 graphs compute as ours."""
    s = cfg.rope_scaling
    if s.type == "dynamic":
        raise gguf_refusal("rope_scaling.type", "dynamic (NTK frequencies that follow the length)")
    if s.type == "yarn":
        # llama.cpp's llama and qwen graphs take YaRN's factor and original length, and use the
        # paper's defaults for the rest (measured: its yarn_attn_factor and beta keys change
        # nothing there).
        default = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
        if s.attention_factor is not None and not math.isclose(
            s.attention_factor, default, rel_tol=1e-6
        ):
            what = f"{s.attention_factor} (llama.cpp's YaRN uses {default:g})"
            raise gguf_refusal("rope_scaling.attention_factor", what)
        check_yarn_ranges(s)


def check_gguf_window(cfg: ModelConfig) -> None:
    """Outside gemma3, llama.cpp's graphs attend to the whole context."""
    if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_seq_len:
        raise gguf_refusal(
            "sliding_window",
            f"{cfg.sliding_window} (its llama, qwen2, qwen3 and phi3 see it all: llama.cpp "
            "turns Phi-3's window off)",
        )
