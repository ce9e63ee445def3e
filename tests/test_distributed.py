"""`torchrun --nproc_per_node 2` on CPU (gloo): DDP and FSDP2 against one process, and resume."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minillm.checkpoint.store import load_model_state
from tests.helpers import SHAKESPEARE, assert_same_function

pytestmark = pytest.mark.slow

CONFIG = """\
model: {d_model: 32, n_layer: 2, n_head: 4, n_kv_head: 2, ffn_hidden: 64, max_seq_len: 64}
data: {source: corpus.txt, vocab_size: 300, out_dir: tokens}
train: {out_dir: run, batch_size: 2, grad_accum: 2, seq_len: 32, max_steps: 6, lr: 1.0e-2,
        min_lr: 1.0e-3, warmup_steps: 2, eval_every: 3, eval_steps: 2, ckpt_every: 3,
        log_every: 1, device: cpu, precision: fp32}
"""
BIN = Path(sys.executable).parent


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: torchrun forwards it to its workers, which live in sessions of
        # their own and would otherwise outlive the test.
        proc.terminate()
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"timed out: {' '.join(args)}\n{out[-2000:]}{err[-2000:]}")
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def torchrun(cwd: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2"]
    args += ["-m", "minillm", "train", "cfg.yaml"]
    for s in sets:
        args += ["--set", s]
    return run(args, cwd)


def single(cwd: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [str(BIN / "minillm"), "train", "cfg.yaml"]
    for s in sets:
        args += ["--set", s]
    return run(args, cwd)


def losses(run_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [e.value for e in acc.Scalars("train/loss")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dist")
    (d / "corpus.txt").write_text(SHAKESPEARE.read_text()[:60_000])
    (d / "cfg.yaml").write_text(CONFIG)
    run([str(BIN / "minillm"), "tokenize", "cfg.yaml"], d)
    # The reference: one process, the same global batch of 2 x 2 x 2 sequences.
    single(d, "train.grad_accum=4", "train.out_dir=single")
    return d


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_follow_the_single_process_loss_curve(workdir: Path, parallel: str) -> None:
    out = f"run_{parallel}"
    torchrun(workdir, f"train.parallel={parallel}", f"train.out_dir={out}")
    ref = losses(workdir / "single")
    got = losses(workdir / out)
    assert len(got) == len(ref) == 6
    assert got == pytest.approx(ref, rel=1e-4)
    # One run directory, one set of checkpoints, written by rank 0 alone.
    ckpts = sorted(p.name for p in (workdir / out / "checkpoints").iterdir())
    assert ckpts == ["BEST", "LATEST", "step_000003", "step_000006"]
    assert len(list((workdir / out / "tb").iterdir())) == 1
    final = load_model_state(workdir / out / "checkpoints" / "step_000006")
    ref_final = load_model_state(workdir / "single" / "checkpoints" / "step_000006")
    for name, tensor in ref_final.items():
        assert_same_function(final[name], tensor)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_resume_from_a_checkpoint_under_torchrun(workdir: Path, parallel: str) -> None:
    out = workdir / f"run_{parallel}"
    if not (out / "checkpoints" / "step_000006").is_dir():
        torchrun(workdir, f"train.parallel={parallel}", f"train.out_dir={out.name}")
    full = load_model_state(out / "checkpoints" / "step_000006")
    # Go back to step 3 as if the job had been stopped there, and run it again.
    resumed = workdir / f"resumed_{parallel}"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000006")
    (resumed / "checkpoints" / "LATEST").write_text("step_000003\n")
    proc = torchrun(workdir, f"train.parallel={parallel}", f"train.out_dir={resumed.name}")
    assert "resuming from" in proc.stdout
    again = load_model_state(resumed / "checkpoints" / "step_000006")
    for name, tensor in full.items():
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=0)


def test_single_process_resumes_a_two_rank_checkpoint_with_a_warning(workdir: Path) -> None:
    src = workdir / "run_fsdp"
    if not src.is_dir():
        torchrun(workdir, "train.parallel=fsdp", "train.out_dir=run_fsdp")
    dst = workdir / "from_fsdp"
    shutil.copytree(src, dst)
    proc = single(workdir, "train.out_dir=from_fsdp", "train.max_steps=8")
    assert "global batch 8 sequences (world size 2) with 4 (world size 1)" in proc.stderr
    assert (dst / "checkpoints" / "step_000008").is_dir()


def test_the_routing_bias_update_sums_the_load_over_ranks(workdir: Path) -> None:
    # DeepSeekMoE: each step's bias update reads the tokens per expert of the whole global
    # batch (all-reduced), so two ranks move the biases exactly as one process does.
    moe = ["model.n_experts=4", "model.moe_router=sigmoid", "train.moe_bias_update=0.01"]
    single(workdir, *moe, "train.grad_accum=4", "train.out_dir=single_bias")
    torchrun(workdir, *moe, "train.out_dir=ddp_bias")
    got = load_model_state(workdir / "ddp_bias" / "checkpoints" / "step_000006")
    want = load_model_state(workdir / "single_bias" / "checkpoints" / "step_000006")
    for layer in range(2):
        bias = f"blocks.{layer}.ffn.router_bias"
        assert want[bias].abs().max() > 0
        assert_same_function(got[bias], want[bias])


def test_muon_under_ddp_follows_the_single_process_and_fsdp_refuses_it(workdir: Path) -> None:
    single(workdir, "train.grad_accum=4", "train.out_dir=single_muon", "train.optimizer=muon")
    torchrun(workdir, "train.optimizer=muon", "train.out_dir=ddp_muon")
    # Newton-Schulz runs in bf16: a last-bit difference of the averaged gradient may move a
    # rounding, hence a looser tolerance than AdamW's.
    assert losses(workdir / "ddp_muon") == pytest.approx(losses(workdir / "single_muon"), rel=1e-3)
    args = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "minillm"]
    args += ["train", "cfg.yaml", "--set", "train.optimizer=muon", "--set", "train.parallel=fsdp"]
    args += ["--set", "train.out_dir=fsdp_muon"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "train.optimizer: muon cannot run under train.parallel: fsdp" in proc.stderr
    # torchrun prints its own traceback for a failed worker; the workers print one line each.
    assert "minillm/train/" not in proc.stderr


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_weight_average_under_torchrun_is_the_single_process_one(
    workdir: Path, parallel: str
) -> None:
    from minillm.checkpoint.store import load_trainer_state

    ema = "train.ema_decay=0.8"
    out = f"ema_{parallel}"
    if not (workdir / "ema_single").is_dir():
        single(workdir, "train.grad_accum=4", "train.out_dir=ema_single", ema)
    torchrun(workdir, f"train.parallel={parallel}", f"train.out_dir={out}", ema)
    got = workdir / out / "checkpoints" / "step_000006"
    ref = workdir / "ema_single" / "checkpoints" / "step_000006"
    for name, tensor in load_model_state(ref).items():  # the average, every rank's shards in it
        assert_same_function(load_model_state(got)[name], tensor)
    raw = load_trainer_state(got)["ema"]["weights"]
    for name, tensor in load_model_state(
        workdir / "single" / "checkpoints" / "step_000006"
    ).items():
        assert_same_function(raw[name], tensor)


LEFT_THREADS = """\
import os, sys
from minillm.config import load_config
from minillm.train.trainer import train

