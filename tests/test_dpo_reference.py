"""DPO's reference model at size (issue 60, item 6): a LoRA run's reference is its own base with
the adapters off, no second copy of the weights (nor of init_from's, once loaded), and its
log-probabilities are the base's; a full fine-tune's reference is a frozen copy, sharded like
the policy under FSDP (`reference_sharder`)."""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path

import pytest
import torch

from minillm.checkpoint.store import load_checkpoint
from minillm.train.distributed import DistInfo
from minillm.train.objectives.common import pad_rows, token_logps
from minillm.train.parallel import reference_sharder
from tests.helpers import make_run
from tests.test_dpo import WORDS, dpo_trainer


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dpo-ref")
    make_run(root / "base")
    rows = [{"prompt": f"say {w}", "chosen": w, "rejected": w[::-1]} for w in WORDS]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def copies_of(shape: tuple[int, ...]) -> int:
    """Distinct storages of live tensors of `shape` (a weight matrix of the base)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated objects
        warnings.simplefilter("ignore")
        return len({t.untyped_storage().data_ptr() for t in gc.get_objects()
                    if isinstance(t, torch.Tensor) and tuple(t.shape) == shape})  # fmt: skip


@pytest.mark.parametrize("rank, copies", [(4, 1), (0, 2)])
def test_a_lora_run_holds_the_base_once(base: Path, tmp_path: Path, rank: int, copies: int) -> None:
    """Every wo (d x d) of the base exists once in a LoRA DPO run (policy and reference share
    it), twice in a full fine-tune's (the policy and its frozen reference)."""
    n_layer = 2
    shape = (64, 64)  # attn.wo of the WIDE tiny model
    before = copies_of(shape)
    trainer = dpo_trainer(base, tmp_path / "run", lora={"rank": rank})
    try:
        assert (trainer.objective.reference.copy is None) == bool(rank)
        assert copies_of(shape) - before == copies * n_layer
    finally:
        trainer.close()


def test_the_reference_log_probs_are_the_bases(base: Path, tmp_path: Path) -> None:
    """After steps that moved the adapters, the policy's log-probs differ from the base's and
    the reference's (adapters off) are the base's, loaded alone from train.init_from."""
    trainer = dpo_trainer(base, tmp_path / "run", lora={"rank": 4}, max_steps=3)
    try:
        for _ in range(3):
            trainer.count_step(trainer.train_step())
        pairs = trainer.objective.train_pairs[:3]
        idx, tgt = pad_rows([p.chosen for p in pairs], [p.chosen_mask for p in pairs])
        plain = load_checkpoint(base / "base" / "run", device="cpu").model
        with torch.no_grad():
            want = token_logps(plain, idx, tgt).double()
            with trainer.objective.reference.model() as ref:
                got = token_logps(ref, idx, tgt).double()
            policy = token_logps(trainer.model.eval(), idx, tgt).double()
    finally:
        trainer.close()
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale
    assert (policy - want).abs().max() > 1e-3 * scale


def test_the_reference_is_sharded_only_under_fsdp(base: Path, tmp_path: Path) -> None:
    trainer = dpo_trainer(base, tmp_path / "run")
    try:
        cfg, device = trainer.cfg, trainer.device
    finally:
        trainer.close()
    one, two = DistInfo(world_size=1), DistInfo(world_size=2)
    assert reference_sharder(cfg, device, one) is None
    assert reference_sharder(cfg, device, two) is None  # parallel: ddp
    cfg.train.parallel = "fsdp"
    assert callable(reference_sharder(cfg, device, two))


def test_a_sharded_reference_is_fsdp2s_and_computes_the_copy(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a (one-rank, gloo) process group the reference copy's parameters are FSDP2's
    DTensor shards, and its log-probs are the unsharded model's."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from minillm.train.objectives.common import Reference
    from minillm.train.parallel import shard_model

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = load_checkpoint(base / "base" / "run", device="cpu").model
        ref = Reference(model, lora=False, shard=lambda m: shard_model(m, "fp32"))
        assert all(isinstance(p, DTensor) for p in ref.copy.parameters())
        assert not any(isinstance(p, DTensor) for p in model.parameters())
        idx = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), ref.model() as r:
            got, want = token_logps(r, idx, idx).double(), token_logps(model, idx, idx).double()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    finally:
        dist.destroy_process_group()
