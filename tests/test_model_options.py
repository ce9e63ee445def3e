"""The model's family options (head_dim, attention_bias, qk_norm, sliding_window, rope_scaling,
and Gemma 3's sandwich_norm, ffn_activation, embed_scale, query_pre_attn_scalar, local layers):
RoPE frequencies equal to transformers' init functions, the sliding window's mask, and the KV
cache (and the decoding fast path) equal to a full forward with every option."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from minillm.config import ConfigError, ModelConfig
from minillm.model import KVCache, Transformer
from minillm.model.decode import Decoder
from minillm.model.rope import inv_frequencies
from tests.helpers import assert_same_function

SCALINGS = {
    "linear": {"type": "linear", "factor": 4.0},
    "dynamic": {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 24},
    "yarn": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 24,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    },
    "yarn-attention-factor": {
        "type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "attention_factor": 1.3,
        "truncate": False,
    },
    "llama3": {
        "type": "llama3",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
}


def hf_rope_parameters(scaling: dict, theta: float) -> dict:
    out = {"rope_type": scaling["type"], "rope_theta": theta}
    out.update({k: v for k, v in scaling.items() if k != "type"})
    return out


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("head_dim", [16, 128])
def test_inverse_frequencies_and_attention_factor_equal_transformers(
    name: str, head_dim: int
) -> None:
    scaling = SCALINGS[name]
    cfg = ModelConfig(
        vocab_size=64,
        d_model=64,
        n_layer=1,
        n_head=4,
        head_dim=head_dim,
        max_seq_len=256,
        rope_theta=500000.0,
        rope_scaling=scaling,
    )
    hf_cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=scaling.get("original_max_position_embeddings", 256),
        rope_parameters=hf_rope_parameters(scaling, 500000.0),
    )
    lengths = [None, 200] if scaling["type"] == "dynamic" else [None]
    for seq_len in lengths:
        want, want_scale = ROPE_INIT_FUNCTIONS[scaling["type"]](hf_cfg, "cpu", seq_len=seq_len)
        got, scale = inv_frequencies(cfg, seq_len)
        torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
        assert scale == pytest.approx(want_scale, rel=1e-12)


def tiny(**kw) -> ModelConfig:
    base = dict(
        vocab_size=97, d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=48, max_seq_len=96
    )
    return ModelConfig(**{**base, **kw})


OPTIONS = {
    "head_dim": dict(head_dim=12),
    "bias+qk_norm": dict(attention_bias=True, qk_norm=True, head_dim=16),
    "window": dict(sliding_window=7),
    "window+moe": dict(sliding_window=5, n_experts=4, n_experts_per_token=2),
    **{f"rope-{k}": dict(rope_scaling=v) for k, v in SCALINGS.items()},
}
# Gemma 3's block: local layers (window 7, their own RoPE base) between global ones (linear
# scaling), in a model of four layers.
GEMMA = dict(n_layer=4, qk_norm=True, sandwich_norm=True, ffn_activation="gelu_tanh",
             embed_scale=True, query_pre_attn_scalar=10, head_dim=12, sliding_window=7,
             sliding_window_pattern=2, rope_local_theta=50.0,
             rope_scaling={"type": "linear", "factor": 2.0})  # fmt: skip
OPTIONS["gemma3"] = GEMMA
# Phi-3's: partial RoPE alone (the Decoder's own step), and with LongRoPE (a row refilled once
# as it crosses the original length, 24).
PHI3 = dict(head_dim=16, partial_rotary=0.75,
            rope_scaling={"type": "longrope", "factor": 4.0, "original_max_position_embeddings": 24,
                          "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                          "long_factor": [1.2, 1.9, 2.8, 4.0, 5.5, 7.0]})  # fmt: skip
OPTIONS["partial_rotary"] = dict(head_dim=16, partial_rotary=0.5)
OPTIONS["phi3"] = PHI3


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # weights spread wide and norms and biases off their init, so that
        for name, p in model.named_parameters():  # a missing or stale term shows in the logits
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.12)
    return model


@pytest.mark.parametrize("case", list(OPTIONS))
@pytest.mark.parametrize("prefill", [10, 30])
def test_kv_cache_and_decoder_equal_the_full_forward(case: str, prefill: int) -> None:
    """Prefill 10 or 30 tokens, then one token at a time to 70 (past the window and past the
    original length): each step's logits equal those of a full forward over the tokens so far."""
    model = random_model(tiny(**OPTIONS[case]))
    ids = torch.randint(0, 97, (2, 70))
    with torch.inference_mode():
        full = [model(ids[:, : t + 1])[0][:, -1] for t in range(prefill - 1, 70)]
        for fast in (False, True):
            cache = KVCache(model.cfg, batch_size=2)
            decoder = Decoder(model, cache)
            got = [model(ids[:, :prefill], kv_cache=cache, last_only=True)[0][:, -1]]
            for t in range(prefill, 70):
                if fast:
                    got.append(decoder.step(ids[:, t]))
                else:
                    got.append(model(ids[:, t : t + 1], kv_cache=cache)[0][:, -1])
            assert_same_function(torch.stack(got), torch.stack(full))


