"""What a Hugging Face Hub model id looks like, for `--ckpt` and `train.init_from` (the config
checks paths before minillm.checkpoint.hub fetches one).

Offers `is_hub_id`.
"""

from __future__ import annotations

import os
import re

# A Hugging Face Hub model id, `org/name` (huggingface_hub's rules for the two parts).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def is_hub_id(value: str) -> bool:
    """Whether `--ckpt` or `train.init_from` may name a Hugging Face Hub model: `org/name`,
    relative, whose `org` is no folder here (`runs/tiny` with runs/ present is a local path)."""
    return (
        bool(_HUB_ID.fullmatch(value))
        and ".." not in value
        and "--" not in value
        and not value.endswith(".")
        and not os.path.isdir(value.split("/")[0])
    )
