"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`, model_type phi3): Llama's block with fused
projections (`self_attn.qkv_proj` = [q; k; v] and `mlp.gate_up_proj` = [gate; up], our own wqkv
and w_gate_up), RoPE on the first `partial_rotary_factor` of each head's dimensions
(model.partial_rotary) and LongRoPE (model.rope_scaling.type longrope).

Offers `Phi3`, `PHI3_DEFAULTS`, `rotary_rows_to_ours` and `rotary_rows_to_hf`.

Ours rotates pairs (i, i + D/2); HF's partial RoPE pairs (i, i + R/2) within the first R
dimensions. So our q and k heads hold HF's dimensions in the order [0..R/2-1, the first half of
R..D-1, R/2..R-1, the second half of R..D-1] (`rotary_rows_to_ours`): the rotated pairs are ours,
the unrotated ones turn by angle 0 (minillm.model.rope). With partial_rotary 1 the order is HF's.
peft's modules are the fused qkv_proj and gate_up_proj, one adapter each.

llama.cpp's phi3: fused tensors, LongRoPE's factors as its `rope_factors_long`/`_short` tensors.
Its tokenizer strips the whitespace after every special token but <unk>, <s> and <|endoftext|>
(as Phi-3's tokenizer.json does, `rstrip: true`) only when general.name holds "phi3" or "phi-3"
(llama-vocab.cpp), and then looks those tokens and </s> up (a vocabulary without them does not
load): `Phi3.gguf_name` writes the name llama.cpp tokenizes the model's tokenizer by.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from minillm.config import ModelConfig
from minillm.errors import CheckpointError, ConfigError
from minillm.families.base import PEFT_MODULES, Named, Tensor, arch_named
from minillm.families.llama import Llama, check_gguf_rope, check_gguf_window

# What llama.cpp looks up when general.name names Phi-3, and the specials it then keeps unstripped.
_LLAMA_CPP_LOOKS_UP = ("<unk>", "<s>", "</s>", "<|endoftext|>")
_LLAMA_CPP_KEEPS = ("<unk>", "<s>", "<|endoftext|>")
# </s> it strips after whatever the tokenizer says (Phi-3's own: special false): not compared.
_NOT_COMPARED = (*_LLAMA_CPP_KEEPS, "</s>")
_LLAMA_CPP_KEYS = ("phi3", "phi-3")

# What transformers' Phi3Config gives a key config.json leaves out (tests check it).
PHI3_DEFAULTS = {
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "sliding_window": None,
}


class Phi3(Llama):
    """Phi3ForCausalLM: fused projections, partial RoPE, LongRoPE."""

    name = model_type = "phi3"
    hf_class = "Phi3ForCausalLM"
    llama_cpp_arch = "phi3"
    defaults = PHI3_DEFAULTS
    accepts = ("llama", "mistral")  # partial_rotary 1 without longrope: Phi-3-mini-4k
    # Phi-3's generation_config.json: eos_token_id [32000, 32001, 32007].
    end_of_turn = ("<|endoftext|>", "<|assistant|>", "<|end|>")
    turn_end = "<|end|>"
    peft_modules = {
        **PEFT_MODULES,
        "wqkv": ("self_attn", ("qkv_proj",)),
        "w_gate_up": ("mlp", ("gate_up_proj",)),
    }
    gguf_pairs = False

    def check_options(self, cfg: ModelConfig) -> None:
        """A ConfigError naming an option Phi3ForCausalLM lacks beside partial RoPE/LongRoPE."""
        for key in ("attention_bias", "qk_norm", "sandwich_norm", "embed_scale", "n_experts"):
            if getattr(cfg, key):
                raise ConfigError(
                    f"model.{key}",
                    "with partial_rotary or longrope (Phi-3's): no transformers family",
                )
        if cfg.ffn_activation != "silu" or cfg.query_pre_attn_scalar is not None:
            key = "ffn_activation" if cfg.ffn_activation != "silu" else "query_pre_attn_scalar"
            raise ConfigError(f"model.{key}", "not in Phi-3, the family of partial_rotary/longrope")
        if cfg.rope_local_theta is not None or cfg.sliding_window_pattern:
            raise ConfigError("model.rope_local_theta", "local layers are not in Phi-3")
        if cfg.rope_scaling.type not in ("none", "longrope"):
            raise ConfigError(
                "model.rope_scaling.type",
                f"{cfg.rope_scaling.type} with partial_rotary: Phi-3 takes none or longrope",
            )

    def normalized(self, hf: dict[str, Any], where: str) -> tuple[dict[str, Any], float]:
        """The factor out of rope_scaling/rope_parameters, Phi-3's older names of LongRoPE (su,
        yarn: transformers reads both as longrope) as longrope, and a window no shorter than the
        context (Phi-4-mini's 262144) as none."""
        key = "rope_scaling" if isinstance(hf.get("rope_scaling"), dict) else "rope_parameters"
        params = dict(hf.get(key) or {})
        partial = params.pop("partial_rotary_factor", None)
        if partial is None:
            partial = hf.get("partial_rotary_factor", 1.0)
        if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
            raise ConfigError("partial_rotary_factor", f"{partial!r} must be in (0, 1]", where)
        kind = params.get("rope_type", params.get("type"))
        if kind in ("su", "yarn"):
            params["rope_type"] = "longrope"
            params.pop("type", None)
        hf = {**hf, key: params or None}
        window = hf.get("sliding_window")
        if window is not None and window >= hf["max_position_embeddings"]:
            window = None
        return {**hf, "sliding_window": window}, float(partial)

    def window_from_hf(self, hf: dict[str, Any], where: str) -> int | None:
        return hf.get("sliding_window")

    def config_to_hf(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        """Llama's keys, Phi-3's (`family_keys`), and LongRoPE's rope_scaling as Phi-3's
        published config.json holds it: type, short_factor and long_factor, the three keys
        transformers 4's Phi3Config accepts (it derives the factor from the lengths and the
        attention factor from that). A factor or attention factor other than those derived is
        written too, which transformers 5 reads and 4 refuses."""
        out = super().config_to_hf(cfg, router_aux_loss_coef)
        s = cfg.rope_scaling
        if s.type != "longrope":
            return out
        rope: dict[str, Any] = {
            "type": "longrope",
            "short_factor": list(s.short_factor),
            "long_factor": list(s.long_factor),
        }
        original = s.original_max_position_embeddings
        if not math.isclose(s.factor, cfg.max_seq_len / original, rel_tol=1e-9):
            rope["factor"] = s.factor
        derived = math.sqrt(1 + math.log(s.factor) / math.log(original)) if s.factor > 1 else 1.0
        if s.attention_factor is not None and not math.isclose(
            s.attention_factor, derived, rel_tol=1e-9
        ):
            rope["attention_factor"] = s.attention_factor
        return {**out, "rope_scaling": rope}

    def family_keys(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        """The partial factor and the original length at the top level, where every
        transformers version reads them."""
        s = cfg.rope_scaling
        original = s.original_max_position_embeddings if s.type == "longrope" else cfg.max_seq_len
        return {
            "partial_rotary_factor": cfg.partial_rotary,
            "original_max_position_embeddings": original,
            "sliding_window": cfg.sliding_window,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
        }

    def qkv_from_hf(self, cfg: ModelConfig, src: Mapping[str, Tensor], attn: str) -> Tensor:
        if attn + "qkv_proj.weight" not in src:
            return rotary_rows_to_ours(super().qkv_from_hf(cfg, src, attn), cfg)
        w = src[attn + "qkv_proj.weight"]
        rows = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
        if w.shape[0] != rows:
            raise RuntimeError(f"{attn}qkv_proj.weight has {w.shape[0]} rows, not {rows}")
        return rotary_rows_to_ours(w, cfg)

    def ffn_from_hf(
        self, cfg: ModelConfig, src: Mapping[str, Tensor], theirs: str, ours: str, i: int
    ) -> Named:
        mlp = theirs + "mlp."
        if mlp + "gate_up_proj.weight" not in src:
            yield from super().ffn_from_hf(cfg, src, theirs, ours, i)
            return
        w = src[mlp + "gate_up_proj.weight"]
        if w.shape[0] % 2:
            raise RuntimeError(f"{mlp}gate_up_proj.weight has an odd number of rows")
        yield ours + "w_gate_up.weight", w
        yield ours + "w_down.weight", src[mlp + "down_proj.weight"]

    def qkv_to_hf(self, cfg: ModelConfig, wqkv: Tensor, attn: str) -> Named:
        yield attn + "qkv_proj.weight", rotary_rows_to_hf(wqkv, cfg)

    def ffn_to_hf(
        self, cfg: ModelConfig, sd: Mapping[str, Tensor], ours: str, theirs: str, i: int
    ) -> Named:
        yield theirs + "mlp.gate_up_proj.weight", sd[ours + "w_gate_up.weight"]
        yield theirs + "mlp.down_proj.weight", sd[ours + "w_down.weight"]

    def fused_rows(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {}  # qkv_proj and gate_up_proj are one module each, fused as ours

    def peft_rows(self, cfg: ModelConfig, target: str, b: Tensor) -> tuple[Tensor, ...]:
        return (rotary_rows_to_hf(b, cfg),) if target == "wqkv" else (b,)

    def gguf_rope_tensors(self, cfg: ModelConfig) -> list[tuple[str, Tensor]]:
        """LongRoPE's factors as phi3's `rope_factors_long`/`_short`: what each frequency is
        divided by."""
        if cfg.rope_scaling.type != "longrope":
            return super().gguf_rope_tensors(cfg)
        import gguf

        return [
            (gguf.TENSOR_NAMES[tensor] + ".weight", torch.tensor(factors))
            for tensor, factors in (
                (gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, cfg.rope_scaling.long_factor),
                (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, cfg.rope_scaling.short_factor),
            )
        ]

    def gguf_arch(self, cfg: ModelConfig) -> Any:
        check_gguf_rope(cfg)
        check_gguf_window(cfg)
        return arch_named(self.llama_cpp_arch)

    def gguf_name(self, name: str, tokenizer: Any, where: str) -> str:
        """`name` with "phi3" where the tokenizer strips whitespace after its special tokens as
        llama.cpp does for a name holding it, and without it where it does not (each written
        "phi_3"); a tokenizer that strips but lacks a token llama.cpp then looks up is refused."""
        specials = [t for t in tokenizer.get_added_tokens_decoder().values() if t.special]
        strips = [t.content for t in specials if t.content not in _NOT_COMPARED and t.rstrip]
        kept = [t.content for t in specials if t.content not in _NOT_COMPARED and not t.rstrip]
        named = any(k in name.lower() for k in _LLAMA_CPP_KEYS)
        if not strips or kept:  # llama.cpp must not strip: no phi3 in the name
            if kept and strips:
                raise CheckpointError(
                    f"{where}: added_tokens: {strips[0]} strips the whitespace after it "
                    f"(rstrip) and {kept[0]} does not; llama.cpp strips after all of Phi-3's "
                    "special tokens or none, not exported"
                )
            for key in _LLAMA_CPP_KEYS if named else ():
                i = name.lower().find(key)
                while i >= 0:
                    name = name[:i] + name[i : i + len(key) - 1] + "_3" + name[i + len(key) :]
                    i = name.lower().find(key)
            return name
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        missing = [t for t in _LLAMA_CPP_LOOKS_UP if t not in vocab]
        if missing:
            raise CheckpointError(
                f"{where}: has no {missing[0]}, which llama.cpp looks up to strip the whitespace "
                f"after {strips[0]} (rstrip) as Phi-3's tokenizer does, not exported"
            )
        return name if named else f"{name} (phi3)"


def _head_order(cfg: ModelConfig) -> torch.Tensor:
    """HF's dimension of each of ours within a head (D,), for partial RoPE."""
    D, R = cfg.head_dim, cfg.rotary_dim
    half, rest = R // 2, (D - R) // 2
    return torch.cat(
        (
            torch.arange(half),
            torch.arange(R, R + rest),
            torch.arange(half, R),
            torch.arange(R + rest, D),
        )
    )


def _permute_qk(w: torch.Tensor, cfg: ModelConfig, order: torch.Tensor) -> torch.Tensor:
    """The rows (dim 0) of a [q; k; v] weight, bias or LoRA B with each q and k head's rows
    taken in `order`; v's as they are."""
    H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    qk, v = w[: (H + K) * D], w[(H + K) * D :]
    heads = qk.reshape(H + K, D, *w.shape[1:])
    return torch.cat((heads[:, order].reshape(qk.shape), v))


def rotary_rows_to_ours(w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF's qkv rows in our order (module docstring); unchanged with partial_rotary 1."""
    if cfg.rotary_dim == cfg.head_dim:
        return w
    return _permute_qk(w, cfg, _head_order(cfg))


def rotary_rows_to_hf(w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Our qkv rows in HF's order: rotary_rows_to_ours undone."""
    if cfg.rotary_dim == cfg.head_dim:
        return w
    return _permute_qk(w, cfg, torch.argsort(_head_order(cfg)))
