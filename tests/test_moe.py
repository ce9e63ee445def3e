"""The mixture-of-experts FFN (model.n_experts): against Hugging Face's MixtralForCausalLM, its
plain reference, the decoder, the load-balancing loss, training and the config's errors."""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import ConfigError, ModelConfig
from minillm.families import from_hf_state_dict, hf_config_dict, to_hf_state_dict
from minillm.model import KVCache, Transformer, use_cpu_kernels
from minillm.model.decode import Decoder
from minillm.model.moe import (
    MoE,
    RouterStats,
    load_balancing_loss,
    moe_dispatch,
    moe_reference,
    route,
    router_stats,
)
from minillm.model.transformer import SwiGLU
from tests.helpers import (
    assert_same_function,
    assert_set_refused,
    make_trainer,
    prepared_config,
    run_trainer,
)

BASE = dict(vocab_size=101, d_model=64, n_layer=2, n_head=4, ffn_hidden=96, max_seq_len=64)
CASES = {
    "top1-mha-tied": dict(n_experts=4, n_experts_per_token=1, n_kv_head=4),
    "top2-gqa-untied": dict(n_experts=4, n_experts_per_token=2, n_kv_head=2, tie_embeddings=False),
    "top2-mha-width": dict(n_experts=3, n_experts_per_token=2, moe_ffn_hidden=48),
    # Qwen1.5-MoE's options (a Qwen2MoeForCausalLM): softmax weights kept, a gated shared
    # expert, block 0 dense, q/k/v biases
    "qwen2moe-shared-dense": dict(n_experts=4, n_experts_per_token=2, moe_shared_ffn_hidden=32,
                                  moe_norm_topk=False, moe_dense_layers=[0],
                                  attention_bias=True, tie_embeddings=False),
    # Qwen3-MoE's (a Qwen3MoeForCausalLM): qk_norm, here without the renormalisation
    "qwen3moe": dict(n_experts=4, n_experts_per_token=2, qk_norm=True, moe_norm_topk=False),
}  # fmt: skip