def test_a_sliding_window_cache_holds_only_the_window() -> None:
    """Decoding past the window, a row keeps W slots (a ring), not one per token; the same
    sequences without a window take a slot per token."""
    W, lengths = 7, []
    for window in (W, None):
        model = random_model(tiny(sliding_window=window))
        cfg = model.cfg
        cache = KVCache(cfg)
        cache.add_rows(2)
        decoder = Decoder(model, cache)
        with torch.inference_mode():
            decoder.prefill(0, torch.randint(0, 97, (30,)))
            decoder.prefill(1, torch.randint(0, 97, (3,)))
            for _ in range(40):
                decoder.step(torch.randint(0, 97, (2,)))
        assert cache.lengths == [70, 43]
        per_slot = 2 * cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * 4  # 2 rows, k and v
        lengths.append(cache.nbytes() // per_slot)
    assert lengths == [W, 96]  # 70 tokens: doubling reaches max_seq_len


def test_dynamic_ntk_rows_at_different_lengths_equal_each_row_alone() -> None:
    """Rows of one cache at different lengths each get their own length's frequencies."""
    _rows_step_equals_each_row_alone(random_model(tiny(rope_scaling=SCALINGS["dynamic"])), 12)


def _rows_step_equals_each_row_alone(model, short: int) -> KVCache:  # noqa: ANN001
    """A batched step of two rows (40 and `short` tokens) equals each row's full forward."""
    a, b = torch.randint(0, 97, (1, 40)), torch.randint(0, 97, (1, short))
    with torch.inference_mode():
        cache = KVCache(model.cfg, batch_size=2)
        decoder = Decoder(model, cache)
        decoder.prefill(0, a[0])
        decoder.prefill(1, b[0])
        nxt = torch.tensor([5, 6])
        got = decoder.step(nxt)
        want_a = model(torch.cat([a, nxt[None, :1]], 1))[0][0, -1]
        want_b = model(torch.cat([b, nxt[None, 1:]], 1))[0][0, -1]
    assert_same_function(got, torch.stack([want_a, want_b]))
    return cache


def test_local_layers_of_rows_at_different_lengths_equal_each_row_alone() -> None:
    """Gemma's cache keeps every key and bands the local layers' (CacheWrite.band_mask): a
    batched step of rows at different lengths, past the window or not, is each row alone."""
    cache = _rows_step_equals_each_row_alone(random_model(tiny(**GEMMA)), 5)
    assert cache.ring is None


def test_sliding_window_sees_exactly_the_last_window_tokens() -> None:
    """A token's logits depend on the `window` tokens ending at it and on nothing earlier in a
    one-layer model; packed documents keep their own windows."""
    model = random_model(tiny(n_layer=1, sliding_window=6))
    ids = torch.randint(0, 97, (1, 30))
    changed = ids.clone()
    changed[0, :10] = (changed[0, :10] + 1) % 97
    with torch.no_grad():
        a, b = model(ids)[0], model(changed)[0]
        # position t sees t-5..t: t >= 15 does not see 0..9
        torch.testing.assert_close(a[0, 15:], b[0, 15:], atol=0, rtol=0)
        assert not torch.allclose(a[0, 14], b[0, 14])
        docs = torch.tensor([[0] * 12 + [1] * 18])
        packed = model(ids, doc_ids=docs)[0]
        assert_same_function(packed[0, :12], model(ids[:, :12])[0][0])
        assert_same_function(packed[0, 12:], model(ids[:, 12:])[0][0])


@pytest.mark.parametrize("options", ["llama-qwen-mistral", "gemma3", "phi3"])
def test_lora_and_cpu_kernels_keep_every_option(options: str) -> None:
    from minillm.config import LoRAConfig
    from minillm.model import use_cpu_kernels
    from minillm.model.lora import add_lora, merge_lora

    cfg = tiny(attention_bias=True, qk_norm=True, head_dim=16, sliding_window=9,
               rope_scaling=SCALINGS["yarn"])  # fmt: skip
    if options in ("gemma3", "phi3"):
        cfg = tiny(**(GEMMA if options == "gemma3" else PHI3))
    model = random_model(cfg)
    ids = torch.randint(0, 97, (2, 40))
    want, loss = model(ids, ids)
    fused = use_cpu_kernels(random_model(cfg)).train()
    got, fused_loss = fused(ids, ids)
    assert_same_function(got, want)
    fused_loss.backward()
    loss.backward()
    for (n, p), q in zip(model.named_parameters(), fused.parameters()):
        assert_same_function(q.grad, p.grad, msg=n)
    add_lora(model, LoRAConfig(rank=4, targets=["wqkv", "wo"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
        adapted = model(ids)[0]
        cache = KVCache(cfg, batch_size=2)
        step = Decoder(model.eval(), cache)
        model(ids[:, :39], kv_cache=cache)
        assert_same_function(step.step(ids[:, 39]), adapted[:, 39])
        assert_same_function(merge_lora(model)(ids)[0], adapted)


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        (dict(head_dim=7), "model.head_dim"),
        (dict(head_dim=0), "model.head_dim"),
        (dict(sliding_window=0), "model.sliding_window"),
        (
            dict(rope_scaling={"type": "yarn", "factor": 4.0}),
            "model.rope_scaling.original_max_position_embeddings",
        ),  # fmt: skip
        (dict(rope_scaling={"type": "linear", "factor": 0.5}), "model.rope_scaling.factor"),
        (dict(sliding_window_pattern=6), "model.sliding_window_pattern"),
        (dict(ffn_activation="gelu_tanh", n_experts=4), "model.ffn_activation"),
        (dict(query_pre_attn_scalar=0), "model.query_pre_attn_scalar"),
        (dict(rope_local_theta=10.0, rope_scaling=SCALINGS["dynamic"]), "model.rope_local_theta"),
        (
            dict(
                rope_scaling={
                    "type": "llama3",
                    "factor": 8.0,
                    "original_max_position_embeddings": 64,
                    "high_freq_factor": 1.0,
                }
            ),
            "model.rope_scaling.high_freq_factor",
        ),  # fmt: skip
    ],
)
def test_bad_option_values_name_the_key(kw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        tiny(**kw)
    assert key in str(e.value)


def test_yaml_keys_of_the_options(tmp_path) -> None:
    from minillm.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {d_model: 32, n_layer: 1, n_head: 4, head_dim: 16, qk_norm: true,\n"
        "        rope_scaling: {type: yarn, factor: 4, original_max_position_embeddings: 128}}\n"
    )
    cfg = load_config(path, ["model.sliding_window=64", "model.rope_scaling.beta_fast=16"])
    m = cfg.model
    assert (m.head_dim, m.qk_norm, m.sliding_window) == (16, True, 64)
    assert (m.rope_scaling.type, m.rope_scaling.factor, m.rope_scaling.beta_fast) == (
        "yarn",
        4.0,
        16.0,
    )
    with pytest.raises(ConfigError, match="model.rope_scaling.type"):
        load_config(path, ["model.rope_scaling.type=ntk"])
