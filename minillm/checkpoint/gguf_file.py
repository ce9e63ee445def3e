"""GGUF files for llama.cpp, Ollama, LM Studio and llama-cpp-python: `export --format gguf`.

Offers `GGUF_DTYPES`, `check_gguf_target`, `gguf_arch`, `gguf_tensors` and `export_gguf` (what the
command runs); the tokenizer's part of the file is minillm.checkpoint.gguf_tokens, the Modelfile
minillm.checkpoint.ollama.

The file is written with gguf-py, the llama.cpp project's own writer, the way its
`convert_hf_to_gguf.py` writes a `LlamaForCausalLM`, except that the tokenizer is described
from what we know rather than guessed: that converter recognises a BPE pre-tokenizer by hashing
the ids of a test string, so it refuses every freshly trained vocabulary. Ours splits text with
GPT-2's byte-level regex, which llama.cpp calls `gpt-2`; a published model's Qwen2, Llama 3 or
SmolLM split is recognised by its tokenizer.json (gguf_tokens.LLAMA_CPP_SPLITS); any other
pre-tokenizer is refused in one line rather than exported with a split that would silently
differ. A sentencepiece-style BPE is llama.cpp's SPM (`llama`) model (gguf_spm).

Weights go through the HF names (minillm.model.hf_names) and gguf's own HF -> GGUF name map. The
architecture is llama.cpp's own for the family (`gguf_arch`): `gemma3` (Gemma's block: norms as (1 +
w), the local layers' window, pattern and RoPE base as keys), `deepseek2` (model.attention mla,
DeepSeekMoE: minillm.checkpoint.gguf_deepseek), `qwen3` (model.qk_norm), `qwen2`
(model.attention_bias), `qwen3moe` (experts and qk_norm), `qwen2moe` (experts and a shared expert),
`phi3` (model.partial_rotary, longrope: fused qkv and gate-up tensors, LongRoPE's factors as its
`rope_factors_long`/`rope_factors_short` tensors and attention factor as a key; llama.cpp picks the
long factors by its context size, n_ctx past the original length, where transformers and minillm
pick them by the sequence's length) or `llama` (Mixtral's experts too). llama.cpp's `llama` RoPE
rotates adjacent pairs (x0, x1), (x2, x3) ... where ours and HF's rotate halves (x_i, x_{i + D/2}),
so for it the rows of wq and wk are permuted per head as the converter does; the qwen and phi3
graphs rotate halves (NEOX) and take them as HF has them. RoPE scaling: linear and yarn as
llama.cpp's rope.scaling keys, llama3 as the `rope_freqs` tensor of per-frequency divisors; what
llama.cpp cannot compute (dynamic NTK, a sliding window shorter than the context outside gemma3,
YaRN without truncation, dense blocks in an MoE) is one error line naming the key, and nothing
written. Beside the .gguf an Ollama Modelfile (`NAME.Modelfile`) carries the chat template in
Ollama's Go form where minillm.checkpoint.ollama recognises its format, and the stop tokens."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minillm.checkpoint.gguf_deepseek import add_deepseek2_keys, deepseek2_problem, split_kv_b
from minillm.checkpoint.gguf_tokens import (
    gguf_specials,
    gguf_vocab,
)
from minillm.checkpoint.hf_export import KEPT, check_not_over_source
from minillm.checkpoint.ollama import modelfile_path, modelfile_text
from minillm.config import ModelConfig
from minillm.errors import CheckpointError, UserError
from minillm.model.hf_names import hf_model_type
from minillm.runtime.disk_space import raise_if_disk_full
from minillm.runtime.files import StagedFile, fsync_dir, fsync_file

GGUF_DTYPES = ("f32", "f16", "q8_0")
Q8_0_BLOCK = 32  # q8_0 quantises rows in blocks of 32 values


def check_gguf_target(
    out: str | Path, force: bool, source: str | Path | None = None, dtype: str = "f32"
) -> None:
    """UserError for an unknown dtype, a name not ending in .gguf, an existing .gguf or Modelfile
    without force, a folder in their place, or a target among the checkpoint's own files."""
    if dtype not in GGUF_DTYPES:
        raise UserError(f"--dtype: {dtype!r} is not one of {', '.join(GGUF_DTYPES)}")
    out = Path(out)
    if out.suffix != ".gguf":
        raise UserError(f"--out {out}: a GGUF file's name ends in .gguf")
    if source is not None:
        check_not_over_source(out, Path(source))
    for path in (out, modelfile_path(out)):
        if path.is_dir():
            raise UserError(f"{path}: is a folder; choose another --out")
        if path.exists() and not force:
            raise UserError(f"{path}: exists (pass --force to replace it)")


