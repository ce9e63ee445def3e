"""Family facts issue 59 found missing, each written by its family module: DeepSeek-V3's routing
keys for vLLM and SGLang (defect 1), Phi-3's published rope_scaling (2), the general.name llama.cpp
keys Phi-3's tokenizer on (6), Qwen3's head_dim and the MoE families' own defaults (8)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import transformers

from minillm.checkpoint.gguf_file import export_gguf
from minillm.checkpoint.store import load_checkpoint
from minillm.config import ModelConfig
from minillm.families import hf_config_dict, model_config_from_hf

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)
SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


def test_deepseek_v3s_export_routes_as_its_published_config() -> None:
    """vLLM and SGLang read scoring_func and topk_method (softmax and greedy when absent) and
    build the correction bias only for noaux_tc; DeepSeek-V3's config.json has them."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layer=3, n_head=4, attention="mla",
                      q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                      n_experts=4, moe_ffn_hidden=16, moe_shared_ffn_hidden=16,
                      moe_router="sigmoid", moe_dense_layers=[0])  # fmt: skip
    written = hf_config_dict(cfg, bos_id=0, eos_id=1, router_aux_loss_coef=0.001)
    published = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
                 "ep_size": 1, "seq_aux": True, "aux_loss_alpha": 0.001,
                 "pretraining_tp": 1}  # fmt: skip
    assert {k: written.get(k) for k in published} == published
    hf = transformers.DeepseekV3Config(**written)
    assert hf.n_routed_experts == 4 and hf.first_k_dense_replace == 1
    assert model_config_from_hf(written) == cfg.__class__(
        **{**cfg.__dict__, "family": "deepseek_v3"}
    )


def test_a_qwen3_config_without_head_dim_is_128_wide_as_transformers() -> None:
    hf = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=64, **SIZES)
    assert "head_dim" not in hf
    cfg = model_config_from_hf(hf)
    assert cfg.head_dim == transformers.Qwen3Config(**hf).head_dim == 128


@pytest.mark.parametrize("model_type, cls", [("qwen2_moe", "Qwen2MoeForCausalLM"),
                                             ("qwen3_moe", "Qwen3MoeForCausalLM")])  # fmt: skip
def test_a_moe_config_without_the_dense_width_reads_with_transformers_default(
    model_type: str, cls: str
) -> None:
    """intermediate_size is the dense layers' width, which a model without any never uses."""
    hf = dict(model_type=model_type, architectures=[cls], num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, shared_expert_intermediate_size=24, **SIZES)  # fmt: skip
    cfg = model_config_from_hf(hf)
    values = {k: v for k, v in hf.items() if k != "model_type"}
    theirs = transformers.AutoConfig.for_model(model_type, **values)
    assert cfg.ffn_hidden == theirs.intermediate_size
    assert cfg.moe_ffn_hidden == 16 and cfg.n_experts == 4


# ----------------------------------------------------------------------------- Phi-3's GGUF name


def _phi3_folder(root: Path, run: str, rstrip: bool) -> Path:
    """The phi3-mini stand-in (Phi-3's tokens and template on a Llama 2 sentencepiece) as a run
    called `run`, its chat tokens stripping the whitespace after them where `rstrip`, as
    Phi-3's own tokenizer.json has them."""
    from tests.published import family_folder

    folder = family_folder(root / "src", "phi3-mini")
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    for token in spec["added_tokens"]:
        if token["content"] in ("<|assistant|>", "<|end|>", "<|user|>", "<|system|>"):
            token["rstrip"] = rstrip
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return Path(shutil.copytree(folder, root / run))


@needs_llama_cpp
@pytest.mark.parametrize("run, rstrip", [("sft", True), ("phi3-sft", False)])
def test_llama_cpp_tokenizes_phi3_chats_as_minillm_whatever_the_run_is_called(
    tmp_path: Path, run: str, rstrip: bool
) -> None:
    """llama.cpp strips the whitespace after Phi-3's special tokens only when general.name holds
    phi3 (llama-vocab.cpp): the name written is the one under which it tokenizes as the model's
    tokenizer does, whatever the run's folder is called."""
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from tests.test_published_exports import CHATS, _kv

    folder = _phi3_folder(tmp_path, run, rstrip)
    loaded = load_checkpoint(folder)
    path = export_gguf(loaded, tmp_path / "m.gguf")
    kv = _kv(path)
    assert ("phi3" in kv["general.name"].lower()) == rstrip
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    render = Jinja2ChatFormatter(kv["tokenizer.chat_template"], "</s>", "<s>")
    for messages in CHATS:
        text = render(messages=messages).prompt
        theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert theirs == loaded.conventions.chat_ids(messages, True), messages


# ----------------------------------------------------------------------------- Phi-3's rope_scaling

_PHI3_LONGROPE = dict(
    architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=64, hidden_size=64,
    intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    max_position_embeddings=512, original_max_position_embeddings=64, partial_rotary_factor=0.5,
    rope_scaling=dict(type="longrope", short_factor=[1.0, 1.1, 1.2, 1.3],
                      long_factor=[2.0, 2.5, 3.0, 3.5]),
)  # fmt: skip


def test_phi3s_longrope_is_written_as_its_published_config_holds_it() -> None:
    """transformers 4's Phi3Config accepts a rope_scaling of exactly type, short_factor and
    long_factor (its _rope_scaling_validation); the factor and attention factor are derived
    from the lengths, as minillm reads them, so nothing of the function is lost."""
    cfg = model_config_from_hf(_PHI3_LONGROPE)
    written = hf_config_dict(cfg, bos_id=0, eos_id=0)
    assert written["rope_scaling"] == _PHI3_LONGROPE["rope_scaling"]
    assert written["original_max_position_embeddings"] == 64
    assert model_config_from_hf(written) == cfg
    theirs = transformers.Phi3Config(**written)  # the installed transformers reads it
    assert theirs.partial_rotary_factor == 0.5


def test_a_phi3_attention_factor_of_its_own_is_kept() -> None:
    """One not derived from the lengths is written beside them (transformers 5 reads it)."""
    hf = {**_PHI3_LONGROPE, "rope_scaling": {**_PHI3_LONGROPE["rope_scaling"],
                                             "attention_factor": 1.3}}  # fmt: skip
    cfg = model_config_from_hf(hf)
    written = hf_config_dict(cfg, bos_id=0, eos_id=0)
    assert written["rope_scaling"]["attention_factor"] == 1.3
    assert model_config_from_hf(written) == cfg


# ----------------------------------------------------------------------------- Phi-3's end of turn


def test_phi3_without_a_generation_config_stops_at_its_published_end_of_turn(
    tmp_path: Path,
) -> None:
    """Phi-3's config.json names <|endoftext|> alone; its generation_config.json stops at
    <|endoftext|>, <|assistant|> and <|end|> (32000, 32001, 32007). Without that file the
    family knows them: replies stop there, and the GGUF holds <|end|> as its end of turn (the
    template probe misses it: <|end|> strips the newline after it)."""
    from tests.test_published_exports import _kv

    folder = _phi3_folder(tmp_path, "sft", rstrip=True)
    (folder / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    loaded = load_checkpoint(folder)
    tok = loaded.tokenizer
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|assistant|>", "<|end|>")}
    config["eos_token_id"] = ids["<|endoftext|>"]
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    loaded = load_checkpoint(folder)
    assert set(ids.values()) <= loaded.conventions.stop_ids
    assert loaded.conventions.turn_end == ids["<|end|>"]
    path = export_gguf(loaded, tmp_path / "m.gguf")
    assert _kv(path)["tokenizer.ggml.eot_token_id"] == ids["<|end|>"]
