"""Multi-head latent attention (model.attention mla) and DeepSeek-V3 folders: the model against
transformers' DeepseekV3ForCausalLM (logits, gradients, greedy with the latent cache against
`generate`, export back), the latent KV cache against the full forward (batched rows at
different lengths, int8), LoRA on its projections, and its config errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from minillm.config import LoRAConfig, ModelConfig
from minillm.errors import ConfigError
from minillm.families import (
    from_hf_state_dict,
    hf_config_dict,
    model_config_from_hf,
    to_hf_state_dict,
)
from minillm.families.deepseek_v3 import DEEPSEEK_DEFAULTS
from minillm.model import KVCache, Transformer
from minillm.model.decode import Decoder
from minillm.model.lora import add_lora, merge_lora
from minillm.model.mla import MLA as MLA_MODULE
from tests.helpers import assert_same_function, make_trainer

V = 96  # vocabulary

YARN = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.8,
    "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0,
}  # fmt: skip


def hf_deepseek(q_lora_rank: int | None, layers: int = 3, seed: int = 0):
    """A random-weight tiny DeepseekV3ForCausalLM: block 0 dense, the others experts (4 groups
    of 2, a token's 2 experts from its 2 best groups, one shared expert), yarn RoPE."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, n_group=4,
        topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        kv_lora_rank=12, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=6, max_position_embeddings=64, rope_parameters=dict(YARN),
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # not all ones: a norm mapped wrongly shows
            else:
                p.normal_(0.0, 0.15)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.weight.normal_(0.0, 0.5)  # clear preferences: no near-ties in the choice
                m.e_score_correction_bias.normal_(0.0, 0.3)
    return model


def ours_from(hf) -> Transformer:
    cfg = model_config_from_hf(hf.config.to_dict())
    model = Transformer(cfg).eval()
    model.load_state_dict(from_hf_state_dict(dict(hf.state_dict()), cfg))
    return model


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_logits_and_gradients_equal_transformers(q_lora_rank: int | None) -> None:
    hf = hf_deepseek(q_lora_rank)
    ours = ours_from(hf)
    assert ours.cfg.attention == "mla" and ours.cfg.moe_dense_layers == [0]
    assert ours.cfg.rope_scaling.mscale_all_dim == 1.0
    idx = torch.randint(0, V, (2, 20))  # past original_max_position_embeddings: yarn matters
    theirs = hf(idx).logits
    mine, _ = ours(idx)
    assert_same_function(mine, theirs)
    probe = torch.randn_like(theirs)
    (theirs * probe).sum().backward()
    (mine * probe).sum().backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    hf_grads.update({n: b for n, b in hf.named_buffers() if "e_score" in n})
    want = from_hf_state_dict(hf_grads, ours.cfg)  # the same row permutation as the weights
    for name, p in ours.named_parameters():  # to 1e-5 of each gradient's scale (up to ~200)
        scale = max(1.0, float(want[name].abs().max()))
        assert float((p.grad - want[name]).abs().max()) <= 1e-5 * scale, name


def test_greedy_with_the_latent_cache_equals_generate() -> None:
    hf = hf_deepseek(16)
    ours = ours_from(hf)
    prompt = torch.randint(2, V, (1, 5))
    want = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, 5:]
    cache = KVCache(ours.cfg, 1)
    decoder = Decoder(ours, cache)
    got = []
    with torch.inference_mode():
        logits = decoder.prefill(0, prompt[0])
        for _ in range(12):
            got.append(int(logits.argmax()))
            logits = decoder.step(torch.tensor(got[-1:]))[0]
    assert got == want.tolist()
    # The cache holds kv_lora_rank + qk_rope_head_dim numbers per token and layer.
    assert cache.k.shape[-1] == 12 + 8 and cache.v.shape[-1] == 0 and cache.k.shape[2] == 1


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_export_back_gives_the_same_logits(q_lora_rank: int | None, tmp_path: Path) -> None:
    """ours -> config.json + safetensors (per-expert names, as DeepSeek publishes) -> a
    transformers model of the same logits; and the saved folder (with a multi-token-prediction
    layer past num_hidden_layers, which is ignored) read back."""
    hf = hf_deepseek(q_lora_rank)
    ours = ours_from(hf)
    tensors = to_hf_state_dict(dict(ours.state_dict()), ours.cfg)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in tensors
    config = hf_config_dict(ours.cfg, bos_id=0, eos_id=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, tmp_path / "model.safetensors")
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    idx = torch.randint(0, V, (1, 24))
    assert_same_function(back(idx).logits, hf(idx).logits)
    # transformers' own save, plus an MTP layer's tensors: read as ours again
    hf.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in saved  # per-expert on disk
    saved["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(3)  # the MTP layer's
    hf_cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    cfg = model_config_from_hf(hf_cfg)
    again = Transformer(cfg).eval()
    again.load_state_dict(from_hf_state_dict(saved, cfg))
    assert_same_function(again(idx)[0], hf(idx).logits)


def test_yarn_mscale_attention_factor_is_transformers() -> None:
    """yarn's mscale and mscale_all_dim (DeepSeek's keys), now read for every family: the
    frequencies and cos/sin factor of transformers' yarn for a Llama config.json."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minillm.model.rope import inv_frequencies

    params = {**YARN, "original_max_position_embeddings": 256}
    hf = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=1024,
        rope_parameters=params,
    )  # fmt: skip
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = model_config_from_hf({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    freq, factor = inv_frequencies(cfg)
    torch.testing.assert_close(freq, want_freq, atol=0, rtol=0)
    assert factor == pytest.approx(want_factor, abs=1e-7) and factor != 1.0


def test_quantized_weights_are_refused_by_key() -> None:
    """DeepSeek-V3's published folder holds fp8 blocks with scales (quantization_config):
    read as they are they would be garbage, so one error naming the key."""
    hf = hf_deepseek(16).config.to_dict()
    hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ConfigError) as e:
        model_config_from_hf(hf)
    assert e.value.key == "quantization_config" and "fp8" in e.value.message


def test_deepseek_v3s_own_config_reads_to_the_same_parameters_as_transformers() -> None:
    """DeepSeek-V3 (671B) as its config.json has it (fp8 quantization left out), both models
    built on the meta device: every parameter shape of ours is one of transformers'."""
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
        topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
        max_position_embeddings=163840, rope_parameters={
            "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            "rope_theta": 10000.0},
    )  # fmt: skip
    cfg = model_config_from_hf(hf_cfg.to_dict())
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.DeepseekV3ForCausalLM(hf_cfg).parameters())
        ours = Transformer(cfg)
    assert ours.param_count() == theirs == 671_026_404_352  # 671B (the MTP module left out)
    assert cfg.moe_dense_layers == [0, 1, 2] and cfg.moe_n_group == 8
    assert KVCache(cfg, 0, max_len=16, device="meta", dtype=torch.bfloat16).token_bytes() == (
        61 * 2 * (512 + 64)
    )


