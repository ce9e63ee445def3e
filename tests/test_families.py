"""minillm.families (issue 59): the family is stored (model.family), each family's adapter works
tensor by tensor over a lazy mapping, and the family facts the issue found missing: DeepSeek-V3's
routing keys, Qwen3's head_dim and the MoE families' own defaults."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
import transformers

from minillm.config import ModelConfig
from minillm.families import (
    FAMILIES,
    family_of,
    from_hf_state_dict,
    hf_config_dict,
    model_config_from_hf,
    resolve_family,
    to_hf_state_dict,
    with_family,
)
from minillm.model import Transformer

SIZES = dict(vocab_size=64, d_model=32, n_layer=3, n_head=4)

# name -> the options of a model of that family (resolve_family's rules)
OPTIONS = {
    "llama": {},
    "qwen2": dict(attention_bias=True),
    "qwen3": dict(qk_norm=True, head_dim=16),
    "mistral": dict(sliding_window=8),
    "mixtral": dict(n_experts=4, n_experts_per_token=2, moe_ffn_hidden=16),
    "qwen2_moe": dict(n_experts=4, moe_ffn_hidden=16, moe_shared_ffn_hidden=24,
                      moe_norm_topk=False, attention_bias=True, moe_dense_layers=[0]),
    "qwen3_moe": dict(qk_norm=True, n_experts=4, moe_ffn_hidden=16, moe_dense_layers=[1]),
    "gemma3": dict(qk_norm=True, sandwich_norm=True, ffn_activation="gelu_tanh",
                   embed_scale=True, sliding_window=8, sliding_window_pattern=3,
                   rope_local_theta=100.0),
    "phi3": dict(partial_rotary=0.5),
    "deepseek_v3": dict(attention="mla", q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, n_experts=4, moe_ffn_hidden=16,
                        moe_shared_ffn_hidden=16, moe_router="sigmoid", moe_dense_layers=[0]),
}  # fmt: skip


def test_every_family_has_a_model_of_its_options() -> None:
    assert sorted(OPTIONS) == sorted(FAMILIES)
    for name, options in OPTIONS.items():
        assert resolve_family(ModelConfig(**SIZES, **options)) == name


class CountingMapping(Mapping[str, torch.Tensor]):
    """A state dict read key by key, as a lazy safetensors mapping is: the keys asked for."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.reads = tensors, []

    def __getitem__(self, key: str) -> torch.Tensor:
        self.reads.append(key)
        return self.tensors[key]

    def __contains__(self, key: object) -> bool:  # a lookup of the keys, no read
        return key in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def _layer(name: str) -> str | None:
    found = re.match(r"(model\.layers|blocks)\.(\d+)\.", name)
    return found.group(2) if found else None


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_adapter_reads_each_tensor_once_and_yields_layer_by_layer(name: str) -> None:
    """from_hf reads every HF tensor once, only when it builds a tensor of ours from it, and
    each yielded tensor comes from one layer's tensors (or one outside the layers): a lazy
    loader holds no more than a layer beyond the model. to_hf undoes it exactly."""
    torch.manual_seed(0)
    cfg = ModelConfig(**SIZES, **OPTIONS[name])
    ours = Transformer(cfg).state_dict()
    for k, v in ours.items():  # no zero or one norms: the round trip must move every value
        ours[k] = torch.randn_like(v) if v.is_floating_point() else v
    hf = to_hf_state_dict(ours, cfg)
    src = CountingMapping(hf)
    back, seen = {}, 0
    for key, tensor in family_of(cfg).from_hf(cfg, src):
        reads = src.reads[seen:]
        seen = len(src.reads)
        assert reads, key  # each tensor of ours is built from the source's
        assert {_layer(r) for r in reads} == {_layer(key)}, (key, reads)
        assert tensor.dtype == hf[reads[0]].dtype
        back[key] = tensor
    assert sorted(src.reads) == sorted(hf)  # every tensor read once
    assert back.keys() == ours.keys()
    for k in ours:
        torch.testing.assert_close(back[k].double(), ours[k].double(), rtol=0, atol=1e-6)
    assert from_hf_state_dict(hf, cfg).keys() == back.keys()