# ----------------------------------------------------------------------------- weights


def rope_pairs_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q or k projection (n_head * D, C) from rotate-half to adjacent-pair order.

    Per head, row i < D/2 and row i + D/2 form one RoPE pair here; llama.cpp wants them as
    rows 2i and 2i + 1. convert_hf_to_gguf.py's LlamaModel.permute, in torch.
    """
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).transpose(1, 2).reshape(rows, cols)


def gguf_arch(cfg: ModelConfig) -> Any:
    """llama.cpp's architecture (a gguf.MODEL_ARCH) that computes `cfg`, or a CheckpointError
    naming the option none of them has."""
    import gguf

    def refuse(key: str, what: str) -> CheckpointError:
        return CheckpointError(f"model.{key}: {what}; llama.cpp has no equivalent, not exported")

    s = cfg.rope_scaling
    if cfg.attention == "mla":  # its own YaRN and MoE rules (gguf_deepseek)
        problem = deepseek2_problem(cfg, refuse)
        if problem is not None:
            raise problem
        if s.type == "yarn":
            _check_yarn_ranges(s, refuse)
        return gguf.MODEL_ARCH.DEEPSEEK2
    if s.type == "dynamic":
        raise refuse("rope_scaling.type", "dynamic (NTK frequencies that follow the length)")
    if s.type == "yarn":
        # llama.cpp's llama and qwen graphs take YaRN's factor and original length, and use the
        # paper's defaults for the rest (measured: its yarn_attn_factor and beta keys change
        # nothing there).
        default = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
        if s.attention_factor is not None and not math.isclose(
            s.attention_factor, default, rel_tol=1e-6
        ):
            what = f"{s.attention_factor} (llama.cpp's YaRN uses {default:g})"
            raise refuse("rope_scaling.attention_factor", what)
        _check_yarn_ranges(s, refuse)
    if hf_model_type(cfg) == "gemma3_text":
        return _gemma3_arch(cfg, refuse)
    if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_seq_len:
        raise refuse(
            "sliding_window",
            f"{cfg.sliding_window} (its llama, qwen2, qwen3 and phi3 see it all: llama.cpp "
            "turns Phi-3's window off)",
        )
    if hf_model_type(cfg) == "phi3":  # none or longrope: hf_model_type checked
        return gguf.MODEL_ARCH.PHI3
    if cfg.n_experts:
        arch = _moe_arch(cfg, refuse)
    elif cfg.qk_norm or cfg.attention_bias:
        arch = gguf.MODEL_ARCH.QWEN3 if cfg.qk_norm else gguf.MODEL_ARCH.QWEN2
    else:
        arch = gguf.MODEL_ARCH.LLAMA
    if s.type == "llama3" and arch != gguf.MODEL_ARCH.LLAMA:  # only its llama graph reads it
        raise refuse("rope_scaling.type", f"llama3 in a {gguf.MODEL_ARCH_NAMES[arch]} model")
    return arch


def _check_yarn_ranges(s: Any, refuse: Any) -> None:
    """YaRN's correction range as llama.cpp computes it: beta 32 and 1, truncated."""
    for key, value, want in (("beta_fast", s.beta_fast, 32.0), ("beta_slow", s.beta_slow, 1.0)):
        if value is not None and not math.isclose(value, want, rel_tol=1e-6):
            raise refuse(f"rope_scaling.{key}", f"{value} (llama.cpp's YaRN uses {want:g})")
    if not s.truncate:
        raise refuse("rope_scaling.truncate", "false (llama.cpp rounds the correction range)")


