"""DeepSeekMoE (model.moe_router sigmoid): the module against transformers' DeepseekV3MoE, the
decoder and int8 on it, its parameter counts, its config errors, and the auxiliary-loss-free
balancing of its routing bias (train.moe_bias_update) in training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import ModelConfig
from minillm.model import KVCache, Transformer
from minillm.model.decode import Decoder
from minillm.model.moe import MoE, route_sigmoid, router_stats, update_router_bias
from tests.helpers import (
    assert_same_function,
    assert_set_refused,
    make_trainer,
    prepared_config,
    run_trainer,
)

C, E, F = 64, 8, 32  # model width, routed experts, expert width

CASES = {
    # DeepSeek-V3's shape in small: 4 groups of 2, a token's 3 experts from its 2 best groups
    "groups-norm": dict(n_group=4, topk_group=2, norm_topk_prob=True, n_shared_experts=2),
    "groups-no-norm": dict(n_group=4, topk_group=2, norm_topk_prob=False, n_shared_experts=1),
    "one-group": dict(n_group=1, topk_group=1, norm_topk_prob=True, n_shared_experts=1),
}


def moe_pair(n_group: int, topk_group: int, norm_topk_prob: bool, n_shared_experts: int):
    """transformers' DeepseekV3MoE with random weights and a random routing bias, and our MoE
    module (model.moe_router sigmoid) holding the same."""
    torch.manual_seed(0)
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=C, n_routed_experts=E, num_experts_per_tok=3, moe_intermediate_size=F,
        n_shared_experts=n_shared_experts, n_group=n_group, topk_group=topk_group,
        norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5, num_attention_heads=4,
    )  # fmt: skip
    hf = DeepseekV3MoE(hf_cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
        hf.gate.weight.normal_(0.0, 0.5)  # clear preferences: no near-ties in the choice
        hf.gate.e_score_correction_bias.normal_(0.0, 0.3)
    cfg = ModelConfig(
        vocab_size=101, d_model=C, n_layer=1, n_head=4, n_experts=E, n_experts_per_token=3,
        moe_ffn_hidden=F, moe_shared_ffn_hidden=F * n_shared_experts, moe_router="sigmoid",
        moe_n_group=n_group, moe_topk_group=topk_group, moe_norm_topk=norm_topk_prob,
        moe_routed_scale=2.5,
    )  # fmt: skip
    ours = MoE(cfg)
    shared = hf.shared_experts
    ours.load_state_dict(
        {
            "router.weight": hf.gate.weight,
            "router_bias": hf.gate.e_score_correction_bias,
            "w_gate_up": hf.experts.gate_up_proj,  # [gate; up] of each expert, as ours
            "w_down": hf.experts.down_proj,
            "shared.w_gate_up.weight": torch.cat((shared.gate_proj.weight, shared.up_proj.weight)),
            "shared.w_down.weight": shared.down_proj.weight,
        }
    )
    return ours, hf


@pytest.mark.parametrize("case", CASES)
def test_the_module_equals_transformers_deepseek_v3_moe(case: str) -> None:
    ours, hf = moe_pair(**CASES[case])
    assert ours.shared.gate is None  # DeepSeek's shared experts are ungated
    x = torch.randn(3, 20, C)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    got, want = ours(xs[0]), hf(xs[1])
    assert_same_function(got, want)
    probe = torch.randn_like(got)
    (got * probe).sum().backward()
    (want * probe).sum().backward()
    assert_same_function(xs[0].grad, xs[1].grad)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    sh = "shared_experts."
    pairs = {
        "router.weight": hf_grads["gate.weight"],
        "w_gate_up": hf_grads["experts.gate_up_proj"],
        "w_down": hf_grads["experts.down_proj"],
        "shared.w_gate_up.weight": torch.cat(
            (hf_grads[sh + "gate_proj.weight"], hf_grads[sh + "up_proj.weight"])
        ),
        "shared.w_down.weight": hf_grads[sh + "down_proj.weight"],
    }
    for name, p in ours.named_parameters():
        assert_same_function(p.grad, pairs[name], msg=name)
    assert ours.router_bias.grad is None and "router_bias" not in dict(ours.named_parameters())


def test_the_bias_decides_the_choice_and_never_the_weight() -> None:
    torch.manual_seed(0)
    x, router = torch.randn(50, C), torch.randn(E, C) * 0.1
    bias = torch.zeros(E)
    bias[5] = 10.0  # every token chooses expert 5
    scores, weights, experts = route_sigmoid(x, router, bias, 2, normalize=False, scale=1.5)
    assert (experts == 5).any(dim=1).all()
    torch.testing.assert_close(weights, 1.5 * torch.sigmoid(x @ router.T).gather(1, experts))
    # Group-limited: 4 groups of 2, one kept; every token's 2 experts are one group's pair.
    _, _, experts = route_sigmoid(x, router, torch.zeros(E), 2, groups=(4, 1))
    assert (experts.min(dim=1).values // 2 == experts.max(dim=1).values // 2).all()


# ------------------------------------------------------------------ the model option

MODEL = dict(
    n_experts=8, n_experts_per_token=2, moe_ffn_hidden=32, moe_shared_ffn_hidden=64,
    moe_router="sigmoid", moe_n_group=4, moe_topk_group=2, moe_routed_scale=2.5,
    moe_dense_layers=[0],
)  # fmt: skip
BASE = dict(vocab_size=101, d_model=C, n_layer=2, n_head=4, ffn_hidden=96, max_seq_len=64)


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**BASE, **MODEL)).eval()
    with torch.no_grad():
        model.blocks[1].ffn.router.weight.normal_(0.0, 0.5)
        model.blocks[1].ffn.router_bias.normal_(0.0, 0.3)
    return model


def test_decoder_step_equals_forward_with_the_cache_and_int8_decodes() -> None:
    from minillm.model.quantize import int8_kernel_problem, quantize_int8

    model, cfg = tiny_model(), ModelConfig(**BASE, **MODEL)
    idx, nxt = torch.randint(1, 101, (2, 7)), torch.randint(1, 101, (2, 6))
    with torch.inference_mode():
        full, _ = model(torch.cat([idx, nxt], dim=1))
        cache = KVCache(cfg, 2, 13)
        for r in range(2):
            model(idx[r : r + 1], kv_cache=cache.rows(r, r + 1))
        decoder = Decoder(model, cache)
        for t in range(6):
            assert_same_function(decoder.step(nxt[:, t]), full[:, 7 + t])
        if int8_kernel_problem() is not None:
            pytest.skip(int8_kernel_problem())
        assert quantize_int8(model) is None
        int8 = model.blocks[1].ffn
        assert type(int8).__name__ == "Int8MoE" and int8.router_bias is not None
        got, _ = model(torch.cat([idx, nxt], dim=1))
    assert (got - full).abs().max() < 0.1 * full.abs().max()
    assert (got[:, -1].argmax(-1) == full[:, -1].argmax(-1)).float().mean() >= 0.5


def test_param_counts_and_flops() -> None:
    model = tiny_model()
    cfg = model.cfg
    S, Fd = 64, 96  # the shared expert's width, the dense block's
    expert, router = 3 * C * F, E * C
    moe = E * expert + router + 3 * C * S  # the shared expert has no gate: no (1, C) row
    attn = 4 * C * C + 2 * C  # q, k, v, o and the two norms
    assert model.param_count() == 101 * C + C + 2 * attn + 3 * C * Fd + moe
    assert model.param_count() - model.active_param_count() == (E - 2) * expert
    assert "blocks.1.ffn.router_bias" in model.state_dict()  # a buffer, not a parameter
    ours, hf = moe_pair(**CASES["groups-norm"])  # transformers counts the block as we do
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    matmul = model.active_param_count() - 5 * C
    assert model.flops_per_token(32) == 6 * matmul + 12 * 2 * C * 32
    assert cfg.moe_shared_ffn_hidden == S


runner = CliRunner()


def test_info_cli_shows_the_router(tmp_path: Path) -> None:
    path = tmp_path / "ds.yaml"
    model = ", ".join(
        f"{k}: {v}" for k, v in {**BASE, **MODEL, "max_seq_len": 256, "vocab_size": 4096}.items()
    )
    path.write_text(f"model: {{{model}}}\n")
    result = runner.invoke(app, ["info", str(path)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "sigmoid, 2 of 4 groups, weights x 2.5" in result.output
    assert "shared expert" in result.output
    assert "2 of 8 experts" in result.output


@pytest.mark.parametrize(
    "sets,expected",
    [
        (["model.moe_router=sigmoid"], "model.moe_router: sigmoid needs a mixture of experts"),
        (["model.n_experts=8", "model.moe_n_group=4"],
         "model.moe_n_group: 4 needs model.moe_router sigmoid"),
        (["model.n_experts=8", "model.moe_routed_scale=2.5"],
         "model.moe_routed_scale: 2.5 needs model.moe_router sigmoid"),
        (["model.n_experts=8", "model.moe_router=sigmoid", "model.moe_n_group=3"],
         "model.moe_n_group: 3 groups of n_experts=8: each group needs the same number"),
        (["model.n_experts=8", "model.moe_router=sigmoid", "model.moe_n_group=8"],
         "model.moe_n_group: 8 groups of n_experts=8: each group needs the same number of "
         "experts, at least 2"),
        (["model.n_experts=8", "model.moe_router=sigmoid", "model.moe_n_group=4",
          "model.moe_topk_group=5"], "model.moe_topk_group: 5 is more than moe_n_group=4"),
        (["model.n_experts=8", "model.n_experts_per_token=3", "model.moe_router=sigmoid",
          "model.moe_n_group=4", "model.moe_topk_group=1"],
         "model.moe_topk_group: 1 groups of 2 experts hold fewer than n_experts_per_token=3"),
        (["model.n_experts=8", "model.moe_router=sigmoid", "model.moe_routed_scale=0"],
         "model.moe_routed_scale: must be > 0"),
        (["model.moe_router=topk"], "model.moe_router:"),
        (["model.n_experts=8", "train.moe_bias_update=0.001"],
         "train.moe_bias_update: 0.001 needs model.moe_router sigmoid"),
        (["model.n_experts=8", "model.moe_router=sigmoid", "train.moe_bias_update=-1"],
         "train.moe_bias_update: must be >= 0"),
    ],
)  # fmt: skip
def test_config_errors_are_one_line(tmp_path: Path, sets: list[str], expected: str) -> None:
    assert_set_refused(tmp_path, sets, expected)


# ------------------------------------------------------------------ balancing the bias


def test_the_bias_update_balances_a_skewed_router() -> None:
    model = tiny_model()
    moe = model.blocks[1].ffn
    with torch.no_grad():
        moe.router_bias.zero_()
        u = torch.ones(C) / C**0.5
        moe.router.weight[0] += u  # experts 0 and 5 favoured by every token of x: logits +3
        moe.router.weight[5] += 0.6 * u  # and +1.8
    x = torch.randn(512, C) + 3 * u

    def load() -> torch.Tensor:
        moe(x)
        return moe.stats.counts

    before = load()
    ratio = before.max() / before.mean()
    assert ratio > 2.0, before
    loads = []
    for _ in range(300):
        loads.append(load())
        update_router_bias(model, loads[-1][None], 0.01)
    # A sign update of fixed size keeps stepping around the balance: averaged over its last 50
    # steps each expert gets its share to a few percent, and no single step is as skewed.
    average = torch.stack(loads[-50:]).mean(dim=0)
    assert (average / average.mean() - 1).abs().max() < 0.05, average
    assert max(float(c.max() / c.mean()) for c in loads[-50:]) < 0.7 * ratio
    assert abs(float(moe.router_bias.sum())) < 1e-4  # centred: the biases keep their sum


@pytest.mark.parametrize("recompute", [False, True])
def test_training_moves_the_bias_by_the_steps_load_and_logs_it(
    tmp_path: Path, recompute: bool
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rate = 0.01
    # With activation checkpointing the backward runs each block's forward again: the load is
    # still counted once per micro-batch.
    train = dict(moe_bias_update=rate, grad_accum=2, max_steps=6, log_every=3)
    cfg = prepared_config(
        tmp_path,
        model={**MODEL, "moe_dense_layers": []},
        train={**train, "activation_checkpointing": recompute},
    )
    trainer = make_trainer(cfg, verbose=False)
    try:
        assert all("router_bias" not in n for n, _ in trainer.model.named_parameters())
        assert not any(
            p is m.router_bias for g in trainer.optimizer.param_groups for p in g["params"]
            for m in trainer.model.modules() if isinstance(m, MoE)
        )  # fmt: skip
        # Step 0's load, summed over its two micro-batches, from a copy at the initial weights.
        copy = Transformer(cfg.model).train()
        copy.load_state_dict(trainer.model.state_dict())
        load = 0.0
        for micro in trainer.batches(0):
            copy(micro.tokens)
            load = load + torch.stack([s.counts for s in router_stats(copy)])
        delta = rate * torch.sign(load.mean(dim=1, keepdim=True) - load)
        want = delta - delta.mean(dim=1, keepdim=True)
        losses = [float(trainer.train_step().loss)]
        got = torch.stack([b.ffn.router_bias for b in trainer.model.blocks])
        assert_same_function(got, want)
        trainer.state.step = 1
        for step in range(1, 6):
            losses.append(float(trainer.train_step().loss))
            trainer.state.step = step + 1
    finally:
        trainer.close()
    assert losses[-1] < losses[0], losses
    run_trainer(replace_out(cfg, tmp_path / "logged"))
    acc = EventAccumulator(str(tmp_path / "logged" / "tb"))
    acc.Reload()
    spread = acc.Scalars("xray/moe/bias_spread")
    assert len(spread) == 2 and 0 < spread[0].value <= 2 * 3 * rate + 1e-6
    assert acc.Scalars("xray/moe/load_max_ratio")[-1].value >= 1.0
    assert acc.Scalars("xray/moe/load_min_ratio")[-1].value <= 1.0


def replace_out(cfg, out: Path):  # noqa: ANN001, ANN201
    from dataclasses import replace

    return replace(cfg, train=replace(cfg.train, out_dir=str(out)))


def test_an_hf_or_gguf_export_of_the_sigmoid_router_is_refused_by_key() -> None:
    from minillm.config import ConfigError
    from minillm.families import hf_config_dict

    cfg = ModelConfig(**BASE, **{**MODEL, "moe_dense_layers": []})
    with pytest.raises(ConfigError) as e:
        hf_config_dict(cfg, bos_id=0, eos_id=0)
    assert e.value.key == "model.moe_router"
    pytest.importorskip("gguf")
    from minillm.checkpoint.gguf_file import gguf_arch

    with pytest.raises(ConfigError) as e:  # its family is asked first
        gguf_arch(cfg)
    assert e.value.key == "model.moe_router"
