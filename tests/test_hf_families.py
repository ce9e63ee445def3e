"""The families that are our one Transformer with options (issue 42): Llama with each RoPE
scaling and any head_dim, Qwen2 (q/k/v biases, tied or not), Qwen3 (qk_norm, its own head_dim)
and Mistral (sliding window), each made by transformers with random weights, read as a folder
(`--ckpt`, `train.init_from`), compared with transformers' logits, gradients and generate at
lengths past the window and past the original context, and exported back to its own class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from minillm.checkpoint.hf_export import export_checkpoint
from minillm.checkpoint.hf_import import import_hf_folder
from minillm.checkpoint.store import load_checkpoint
from minillm.config import Config, ConfigError, TrainConfig
from minillm.families import model_config_from_hf
from minillm.infer.engine import SamplingParams, generate
from minillm.info import model_info
from minillm.model import Transformer
from minillm.tokenizer.bpe import EOT
from tests.helpers import VOCAB, assert_same_function, spread_weights_, tiny_tokenizer

T = 70  # tokens compared: past the window (16) and past the original context (24)
SIZES = dict(vocab_size=VOCAB + 20, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)  # fmt: skip


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _rope(kind: str, **kw) -> dict:
    return {"rope_type": kind, "rope_theta": 500.0, **kw}


# name -> (transformers class, config class, config values)
CASES = {
    "llama-linear": ("LlamaForCausalLM", "LlamaConfig",
                     dict(max_position_embeddings=96, rope_parameters=_rope("linear", factor=4.0))),
    "llama-dynamic": ("LlamaForCausalLM", "LlamaConfig",
                      dict(max_position_embeddings=24,
                           rope_parameters=_rope("dynamic", factor=4.0))),
    "llama-yarn": ("LlamaForCausalLM", "LlamaConfig",
                   dict(max_position_embeddings=96, rope_parameters=_rope(
                       "yarn", factor=4.0, original_max_position_embeddings=24))),
    "llama-yarn-attention": ("LlamaForCausalLM", "LlamaConfig",
                             dict(max_position_embeddings=96, rope_parameters=_rope(
                                 "yarn", factor=4.0, original_max_position_embeddings=24,
                                 attention_factor=1.3, beta_fast=16.0, beta_slow=2.0))),
    "llama3-head_dim": ("LlamaForCausalLM", "LlamaConfig",
                        dict(max_position_embeddings=96, head_dim=24, rope_parameters=_rope(
                            "llama3", factor=4.0, original_max_position_embeddings=24,
                            low_freq_factor=1.0, high_freq_factor=4.0))),
    "qwen2-tied": ("Qwen2ForCausalLM", "Qwen2Config",
                   dict(max_position_embeddings=96, tie_word_embeddings=True,
                        rope_parameters=_rope("default"))),
    "qwen2-untied-yarn": ("Qwen2ForCausalLM", "Qwen2Config",
                          dict(max_position_embeddings=96, tie_word_embeddings=False,
                               rope_parameters=_rope("yarn", factor=4.0,
                                                     original_max_position_embeddings=24))),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",
              dict(max_position_embeddings=96, head_dim=24, tie_word_embeddings=False,
                   rope_parameters=_rope("default"))),
    "mistral": ("MistralForCausalLM", "MistralConfig",
                dict(max_position_embeddings=96, sliding_window=16, tie_word_embeddings=False,
                     rope_parameters=_rope("default"))),
    # Gemma 3: local layers (window 16, their own base) then global ones, head_dim and the
    # softmax scale of their own; transformers 5's rope_parameters, then the published keys.
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(num_hidden_layers=4, max_position_embeddings=96, head_dim=24,
                    query_pre_attn_scalar=20, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters={"full_attention": _rope("default"),
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 50.0}})),
    "gemma3-linear-untied": ("Gemma3ForCausalLM", "Gemma3TextConfig",
                             dict(num_hidden_layers=3, max_position_embeddings=96, head_dim=16,
                                  query_pre_attn_scalar=16, sliding_window=16,
                                  sliding_window_pattern=3, rope_theta=500.0,
                                  rope_local_base_freq=50.0, tie_word_embeddings=False,
                                  rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # Qwen1.5-MoE's shape: softmax weights not renormalised, a gated shared expert, q/k/v
    # biases, here block 0 dense (mlp_only_layers).
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(max_position_embeddings=96, tie_word_embeddings=False, **MOE,
                       shared_expert_intermediate_size=48, norm_topk_prob=False,
                       mlp_only_layers=[0], rope_parameters=_rope("default"))),
    # every block sparse (llama.cpp's qwen2moe has no dense one), a tied head
    "qwen2_moe-tied": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                       dict(max_position_embeddings=96, tie_word_embeddings=True, **MOE,
                            shared_expert_intermediate_size=48, norm_topk_prob=False,
                            rope_parameters=_rope("default"))),
    # Qwen3-30B-A3B's: qk_norm, renormalised top-k, every block sparse.
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(max_position_embeddings=96, head_dim=24, tie_word_embeddings=False,
                       **MOE, norm_topk_prob=True, rope_parameters=_rope("default"))),
    # every second block sparse (decoder_sparse_step), a window in every layer, tied
    "qwen3_moe-step-window": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                              dict(max_position_embeddings=96, tie_word_embeddings=True, **MOE,
                                   norm_topk_prob=False, decoder_sparse_step=2,
                                   use_sliding_window=True, sliding_window=16,
                                   rope_parameters=_rope("default"))),
}  # fmt: skip


def family_folder(root: Path, case: str) -> tuple[Path, torch.nn.Module]:
    """transformers' model of `case` with random weights spread wide (norms and biases off their
    init), saved with our tokenizer."""
    model_class, config_class, values = CASES[case]
    tok = tiny_tokenizer()
    eot = tok.token_to_id(EOT)
    hf_cfg = getattr(transformers, config_class)(**{**SIZES, **values}, bos_token_id=eot,
                                                 eos_token_id=eot)  # fmt: skip
    torch.manual_seed(5)
    hf = spread_weights_(getattr(transformers, model_class)(hf_cfg).eval())
    folder = root / case
    hf.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder, hf


def ours(folder: Path) -> Transformer:
    cfg, state, _ = import_hf_folder(folder)
    model = Transformer(cfg)
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients_equal_transformers(tmp_path: Path, case: str) -> None:
    folder, hf = family_folder(tmp_path, case)
    model = ours(folder)
    idx = torch.randint(0, VOCAB + 20, (2, T))
    targets = torch.cat((idx[:, 1:], torch.full((2, 1), -100)), dim=1)  # as transformers shifts
    logits, loss = model(idx, targets)
    ref = hf(idx, labels=idx)
    assert_same_function(logits, ref.logits)
    assert_same_function(loss, ref.loss)
    loss.backward()
    ref.loss.backward()
    layer = hf.model.layers[1].self_attn
    want = {
        "tok_emb.weight": hf.model.embed_tokens.weight.grad,
        "blocks.1.attn.wqkv.weight": torch.cat(
            [layer.q_proj.weight.grad, layer.k_proj.weight.grad, layer.v_proj.weight.grad]
        ),
        "blocks.1.attn.wo.weight": layer.o_proj.weight.grad,
    }
    if layer.q_proj.bias is not None:
        want["blocks.1.attn.wqkv.bias"] = torch.cat(
            [layer.q_proj.bias.grad, layer.k_proj.bias.grad, layer.v_proj.bias.grad]
        )
    if hasattr(layer, "q_norm"):
        want["blocks.1.attn.q_norm.weight"] = layer.q_norm.weight.grad
        want["blocks.1.attn.k_norm.weight"] = layer.k_norm.weight.grad
    block = hf.model.layers[1]
    if hasattr(block.mlp, "down_proj"):
        want["blocks.1.ffn.w_down.weight"] = block.mlp.down_proj.weight.grad
    if hasattr(block, "post_feedforward_layernorm"):  # Gemma's sandwich: each norm's own name
        want["blocks.1.attn_post_norm.weight"] = block.post_attention_layernorm.weight.grad
        want["blocks.1.ffn_norm.weight"] = block.pre_feedforward_layernorm.weight.grad
        want["blocks.1.ffn_post_norm.weight"] = block.post_feedforward_layernorm.weight.grad
        want["norm.weight"] = hf.model.norm.weight.grad
    else:
        want["blocks.1.ffn_norm.weight"] = block.post_attention_layernorm.weight.grad
    mlp = hf.model.layers[1].mlp
    if hasattr(mlp, "experts"):  # the Qwen MoEs: router, stacked experts, shared expert
        want["blocks.1.ffn.router.weight"] = mlp.gate.weight.grad
        want["blocks.1.ffn.w_gate_up"] = mlp.experts.gate_up_proj.grad
        want["blocks.1.ffn.w_down"] = mlp.experts.down_proj.grad
    if hasattr(mlp, "shared_expert"):
        shared = mlp.shared_expert
        want["blocks.1.ffn.shared.w_gate_up.weight"] = torch.cat(
            [shared.gate_proj.weight.grad, shared.up_proj.weight.grad]
        )
        want["blocks.1.ffn.shared.w_down.weight"] = shared.down_proj.weight.grad
        want["blocks.1.ffn.shared.gate.weight"] = mlp.shared_expert_gate.weight.grad
    dense = hf.model.layers[0].mlp
    if hasattr(dense, "gate_proj"):
        want["blocks.0.ffn.w_down.weight"] = dense.down_proj.weight.grad
    grads = dict(model.named_parameters())
    for name, g in want.items():
        assert_same_function(grads[name].grad, g, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_cached_greedy_equals_transformers_generate(tmp_path: Path, case: str) -> None:
    """Our KV-cached greedy decode against transformers' generate, 30 prompt tokens then 40 new
    ones. Dynamic NTK against transformers without its cache: its cached generate keeps keys
    rotated at earlier lengths' frequencies, so it is not its own full forward (ours is)."""
    folder, hf = family_folder(tmp_path, case)
    model = ours(folder)
    torch.manual_seed(1)
    prompt = torch.randint(0, VOCAB, (30,)).tolist()
    got = generate(model, [prompt], SamplingParams.greedy(40))[0]
    hf.generation_config.eos_token_id = None  # 40 tokens, as ours without stop ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                          use_cache=case != "llama-dynamic")  # fmt: skip
    assert got == out[0, 30:].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_export_writes_the_same_class_back(tmp_path: Path, case: str) -> None:
    folder, hf = family_folder(tmp_path, case)
    out = export_checkpoint(load_checkpoint(folder), tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [CASES[case][0]]
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again) is type(hf)
    idx = torch.randint(0, VOCAB + 20, (1, T))
    with torch.no_grad():
        assert_same_function(again(idx).logits, hf(idx).logits)
    assert import_hf_folder(out)[0] == import_hf_folder(folder)[0]