def _moe_arch(cfg: ModelConfig, refuse: Any) -> Any:
    """llama.cpp's graph for a mixture of experts: `qwen3moe` (qk_norm; top-k renormalised),
    `qwen2moe` (a gated shared expert, q/k/v biases; softmax weights kept) or `llama` (Mixtral:
    renormalised). Each makes every block sparse: model.moe_dense_layers has no equivalent."""
    import gguf

    if cfg.moe_dense_layers:
        raise refuse("moe_dense_layers", f"{cfg.moe_dense_layers} (its MoE graphs have none)")
    if cfg.moe_router == "sigmoid":
        raise refuse("moe_router", "sigmoid (the llama and qwen MoE graphs route by softmax)")
    if cfg.qk_norm and not (cfg.moe_shared_ffn_hidden or cfg.attention_bias):
        arch, renormalised = gguf.MODEL_ARCH.QWEN3MOE, True
    elif cfg.moe_shared_ffn_hidden and not cfg.qk_norm:
        if not cfg.attention_bias:
            raise refuse("attention_bias", "false with a shared expert (its qwen2moe has biases)")
        arch, renormalised = gguf.MODEL_ARCH.QWEN2MOE, False
    elif not (cfg.qk_norm or cfg.attention_bias or cfg.moe_shared_ffn_hidden):
        arch, renormalised = gguf.MODEL_ARCH.LLAMA, True
    else:  # hf_model_type's rule: no family has these together
        raise refuse("n_experts", "with qk_norm, attention_bias and a shared expert as no graph")
    if cfg.moe_norm_topk != renormalised:
        does = "renormalises" if renormalised else "does not renormalise"
        name = gguf.MODEL_ARCH_NAMES[arch]
        raise refuse("moe_norm_topk", f"{cfg.moe_norm_topk} (its {name} {does} the top k)")
    return arch


def _gemma3_arch(cfg: ModelConfig, refuse: Any) -> Any:
    """llama.cpp's gemma3, for what its graph computes: Gemma's softmax scale (1/sqrt(head_dim);
    27B's d_model/n_head), plain or linear RoPE on the global layers."""
    import gguf

    if cfg.rope_scaling.type not in ("none", "linear"):
        raise refuse("rope_scaling.type", f"{cfg.rope_scaling.type} in a gemma3 model")
    # llama.cpp's gemma3 scales by head_dim, or by d_model / n_head when it takes the model for
    # Gemma 3 27B (62 layers); it reads no key for it.
    theirs = cfg.d_model // cfg.n_head if cfg.n_layer == 62 else cfg.head_dim
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    if scalar != theirs:
        raise refuse("query_pre_attn_scalar", f"{scalar} (llama.cpp's gemma3 here: {theirs})")
    return gguf.MODEL_ARCH.GEMMA3


def llama3_rope_freqs(cfg: ModelConfig) -> torch.Tensor:
    """llama.cpp's `rope_freqs` (D/2,) for rope_scaling llama3: what each plain frequency is
    divided by (convert_hf_to_gguf.py's rope_factors), from our own frequencies."""
    from minillm.model.rope import inv_frequencies

    plain = ModelConfig(**{**dataclasses.asdict(cfg), "rope_scaling": {}})
    return inv_frequencies(plain)[0] / inv_frequencies(cfg)[0]