def make_pair(**kw) -> tuple[Transformer, transformers.PreTrainedModel, ModelConfig]:
    """A tiny HF Mixtral (Qwen2-MoE, Qwen3-MoE with their options) with random weights and our
    Transformer holding the same weights."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{**BASE, **kw})
    hf_cfg = hf_config_dict(cfg, bos_id=0, eos_id=0, router_aux_loss_coef=0.02)
    (arch,) = hf_cfg.pop("architectures")
    hf_cfg.pop("torch_dtype")
    hf = getattr(transformers, arch)(transformers.AutoConfig.for_model(**hf_cfg)).eval()
    with torch.no_grad():  # HF initialises norms to 1 and experts to 0.02: make them informative
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "gate" in name and "experts" not in name and "shared" not in name:
                p.normal_(0.0, 0.5)  # a router with clear preferences: no near-ties in top-k
    ours = Transformer(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    return ours, hf, cfg


@pytest.mark.parametrize("case", CASES)
def test_logits_and_gradients_match_hf_mixtral(case: str) -> None:
    ours, hf, cfg = make_pair(**CASES[case])
    idx = torch.randint(0, cfg.vocab_size, (3, 40))
    probe = torch.randn(3, 40, cfg.vocab_size)
    out = hf(idx, output_router_logits=True)
    got, _ = ours(idx)
    assert_same_function(got, out.logits)
    aux = load_balancing_loss(router_stats(ours), cfg.n_experts)
    # Ours is HF's function of each layer alone, averaged (HF's own pools the layers first).
    per_layer = [
        load_balancing_loss_func((g,), cfg.n_experts, cfg.n_experts_per_token)
        for g in out.router_logits
    ]
    hf_aux = torch.stack(per_layer).mean()
    assert_same_function(aux, hf_aux)
    # A loss that weighs every logit, plus the load-balancing loss (the router's own gradient).
    ((out.logits * probe).sum() + hf_aux).backward()
    ((got * probe).sum() + aux).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    if cfg.tie_embeddings:
        hf_grads.pop("lm_head.weight", None)
    want = from_hf_state_dict(hf_grads, cfg)
    for name, p in ours.named_parameters():
        scale = want[name].abs().max().item()
        # rounding grows with the activations' size (about 1), not with a small gradient's
        assert_same_function(p.grad, want[name], scale=max(1.0, scale), msg=name)


def test_hf_names_round_trip_through_the_published_mixtral_layout() -> None:
    ours, hf, cfg = make_pair(**CASES["top2-gqa-untied"])
    theirs = to_hf_state_dict(ours.state_dict(), cfg)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in theirs
    assert theirs["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, 64)
    back = from_hf_state_dict(theirs, cfg)
    assert back.keys() == ours.state_dict().keys()
    for name, value in ours.state_dict().items():
        assert torch.equal(back[name], value), name


def test_hf_names_round_trip_through_the_published_qwen_moe_layout() -> None:
    ours, hf, cfg = make_pair(**CASES["qwen2moe-shared-dense"])
    theirs = to_hf_state_dict(ours.state_dict(), cfg)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in theirs
    assert theirs["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert "model.layers.0.mlp.gate_proj.weight" in theirs  # block 0 is dense
    back = from_hf_state_dict(theirs, cfg)
    assert back.keys() == ours.state_dict().keys()
    for name, value in ours.state_dict().items():
        assert torch.equal(back[name], value), name


@pytest.mark.parametrize(
    "options, key",
    [
        (dict(qk_norm=True, moe_shared_ffn_hidden=32), "model.moe_shared_ffn_hidden"),
        (dict(moe_norm_topk=False), "model.moe_norm_topk"),
        (dict(moe_dense_layers=[1]), "model.moe_dense_layers"),
        (dict(attention_bias=True), "model.attention_bias"),
        (dict(moe_shared_ffn_hidden=32, sliding_window=16), "model.sliding_window"),
    ],
)
def test_an_moe_no_transformers_family_computes_is_refused_by_key(options: dict, key: str) -> None:
    cfg = ModelConfig(**BASE, n_experts=4, **options)
    with pytest.raises(ConfigError) as e:
        hf_config_dict(cfg, bos_id=0, eos_id=0)
    assert e.value.key == key


def test_the_qwen_moe_options_count_their_parameters_and_quantize() -> None:
    from minillm.model.quantize import int8_kernel_problem, quantize_int8

    cfg = ModelConfig(**BASE, **CASES["qwen2moe-shared-dense"])
    model = Transformer(cfg).eval()
    C, F, S, E, L = 64, 96, 32, 4, 2  # F: moe_ffn_hidden, the dense width by default
    moe = E * 3 * C * F + E * C + 3 * C * S + C  # experts, router, shared expert and its gate
    dense = 3 * C * cfg.ffn_hidden
    assert isinstance(model.blocks[0].ffn, SwiGLU) and isinstance(model.blocks[1].ffn, MoE)
    attn = C * 3 * C + 3 * C + C * C + 2 * C  # biased q/k/v, o, the two norms
    assert model.param_count() == 2 * 101 * C + C + L * attn + dense + moe
    assert model.param_count() - model.active_param_count() == (E - 2) * 3 * C * F
    shared_down = model.blocks[1].ffn.shared.w_down.weight
    assert any(w is shared_down for w in model.residual_projections())
    idx = torch.randint(0, 101, (2, 12))
    with torch.no_grad():
        want = model(idx)[0]
        if int8_kernel_problem() is not None:
            pytest.skip(int8_kernel_problem())
        assert quantize_int8(model) is None
        got = model(idx)[0]
    assert type(model.blocks[1].ffn.shared.w_down).__name__ == "Int8Linear"
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_dispatch_equals_the_plain_reference_forward_and_gradients() -> None:
    torch.manual_seed(1)
    N, C, E, F, k = 50, 16, 6, 24, 2
    x, router = torch.randn(N, C), torch.randn(E, C)
    x[:5] = x[5]  # identical tokens
    x[:, 0], router[E - 1] = 5.0, 0.0
    router[E - 1, 0] = -20.0  # an expert no token picks
    w_gate_up, w_down = torch.randn(E, 2 * F, C) * 0.2, torch.randn(E, C, F) * 0.2
    leaves = tuple(t.requires_grad_() for t in (x, router, w_gate_up, w_down))
    probe = torch.randn(N, C)
    results = []
    for fn in (moe_reference, moe_dispatch):
        _, weights, experts = route(x, router, k)
        y = fn(x, weights, experts, w_gate_up, w_down)
        grads = torch.autograd.grad((y * probe).sum(), leaves)
        results.append((y, grads))
    assert not (experts == E - 1).any()  # the unused expert: a zero gradient, not None
    (y_ref, g_ref), (y_fast, g_fast) = results
    assert_same_function(y_fast, y_ref)
    for a, b in zip(g_fast, g_ref):
        assert_same_function(a, b)
    assert g_fast[2][E - 1].abs().max() == 0 and g_ref[1].abs().max() > 0


def test_each_token_gets_its_top_k_renormalised() -> None:
    probs, weights, experts = route(torch.eye(4), torch.tensor([[0.0, 0, 0, 0], [0, 0, 3, 0]]), 1)
    assert experts[:, 0].tolist() == [0, 0, 1, 0] and torch.equal(weights, torch.ones(4, 1))
    x = torch.randn(7, 8)
    probs, weights, experts = route(x, torch.randn(5, 8), 3)
    torch.testing.assert_close(weights.sum(-1), torch.ones(7))
    top = probs.gather(1, experts)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))


@pytest.mark.parametrize("k", [1, 2])
def test_a_balanced_router_gives_the_minimum_load_balancing_loss_k(k: int) -> None:
    # Uniform probabilities and every expert chosen equally often: E * sum_e (k/E)(1/E) = k.
    E, N = 4, 8
    stats = [RouterStats(torch.full((E,), N / E), torch.full((E,), N * k / E), N)] * 3
    assert load_balancing_loss(stats, E).item() == pytest.approx(k, abs=1e-12)
    # All tokens on one expert, all probability on it: E * k, the maximum.
    skewed = RouterStats(torch.tensor([N, 0.0, 0, 0]), torch.tensor([N * k, 0.0, 0, 0]), N)
    assert load_balancing_loss([skewed], E).item() == pytest.approx(E * k)
    # Two layers unbalanced in opposite ways are not balanced: pooled over the layers (HF's
    # load_balancing_loss_func) they would score the minimum k = 1.
    one = RouterStats(torch.tensor([N, 0.0]), torch.tensor([N, 0.0]), N)
    other = RouterStats(torch.tensor([0.0, N]), torch.tensor([0.0, N]), N)
    assert load_balancing_loss([one, other], 2).item() == pytest.approx(2.0)
    pooled = load_balancing_loss_func(
        (torch.tensor([[9.0, 0]] * N), torch.tensor([[0, 9.0]] * N)), 2, 1
    )
    assert pooled.item() == pytest.approx(1.0, abs=1e-3)
    # A real router: the loss never goes below k.
    ours, _, cfg = make_pair(**CASES["top2-gqa-untied"])
    ours(torch.randint(0, cfg.vocab_size, (2, 30)))
    assert load_balancing_loss(router_stats(ours), cfg.n_experts).item() >= 2.0 - 1e-6


@pytest.mark.parametrize("case", ["top1-mha-tied", "top2-gqa-untied", "qwen2moe-shared-dense"])
def test_decoder_step_equals_forward_with_the_cache(case: str) -> None:
    ours, _, cfg = make_pair(**CASES[case])
    idx = torch.randint(1, cfg.vocab_size, (3, 9))
    nxt = torch.randint(1, cfg.vocab_size, (3, 8))
    with torch.inference_mode():
        full, _ = ours(torch.cat([idx, nxt], dim=1))
        ref_cache, cache = KVCache(cfg, 3, 17), KVCache(cfg, 3, 17)
        for r in range(3):
            ours(idx[r : r + 1], kv_cache=ref_cache.rows(r, r + 1))
            ours(idx[r : r + 1], kv_cache=cache.rows(r, r + 1))
        decoder = Decoder(ours, cache)
        for t in range(8):
            ref = ours(nxt[:, t : t + 1], kv_cache=ref_cache, last_only=True)[0][:, 0]
            got = decoder.step(nxt[:, t])
            assert_same_function(got, ref)
            assert_same_function(got, full[:, 9 + t])


def assert_same_gradients(ours: Transformer, other: Transformer, cfg: ModelConfig) -> None:
    """One training batch's loss plus the load-balancing loss: `other` gets ours' gradients."""
    idx = torch.randint(0, cfg.vocab_size, (2, 24))
    targets = torch.randint(0, cfg.vocab_size, (2, 24))
    for model in (ours.train(), other.train()):
        _, loss = model(idx, targets)
        (loss + load_balancing_loss(router_stats(model), cfg.n_experts)).backward()
    for (name, a), b in zip(ours.named_parameters(), other.parameters()):
        assert_same_function(b.grad, a.grad, msg=name)


@pytest.mark.parametrize("case", ["top2-gqa-untied", "qwen2moe-shared-dense"])
def test_cpu_kernels_train_an_moe_as_the_plain_modules_do(case: str) -> None:
    ours, _, cfg = make_pair(**CASES[case])
    fused = use_cpu_kernels(Transformer(cfg))
    fused.load_state_dict(ours.state_dict())
    assert type(fused.blocks[1].ffn).__name__ == "FusedMoE"
    if cfg.moe_shared_ffn_hidden:
        assert type(fused.blocks[1].ffn.shared).__name__ == "FusedSharedExpert"
    assert_same_gradients(ours, fused, cfg)


def test_activation_checkpointing_gives_the_same_gradients_aux_loss_included() -> None:
    ours, _, cfg = make_pair(**CASES["top2-gqa-untied"])
    recomputed = Transformer(cfg)
    recomputed.load_state_dict(ours.state_dict())
    recomputed.activation_checkpointing = True
    assert_same_gradients(ours, recomputed, cfg)


def test_param_counts_flops_and_residual_init() -> None:
    cfg = ModelConfig(**BASE, n_experts=4, n_experts_per_token=2)
    model = Transformer(cfg)
    C, F, E, L = 64, 96, 4, 2
    expert = 3 * C * F
    assert cfg.moe_ffn_hidden == F
    assert model.param_count() - model.active_param_count() == L * (E - 2) * expert
    dense_part = model.param_count() - L * (E * expert + E * C)
    assert model.active_param_count() == dense_part + L * (2 * expert + E * C)
    matmul = model.active_param_count() - (2 * L + 1) * C  # less the norm gains; the tied head
    assert model.flops_per_token(32) == 6 * matmul + 12 * L * C * 32
    downs = model.residual_projections()
    assert downs[1] is model.blocks[0].ffn.w_down and downs[1].dim() == 3
    assert downs[1].std().item() == pytest.approx(0.02 / 2, rel=0.1)


runner = CliRunner()


@pytest.mark.parametrize(
    "sets,expected",
    [
        (
            ["model.n_experts=4", "model.n_experts_per_token=5"],
            "model.n_experts_per_token: 5 is more than n_experts=4",
        ),
        (["model.n_experts=1"], "model.n_experts: 1 expert is the dense FFN behind a router"),
        (["train.moe_aux_loss=0.01"], "train.moe_aux_loss: 0.01 needs a mixture of experts"),
        (["model.moe_shared_ffn_hidden=32"],
         "model.moe_shared_ffn_hidden: 32 needs a mixture of experts (n_experts)"),
        (["model.moe_norm_topk=false"], "model.moe_norm_topk: False needs a mixture of experts"),
        (["model.n_experts=4", "model.moe_dense_layers=[2]"],
         "model.moe_dense_layers: [2]: block numbers must be distinct, from 0 to n_layer - 1 = 1"),
        (["model.n_experts=4", "model.moe_dense_layers=[0, 0]"],
         "model.moe_dense_layers: [0, 0]: block numbers must be distinct"),
        (["model.n_experts=4", "model.moe_dense_layers=[0, 1]"],
         "model.moe_dense_layers: every block dense: that is n_experts 0"),
    ],
)  # fmt: skip
def test_config_errors_are_one_line(tmp_path: Path, sets: list[str], expected: str) -> None:
    assert_set_refused(tmp_path, sets, expected)


# ------------------------------------------------------------------ training

MOE = dict(n_experts=4, n_experts_per_token=2)


def test_training_adds_the_aux_loss_and_logs_the_expert_load(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = prepared_config(
        tmp_path, model=MOE, train=dict(moe_aux_loss=0.05, max_steps=4, log_every=2)
    )
    trainer = run_trainer(cfg)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    aux = [e.value for e in acc.Scalars("xray/moe/aux_loss")]
    assert len(aux) == 2 and all(a >= 2.0 - 1e-4 for a in aux)  # k = 2 at best
    for layer in range(cfg.model.n_layer):
        load = [acc.Scalars(f"xray/moe/layer{layer}/expert{e}")[-1].value for e in range(4)]
        assert sum(load) == pytest.approx(2.0)  # each token counted at its k = 2 experts
    assert trainer.expert_load.micro_batches == 0  # reset at the log


def _grads(cfg, micro: list) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The gradients of one train_step on `micro`, taken before the clip and step."""
    trainer = make_trainer(cfg, verbose=False, batches=lambda step: micro)
    grads = {}

    def capture(loss: torch.Tensor) -> tuple[torch.Tensor, bool]:
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return torch.zeros(()), True

    trainer._clip_and_step = capture
    try:
        trainer.train_step()
    finally:
        trainer.close()
    return grads