# Published config.json values (nothing downloaded): the sizes `minillm info` must count.
PUBLISHED = {
    "Llama-3.1-8B": (8_030_261_248, dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        hidden_act="silu", rope_scaling=dict(factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8192, rope_type="llama3"))),
    "Qwen2.5-7B": (7_615_616_512, dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064,
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_theta=1000000.0, sliding_window=131072, use_sliding_window=False,
        max_window_layers=28, tie_word_embeddings=False, hidden_act="silu", rope_scaling=None)),
    "Qwen3-8B": (8_190_735_360, dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, sliding_window=None, use_sliding_window=False,
        max_window_layers=36, tie_word_embeddings=False, attention_bias=False,
        hidden_act="silu", rope_scaling=None)),
    "gemma-3-1b-it": (999_885_952, dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144,
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
        query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=1000000,
        rope_local_base_freq=10000, rope_scaling=None, sliding_window=512,
        sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=None, final_logit_softcapping=None, attention_bias=False)),
    "gemma-3-270m": (268_098_176, dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144,
        hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
        query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling=None, sliding_window=512,
        layer_types=["sliding_attention"] * 5 + ["full_attention"]
        + (["sliding_attention"] * 5 + ["full_attention"]) * 2,
        hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=None,
        final_logit_softcapping=None, use_bidirectional_attention=False)),
    "Qwen3-30B-A3B": (30_532_122_624, dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, max_window_layers=48,
        rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=None, use_sliding_window=False,
        tie_word_embeddings=False, attention_bias=False, hidden_act="silu", rope_scaling=None,
        router_aux_loss_coef=0.001, output_router_logits=False)),
    "Qwen1.5-MoE-A2.7B": (14_315_784_192, dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=151936,
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
        decoder_sparse_step=1, max_position_embeddings=8192, max_window_layers=21,
        rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=32768, use_sliding_window=False,
        tie_word_embeddings=False, hidden_act="silu", router_aux_loss_coef=0.001,
        output_router_logits=False)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_info_counts_the_parameters_transformers_has(name: str) -> None:
    published, values = PUBLISHED[name]
    hf_cfg = transformers.AutoConfig.for_model(**values)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    theirs = sum(p.numel() for p in hf.parameters())
    m = model_config_from_hf(values)
    cfg = Config(m, train=TrainConfig(seq_len=4096, batch_size=1, device="cpu"))
    assert model_info(cfg)["params"] == theirs == published


