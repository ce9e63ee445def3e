"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`) as our Transformer with model.partial_rotary and
rope_scaling longrope: transformers' own model with random weights, read as a folder, compared
with its logits and gradients below and past the original length, with its generate, exported
back to its class; Phi-4-mini's size counted as transformers counts it on the meta device."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from minillm.checkpoint.hf_export import export_checkpoint
from minillm.checkpoint.hf_import import import_hf_folder
from minillm.checkpoint.store import load_checkpoint
from minillm.config import Config, ConfigError, ModelConfig, TrainConfig
from minillm.errors import CheckpointError
from minillm.families import model_config_from_hf, resolve_family
from minillm.infer.engine import SamplingParams, generate
from minillm.info import model_info
from minillm.model import Transformer
from minillm.model.rope import inv_frequencies
from minillm.tokenizer.bpe import EOT
from tests.helpers import VOCAB, assert_same_function, spread_weights_, tiny_tokenizer

ORIGINAL = 24  # original_max_position_embeddings: lengths 20 (short factors) and 70 (long)


def _factors(n: int, start: float, step: float) -> list[float]:
    return [round(start + step * i, 3) for i in range(n)]


# name -> (partial_rotary_factor, Phi3Config values beyond the sizes)
CASES = {
    # Phi-4-mini's shape: 3/4 of each head rotated, LongRoPE, a tied head
    "phi4-mini": (0.75, dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "longrope", "short_factor": _factors(6, 1.0, 0.1),
        "long_factor": _factors(6, 1.5, 0.3)})),
    # Phi-3-mini-128k's: every dimension rotated, LongRoPE (its older name su), untied
    "mini-128k": (1.0, dict(tie_word_embeddings=False, rope_scaling={
        "type": "su", "short_factor": _factors(8, 1.0, 0.05),
        "long_factor": _factors(8, 1.2, 0.4)})),
    # partial RoPE alone (no scaling), an attention factor of its own on LongRoPE elsewhere
    "partial-plain": (0.5, dict(tie_word_embeddings=True, rope_scaling=None)),
    "attention-factor": (0.75, dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "longrope", "short_factor": _factors(6, 1.0, 0.2),
        "long_factor": _factors(6, 2.0, 0.5), "attention_factor": 1.3})),
}  # fmt: skip


def phi3_folder(root: Path, case: str, original: int = ORIGINAL) -> tuple[Path, torch.nn.Module]:
    """transformers' Phi3ForCausalLM of `case` with random weights spread wide, saved with our
    tokenizer; its context 4 times the original length."""
    partial, values = CASES[case]
    tok = tiny_tokenizer()
    eot = tok.token_to_id(EOT)
    hf_cfg = transformers.Phi3Config(
        vocab_size=VOCAB + 20, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * original,
        original_max_position_embeddings=original, partial_rotary_factor=partial,
        rope_theta=500.0, bos_token_id=eot, eos_token_id=eot, pad_token_id=None, **values,
    )  # fmt: skip
    torch.manual_seed(5)
    hf = spread_weights_(transformers.Phi3ForCausalLM(hf_cfg).eval())
    folder = root / case
    hf.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder, hf


def ours(folder: Path) -> Transformer:
    cfg, state, _ = import_hf_folder(folder)
    model = Transformer(cfg)
    model.load_state_dict(state)
    return model.eval()


def _rows_ours(w: torch.Tensor, model: Transformer) -> torch.Tensor:
    from minillm.families.phi3 import rotary_rows_to_ours

    return rotary_rows_to_ours(w, model.cfg)