def threads():
    tasks = os.listdir("/proc/self/task")
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks)

def say(line):  # one write: the ranks share torchrun's stdout
    os.write(1, (line + "\\n").encode())

try:
    train(load_config("cfg.yaml", sys.argv[1:]), resume=False, force=True)
    say(f"threads: {threads()}")
except Exception as error:  # its traceback, alive here, still holds the trainer's frames
    say(f"threads: {threads()} after {type(error).__name__}")
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc for thread names")
@pytest.mark.parametrize(
    "parallel,ending",
    [("ddp", "done"), ("fsdp", "done"), ("ddp", "failed")],
)
def test_training_leaves_no_gloo_threads_for_the_interpreter_shutdown(
    workdir: Path, parallel: str, ending: str
) -> None:
    # A process group kept alive until Python shuts down has its worker threads free a tensor
    # then, which aborts the rank (SIGABRT) after a run that succeeded: now and then, not always.
    # That it is gone when `train` returns (or raises) is what can be checked every time.
    (workdir / "left_threads.py").write_text(LEFT_THREADS)
    args = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "left_threads.py"]
    args += [f"train.parallel={parallel}", f"train.out_dir=threads_{parallel}_{ending}"]
    if ending == "failed":  # weights that overflow at once: the run stops on non-finite steps
        args += ["train.lr=1e30", "train.max_bad_steps=1"]
    proc = run(args, workdir)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("threads:")]
    assert len(lines) == 2  # one per rank
    for line in lines:
        assert "gloo" not in line, line
        assert ("after" in line) == (ending == "failed"), line
