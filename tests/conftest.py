"""Shared fixtures: tiny configs and models that run in milliseconds on CPU."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from minillm.config import ModelConfig
from tests.helpers import prepared_config, tiny_model_config

torch.set_num_threads(min(2, torch.get_num_threads()))
# The trainer caches its probed FLOP/s peak per machine; a probe taken while tests load the
# machine must not become the user's MFU reference: tests keep theirs apart (one per session,
# shared with the CLI subprocesses through the environment).
os.environ.setdefault("MINILLM_CACHE_DIR", tempfile.mkdtemp(prefix="minillm-test-cache-"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenized corpus shared by the tests of a module (they only read it)."""
    base = tmp_path_factory.mktemp("corpus")
    prepared_config(base)
    return base


@pytest.fixture
def tiny_model_cfg() -> ModelConfig:
    """The tiny config's (wide) model section alone, with a 97-token vocabulary."""
    return tiny_model_config(vocab_size=97)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` skip, saying why, on a machine without a CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
