"""What every config section shares: `setting` (a field whose help text documents its key),
`Section` (checks that raise a ConfigError naming the key at fault) and `DEVICE_PATTERN`.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import field
from typing import Any

from minillm.errors import ConfigError

# What train.device and `--device` accept (runtime.resolve_device checks availability).
DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def setting(default: Any = dataclasses.MISSING, help: str = "", **kw: Any) -> Any:
    """A dataclass field whose help text documents the config key."""
    if isinstance(default, (list, dict, tuple)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


class Section:
    """Shared behaviour of the config sections: checks that name the key at fault."""

    _section: typing.ClassVar[str] = ""

    def _fail(self, key: str, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self._section}.{key}" if self._section else key, message)

    def _positive(self, *keys: str) -> None:
        for key in keys:
            value = getattr(self, key)
            if value is not None and value <= 0:
                self._fail(key, f"must be > 0, got {value}")

    def _non_negative(self, *keys: str) -> None:
        for key in keys:
            value = getattr(self, key)
            if value < 0:
                self._fail(key, f"must be >= 0, got {value}")