def test_a_missing_tensor_is_a_key_error_naming_it() -> None:
    cfg = ModelConfig(**SIZES, **OPTIONS["qwen2"])
    hf = to_hf_state_dict(Transformer(cfg).state_dict(), cfg)
    del hf["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(KeyError, match="model.layers.1.self_attn.k_proj.bias"):
        from_hf_state_dict(hf, cfg)


def test_the_stored_family_names_the_export_not_the_options() -> None:
    """A Mistral read without a window (v0.2 on) stays Mistral; a Phi-3 with full RoPE and no
    LongRoPE (Phi-3-mini-4k) stays Phi-3. Options are resolved only where none is stored."""
    plain = ModelConfig(**SIZES)
    assert hf_config_dict(plain, 0, 0)["architectures"] == ["LlamaForCausalLM"]
    for name, cls in (("mistral", "MistralForCausalLM"), ("phi3", "Phi3ForCausalLM")):
        cfg = with_family(ModelConfig(**SIZES, family=name))
        assert hf_config_dict(cfg, 0, 0)["architectures"] == [cls]
    assert with_family(plain).family == "llama"


def test_a_stored_family_that_lacks_the_options_is_refused_by_key() -> None:
    from minillm.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        with_family(ModelConfig(**SIZES, qk_norm=True, family="llama"))
    assert e.value.key == "model.family" and "qwen3" in e.value.message
    with pytest.raises(ConfigError) as e:
        with_family(ModelConfig(**SIZES, family="gpt2"))
    assert e.value.key == "model.family"
    # Options of no family: the run keeps no family (it trains; an export names the option).
    odd = with_family(ModelConfig(**SIZES, qk_norm=True, attention_bias=True))
    assert odd.family is None


def test_an_imported_config_records_its_family() -> None:
    for name, family in FAMILIES.items():
        hf = transformers.AutoConfig.for_model(family.model_type).to_dict()
        hf.update(architectures=[family.hf_class], quantization_config=None)
        if name == "deepseek_v3":
            hf.pop("rope_scaling", None)
        assert model_config_from_hf(hf).family == name


def test_a_checkpoint_saved_without_a_family_resolves_it_on_load_and_resumes(
    tmp_path: Path,
) -> None:
    """A checkpoint from before model.family was stored (make_run saves a config without it)
    loads with its family resolved, and a resume with the family set is no architecture change."""
    from minillm.checkpoint.store import load_checkpoint
    from minillm.config import config_to_dict
    from minillm.train.resume import resume_differences
    from tests.helpers import make_run

    run_dir, cfg, _ = make_run(tmp_path, model=dict(qk_norm=True))
    assert cfg.model.family is None
    loaded = load_checkpoint(run_dir)
    assert loaded.config.model.family == "qwen3"
    refused, _ = resume_differences(config_to_dict(cfg), loaded.config)
    assert refused == []
    refused, _ = resume_differences(config_to_dict(loaded.config), cfg)
    assert refused == ["model.family ('qwen3' -> None)"]


def test_a_run_writes_its_resolved_family_to_config_yaml(tmp_path: Path) -> None:
    """A run's family is resolved once, when it starts, and travels with it: config.yaml and
    its checkpoints' config say it (a Config built in Python has none of its own)."""
    import yaml

    from minillm.checkpoint.store import load_checkpoint
    from tests.helpers import prepared_config, run_trainer

    cfg = prepared_config(tmp_path, model=dict(attention_bias=True), train=dict(max_steps=1))
    assert cfg.model.family is None
    trainer = run_trainer(cfg)
    written = yaml.safe_load((trainer.run_dir / "config.yaml").read_text(encoding="utf-8"))
    assert written["model"]["family"] == "qwen2"
    assert load_checkpoint(trainer.run_dir).config.model.family == "qwen2"
