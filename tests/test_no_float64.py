"""Apple's MPS has no float64: training and evaluation there must not upcast a device tensor
to it. The device is stood in on the CPU: `sum_dtype` is told the CPU lacks float64 (as it says
of MPS), and a dispatch mode fails on any op that turns a lower-precision tensor into float64
(what `.double()` of a loss on MPS does; host-side float64 made from Python numbers is fine
there and is not flagged)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.checkpoint.init_from import load_run_config
from minillm.runtime import device as device_mod
from minillm.runtime.device import sum_dtype
from tests.helpers import make_run, make_trainer, prepared_config
from tests.test_dpo import dpo_yaml
from tests.test_grpo import grpo_yaml


class NoUpcastToFloat64(TorchDispatchMode):
    """Raises on an op whose result is float64 while a floating input was not."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        lower = [t for t in ins if t.is_floating_point() and t.dtype != torch.float64]
        if lower and any(t.dtype == torch.float64 for t in outs):
            raise AssertionError(f"{func}: a {lower[0].dtype} tensor became float64")
        return out


@pytest.fixture()
def no_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_mod, "NO_FLOAT64", frozenset({"mps", "cpu"}))


def test_sum_dtype_is_float32_on_mps_only() -> None:
    assert sum_dtype(torch.device("mps")) == torch.float32
    assert sum_dtype(torch.device("cpu")) == torch.float64
    assert sum_dtype(torch.device("cuda", 0)) == torch.float64
    assert sum_dtype("mps") == torch.float32 and sum_dtype("cpu") == torch.float64


def test_the_stand_in_catches_a_double_of_a_loss() -> None:
    with pytest.raises(AssertionError, match="became float64"), NoUpcastToFloat64():
        torch.ones(3).sum().double()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nofloat64")
    make_run(root / "base")
    words = ["a", "b", "c", "d"]
    rows = [{"messages": [{"role": "user", "content": f"say {w}"}], "answer": w} for w in words]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pairs = [{"prompt": f"say {w}", "chosen": w, "rejected": w + w} for w in words]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in pairs) + "\n")
    return root


# grpo-kl: train.grpo.kl > 0 logs the KL term's mean, totals[1] over the reply tokens (issue 59,
# defect 5: a float32 device sum over a float64 count is float64 on MPS, which raises there).
@pytest.mark.parametrize("objective", ["lm", "dpo", "grpo", "grpo-kl"])
def test_a_training_step_and_its_evaluation_make_no_float64(
    objective: str, base: Path, tmp_path: Path, no_float64: None
) -> None:
    if objective == "lm":
        cfg = prepared_config(tmp_path)
    elif objective == "dpo":
        cfg = load_run_config(dpo_yaml(base, tmp_path / "run", max_steps=1), [])
    else:
        kl = (
            {"grpo": {"group_size": 4, "max_new_tokens": 6, "kl": 0.1}} if "kl" in objective else {}
        )
        cfg = load_run_config(grpo_yaml(base, tmp_path / "run", max_steps=1, **kl), [])
    trainer = make_trainer(cfg, verbose=False)
    try:
        with NoUpcastToFloat64():
            result = trainer.train_step()
            scores = trainer.evaluate()
        assert result.finite and torch.isfinite(result.loss)
        assert all(v == v for v in scores.values())  # no NaN
        if objective == "grpo-kl":
            kl = trainer.objective.scalars()["grpo/kl"]
            assert type(kl) is float and kl == kl
    finally:
        trainer.close()