@pytest.mark.parametrize("name, active", [("Qwen3-30B-A3B", 3.3), ("Qwen1.5-MoE-A2.7B", 2.7)])
def test_info_counts_the_active_parameters_of_the_qwen_moes(name: str, active: float) -> None:
    """The activated parameters their model cards give (Qwen3-30B-A3B: 3.3B; Qwen1.5-MoE: 2.7B):
    each token's k experts, the shared expert and everything outside the experts."""
    total, hf = PUBLISHED[name]
    m = model_config_from_hf(hf)
    cfg = Config(m, train=TrainConfig(seq_len=4096, batch_size=1, device="cpu"))
    unused = hf["num_experts"] - hf["num_experts_per_tok"]  # experts a token skips, per layer
    skipped = hf["num_hidden_layers"] * unused * 3 * hf["hidden_size"] * hf["moe_intermediate_size"]
    got = model_info(cfg)["params_active"]
    assert got == total - skipped
    assert abs(got / 1e9 - active) < 0.06  # 3.35B and 2.69B: the cards round them


@pytest.mark.parametrize(
    "changes, key",
    [
        (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
              sliding_window=16, max_window_layers=1), "layer_types"),
        (dict(rope_scaling=dict(rope_type="yarn", factor=4.0, partial_rotary_factor=0.5)),
         "rope_scaling.partial_rotary_factor"),
        (dict(rope_scaling=dict(rope_type="linear", factor=4.0, mscale_all_dim=1.0)),
         "rope_scaling.mscale_all_dim"),
        (dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=True),
         "attention_bias"),
        (dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
              attention_bias=True), "attention_bias"),
        (dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
              use_sliding_window=True, sliding_window=16, max_window_layers=2),
         "use_sliding_window"),
        (dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
              layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        (dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
              decoder_sparse_step=0), "decoder_sparse_step"),
        (dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
              shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
        (dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=0),
         "num_experts"),
        (dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
              num_experts_per_tok=8), "num_experts_per_tok"),
        (dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
              decoder_sparse_step=3), "decoder_sparse_step"),
    ],
)  # fmt: skip
def test_what_a_family_has_beyond_our_options_is_refused_by_key(changes: dict, key: str) -> None:
    values = {**PUBLISHED["Llama-3.1-8B"][1], "num_hidden_layers": 2, **changes}
    with pytest.raises(ConfigError) as e:
        model_config_from_hf(values)
    assert e.value.key == key