def test_the_aux_loss_gradient_and_its_accumulation(tmp_path: Path) -> None:
    cfg = prepared_config(tmp_path, model=MOE, train=dict(moe_aux_loss=0.5, grad_clip=0.0))
    trainer = make_trainer(cfg, verbose=False)
    micro = trainer.batches(0)[:1]
    trainer.close()
    m = micro[0]
    with_aux = _grads(cfg, [m])
    twice = _grads(replace(cfg, train=replace(cfg.train, grad_accum=2)), [m, m])
    for name, g in with_aux.items():  # two equal micro-batches: the gradient of one
        assert_same_function(twice[name], g, msg=name)
    without = _grads(replace(cfg, train=replace(cfg.train, moe_aux_loss=0.0)), [m])
    # The aux loss reaches the routers only (and what feeds them): the experts' gradients agree.
    assert torch.equal(without["blocks.1.ffn.w_down"], with_aux["blocks.1.ffn.w_down"])
    router = "blocks.1.ffn.router.weight"
    assert not torch.allclose(without[router], with_aux[router], atol=1e-6)
    # ... by exactly coef * d(aux)/d(router): the loss of the same forward, differentiated alone.
    model = Transformer(cfg.model)
    model.load_state_dict(trainer.model.state_dict())
    model(m.tokens)
    aux = load_balancing_loss(router_stats(model), 4)
    (grad,) = torch.autograd.grad(aux, model.blocks[1].ffn.router.weight)
    assert_same_function(with_aux[router] - without[router], 0.5 * grad)


