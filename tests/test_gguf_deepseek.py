"""GGUF export of multi-head latent attention models as llama.cpp's `deepseek2` (issue 51):
DeepseekV3ForCausalLM folders (query bottleneck or none, DeepSeekMoE with its routing bias,
groups, routed scale, shared experts and a dense first block, YaRN with DeepSeek's mscale) and a
minillm run trained as `model.attention: mla`, each loaded in llama.cpp with logits and greedy
text equal to minillm's; what its graph computes otherwise is one error line naming the key."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from minillm.checkpoint.gguf_file import export_gguf, gguf_arch
from minillm.checkpoint.store import load_checkpoint
from minillm.config import ModelConfig
from minillm.errors import CheckpointError
from minillm.infer.engine import SamplingParams, generate
from minillm.tokenizer.bpe import EOT
from tests.helpers import VOCAB, make_run, spread_weights_, tiny_tokenizer

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
SIZES = dict(vocab_size=VOCAB + 20, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=128,
             moe_intermediate_size=16, **MLA)  # fmt: skip
FOLDERS = {
    # DeepSeek-V3's options: a query bottleneck, a dense first block, 8 experts in 4 groups of
    # which a token's come from 2, two shared experts, a routed scale; YaRN past 32 tokens
    "v3-yarn": dict(num_hidden_layers=3, q_lora_rank=24, first_k_dense_replace=1,
                    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                    n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                    rope_scaling=dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                                      original_max_position_embeddings=32)),
    # V2-Lite's: no query bottleneck, weights not renormalised, its YaRN (mscale and
    # mscale_all_dim 0.707: llama.cpp's other branch); and a tied head
    "v2-lite-tied": dict(num_hidden_layers=2, q_lora_rank=None, first_k_dense_replace=0,
                         n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                         n_shared_experts=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                         tie_word_embeddings=True,
                         rope_scaling=dict(rope_type="yarn", factor=4.0, mscale=0.707,
                                           mscale_all_dim=0.707,
                                           original_max_position_embeddings=32)),
}  # fmt: skip


def deepseek_folder(root: Path, case: str) -> Path:
    """A DeepseekV3ForCausalLM of `case` with random weights spread wide and a routing bias of
    its own, saved with our tokenizer."""
    tok = tiny_tokenizer()
    eot = tok.token_to_id(EOT)
    cfg = transformers.DeepseekV3Config(**SIZES, **FOLDERS[case], bos_token_id=eot,
                                        eos_token_id=eot)  # fmt: skip
    torch.manual_seed(5)
    hf = spread_weights_(transformers.DeepseekV3ForCausalLM(cfg).eval())
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    folder = root / case
    hf.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def mla_run(root: Path) -> Path:
    """A minillm run of `model.attention: mla` (dense, norm_eps 1e-5, which its latent norms use
    as llama.cpp's do)."""
    run_dir, _, _ = make_run(root, model=dict(attention="mla", n_kv_head=None, q_lora_rank=32,
                                              n_layer=2, max_seq_len=128, **MLA))  # fmt: skip
    return run_dir


def _llama(path: Path, **kw: Any) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=96, n_batch=96, n_ubatch=96, n_threads=2,
                 n_threads_batch=2, verbose=False, type_k=0, type_v=0, **kw)  # fmt: skip


def probe_ids(vocab_size: int) -> list[int]:
    torch.manual_seed(2)
    return torch.randint(0, vocab_size, (70,)).tolist()  # past YaRN's original 32


def logit_diff(loaded: Any, path: Path, ids: list[int]) -> float:
    """The greatest difference of llama.cpp's logits on the GGUF file `path` from ours, as a
    share of our logits' range."""
    llm = _llama(path, logits_all=True)
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)])
    with torch.no_grad():
        ours = loaded.model(torch.tensor([ids]))[0][0].numpy()
    return float(np.abs(theirs - ours).max() / (ours.max() - ours.min()))