@pytest.mark.parametrize(
    "changes, key",
    [
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(hidden_activation="gelu"), "hidden_activation"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention",
                                                "sliding_attention"]), "layer_types"),
        (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "rope_scaling"),
    ],
)  # fmt: skip
def test_what_gemma3_has_beyond_our_options_is_refused_by_key(changes: dict, key: str) -> None:
    values = {**PUBLISHED["gemma-3-1b-it"][1], "num_hidden_layers": 2, **changes}
    with pytest.raises(ConfigError) as e:
        model_config_from_hf(values)
    assert e.value.key == key


@pytest.mark.parametrize(
    "model_type",
    [
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "gemma3_text",
        "qwen2_moe",
        "qwen3_moe",
        "phi3",
    ],
)
def test_keys_left_out_of_config_json_are_the_familys_defaults(model_type: str) -> None:
    """Issue 50, defect 5: a config.json without rope_theta, rms_norm_eps, the context, the
    window or the key/value heads reads as transformers' class of that family reads it (a
    Mixtral without rope_theta rotates at 1e6, not Llama's 10,000)."""
    from minillm.families import model_config_from_hf

    sizes = {"model_type": model_type, "vocab_size": 320, "hidden_size": 128,
             "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 32}  # fmt: skip
    theirs = transformers.AutoConfig.for_model(**sizes)
    ours = model_config_from_hf(dict(sizes))
    rope = getattr(theirs, "rope_parameters", None) or {}
    if model_type == "gemma3_text":  # one RoPE per layer type, local layers from the pattern
        assert ours.rope_local_theta == rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
        assert [ours.local_layer(i) for i in range(2)] == [
            t == "sliding_attention" for t in theirs.layer_types
        ]
        assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar
        assert ours.head_dim == theirs.head_dim
        assert ours.tie_embeddings == theirs.tie_word_embeddings
    assert ours.rope_theta == rope.get("rope_theta", getattr(theirs, "rope_theta", None))
    assert ours.norm_eps == theirs.rms_norm_eps
    assert ours.max_seq_len == theirs.max_position_embeddings
    assert ours.n_kv_head == theirs.num_key_value_heads
    has_window = model_type in ("mistral", "gemma3_text")
    window = getattr(theirs, "sliding_window", None) if has_window else None
    assert ours.sliding_window == window
    if model_type == "mixtral":
        assert (ours.n_experts, ours.n_experts_per_token) == (
            theirs.num_local_experts, theirs.num_experts_per_tok)  # fmt: skip
    if model_type.endswith("_moe"):
        assert (ours.n_experts, ours.n_experts_per_token, ours.moe_ffn_hidden,
                ours.moe_norm_topk, ours.moe_dense_layers) == (
            theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
            theirs.norm_topk_prob, [])  # fmt: skip
        shared = getattr(theirs, "shared_expert_intermediate_size", 0)
        assert ours.moe_shared_ffn_hidden == (shared if model_type == "qwen2_moe" else 0)
        assert ours.attention_bias == getattr(theirs, "qkv_bias", False)


@pytest.mark.parametrize("kind", ["yarn", "llama3"])
def test_a_top_level_original_length_wins_as_in_transformers(kind: str) -> None:
    """Issue 50, defect 4: config.json's top-level original_max_position_embeddings is what
    transformers 5 uses for yarn and llama3 (over rope_scaling's): the frequencies agree."""
    from minillm.families import model_config_from_hf
    from minillm.model.rope import inv_frequencies

    scaling = {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 64}
    if kind == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)
    hf = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 1024,
          "original_max_position_embeddings": 256, "rope_scaling": scaling}  # fmt: skip
    theirs = transformers.LlamaConfig(**hf)
    ours = model_config_from_hf(dict(hf))
    assert ours.rope_scaling.original_max_position_embeddings == 256
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(theirs)
    torch.testing.assert_close(inv_frequencies(ours)[0].float(), rotary.inv_freq.float())


@pytest.mark.parametrize(
    "options, key",
    [
        (dict(sandwich_norm=True, embed_scale=True, ffn_activation="gelu_tanh"), "model.qk_norm"),
        (dict(qk_norm=True, sandwich_norm=True, embed_scale=True), "model.ffn_activation"),
        (dict(qk_norm=True, embed_scale=True, ffn_activation="gelu_tanh"), "model.sandwich_norm"),
    ],
)
def test_an_export_without_all_of_gemmas_block_names_the_missing_option(
    options: dict, key: str
) -> None:
    """Gemma 3's options come together: a model with some of them has no transformers class."""
    from minillm.config import ModelConfig
    from minillm.families import resolve_family

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, **options)
    with pytest.raises(ConfigError) as e:
        resolve_family(cfg)
    assert e.value.key == key
