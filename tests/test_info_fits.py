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
GiB = 1024**3
# The framework on a CPU (minillm.fits: tiny jobs' measured peaks): to sample, to train, QLoRA.
RUN_FW, TRAIN_FW, QLORA_FW = 250 * 2**20, 400 * 2**20, 450 * 2**20


def test_the_four_jobs_against_hand_computed_bytes() -> None:
    fits = model_info(
        config_from_dict({"model": MODEL, "data": {"vocab_size": 300}, "train": TRAIN})
    )["fits"]
    assert fits["device"] == "cpu"
    assert (fits["params"], fits["params_nf4"], fits["params_adapters"]) == (
        PARAMS, 2 * LINEAR, ADAPTERS)  # fmt: skip
    assert fits["run"] == {
        "weights": 2 * PARAMS,
        "kv_cache": 32 * 2 * (2 * 2 * 16) * 2,  # tokens x layers x (k and v of 2 heads) x bf16
        "activations": 32 * (4 * 64 + 2 * 96) * 2 + 320 * 4,
        "framework": RUN_FW,
        "total": 2 * PARAMS + 8192 + 29952 + RUN_FW,
    }
    lora_total = 2 * PARAMS + 16 * ADAPTERS + ACTS + TRAIN_FW
    assert fits["lora"] == {"weights": 2 * PARAMS, "adapters": 16 * ADAPTERS,
                            "activations": ACTS, "framework": TRAIN_FW,
                            "total": lora_total}  # fmt: skip
    # The embedding, head and norms stay in the compute dtype (bf16 here), the rest in NF4.
    qweights = 2 * (PARAMS - 2 * LINEAR) + round(2 * LINEAR * NF4)
    assert qweights == 82560 + 31695
    assert fits["qlora"] == {
        "weights": qweights, "adapters": 16 * ADAPTERS, "activations": ACTS,
        "dequantized": 192 * 64 * 2,  # the widest layer, w_gate_up, in bf16 for its product
        "framework": QLORA_FW,  # bitsandbytes imported too
        "total": qweights + 16 * ADAPTERS + ACTS + 192 * 64 * 2 + QLORA_FW,
    }  # fmt: skip
    # bf16 autocast keeps a cast copy of every weight for the backward; AdamW's foreach step
    # (4 bytes a parameter, after the backward) adds nothing beyond those and the activations.
    assert 4 * PARAMS < 2 * PARAMS + ACTS
    assert fits["full"] == {"weights": 16 * PARAMS, "activations": ACTS,
                            "autocast_copies": 2 * PARAMS, "adamw_step": 0,
                            "framework": TRAIN_FW,
                            "total": 18 * PARAMS + ACTS + TRAIN_FW}  # fmt: skip
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


def test_the_framework_is_the_devices(tmp_path: Path) -> None:
    """On CUDA each job counts the CUDA context (0.5 GiB, assumed) in place of the CPU
    process's imports; the fp32 QLoRA line says its embedding and head are fp32."""
    cfg = {"model": MODEL, "data": {"vocab_size": 300},
           "train": {**TRAIN, "precision": "fp32", "device": "cuda"}}  # fmt: skip
    fits = model_info(config_from_dict(cfg))["fits"]
    assert fits["device"] == "cuda" and fits["dtype"] == "fp32"
    assert {fits[job]["framework"] for job in ("run", "lora", "qlora", "full")} == {GiB // 2}
    # fp32: no cast copies; fused AdamW on CUDA: no foreach temporary
    assert fits["full"].keys() == {"weights", "activations", "framework", "total"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    table = runner.invoke(app, ["info", str(path)], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    unquantized = (PARAMS - 2 * LINEAR) * 4 / GiB
    assert f"weights 0.00 (fp32 embedding/head {unquantized:.2f})" in table.stdout
    assert "framework 0.50 GiB" in table.stdout and "cuda" in table.stdout


def test_a_cpu_full_fine_tune_peaks_at_adamws_foreach_step() -> None:
    """Where the activations are smaller than 4 bytes a parameter (a short context), the full
    fine-tune's peak is AdamW's step: sqrt(v) of every parameter at once beside the 16 bytes."""
    cfg = {"model": MODEL, "data": {"vocab_size": 300},
           "train": {**TRAIN, "precision": "fp32", "seq_len": 4}}  # fmt: skip
    fits = model_info(config_from_dict(cfg))["fits"]
    full = fits["full"]
    assert full["adamw_step"] == 4 * PARAMS - full["activations"] > 0
    assert full["total"] == 20 * PARAMS + TRAIN_FW
