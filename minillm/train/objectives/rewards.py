"""The rewards of `train.objective: grpo` (`train.grpo.reward`), one definition of "correct" with
`eval --task`.

Offers `load_reward(spec, config_dir)` (exact, number, or a user's python:module:function) and
`score(fn, messages, reply, answer, where)` (the reward as a float, or one error line).

`exact` is 1.0 when the reply equals the answer as exact match scores it
(minillm.infer.task_scoring.answer_matches), `number` when its last number equals the answer (as
`--extract-number`), else 0.0. `python:module:function` loads module.py from the config file's
folder and calls `function(prompt_messages, reply_text, answer) -> float`, prompt_messages a
list of {role, content}.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minillm.errors import ConfigError, UserError
from minillm.infer.task_scoring import answer_matches

Reward = Callable[[list[dict[str, str]], str, str], Any]
KEY = "train.grpo.reward"


def load_reward(spec: str, config_dir: Path | None = None) -> Reward:
    """The reward function `spec` names; a ConfigError naming train.grpo.reward when a python
    module or function cannot be loaded."""
    if spec in ("exact", "number"):
        number = spec == "number"
        return lambda messages, reply, answer: float(answer_matches(reply, answer, number))
    _, module, name = spec.split(":")
    folder = config_dir if config_dir is not None else Path.cwd()
    path = folder.joinpath(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        raise ConfigError(KEY, f"{spec}: no {path} (the module is looked up in the config "
                          "file's folder)")  # fmt: skip
    unique = f"minillm_reward_{abs(hash(str(path.resolve())))}"
    loader = importlib.util.spec_from_file_location(unique, path)
    module_obj = importlib.util.module_from_spec(loader)
    sys.modules[unique] = module_obj
    try:
        loader.loader.exec_module(module_obj)
    except Exception as e:
        raise ConfigError(KEY, f"{spec}: importing {path} raised {type(e).__name__}: {e}") from None
    fn = getattr(module_obj, name, None)
    if not callable(fn):
        raise ConfigError(KEY, f"{spec}: {path} has no function {name!r}")
    return fn


def score(fn: Reward, messages: list[dict[str, str]], reply: str, answer: str, where: str) -> float:
    """fn's reward for one reply as a float; a function that raises or returns something other
    than a finite number is one UserError naming train.grpo.reward and the prompt's line."""
    try:
        value = fn(messages, reply, answer)
    except Exception as e:
        raise UserError(f"{where}: {KEY}: the function raised {type(e).__name__}: {e}") from None
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{where}: {KEY}: the function returned {value!r:.40}, not a finite number")
    return float(value)