def test_lora_on_the_experts_is_refused_attention_adapters_are_not(tmp_path: Path) -> None:
    from minillm.config import ConfigError, config_from_dict

    raw = dict(
        model={**BASE, **MOE, "vocab_size": 300},
        data=dict(vocab_size=300),
        train=dict(init_from=str(tmp_path), seq_len=32, lora=dict(rank=4)),
    )
    with pytest.raises(ConfigError, match="train.lora.targets: w_gate_up, w_down on a mixture"):
        config_from_dict(raw)
    raw["train"]["lora"]["targets"] = ["wqkv", "wo"]
    assert config_from_dict(raw).train.lora.targets == ["wqkv", "wo"]


# ------------------------------------------------------------------ info

MIXTRAL_8X7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
    sliding_window=None, model_type="mixtral", architectures=["MixtralForCausalLM"],
)  # fmt: skip


def test_info_counts_mixtral_8x7b_as_transformers_does(tmp_path: Path) -> None:
    from minillm.config import Config
    from minillm.families import model_config_from_hf
    from minillm.info import model_info

    cfg = model_config_from_hf(MIXTRAL_8X7B)
    hf_cfg = {k: v for k, v in MIXTRAL_8X7B.items() if k not in ("model_type", "architectures")}
    with torch.device("meta"):
        hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**hf_cfg))
    hf_params = sum(p.numel() for p in hf.parameters())
    info = model_info(Config(model=cfg))
    assert info["params"] == hf_params == 46_702_792_704
    expert = 3 * 4096 * 14336
    assert info["params_active"] == hf_params - 32 * 6 * expert == 12_879_925_248
    # 6 FLOPs per active matmul weight: the embedding is a lookup, the untied head a matmul.
    matmul = info["params_active"] - 32000 * 4096 - (2 * 32 + 1) * 4096
    assert info["flops_per_token"] == 6 * matmul + 12 * 32 * 4096 * info["seq_len"]


