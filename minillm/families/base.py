"""What every family shares: the `Family` interface the registry holds, and the Hugging Face
pieces more than one family reads or writes (RoPE's keys both ways, the config.json tail, a
SwiGLU's three projections).

Offers `Family`, `Refuse`, `hf_rope_scaling`, `rope_from_hf`, `config_tail`, `swiglu_from_hf`,
`swiglu_to_hf` and `gguf_refusal`.

A family is one object (minillm.families.registry holds them by name): its config.json reader
and writer with transformers' defaults, its state-dict adapter both ways, working tensor by
tensor (`from_hf`, `to_hf`: each yielded tensor is built from the fewest source tensors, which
a lazy mapping reads on `__getitem__`), its peft module names, its llama.cpp architecture with
its keys and refusals, its end-of-turn ids and what the decoder's fast path serves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from minillm.config import ModelConfig
from minillm.errors import CheckpointError, ConfigError

Tensor = torch.Tensor
Named = Iterator[tuple[str, Tensor]]
Refuse = Callable[[str, str], CheckpointError]

# model.rope_scaling's keys as transformers' rope_parameters spell them (all but `type`).
ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "truncate",
        "mscale",
        "mscale_all_dim",
    ),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "short_factor",
        "long_factor",
    ),
}
# Our fused layer -> peft's modules (under model.layers.N.) and how B's rows split among them.
PEFT_MODULES = {
    "wqkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "wo": ("self_attn", ("o_proj",)),
    "w_gate_up": ("mlp", ("gate_proj", "up_proj")),
    "w_down": ("mlp", ("down_proj",)),
}


def arch_named(name: str) -> Any:
    """The gguf.MODEL_ARCH llama.cpp calls `name` (general.architecture)."""
    import gguf

    return {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[name]


def gguf_refusal(key: str, what: str) -> CheckpointError:
    """The one error line of an option llama.cpp has no equivalent for."""
    return CheckpointError(f"model.{key}: {what}; llama.cpp has no equivalent, not exported")


class Family:
    """One published model family: what minillm reads, writes and refuses for it."""

    name: ClassVar[str] = ""  # model.family's value
    model_type: ClassVar[str] = ""  # config.json's
    hf_class: ClassVar[str] = ""  # config.json's architectures
    # What transformers' config class gives a key config.json leaves out.
    defaults: ClassVar[dict[str, Any]] = {}
    # The tokens the published generation_config.json stops at, for a folder without one, and
    # the one its template writes after a reply.
    end_of_turn: ClassVar[tuple[str, ...]] = ()
    turn_end: ClassVar[str | None] = None
    # The families whose options this one's class also computes (a Mistral without a window).
    accepts: ClassVar[tuple[str, ...]] = ()
    peft_modules: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = PEFT_MODULES
    llama_cpp_arch: ClassVar[str] = ""  # its llama.cpp architecture (general.architecture)

    def config_from_hf(self, hf: dict[str, Any], where: str) -> ModelConfig:
        """Our ModelConfig of the family's config.json, `defaults` already filled in."""
        raise NotImplementedError

    def config_to_hf(self, cfg: ModelConfig, router_aux_loss_coef: float) -> dict[str, Any]:
        """config.json for `cfg` but the tail every family ends with (`config_tail`)."""
        raise NotImplementedError

    def from_hf(self, cfg: ModelConfig, src: Mapping[str, Tensor]) -> Named:
        """(our name, tensor) of every parameter from HF-named `src`, read key by key (`key in
        src` asks its keys only); KeyError names a missing tensor, RuntimeError parts that do
        not join. Dtypes as they are."""
        raise NotImplementedError

    def to_hf(self, cfg: ModelConfig, sd: Mapping[str, Tensor]) -> Named:
        """(HF name, tensor) of every tensor of our state dict `sd`."""
        raise NotImplementedError

    def check_peft(self, cfg: ModelConfig) -> None:
        """A ConfigError where the family's adapters have no peft layout minillm writes."""

    def fused_rows(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The rows of each of our fused layers that are one Hugging Face module each (q, k, v
        of wqkv; gate, up of w_gate_up): what bitsandbytes quantizes as one weight under
        transformers, so QLoRA's NF4 base (minillm.model.nf4) quantizes them so too."""
        H, K, D, F = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.ffn_hidden
        return {"wqkv": (H * D, K * D, K * D), "w_gate_up": (F, F)}

    def peft_rows(self, cfg: ModelConfig, target: str, b: Tensor) -> tuple[Tensor, ...]:
        """A LoRA B of our fused `target` split by rows into its peft modules' B's (the rows of
        `fused_rows`; wo and w_down are one module each)."""
        rows = {"wo": (cfg.d_model,), "w_down": (cfg.d_model,), **self.fused_rows(cfg)}
        return b.split(rows[target], dim=0)

    def gguf_arch(self, cfg: ModelConfig) -> Any:
        """llama.cpp's architecture (a gguf.MODEL_ARCH) for `cfg`, or a CheckpointError naming
        the option its graph computes otherwise."""
        raise gguf_refusal("family", f"{self.name} has no llama.cpp architecture minillm writes")

    def add_gguf_keys(self, w: Any, cfg: ModelConfig) -> None:
        """The architecture's hyper-parameters (heads, lengths, experts) on a GGUFWriter."""
        raise NotImplementedError

    def gguf_rope_tensors(self, cfg: ModelConfig) -> list[tuple[str, Tensor]]:
        """(GGUF name, tensor) of the RoPE scaling llama.cpp reads as tensors: llama3's
        `rope_freqs`, what each plain frequency is divided by (convert_hf_to_gguf.py's
        rope_factors), from our own frequencies."""
        if cfg.rope_scaling.type != "llama3":
            return []
        import dataclasses

        import gguf

        from minillm.model.rope import inv_frequencies

        plain = ModelConfig(**{**dataclasses.asdict(cfg), "rope_scaling": {}})
        freqs = inv_frequencies(plain)[0] / inv_frequencies(cfg)[0]
        return [(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", freqs)]

    def gguf_tensor(self, cfg: ModelConfig, hf_name: str, w: Tensor) -> list[tuple[str, Tensor]]:
        """(HF-style name, tensor) to look up in gguf's name map for one HF tensor: itself, or
        the family's own split or shift of it."""
        return [(hf_name, w)]

    def gguf_name(self, name: str, tokenizer: Any, where: str) -> str:
        """general.name for a file named `name` of a model with `tokenizer` (a tokenizers
        Tokenizer read from `where`): `name`, or what llama.cpp keys its tokenizer on (Phi-3's)."""
        return name

    def fast_decode(self, cfg: ModelConfig) -> bool:
        """Whether minillm.model.decode's fast loop computes this family's block."""
        from minillm.model.decode import fast_path_serves

        return fast_path_serves(cfg)


# ----------------------------------------------------------------------------- HF pieces


def hf_rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """config.json's rope_scaling for model.rope_scaling (None for plain RoPE), which
    transformers 4 reads as such and 5 as its rope_parameters."""
    s = cfg.rope_scaling
    if s.type == "none":
        return None
    out: dict[str, Any] = {"rope_type": s.type, "rope_theta": cfg.rope_theta}
    out.update({k: getattr(s, k) for k in ROPE_KEYS[s.type] if getattr(s, k) is not None})
    return out


def rope_from_hf(hf: dict[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """rope_theta and model.rope_scaling's values from config.json's rope_scaling (transformers
    4) or rope_parameters (5), `hf` with its family's defaults filled in; what minillm does not
    compute is a ConfigError naming the key."""
    key, params = "rope_parameters", hf.get("rope_parameters")
    if isinstance(hf.get("rope_scaling"), dict):
        key, params = "rope_scaling", hf["rope_scaling"]
    params = params if isinstance(params, dict) else {}
    theta = params.get("rope_theta", hf["rope_theta"])
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), {}
    if kind not in ROPE_KEYS or (kind == "longrope" and hf.get("model_type") != "phi3"):
        kinds = ", ".join(k for k in ROPE_KEYS if k != "longrope") + "; longrope in Phi-3 only"
        raise ConfigError(key, f"rope_type {kind!r} is not supported (minillm: {kinds})", where)
    for extra in ("mscale", "mscale_all_dim"):  # DeepSeek's (MLA's softmax scale) for any type
        if kind != "yarn" and params.get(extra):
            message = f"{params[extra]!r} with {kind} is not supported"
            raise ConfigError(f"{key}.{extra}", message, where)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{key}.partial_rotary_factor", "partial RoPE is not supported", where)
    scaling = {
        "type": kind,
        **{k: params[k] for k in ROPE_KEYS[kind] if params.get(k) is not None},
    }
    max_len = hf["max_position_embeddings"]
    if kind == "dynamic":  # transformers scales past max_position_embeddings
        scaling["original_max_position_embeddings"] = max_len
    elif kind in ("yarn", "llama3", "longrope"):  # transformers' defaults where it has none
        # transformers 5 prefers a top-level original_max_position_embeddings (Phi-3's place
        # for it) to rope_scaling's own.
        if hf.get("original_max_position_embeddings") is not None:
            scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        scaling.setdefault("original_max_position_embeddings", max_len)
        if "factor" not in scaling:
            scaling["factor"] = max_len / scaling["original_max_position_embeddings"]
    return float(theta), scaling


def config_tail(bos_id: int | None, eos_id: int | None, dtype: str = "float32") -> dict[str, Any]:
    """The keys every config.json minillm writes ends with, whatever the family; `dtype` is the
    weights' (what `from_pretrained(dtype="auto")` and minillm's `--dtype auto` load in)."""
    return {
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        # No pad id: LlamaModel hands it to nn.Embedding as padding_idx, whose row then never
        # gets a gradient, and ours is end-of-text, which a fine-tune must keep learning.
        "pad_token_id": None,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def refuse_values(hf: dict[str, Any], refused: list[tuple[str, Any]], where: str) -> None:
    """A ConfigError naming the first key of config.json whose value minillm does not compute."""
    for key, ok in refused:
        if hf.get(key, ok) != ok:
            raise ConfigError(key, f"{hf[key]!r} is not supported (minillm needs {ok!r})", where)


def swiglu_from_hf(src: Mapping[str, Tensor], theirs: str, ours: str) -> Named:
    """A SwiGLU's gate_proj and up_proj as our fused [gate; up], and its down_proj."""
    gate_up = torch.cat([src[theirs + "gate_proj.weight"], src[theirs + "up_proj.weight"]], dim=0)
    yield ours + "w_gate_up.weight", gate_up
    yield ours + "w_down.weight", src[theirs + "down_proj.weight"]


def swiglu_to_hf(sd: Mapping[str, Tensor], ours: str, theirs: str) -> Named:
    """A SwiGLU's fused [gate; up] and down as gate_proj, up_proj and down_proj."""
    gate, up = sd[ours + "w_gate_up.weight"].chunk(2, dim=0)
    yield theirs + "gate_proj.weight", gate
    yield theirs + "up_proj.weight", up
    yield theirs + "down_proj.weight", sd[ours + "w_down.weight"]


def experts_from_hf(
    src: Mapping[str, Tensor], moe: str, ours: str, names: tuple[str, str, str], E: int
) -> Named:
    """One layer's experts, stacked as ours (E, 2F, C) and (E, C, F), from transformers 5's
    stacks (`moe`experts.gate_up_proj, already our layout) or the published per-expert
    names (gate, up, down of `names`)."""
    stacked = moe + "experts."
    if stacked + "gate_up_proj" in src:
        yield ours + "w_gate_up", src[stacked + "gate_up_proj"]
        yield ours + "w_down", src[stacked + "down_proj"]
        return
    experts = [stacked + f"{e}." for e in range(E)]
    gate, up, down = (f"{n}.weight" for n in names)
    yield (
        ours + "w_gate_up",
        torch.stack([torch.cat([src[x + gate], src[x + up]]) for x in experts]),
    )
    yield ours + "w_down", torch.stack([src[x + down] for x in experts])


def experts_to_hf(
    sd: Mapping[str, Tensor], ours: str, moe: str, names: tuple[str, str, str], E: int
) -> Named:
    """One layer's stacked experts under the published per-expert names (gate, up, down)."""
    for e in range(E):
        gate, up = sd[ours + "w_gate_up"][e].chunk(2, dim=0)
        expert = moe + f"experts.{e}."
        yield expert + f"{names[0]}.weight", gate
        yield expert + f"{names[1]}.weight", up
        yield expert + f"{names[2]}.weight", sd[ours + "w_down"][e]
