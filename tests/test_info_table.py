"""`minillm info`'s table at 80 columns, and its activation estimate under latent attention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import Config, DataConfig, ModelConfig, TrainConfig
from minillm.info import activation_bytes
from minillm.model import Transformer

runner = CliRunner()

# DeepSeek-V3's shape (MLA with a query bottleneck, the sigmoid router, a shared expert, three
# dense blocks) under Muon: the longest values the table has.
DEEPSEEK_V3 = (
    "model: {vocab_size: 129280, d_model: 7168, n_layer: 61, n_head: 128, attention: mla,"
    " q_lora_rank: 1536, kv_lora_rank: 512, qk_nope_head_dim: 128, qk_rope_head_dim: 64,"
    " v_head_dim: 128, n_experts: 256, n_experts_per_token: 8, moe_ffn_hidden: 2048,"
    " ffn_hidden: 18432, moe_shared_ffn_hidden: 2048, moe_dense_layers: [0, 1, 2],"
    " moe_router: sigmoid, moe_n_group: 8, moe_topk_group: 4, moe_routed_scale: 2.5,"
    " tie_embeddings: false}\n"
    "data: {vocab_size: 129280}\n"
    "train: {optimizer: muon, batch_size: auto, batch_tokens: 65536}\n"
)


def table_rows(output: str) -> list[list[str]]:
    """The cells of each line of the table's body (the lines between its borders)."""
    return [
        [cell.strip() for cell in line.strip().strip("│").split("│")]
        for line in output.splitlines()
        if line.startswith("│")
    ]


@pytest.mark.parametrize("config", ["configs/tiny.yaml", "configs/llama2-7b.yaml", "deepseek"])
def test_info_table_fits_80_columns_a_value_a_line(config: str, tmp_path: Path) -> None:
    if config == "deepseek":
        config = str(tmp_path / "deepseek.yaml")
        Path(config).write_text(DEEPSEEK_V3)
    result = runner.invoke(app, ["info", config], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert all(len(line) <= 80 for line in result.output.splitlines())
    rows = table_rows(result.output)
    assert len(rows) > 10
    # A wrapped value continues on a line of its own whose label cell is empty.
    wrapped = [r for r in rows if len(r) != 2 or not r[0] or not r[1]]
    assert not wrapped, f"values wrapped at 80 columns: {wrapped}"


def test_info_shows_mla_head_widths(tmp_path: Path) -> None:
    path = tmp_path / "deepseek.yaml"
    path.write_text(DEEPSEEK_V3)
    result = runner.invoke(app, ["info", str(path)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    rows = dict(r for r in table_rows(result.output) if len(r) == 2)
    # head_dim is the RoPE width alone (64) under MLA: the heads are 192 (q/k) and 128 (v) wide
    assert rows["attention"] == "MLA, 128 heads, q/k 192 (64 RoPE), v 128"
    assert rows["MLA latents"] == "kv 512, q 1536"
    assert rows["router"] == "sigmoid, 4 of 8 groups, weights x 2.5"
    assert rows["dense blocks"] == "0-2, ffn 18432"
    assert "head dim" not in result.output


def saved_values(cfg: ModelConfig, batch: int = 2, T: int = 32) -> float:
    """fp32 values autograd keeps per token for the backward of one forward of `cfg`."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    idx = torch.randint(0, cfg.vocab_size, (batch, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return total / (4 * batch * T)


def per_layer(measure: Any, **model: Any) -> float:
    """What `measure` gives for one more layer: a block's share, without the embedding's and
    the head's."""
    base = dict(vocab_size=512, d_model=64, n_head=4, ffn_hidden=128, max_seq_len=64)
    two, one = (ModelConfig(**{**base, **model, "n_layer": n}) for n in (2, 1))
    return measure(two) - measure(one)


def estimated_values(cfg: ModelConfig) -> float:
    """info's activation values per token (fp32, no checkpointing)."""
    full = Config(
        model=cfg, data=DataConfig(vocab_size=cfg.vocab_size), train=TrainConfig(seq_len=32)
    )
    return activation_bytes(full, half=False, checkpointing=False) / (4 * 32)


MLA = dict(attention="mla", qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32)


@pytest.mark.parametrize(
    "widths",
    [{}, dict(qk_nope_head_dim=64), dict(v_head_dim=64), dict(kv_lora_rank=96),
     dict(qk_rope_head_dim=16), dict(q_lora_rank=48)],
    ids=["small", "nope-64", "v-64", "latent-96", "rope-16", "q-bottleneck"],
)  # fmt: skip
def test_info_estimates_mla_activations_as_it_does_gqa(widths: dict[str, int]) -> None:
    """A block's activation estimate is as close to what autograd keeps under MLA, whatever its
    head widths, as under GQA: not the GQA formula with head_dim (the RoPE width alone)."""
    gqa = per_layer(estimated_values) / per_layer(saved_values)
    model = {**MLA, **widths}
    mla = per_layer(estimated_values, **model) / per_layer(saved_values, **model)
    assert mla == pytest.approx(gqa, rel=0.2)