def test_info_cli_shows_total_and_active_parameters(tmp_path: Path) -> None:
    path = tmp_path / "moe.yaml"
    path.write_text(
        "model: {d_model: 64, n_layer: 2, n_head: 4, n_experts: 8, n_experts_per_token: 2}\n"
    )
    result = runner.invoke(app, ["info", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "active parameters per token" in result.output
    assert "2 of 8 experts" in result.output and "8 experts of ffn 256, top-2" in result.output


# ------------------------------------------------------------------ resume, sample


# DeepSeekMoE's: the sigmoid router's bias, moved each step by train.moe_bias_update, is model
# state (a buffer) that a resume must restore with the weights.
SIGMOID = dict(moe_router="sigmoid", n_experts=4, moe_routed_scale=2.0, moe_shared_ffn_hidden=32)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_an_moe_run_resumes_bitwise(tmp_path: Path, router: str) -> None:
    from tests.helpers import assert_same_weights, resumed_runs

    model, train = {**MOE, "dropout": 0.1}, dict(moe_aux_loss=0.02, grad_accum=2)
    if router == "sigmoid":
        model, train = {**model, **SIGMOID}, {**train, "moe_bias_update": 0.01}
    cfg = prepared_config(tmp_path, model=model, train=train)
    straight, stopped, resumed = resumed_runs(cfg, tmp_path, stop_at=3)  # saves at step 3
    assert resumed.state.step == 8 and "blocks.0.ffn.w_gate_up" in straight.model.state_dict()
    assert_same_weights(straight, resumed)
    if router == "sigmoid":  # the bias had moved when the run stopped
        assert stopped.model.state_dict()["blocks.1.ffn.router_bias"].abs().max() > 0


def test_sample_cli_decodes_an_moe_run(tmp_path: Path) -> None:
    cfg = prepared_config(tmp_path, model=MOE, train=dict(max_steps=2, ckpt_every=2))
    run_trainer(cfg)
    args = ["sample", "--ckpt", cfg.train.out_dir, "--prompt", "ROMEO:", "--max-new-tokens", "8"]
    greedy = [runner.invoke(app, [*args, "--temperature", "0"]) for _ in range(2)]
    assert greedy[0].exit_code == 0, greedy[0].output
    assert greedy[0].stdout.startswith("ROMEO:") and greedy[0].stdout == greedy[1].stdout


# ------------------------------------------------------------------ export: HF, init_from, GGUF

# An awkward MoE: GQA, untied head, 5 experts of their own width, top-2, an aux loss.
EXPORT_MODEL = dict(
    n_experts=5, n_experts_per_token=2, n_kv_head=2, tie_embeddings=False, moe_ffn_hidden=64
)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory):
    from minillm.checkpoint.store import load_checkpoint
    from tests.helpers import make_run

    root = tmp_path_factory.mktemp("moe-export")
    run_dir, cfg, net = make_run(root, model=EXPORT_MODEL, train=dict(moe_aux_loss=0.02))
    return root, run_dir, load_checkpoint(run_dir)


def test_hf_export_is_a_mixtral_transformers_runs_with_our_logits(moe_run) -> None:
    import json

    root, run_dir, loaded = moe_run
    out = root / "hf"
    result = runner.invoke(app, ["export", "--ckpt", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["architectures"] == ["MixtralForCausalLM"] and hf_cfg["model_type"] == "mixtral"
    assert (hf_cfg["num_local_experts"], hf_cfg["num_experts_per_tok"]) == (5, 2)
    assert hf_cfg["intermediate_size"] == 64 and hf_cfg["router_aux_loss_coef"] == 0.02
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    idx = torch.randint(0, loaded.config.model.vocab_size, (2, 40))
    with torch.no_grad():
        ours, _ = loaded.model(idx)
        ref = hf(idx).logits
    assert_same_function(ref, ours)


def test_init_from_an_hf_mixtral_folder_starts_from_its_weights(moe_run, tmp_path: Path) -> None:
    import yaml

    from minillm.checkpoint.hf_export import export_checkpoint
    from minillm.checkpoint.init_from import load_run_config
    from tests.helpers import write_shards

    root, run_dir, loaded = moe_run
    hf_dir = export_checkpoint(loaded, tmp_path / "hf")
    vocab = loaded.config.data.vocab_size
    raw = {
        "data": dict(source=str(tmp_path / "corpus.jsonl"), vocab_size=vocab,
                     tokenizer=str(hf_dir / "tokenizer.json"), out_dir=str(tmp_path / "tok")),
        "train": dict(out_dir=str(tmp_path / "run2"), init_from=str(hf_dir), batch_size=2,
                      seq_len=16, max_steps=1, device="cpu", precision="fp32"),
    }  # fmt: skip
    path = tmp_path / "init.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_run_config(path)  # no model section: the folder's config.json gives it
    assert (cfg.model.n_experts, cfg.model.n_experts_per_token, cfg.model.moe_ffn_hidden) == (
        5, 2, 64
    )  # fmt: skip
    write_shards(cfg, ["First document, long enough to train on. " * 20] * 6)
    trainer = make_trainer(cfg, verbose=False)
    try:
        got = trainer.model.state_dict()
        want = loaded.model.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        trainer.close()


needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)


@needs_llama_cpp
@pytest.mark.parametrize("dtype,bound", [("f32", 1e-4), ("q8_0", 6e-2)])
def test_gguf_export_runs_in_llama_cpp_with_our_logits_and_greedy_tokens(
    moe_run, dtype: str, bound: float
) -> None:
    import gguf
    import numpy as np
    from llama_cpp import Llama

    from minillm.checkpoint.gguf_file import export_gguf
    from minillm.infer.engine import SamplingParams, generate
    from minillm.tokenizer.bpe import eot_id

    root, run_dir, loaded = moe_run
    path = export_gguf(loaded, root / f"moe-{dtype}.gguf", dtype)
    reader = gguf.GGUFReader(path)
    fields = {f.name: f.parts[-1][0] for f in reader.fields.values() if len(f.parts[-1]) == 1}
    assert (fields["llama.expert_count"], fields["llama.expert_used_count"]) == (5, 2)
    assert fields["llama.feed_forward_length"] == 64
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert shapes["blk.1.ffn_gate_inp.weight"] == (64, 5)  # ggml's order: (C, E)
    assert shapes["blk.1.ffn_gate_exps.weight"] == shapes["blk.1.ffn_up_exps.weight"] == (64, 64, 5)
    assert shapes["blk.1.ffn_down_exps.weight"] == (64, 64, 5)
    assert not any(".ffn_gate.weight" in name for name in shapes)

    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    ids = [eot_id(loaded.tokenizer), *loaded.tokenizer.encode(text).ids][:40]
    kw = dict(n_ctx=64, n_batch=64, n_ubatch=64, n_threads=2, n_threads_batch=2, verbose=False)
    llm = Llama(model_path=str(path), logits_all=True, type_k=0, type_v=0, **kw)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids[1:]
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)])
    with torch.no_grad():
        ours = loaded.model(torch.tensor([ids]))[0][0].numpy()
    rel = np.abs(theirs - ours).max() / (ours.max() - ours.min())
    print(f"\nMoE {dtype}: max |diff| {rel:.2e} of the logit range")
    assert rel <= bound
    if dtype == "f32":
        n = loaded.config.model.max_seq_len - 20
        want = generate(loaded.model, [ids[:20]], SamplingParams.greedy(n))[0]
        llm = Llama(model_path=str(path), type_k=0, type_v=0, **kw)
        got = list(itertools.islice(llm.generate(ids[:20], temp=0.0, repeat_penalty=1.0), n))
        assert got == want


