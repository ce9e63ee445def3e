"""`minillm info`'s "what fits" against whole processes (issue 60): the estimate of a job is
within a tolerance of the peak RSS of that job run in a fresh process on a small folder, where
the framework (Python, torch, minillm; bitsandbytes for QLoRA) is most of the peak, so an
estimate of the tensors alone is far under it. scripts/bench_scale.py --info checks the same at
290M and 1.1B parameters (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import LLAMA_24M, ROOT, SHAKESPEARE, llama_folder

ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
# Measured / estimate on this project's 2-core AMD EPYC (torch 2.13) at this size: run 1.16,
# LoRA 1.23, QLoRA 1.23, full 1.03 (`minillm train` peaks ~0.12 GB above its Trainer's steps
# for LoRA here, 1.01x the estimate; at 290M and 1.1B, scripts/bench_scale.py: 1.00-1.05).
# At this size the framework is most of the peak, and it varies by install: `import torch,
# minillm.cli` peaked at 226 MB in the development venv and at 284 MB in CI's fresh one (the
# same torch 2.13 wheel), which put the run job at 1.39x there. The old estimates (no
# framework) were 2-4x under, which these bounds still catch.
LOW, HIGH = 0.8, 1.5


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~24M-parameter bf16 Llama folder (fp32 ~96 MB: a quarter of the framework's bytes)."""
    root = tmp_path_factory.mktemp("fits")
    llama_folder(root / "hf", **LLAMA_24M)
    (root / "corpus.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000])
    return root / "hf"


# `python -m minillm ARGS` that writes its own peak RSS last on stderr: VmHWM, the high-water
# mark of this process's memory since its exec. Not os.wait4's ru_maxrss: Linux carries the
# parent's RSS at the fork into the child's (pytest's, with torch imported, is ~0.5 GB).
PEAK = """
import atexit, runpy, sys
hwm = lambda: [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
atexit.register(lambda: sys.stderr.write("\\n" + hwm()))
sys.argv = ["minillm", *sys.argv[1:]]
runpy.run_module("minillm", run_name="__main__", alter_sys=True)
"""


def peak_rss(args: list[str]) -> int:
    """The peak RSS (bytes) of `python -m minillm ARGS` in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", PEAK, *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-1000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]  # "VmHWM:    408000 kB"
    assert last.startswith("VmHWM:") and last.endswith("kB"), last
    return int(last.split()[1]) * 1024


def fits(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "minillm", "info", *args, "--json"], cwd=ROOT,
                         env=ENV, check=True, capture_output=True, text=True).stdout  # fmt: skip
    return json.loads(out)["fits"]


@pytest.mark.slow
def test_the_run_estimate_is_a_sample_process_peak(folder: Path) -> None:
    """`sample --dtype float32` against info's `run` at fp32 and its context; the weights alone
    (the estimate before the framework was counted) are under a third of the peak."""
    peak = peak_rss(["sample", "--ckpt", str(folder), "--prompt", "Hello there", "--device",
                     "cpu", "--dtype", "float32", "--max-new-tokens", "8", "--temperature", "0",
                     "--ignore-eos"])  # fmt: skip
    run = fits(["--ckpt", str(folder), "--dtype", "float32", "--set", "train.seq_len=16",
                "--set", "train.device=cpu"])["run"]  # fmt: skip
    assert run["framework"] > 0
    assert LOW <= peak / run["total"] <= HIGH, (peak, run)
    assert run["weights"] < peak / 3


@pytest.mark.slow
@pytest.mark.parametrize("job", ["lora", "qlora", "full"])
def test_the_training_estimates_are_a_training_process_peak(
    folder: Path, tmp_path: Path, job: str
) -> None:
    """Three fp32 steps of `minillm train` (LoRA rank 16, QLoRA, a full fine-tune) at batch 1 x
    64 tokens against info's estimate of that job for the same config."""
    if job == "qlora":
        pytest.importorskip("bitsandbytes")
    lora = {"full": {"rank": 0}, "lora": {"rank": 16}, "qlora": {"rank": 16, "quantize": "nf4"}}
    raw = {
        "data": {"source": str(folder.parent / "corpus.txt"), "out_dir": str(tmp_path / "tok")},
        "train": {"init_from": str(folder), "out_dir": str(tmp_path / "run"), "batch_size": 1,
                  "seq_len": 64, "max_steps": 3, "warmup_steps": 0, "device": "cpu",
                  "precision": "fp32", "eval_every": 0, "ckpt_every": 0, "log_every": 1,
                  "lora": lora[job]},
    }  # fmt: skip
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    subprocess.run([sys.executable, "-m", "minillm", "tokenize", str(config)], cwd=ROOT,
                   env=ENV, check=True, capture_output=True)  # fmt: skip
    peak = peak_rss(["train", str(config)])
    estimate = fits([str(config)])[job]
    assert estimate["framework"] > 0
    assert LOW <= peak / estimate["total"] <= HIGH, (peak, estimate)