@pytest.mark.parametrize("T", [20, 70])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients_equal_transformers(tmp_path: Path, case: str, T: int) -> None:
    """Below the original length (short factors) and past it (long ones, for every position)."""
    folder, hf = phi3_folder(tmp_path, case)
    model = ours(folder)
    assert model.cfg.partial_rotary == CASES[case][0]
    idx = torch.randint(0, VOCAB + 20, (2, T))
    targets = torch.cat((idx[:, 1:], torch.full((2, 1), -100)), dim=1)  # as transformers shifts
    logits, loss = model(idx, targets)
    ref = hf(idx, labels=idx)
    assert_same_function(logits, ref.logits)
    assert_same_function(loss, ref.loss)
    loss.backward()
    ref.loss.backward()
    layer = hf.model.layers[1]
    want = {
        "tok_emb.weight": hf.model.embed_tokens.weight.grad,
        "blocks.1.attn.wqkv.weight": _rows_ours(layer.self_attn.qkv_proj.weight.grad, model),
        "blocks.1.attn.wo.weight": layer.self_attn.o_proj.weight.grad,
        "blocks.1.ffn.w_gate_up.weight": layer.mlp.gate_up_proj.weight.grad,
        "blocks.1.ffn.w_down.weight": layer.mlp.down_proj.weight.grad,
        "blocks.1.attn_norm.weight": layer.input_layernorm.weight.grad,
        "blocks.1.ffn_norm.weight": layer.post_attention_layernorm.weight.grad,
        "norm.weight": hf.model.norm.weight.grad,
    }
    grads = dict(model.named_parameters())
    for name, g in want.items():
        assert_same_function(grads[name].grad, g, msg=name)


def test_a_batch_of_rows_on_either_side_of_the_original_length_equals_each_alone(
    tmp_path: Path,
) -> None:
    """Each row takes the factors of its own length (transformers takes the batch's longest):
    a left-padded row of 20 tokens beside one of 30 reads the short factors as it would alone."""
    folder, _ = phi3_folder(tmp_path, "phi4-mini")
    model = ours(folder)
    short, long = torch.randint(0, VOCAB, (20,)), torch.randint(0, VOCAB, (30,))
    idx = torch.stack((torch.cat((torch.zeros(10, dtype=torch.long), short)), long))
    mask = torch.ones_like(idx)
    mask[0, :10] = 0
    with torch.no_grad():
        both = model(idx, attention_mask=mask)[0]
        alone = [model(short[None])[0][0], model(long[None])[0][0]]
    assert_same_function(both[0, 10:], alone[0])
    assert_same_function(both[1], alone[1])


@pytest.mark.parametrize("prompt_len", [10, 30])
@pytest.mark.parametrize("case", ["phi4-mini", "mini-128k"])
def test_cached_greedy_equals_transformers_generate(
    tmp_path: Path, case: str, prompt_len: int
) -> None:
    """Our KV-cached greedy decode of 40 new tokens against transformers' generate. From a
    prompt of 10 the decode crosses the original length (24): our row is refilled once with the
    long factors there, which is transformers' full forward, so against its generate without a
    cache (its cached generate keeps the keys rotated at the short factors). From a prompt of 30,
    past the original already, its cached generate is its full forward too."""
    folder, hf = phi3_folder(tmp_path, case)
    model = ours(folder)
    torch.manual_seed(1)
    prompt = torch.randint(0, VOCAB, (prompt_len,)).tolist()
    got = generate(model, [prompt], SamplingParams.greedy(40))[0]
    hf.generation_config.eos_token_id = None  # 40 tokens, as ours without stop ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                          use_cache=prompt_len > ORIGINAL)  # fmt: skip
    assert got == out[0, prompt_len:].tolist()


def test_cached_greedy_below_the_original_length_equals_cached_generate(tmp_path: Path) -> None:
    folder, hf = phi3_folder(tmp_path, "phi4-mini")
    model = ours(folder)
    prompt = torch.randint(0, VOCAB, (5,)).tolist()
    got = generate(model, [prompt], SamplingParams.greedy(15))[0]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=15, do_sample=False)
    assert got == out[0, 5:].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_export_writes_phi3_back(tmp_path: Path, case: str) -> None:
    folder, hf = phi3_folder(tmp_path, case)
    out = export_checkpoint(load_checkpoint(folder), tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Phi3ForCausalLM"]
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again) is type(hf)
    for T in (20, 70):
        idx = torch.randint(0, VOCAB + 20, (1, T))
        with torch.no_grad():
            assert_same_function(again(idx).logits, hf(idx).logits)
    assert import_hf_folder(out)[0] == import_hf_folder(folder)[0]


# Phi-4-mini-instruct's published config.json (nothing downloaded), its 48 LongRoPE factors
# replaced by numbers of the same count: the size does not depend on them.
_PHI4_MINI = dict(
    architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=200064, hidden_size=3072,
    intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
    max_position_embeddings=131072, original_max_position_embeddings=4096,
    partial_rotary_factor=0.75, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
    tie_word_embeddings=True, sliding_window=262144, bos_token_id=199999,
    eos_token_id=199999, pad_token_id=199999, resid_pdrop=0.0, embd_pdrop=0.0,
    attention_dropout=0.0, rope_scaling=dict(type="longrope", short_factor=[1.0] * 48,
                                             long_factor=[1.5] * 48),
)  # fmt: skip