@needs_llama_cpp
def test_a_minillm_runs_file_is_as_close_as_a_deepseek_folders(tmp_path: Path) -> None:
    """Issue 59, defect 4: the latent norms at model.norm_eps (1e-5 here), as llama.cpp's, so
    a run's file is computed as closely as a published folder's (1e-6 both ways). With a fixed
    1e-6 in ours the run's difference was 6x the folder's (5.1e-6 against 8.2e-7 of the range
    on an AMD EPYC): the bound is relative to the folder's, which rounding sets on each CPU."""
    diffs = {}
    for name, source in (("folder", deepseek_folder(tmp_path, "v3-yarn")),
                         ("run", mla_run(tmp_path))):  # fmt: skip
        loaded = load_checkpoint(source)
        path = export_gguf(loaded, tmp_path / f"{name}.gguf")
        diffs[name] = logit_diff(loaded, path, probe_ids(loaded.config.model.vocab_size))
    print(f"\nmax |diff| of the logit range: {diffs}")
    assert diffs["run"] <= 3 * max(diffs["folder"], 1e-7)


@needs_llama_cpp
@pytest.mark.parametrize("case", [*FOLDERS, "minillm-run"])
def test_llama_cpp_computes_our_logits_and_greedy_text(tmp_path: Path, case: str) -> None:
    from gguf import GGUFReader

    source = mla_run(tmp_path) if case == "minillm-run" else deepseek_folder(tmp_path, case)
    loaded = load_checkpoint(source)
    path = export_gguf(loaded, tmp_path / "m.gguf")
    fields = GGUFReader(path).fields
    arch = fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "deepseek2"
    m = loaded.config.model
    lengths = {k: int(fields[f"deepseek2.attention.{k}"].parts[-1][0]) for k in
               ("key_length", "value_length", "key_length_mla", "value_length_mla")}  # fmt: skip
    assert lengths == {"key_length": 16 + 8, "value_length": 16, "key_length_mla": 8 + 8,
                       "value_length_mla": 12}  # fmt: skip
    ids = probe_ids(m.vocab_size)
    rel = logit_diff(loaded, path, ids)
    print(f"\n{case}: max |diff| {rel:.2e} of the logit range")
    assert rel <= 1e-4  # test_gguf.py's bound for f32 weights and an f32 KV cache
    prompt = ids[:30]
    mine = generate(loaded.model, [prompt], SamplingParams.greedy(40))[0]
    llm = _llama(path)
    cpp = list(itertools.islice(llm.generate(prompt, temp=0.0, repeat_penalty=1.0), 40))
    assert cpp == mine


BASE = dict(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=64, attention="mla", **MLA)
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=16)
SIGMOID = dict(n_experts=4, moe_router="sigmoid", moe_ffn_hidden=16)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(rope_scaling=dict(type="linear", factor=2.0)),
         "model.rope_scaling.type: linear in a deepseek2 model"),
        (dict(rope_scaling=YARN), "model.rope_scaling.mscale_all_dim: null"),
        (dict(rope_scaling={**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}),
         "model.rope_scaling.mscale: 0.707 (cos and sin scaled by 0.9"),
        (dict(rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 16.0}),
         "model.rope_scaling.beta_fast: 16.0"),
        (dict(n_layer=27, q_lora_rank=16), "model.q_lora_rank: 16 in 27 layers"),
        (dict(SIGMOID, moe_shared_ffn_hidden=24), "model.moe_shared_ffn_hidden: 24"),
        (dict(SIGMOID), "model.moe_shared_ffn_hidden: 0"),
        (dict(SIGMOID, moe_shared_ffn_hidden=32, n_layer=3, moe_dense_layers=[1]),
         "model.moe_dense_layers: [1]"),
    ],
)  # fmt: skip
def test_what_deepseek2_computes_otherwise_is_refused_by_name(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(CheckpointError) as e:
        gguf_arch(ModelConfig(**{**BASE, **options}))
    text = str(e.value)
    assert text.startswith(message) and "llama.cpp has no equivalent" in text and "\n" not in text


def test_deepseeks_own_yarn_is_exported() -> None:
    import gguf

    yarn = {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}  # V2-Lite's: equal, so cos x 1
    cfg = ModelConfig(**BASE, rope_scaling=yarn, q_lora_rank=16)
    assert gguf_arch(cfg) == gguf.MODEL_ARCH.DEEPSEEK2
