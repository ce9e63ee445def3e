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

Weights go through the HF names of the model's family (minillm.families: `to_hf`) and gguf's own
HF -> GGUF name map. The architecture, its keys, its tensor renames and its refusals are the
family's (`gguf_arch`, `add_gguf_keys`, `gguf_tensor`): llama.cpp's `llama` (Llama, Mistral,
Mixtral: q/k rows permuted to its adjacent RoPE pairs), `qwen2`, `qwen3`, `qwen2moe`, `qwen3moe`,
`gemma3`, `phi3` or `deepseek2`. RoPE scaling: linear and yarn as llama.cpp's rope.scaling keys,
llama3 as the `rope_freqs` tensor of per-frequency divisors, longrope as phi3's factor tensors;
what llama.cpp cannot compute (dynamic NTK, a sliding window shorter than the context outside
gemma3, YaRN without truncation, dense blocks in an MoE) is one error line naming the key, and
nothing written. Beside the .gguf an Ollama Modelfile (`NAME.Modelfile`) carries the chat
template in Ollama's Go form where minillm.checkpoint.ollama recognises its format, and the stop
tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from minillm.checkpoint.gguf_tokens import (
    gguf_specials,
    gguf_vocab,
)
from minillm.checkpoint.hf_export import KEPT, check_not_over_source
from minillm.checkpoint.ollama import modelfile_path, modelfile_text
from minillm.config import ModelConfig
from minillm.errors import UserError
from minillm.families import family_of
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


def gguf_arch(cfg: ModelConfig) -> Any:
    """llama.cpp's architecture (a gguf.MODEL_ARCH) that computes `cfg`: its family's, or a
    CheckpointError naming the option its graph computes otherwise."""
    return family_of(cfg).gguf_arch(cfg)


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

    qtypes = gguf.GGMLQuantizationType
    family = family_of(cfg)
    arch = family.gguf_arch(cfg)
    names = gguf.get_tensor_name_map(arch, cfg.n_layer)
    named: list[tuple[str, torch.Tensor]] = family.gguf_rope_tensors(cfg)
    for hf_name, hf_w in family.to_hf(cfg, state):
        moe = ".block_sparse_moe." in hf_name or ".mlp.experts." in hf_name
        router = hf_name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        if moe or router:  # the experts, router and routing bias: below
            continue
        for hf_part, w in family.gguf_tensor(cfg, hf_name, hf_w):
            name = names.get_name(hf_part, try_suffixes=(".weight", ".bias"))
            if name is None:  # a name gguf does not know would be a bug in the mapping
                raise RuntimeError(f"gguf has no {arch.name.lower()} tensor for {hf_part}")
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
    family = family_of(m)
    arch = family.gguf_arch(m)  # before anything is written: an option llama.cpp lacks is refused
    # What llama.cpp shows, and for Phi-3 what it keys its tokenizer on (Phi3.gguf_name).
    general_name = family.gguf_name(_run_name(ckpt.path), ckpt.tokenizer, where)
    tensors = gguf_tensors(state, m, dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    staged = StagedFile(out)
    modelfile = None
    w = gguf.GGUFWriter(staged.tmp, gguf.MODEL_ARCH_NAMES[arch])
    try:
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(general_name)
        w.add_string("minillm.version", __version__)
        w.add_file_type(_file_type(dtype))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        # Every hyper-parameter llama.cpp's llama loader reads (llama-model.cpp, LLM_ARCH_LLAMA).
        w.add_context_length(m.max_seq_len)
        w.add_embedding_length(m.d_model)
        w.add_block_count(m.n_layer)
        family.add_gguf_keys(w, m)  # heads, widths, experts: its architecture's
        w.add_rope_freq_base(m.rope_theta)
        w.add_rope_dimension_count(m.rotary_dim)  # model.partial_rotary's (phi3)
        _add_rope_scaling(w, m)
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