def phi4_mini(**changes: object) -> dict:
    """A fresh copy: transformers' config classes write into the rope_scaling dict they get."""
    return json.loads(json.dumps({**_PHI4_MINI, **changes}))


def test_info_counts_phi4_mini_as_transformers() -> None:
    hf_cfg = transformers.AutoConfig.for_model(**phi4_mini())
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    theirs = sum(p.numel() for p in hf.parameters())
    m = model_config_from_hf(phi4_mini())
    assert (m.partial_rotary, m.rotary_dim, m.sliding_window) == (0.75, 96, None)
    cfg = Config(m, train=TrainConfig(seq_len=4096, batch_size=1, device="cpu"))
    assert model_info(cfg)["params"] == theirs == 3_836_021_760


def test_phi4_minis_frequencies_and_attention_factor_are_transformers() -> None:
    """The published shape's short and long frequencies, and its attention factor
    sqrt(1 + ln 32 / ln 4096) = sqrt(1 + 5/12)."""
    hf_cfg = transformers.Phi3Config(**phi4_mini(rope_scaling=dict(
        type="longrope", short_factor=_factors(48, 1.0, 0.01),
        long_factor=_factors(48, 1.0, 0.7))))  # fmt: skip
    m = model_config_from_hf(hf_cfg.to_dict() | {"rope_scaling": hf_cfg.rope_parameters})
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf_cfg)
    for positions in ([[0, 4095]], [[0, 4096]]):  # lengths 4096 (short) and 4097 (long)
        ids = torch.tensor(positions)
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), ids)
        inv_freq, scale = inv_frequencies(m, int(ids.max()) + 1)
        assert scale == pytest.approx(rotary.attention_scaling)
        assert scale == pytest.approx((1 + 5 / 12) ** 0.5)
        torch.testing.assert_close(inv_freq[:48], rotary.inv_freq, atol=0, rtol=0)
        assert (inv_freq[48:] == 0).all()  # the unrotated quarter


def test_keys_left_out_of_a_phi3_config_are_phi3configs_defaults() -> None:
    sizes = {"model_type": "phi3", "vocab_size": 320, "hidden_size": 128,
             "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 32}  # fmt: skip
    theirs = transformers.AutoConfig.for_model(**sizes)
    m = model_config_from_hf(dict(sizes))
    assert m.rope_theta == theirs.rope_parameters["rope_theta"]
    assert m.norm_eps == theirs.rms_norm_eps
    assert m.max_seq_len == theirs.max_position_embeddings
    assert m.n_kv_head == theirs.num_key_value_heads
    assert m.tie_embeddings == theirs.tie_word_embeddings
    assert m.sliding_window == theirs.sliding_window
    assert m.partial_rotary == theirs.rope_parameters["partial_rotary_factor"]


@pytest.mark.parametrize(
    "changes, key",
    [
        (dict(partial_rotary_factor=0.7), "model.partial_rotary"),  # 128 * 0.7 is not whole
        (dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
        (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 47,
                                long_factor=[1.0] * 48)), "model.rope_scaling.short_factor"),
        (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 48)),
         "model.rope_scaling.long_factor"),
        (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "model.rope_scaling.type"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)  # fmt: skip
def test_what_minillm_cannot_read_names_the_key(changes: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        m = model_config_from_hf(phi4_mini(num_hidden_layers=2, **changes))
        resolve_family(m)
    assert e.value.key == key


@pytest.mark.parametrize(
    "options, key",
    [
        (dict(partial_rotary=0.3), "model.partial_rotary"),  # 16 * 0.3: not whole
        (dict(partial_rotary=0.125), "model.partial_rotary"),  # 2 of 16: fine; 1 of 8 below
        (dict(head_dim=8, partial_rotary=0.125), "model.partial_rotary"),
        (dict(rope_scaling=dict(type="longrope", original_max_position_embeddings=8,
                                short_factor=[1.0] * 8)), "model.rope_scaling.long_factor"),
        (dict(rope_scaling=dict(type="linear", factor=2.0, short_factor=[1.0])),
         "model.rope_scaling.short_factor"),
    ],
)  # fmt: skip
def test_the_new_options_refuse_bad_values_by_key(options: dict, key: str) -> None:
    if options == dict(partial_rotary=0.125):
        cfg = ModelConfig(vocab_size=64, d_model=64, n_layer=1, n_head=4, **options)
        assert cfg.rotary_dim == 2
        return
    with pytest.raises(ConfigError) as e:
        ModelConfig(vocab_size=64, d_model=64, n_layer=1, n_head=4, **options)
    assert e.value.key == key


def test_partial_rotary_with_another_familys_option_names_it() -> None:
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layer=1, n_head=4, partial_rotary=0.5,
                      qk_norm=True)  # fmt: skip
    with pytest.raises(ConfigError) as e:
        resolve_family(cfg)
    assert e.value.key == "model.qk_norm"


needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)


@needs_llama_cpp
@pytest.mark.parametrize("n_ctx, T", [(96, 70), (256, 40)])
@pytest.mark.parametrize("case", ["phi4-mini", "mini-128k", "attention-factor"])
def test_llama_cpp_computes_our_logits_and_greedy_text(
    tmp_path: Path, case: str, n_ctx: int, T: int
) -> None:
    """GGUF as llama.cpp's phi3 (partial RoPE, fused tensors, LongRoPE's factor tensors and
    attention factor). llama.cpp takes the long factors for a context (n_ctx) past the
    original length, so a context of 96 past an original 24 is compared at 70 tokens (ours:
    long), and one of 256 (llama.cpp's least) within an original 256 at 40 (ours: short).
    (The test folders are not named phi3-...: llama.cpp then looks for Phi-3's own special
    tokens in the vocabulary, which our tiny tokenizer does not have.)"""
    from gguf import GGUFReader
    from llama_cpp import Llama

    from minillm.checkpoint.gguf_file import export_gguf

    folder, _ = phi3_folder(tmp_path, case, original=ORIGINAL if n_ctx == 96 else 256)
    loaded = load_checkpoint(folder)
    path = export_gguf(loaded, tmp_path / "m.gguf")
    arch = GGUFReader(path).fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "phi3"
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (T,)).tolist()

    def llama(**kw: object) -> Llama:
        return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                     n_threads=2, n_threads_batch=2, verbose=False, type_k=0, type_v=0,
                     **kw)  # fmt: skip

    llm = llama(logits_all=True)
    llm.eval(ids)
    theirs = np.asarray(llm.scores[:T])
    with torch.no_grad():
        ours = loaded.model(torch.tensor([ids]))[0][0].numpy()
    rel = np.abs(theirs - ours).max() / (ours.max() - ours.min())
    print(f"\n{case} n_ctx {n_ctx}: max |diff| {rel:.2e} of the logit range")
    assert rel <= 1e-4  # test_gguf.py's bound for f32 weights and an f32 KV cache
    prompt, new = ids[:30], 40
    mine = generate(loaded.model, [prompt], SamplingParams.greedy(new))[0]
    cpp = list(itertools.islice(llama().generate(prompt, temp=0.0, repeat_penalty=1.0), new))
    assert cpp == mine


def test_a_window_llama_cpp_turns_off_is_refused_by_name(tmp_path: Path) -> None:
    from minillm.checkpoint.gguf_file import gguf_arch

    cfg = ModelConfig(vocab_size=64, d_model=64, n_layer=1, n_head=4, partial_rotary=0.5,
                      sliding_window=16, max_seq_len=64)  # fmt: skip
    with pytest.raises(CheckpointError) as e:
        gguf_arch(cfg)
    assert str(e.value).startswith("model.sliding_window: 16") and "phi3" in str(e.value)


def test_a_cached_batch_across_the_original_length_equals_each_row_and_the_full_forward() -> None:
    """Rows of 10 and 30 prompt tokens decoded together (one crosses 24 while the other is past
    it): each row's greedy text is its own alone, and that of a full forward every step."""
    from tests.test_model_options import PHI3, random_model, tiny

    model = random_model(tiny(**PHI3))
    torch.manual_seed(0)
    a, b = torch.randint(0, 97, (10,)).tolist(), torch.randint(0, 97, (30,)).tolist()
    both = generate(model, [a, b], SamplingParams.greedy(30))
    assert both == [generate(model, [p], SamplingParams.greedy(30))[0] for p in (a, b)]
    for prompt, got in zip((a, b), both):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(30):
                ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
        assert got == ids[len(prompt) :]