def gguf_tensors(
    state: dict[str, torch.Tensor], cfg: ModelConfig, dtype: str
) -> list[tuple[str, np.ndarray, Any]]:
    """(GGUF name, data, GGMLQuantizationType) for every tensor of our float32 `state`.

    Norms stay f32 (llama.cpp adds them to f32 activations). f16 and q8_0 apply to the 2-D
    weights; a q8_0 weight whose rows are not a multiple of 32 long is written f16 instead, as
    llama.cpp's converter falls back. A tied head writes no `output.weight`: llama.cpp then uses
    the token embedding, as our model does. A mixture of experts' router is `ffn_gate_inp`
    (E, C), kept f32 as llama.cpp's converter keeps it, and its experts the stacks
    `ffn_gate_exps`, `ffn_up_exps` (E, F, C) and `ffn_down_exps` (E, C, F); qwen2moe's shared
    expert its `*_shexp` tensors, the gate `ffn_gate_inp_shexp` (C,), and its head always (its
    loader has no tied head: a tied one is written as a copy of the embedding).
    """
    import gguf
    from gguf.quants import quantize

    from minillm.model.hf_names import to_hf_state_dict

    qtypes = gguf.GGMLQuantizationType
    arch = gguf_arch(cfg)
    names = gguf.get_tensor_name_map(arch, cfg.n_layer)
    pairs = arch == gguf.MODEL_ARCH.LLAMA  # qwen2/qwen3 rotate halves, as we do
    # deepseek2 rotates pairs, which DeepSeek's HF layout already holds (gguf_deepseek)
    deepseek = arch == gguf.MODEL_ARCH.DEEPSEEK2
    # gemma3 takes Gemma's norms as (1 + w), as its converter writes them: ours as they are
    norm_shift = 1.0 if arch == gguf.MODEL_ARCH.GEMMA3 else 0.0
    named: list[tuple[str, torch.Tensor]] = []
    if cfg.rope_scaling.type == "llama3":
        named.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                      llama3_rope_freqs(cfg)))  # fmt: skip
    if cfg.rope_scaling.type == "longrope":  # phi3's: what each frequency is divided by
        for tensor, factors in (
            (gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, cfg.rope_scaling.long_factor),
            (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, cfg.rope_scaling.short_factor),
        ):
            named.append((gguf.TENSOR_NAMES[tensor] + ".weight", torch.tensor(factors)))
    hf_state = to_hf_state_dict(state, cfg)
    if cfg.tie_embeddings and arch == gguf.MODEL_ARCH.QWEN2MOE:
        hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]
    for hf_name, w in hf_state.items():
        moe = ".block_sparse_moe." in hf_name or ".mlp.experts." in hf_name
        router = hf_name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        if moe or router:  # the experts, router and routing bias: below
            continue
        if deepseek and hf_name.endswith("kv_b_proj.weight"):  # W_uk, W_uv as its graph absorbs
            prefix = names.get_name(hf_name.replace("kv_b_proj", "k_b_proj"), (".weight",))
            k_b, v_b = split_kv_b(w, cfg)
            named += [(prefix, k_b), (prefix.replace("attn_k_b", "attn_v_b"), v_b)]
            continue
        if hf_name.endswith("shared_expert_gate.weight"):  # (1, C): llama.cpp reads (C,)
            w = w.reshape(-1)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:  # a name gguf does not know would be a bug in the mapping
            raise RuntimeError(f"gguf has no {arch.name.lower()} tensor for {hf_name}")
        if pairs and hf_name.endswith("q_proj.weight"):
            w = rope_pairs_permute(w, cfg.n_head)
        elif pairs and hf_name.endswith("k_proj.weight"):
            w = rope_pairs_permute(w, cfg.n_kv_head)
        elif norm_shift and hf_name.endswith("norm.weight"):
            w = w + norm_shift
        named.append((name, w))
    for i in range(cfg.n_layer if cfg.n_experts else 0):  # dense only in deepseek2
        if i in cfg.moe_dense_layers:
            continue
        gate, up = state[f"blocks.{i}.ffn.w_gate_up"].chunk(2, dim=1)  # (E, F, C) each
        bias = state.get(f"blocks.{i}.ffn.router_bias")  # the sigmoid router's: for choice
        if bias is not None:
            name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_EXP_PROBS_B].format(bid=i)
            named.append((name + ".bias", bias))
        for tensor, w in (
            (gguf.MODEL_TENSOR.FFN_GATE_INP, state[f"blocks.{i}.ffn.router.weight"]),
            (gguf.MODEL_TENSOR.FFN_GATE_EXP, gate),
            (gguf.MODEL_TENSOR.FFN_UP_EXP, up),
            (gguf.MODEL_TENSOR.FFN_DOWN_EXP, state[f"blocks.{i}.ffn.w_down"]),
        ):
            named.append((gguf.TENSOR_NAMES[tensor].format(bid=i) + ".weight", w))
    out = []
    for name, w in named:
        data = w.detach().float().cpu().contiguous().numpy()
        if data.ndim == 1 or dtype == "f32" or name.endswith("ffn_gate_inp.weight"):
            out.append((name, data, qtypes.F32))
        elif dtype == "q8_0" and data.shape[-1] % Q8_0_BLOCK == 0:
            out.append((name, quantize(data, qtypes.Q8_0), qtypes.Q8_0))
        else:
            out.append((name, data.astype(np.float16), qtypes.F16))
    return out


