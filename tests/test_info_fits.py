"""`minillm info`'s "what fits" (issue 60, item 5; minillm.fits): the bytes to run, LoRA, QLoRA
and fully fine-tune a model, checked against values computed by hand for a tiny config, and the
same numbers in `info --json` and the table."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from minillm.cli import app
from minillm.config import config_from_dict
from minillm.info import model_info

runner = CliRunner()
MODEL = dict(d_model=64, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=96, vocab_size=320,
             max_seq_len=64, tie_embeddings=False)  # fmt: skip
TRAIN = dict(seq_len=32, batch_size=1, precision="bf16", device="cpu")

# By hand. Embedding and head 320 x 64 each; a block: wqkv (4 + 2 + 2) x 16 = 128 rows of 64,
# wo 64 x 64, w_gate_up 192 x 64, w_down 64 x 96, two norms of 64; the final norm 64.
LINEAR = 128 * 64 + 64 * 64 + 192 * 64 + 64 * 96  # 30,720 a block
PARAMS = 2 * 320 * 64 + 2 * (LINEAR + 128) + 64  # 102,720
# Rank 16 adapters: r (in + out) on each of the four layers.
ADAPTERS = 2 * 16 * ((64 + 128) + (64 + 64) + (64 + 192) + (96 + 64))  # 23,552
# bf16 activations of one sequence of 32: (10 C + 3 K D + 4 F) x 2 bytes a layer, fp32 logits
# and their gradient.
ACTS = 32 * (2 * (10 * 64 + 3 * 2 * 16 + 4 * 96) * 2 + 2 * 320 * 4)  # 225,280
NF4 = (4 + 8 / 64 + 32 / (64 * 256)) / 8  # bytes a weight: codes, block scales, their scales


def test_the_four_jobs_against_hand_computed_bytes() -> None:
    fits = model_info(
        config_from_dict({"model": MODEL, "data": {"vocab_size": 300}, "train": TRAIN})
    )["fits"]
    assert (fits["params"], fits["params_nf4"], fits["params_adapters"]) == (
        PARAMS, 2 * LINEAR, ADAPTERS)  # fmt: skip
    assert fits["run"] == {
        "weights": 2 * PARAMS,
        "kv_cache": 32 * 2 * (2 * 2 * 16) * 2,  # tokens x layers x (k and v of 2 heads) x bf16
        "activations": 32 * (4 * 64 + 2 * 96) * 2 + 320 * 4,
        "total": 2 * PARAMS + 8192 + 29952,
    }
    lora_total = 2 * PARAMS + 16 * ADAPTERS + ACTS
    assert fits["lora"] == {"weights": 2 * PARAMS, "adapters": 16 * ADAPTERS,
                            "activations": ACTS, "total": lora_total}  # fmt: skip
    qweights = 2 * (PARAMS - 2 * LINEAR) + round(2 * LINEAR * NF4)
    assert qweights == 82560 + 31695
    assert fits["qlora"] == {
        "weights": qweights, "adapters": 16 * ADAPTERS, "activations": ACTS,
        "dequantized": 192 * 64 * 2,  # the widest layer, w_gate_up, in bf16 for its product
        "total": qweights + 16 * ADAPTERS + ACTS + 192 * 64 * 2,
    }  # fmt: skip
    assert fits["full"] == {"weights": 16 * PARAMS, "activations": ACTS,
                            "total": 16 * PARAMS + ACTS}  # fmt: skip
    assert fits["qlora"]["weights"] < 0.6 * fits["lora"]["weights"]


def test_the_rank_and_context_are_the_configs(tmp_path: Path) -> None:
    """train.lora.rank (with init_from's model) and train.seq_len are what the rows use; the
    table shows each job's total."""
    cfg = {"model": MODEL, "data": {"vocab_size": 300}, "train": {**TRAIN, "seq_len": 16}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = runner.invoke(app, ["info", str(path), "--json"])
    assert result.exit_code == 0, result.output
    fits = json.loads(result.stdout)["fits"]
    assert fits["context"] == 16 and fits["lora_rank"] == 16 and fits["dtype"] == "bf16"
    assert fits["run"]["kv_cache"] == 16 * 2 * 64 * 2
    table = runner.invoke(app, ["info", str(path)])
    assert table.exit_code == 0, table.output
    assert "fits: QLoRA r16" in table.stdout and "rank 16, NF4 base" in table.stdout
    assert "full fine-tune" in table.stdout
