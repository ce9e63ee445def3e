"""Shared fixtures: tiny configs and models that run in milliseconds on CPU."""

from __future__ import annotations

import pytest
import torch

from minillm.config import ModelConfig

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def tiny_model_cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=97, d_model=64, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=96, max_seq_len=64
    )