# ------------------------------------------------------------------ the bench


@pytest.mark.slow
def test_bench_train_has_an_moe_row_against_the_dense_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.helpers import load_script

    bench = load_script("bench_train", monkeypatch)
    bench.main(["--shapes", "tiny", "--compile", "no", "--steps", "2", "--warmup", "1",
                "--peak-seconds", "0.05", "--threads", "0", "--moe", "4,2"])  # fmt: skip
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("minillm MoE 4x128 top-2 "))
    assert float(row.split()[-1]) == pytest.approx(5.545, abs=0.05)  # loss@0 about ln(256)
    assert "minillm MoE 4x128 top-2: " in out and "x tokens/s" in out and "x peak memory" in out


def test_muon_takes_the_router_adamw_the_stacked_experts(tmp_path: Path) -> None:
    from minillm.model.param_groups import optimizer_split

    cfg = prepared_config(tmp_path, model=MOE, train=dict(optimizer="muon", max_steps=2))
    trainer = run_trainer(cfg)
    split = {k: [n for n, _ in v] for k, v in optimizer_split(trainer.model, "muon").items()}
    assert "blocks.0.ffn.router.weight" in split["muon"]
    assert "blocks.0.ffn.w_gate_up" in split["adamw"] and "blocks.0.ffn.w_down" in split["adamw"]
    assert trainer.state.step == 2