def test_family_defaults_are_transformers() -> None:
    defaults = transformers.DeepseekV3Config()
    for key, value in DEEPSEEK_DEFAULTS.items():
        if key == "rope_theta":
            assert defaults.rope_parameters["rope_theta"] == value
        else:
            assert getattr(defaults, key) == value, key


# ----------------------------------------------------------------------------- from scratch


def mla_config(**kw) -> ModelConfig:
    base = dict(
        vocab_size=V, d_model=32, n_layer=2, n_head=4, attention="mla", q_lora_rank=16,
        kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_seq_len=64,
    )  # fmt: skip
    return ModelConfig(**{**base, **kw})


def decode_all(model: Transformer, prompts: list[torch.Tensor], steps: int) -> list[list[int]]:
    """Greedy continuations of prompts, all rows batched in one cache (continuous batching)."""
    cache = KVCache(model.cfg, len(prompts))
    decoder = Decoder(model, cache)
    out: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        last = torch.stack([decoder.prefill(i, p).argmax() for i, p in enumerate(prompts)])
        for _ in range(steps):
            for i, t in enumerate(last.tolist()):
                out[i].append(t)
            last = decoder.step(last).argmax(-1)
    return out


def test_cached_decode_equals_the_full_forward_and_rows_alone() -> None:
    torch.manual_seed(1)
    model = Transformer(mla_config(q_lora_rank=None)).eval()
    idx = torch.randint(0, V, (2, 14))
    full, _ = model(idx)
    cache = KVCache(model.cfg, 2)
    with torch.no_grad():
        parts = [model(idx[:, :6], kv_cache=cache)[0]]
        parts += [model(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(6, 14)]
    assert_same_function(torch.cat(parts, 1), full)
    # rows at different lengths in one cache decode as each would alone
    prompts = [torch.randint(0, V, (n,)) for n in (3, 9, 5)]
    batched = decode_all(model, prompts, 6)
    assert batched == [decode_all(model, [p], 6)[0] for p in prompts]


def test_int8_decodes_on_the_latent_cache() -> None:
    from minillm.model.quantize import int8_kernel_problem, quantize_int8

    if int8_kernel_problem() is not None:
        pytest.skip("no int8 kernel on this CPU")
    torch.manual_seed(2)
    model = Transformer(mla_config()).eval()
    prompt = torch.randint(0, V, (7,))
    with torch.inference_mode():
        want = model(prompt[None])[0][0, -1]
    assert quantize_int8(model) is None
    assert type(model.blocks[0].attn.wkv_b) is torch.nn.Linear  # absorbed: kept float
    cache = KVCache(model.cfg, 1)
    with torch.inference_mode():
        got = Decoder(model, cache).prefill(0, prompt)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
    assert len(decode_all(model, [prompt, prompt[:3]], 4)[1]) == 4


def test_lora_targets_the_latent_projections() -> None:
    torch.manual_seed(3)
    model = Transformer(mla_config())
    add_lora(model, LoRAConfig(rank=2, targets=["wqkv", "wo"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for layer in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"):
        assert f"blocks.1.attn.{layer}.lora_A" in trainable
    idx = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0.0, 0.1)
    _, loss = model(idx, idx)
    loss.backward()
    assert model.blocks[0].attn.wkv_b.lora_B.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        adapted = model(idx)[0]
        cache = KVCache(model.cfg, 2)
        cached = model(idx, kv_cache=cache)[0]  # the absorbed path reads the adapted wkv_b
        assert_same_function(cached, adapted)
        merge_lora(model)
        assert_same_function(model(idx)[0], adapted)


def test_cache_bytes_per_token_are_the_latent() -> None:
    cfg = mla_config()
    cache = KVCache(cfg, 1)
    cache.reserve(1, 8)
    assert cache.nbytes() == 8 * cache.token_bytes()
    assert cache.token_bytes() == cfg.n_layer * 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    gqa = ModelConfig(vocab_size=V, d_model=32, n_layer=2, n_head=4, n_kv_head=2)
    bf16 = KVCache(gqa, 1, dtype=torch.bfloat16)
    assert bf16.token_bytes() == gqa.n_layer * 2 * 2 * gqa.n_kv_head * gqa.head_dim


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        (dict(kv_lora_rank=None), "model.kv_lora_rank"),
        (dict(qk_rope_head_dim=5), "model.qk_rope_head_dim"),
        (dict(n_kv_head=2), "model.n_kv_head"),
        (dict(sliding_window=8), "model.sliding_window"),
        (dict(attention="gqa"), "model.q_lora_rank"),
        (dict(partial_rotary=0.5), "model.partial_rotary"),  # Phi-3's, beside qk_rope_head_dim
        (
            dict(
                rope_scaling=dict(
                    type="longrope",
                    original_max_position_embeddings=32,
                    short_factor=[1.0, 1.0],
                    long_factor=[2.0, 2.0],
                )
            ),
            "model.rope_scaling.type",
        ),
    ],
)
def test_bad_mla_configs_name_the_key(kw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        mla_config(**kw)
    assert e.value.key == key


# ----------------------------------------------------------------------------- training

MLA = dict(
    attention="mla", q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=6, head_dim=None, n_kv_head=None,
)  # fmt: skip


@pytest.mark.parametrize("objective", ["lm", "dpo", "grpo"])
def test_mla_trains_under_every_objective(tmp_path: Path, objective: str) -> None:
    """A from-scratch MLA model (and DeepSeekMoE) takes steps under each objective: finite
    losses, every MLA projection moves (GRPO's rollouts decode through the latent cache)."""
    from tests.helpers import make_run, post_training_data, prepared_config
    from tests.test_objectives import post_config

    model = {**MLA, "n_experts": 4, "moe_router": "sigmoid", "moe_dense_layers": [0]}
    if objective == "lm":
        cfg = prepared_config(tmp_path, model=model, train=dict(max_steps=4))
        trainer = make_trainer(cfg, verbose=False)
    else:
        make_run(tmp_path / "mla", model=model)
        bases = post_training_data(tmp_path)
        cfg = post_config(bases, tmp_path / "run", objective, base="mla")
        trainer = make_trainer(cfg, verbose=False, config_dir=bases)
    try:
        assert isinstance(trainer.model.blocks[0].attn, MLA_MODULE)
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        for _ in range(2):
            out = trainer.train_step()
            trainer.count_step(out)
            assert out.finite and math.isfinite(float(out.loss))
        after = trainer.model.state_dict()
        for layer in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"):
            key = f"blocks.1.attn.{layer}.weight"
            assert not torch.equal(before[key], after[key]), key
    finally:
        trainer.close()


def test_left_padding_and_packed_documents_are_each_row_alone() -> None:
    """attention_mask (left pads output zeros, not averages) and doc_ids go through MLA's
    decompressed path as through GQA's."""
    torch.manual_seed(4)
    model = Transformer(mla_config()).eval()
    a, b = torch.randint(0, V, (1, 7)), torch.randint(0, V, (1, 4))
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), b), dim=1)
    mask = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        both = model(torch.cat((a, padded)), attention_mask=mask)[0]
        assert_same_function(both[1, 3:], model(b)[0][0])
        packed = model(torch.cat((a, b), dim=1), doc_ids=torch.tensor([[0] * 7 + [1] * 4]))[0]
        assert_same_function(packed[0, 7:], model(b)[0][0])


def test_latent_norms_use_the_configs_norm_eps() -> None:
    """Issue 59, defect 4: the query and key/value latents are normalised with model.norm_eps,
    as llama.cpp (and vLLM) normalise them, not a fixed 1e-6 (tests/test_gguf_deepseek.py: a
    run's file then computes our logits)."""
    eps = 0.25  # about the latents' mean square below: a wrong eps shows
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layer=1, n_head=4, attention="mla",
                      q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      norm_eps=eps)  # fmt: skip
    attn = MLA_MODULE(cfg)
    torch.manual_seed(0)
    for norm, width in ((attn.q_norm, 16), (attn.kv_norm, 12)):
        x = torch.randn(5, width, dtype=torch.float64) * 0.5
        want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        torch.testing.assert_close(norm(x.float()).double(), want, rtol=1e-5, atol=0)
