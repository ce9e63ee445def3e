"""The training objectives (`train.objective`), each behind one contract (`common.Objective`).

Offers `open_objective(setup)` (the objective a config names, its data read and checked) and
the registry `OBJECTIVES` (which objective reads token shards is the config's
`TrainConfig.reads_shards`, so that `minillm tokenize` needs no training code). Modules:
`common` (the contract and what the objectives share), `lm` (next-token
prediction over the shards, with `packing`), `dpo` (preference pairs), `grpo` (rollouts against a
reward, with `rewards`). This is the one place that maps an objective's name to its code.
"""

from __future__ import annotations

from minillm.train.objectives.common import Objective, Setup
from minillm.train.objectives.dpo import DPO
from minillm.train.objectives.grpo import GRPO
from minillm.train.objectives.lm import LM

OBJECTIVES: dict[str, type] = {"lm": LM, "dpo": DPO, "grpo": GRPO}


def open_objective(setup: Setup) -> Objective:
    """The objective of `setup.cfg.train.objective`, its data read and checked (nothing
    written): a bad file is one error line before the run touches its folder."""
    return OBJECTIVES[setup.cfg.train.objective](setup)


__all__ = ["OBJECTIVES", "Objective", "Setup", "open_objective"]
