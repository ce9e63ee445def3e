"""The benchmark scripts' llama.cpp arms still run against the current export (bench_sample's
q8_0 GGUF of a bare model went stale once when the export started reading a checkpoint's
tokenizer conventions, and nothing but a benchmark run noticed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from minillm.config import ModelConfig
from minillm.model import Transformer

SCRIPTS = Path(__file__).parent.parent / "scripts"
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed: make interop")


def load_script(name: str):  # noqa: ANN201
    sys.path.insert(0, str(SCRIPTS))  # the scripts import each other, as when run
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def test_bench_sample_llama_cpp_arm_decodes_our_q8_0_export(tmp_path: Path) -> None:
    bench = load_script("bench_sample")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, d_model=64, n_layer=2, n_head=4, n_kv_head=2,
                      max_seq_len=256)  # fmt: skip
    llm = bench.llama_cpp_q8(Transformer(cfg).eval(), tmp_path, 1, 64)
    try:
        tokens = []
        for token in llm.generate(list(range(5, 21)), temp=0.0):
            tokens.append(token)
            if len(tokens) == 8:
                break
        assert len(tokens) == 8 and all(0 <= t < cfg.vocab_size for t in tokens)
    finally:
        llm.close()