# ----------------------------------------------------------------------------- Ollama


# ----------------------------------------------------------------------------- export


def _run_name(ckpt: Path) -> str:
    """The run's folder name: general.name, what llama.cpp and LM Studio show."""
    return ckpt.parent.parent.name if ckpt.parent.name == "checkpoints" else ckpt.name


def _file_type(dtype: str) -> int:
    from gguf import LlamaFileType

    return {
        "f32": LlamaFileType.ALL_F32,
        "f16": LlamaFileType.MOSTLY_F16,
        "q8_0": LlamaFileType.MOSTLY_Q8_0,
    }[dtype]


def _add_rope_scaling(w: Any, m: ModelConfig) -> None:
    """llama.cpp's rope.scaling keys for linear and yarn (llama3 is the rope_freqs tensor), and
    longrope's original length and attention factor (its factors are tensors)."""
    import gguf

    from minillm.model.rope import inv_frequencies

    s = m.rope_scaling
    if s.type == "longrope":  # as convert_hf_to_gguf.py's Phi-3
        w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)
        w.add_rope_scaling_attn_factors(inv_frequencies(m)[1])
        return
    if s.type not in ("linear", "yarn"):
        return
    w.add_rope_scaling_type(gguf.RopeScalingType(s.type))
    w.add_rope_scaling_factor(s.factor)
    if s.type == "yarn":  # the rest is llama.cpp's defaults, which gguf_arch checked
        w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)


def export_gguf(ckpt: Any, out: str | Path, dtype: str = "f32", force: bool = False) -> Path:
    """Write a LoadedCheckpoint as a llama.cpp GGUF file at `out` and an Ollama Modelfile beside
    it, each under a temporary name, fsynced, then renamed: a failure leaves both as they were.
    """
    import gguf

    from minillm import __version__

    out = Path(out)
    check_gguf_target(out, force, ckpt.path, dtype)
    cfg, m = ckpt.config, ckpt.config.model
    where = str(ckpt.path / "tokenizer.json")
    vocab = gguf_vocab(ckpt.tokenizer, m.vocab_size, where)  # before anything is written
    ids = gguf_specials(ckpt, where)
    state = {k: v.detach().float().cpu() for k, v in ckpt.model.state_dict().items()}
    arch = gguf_arch(m)  # before anything is written: an option llama.cpp lacks is refused
    tensors = gguf_tensors(state, m, dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    staged = StagedFile(out)
    modelfile = None
    w = gguf.GGUFWriter(staged.tmp, gguf.MODEL_ARCH_NAMES[arch])
    try:
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(_run_name(ckpt.path))
        w.add_string("minillm.version", __version__)
        w.add_file_type(_file_type(dtype))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        # Every hyper-parameter llama.cpp's llama loader reads (llama-model.cpp, LLM_ARCH_LLAMA).
        w.add_context_length(m.max_seq_len)
        w.add_embedding_length(m.d_model)
        w.add_block_count(m.n_layer)
        llama = arch == gguf.MODEL_ARCH.LLAMA
        w.add_feed_forward_length(m.moe_ffn_hidden if m.n_experts and llama else m.ffn_hidden)
        w.add_head_count(m.n_head)
        if arch == gguf.MODEL_ARCH.DEEPSEEK2:  # the latent's attention, DeepSeekMoE, YaRN
            add_deepseek2_keys(w, m)
        else:
            if m.n_experts:  # llama (Mixtral), qwen2moe, qwen3moe: softmax, top-k (gguf_arch)
                w.add_expert_count(m.n_experts)
                w.add_expert_used_count(m.n_experts_per_token)
                if not llama:
                    w.add_expert_feed_forward_length(m.moe_ffn_hidden)
                if m.moe_shared_ffn_hidden:
                    w.add_expert_shared_feed_forward_length(m.moe_shared_ffn_hidden)
            w.add_head_count_kv(m.n_kv_head)
            w.add_key_length(m.head_dim)
            w.add_value_length(m.head_dim)
        w.add_rope_freq_base(m.rope_theta)
        w.add_rope_dimension_count(m.rotary_dim)  # model.partial_rotary's (phi3)
        _add_rope_scaling(w, m)
        if arch == gguf.MODEL_ARCH.GEMMA3:  # its local layers: window, which ones, their base
            w.add_sliding_window(m.sliding_window or m.max_seq_len)
            w.add_sliding_window_pattern([m.local_layer(i) for i in range(m.n_layer)])
            local_theta = m.rope_theta if m.rope_local_theta is None else m.rope_local_theta
            w.add_rope_freq_base_swa(local_theta)
        w.add_layer_norm_rms_eps(m.norm_eps)
        w.add_vocab_size(m.vocab_size)
        # The tokenizer: byte-level BPE with the split gguf_vocab recognised, or llama.cpp's
        # SPM for a sentencepiece-style one (scores in place of merges).
        w.add_tokenizer_model(vocab.model)
        w.add_token_list(vocab.tokens)
        w.add_token_types(vocab.types)
        if vocab.scores is not None:
            w.add_token_scores(vocab.scores)
            w.add_add_space_prefix(bool(vocab.add_space_prefix))
        else:
            w.add_tokenizer_pre(vocab.pre)
            w.add_token_merges(vocab.merges)
        # The model's special ids (gguf_tokens.gguf_specials): minillm's own end-of-text as bos,
        # eos and pad, or a published model's own, and its BOS added where its tokenizer adds it.
        for add, value in (
            (w.add_bos_token_id, ids.bos),
            (w.add_eos_token_id, ids.eos),
            (w.add_pad_token_id, ids.pad),
            (w.add_eot_token_id, ids.eot),
            (w.add_unk_token_id, vocab.unk),
        ):
            if value is not None:
                add(value)
        w.add_add_bos_token(ids.add_bos)
        w.add_add_eos_token(ids.add_eos)
        if ids.template is not None:
            w.add_chat_template(ids.template)
        # The run's sampling defaults, which recent llama.cpp builds take when the user sets none.
        w.add_sampling_temp(cfg.sample.temperature)
        w.add_sampling_top_k(cfg.sample.top_k)
        w.add_sampling_top_p(cfg.sample.top_p)
        for name, data, qtype in tensors:
            w.add_tensor(name, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        fsync_file(staged.tmp)
        text = modelfile_text(out.name, ids, cfg.sample, m.max_seq_len, ckpt.conventions.special)
        modelfile = StagedFile.text(modelfile_path(out), text)
        check_gguf_target(out, force, ckpt.path, dtype)  # again: someone may have written since
        staged.commit()
        modelfile.commit()
    except BaseException as e:
        w.close()
        staged.discard()
        if modelfile is not None:
            modelfile.discard()
        need = lambda: sum(data.nbytes for _, data, _ in tensors)  # noqa: E731
        raise_if_disk_full(e, out.parent, f"the GGUF file {out.name}", need, KEPT)
        raise
    fsync_dir(out.parent)
    return out
