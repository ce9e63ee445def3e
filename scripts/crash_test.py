"""Kill `minillm train` with SIGKILL at seeded random instants and check nothing is ever lost.

    python scripts/crash_test.py --kills 50
    python scripts/crash_test.py --config configs/rl-dpo.yaml --kills 10 [--set KEY=VALUE]...

Trains a run once straight through (the reference) and once with N kills; each restart must
resume from a complete checkpoint. Without --config the run is a tiny model on a slice of the
shipped Shakespeare; with it, that config (any objective, LoRA or not: its paths are read from
the current folder, as `minillm` reads them), its train.out_dir, max_steps, ckpt_every and
keep_last set by this script. Checkpoint writes are stretched (scripts/slow_saves.py) so that
kills land inside them too. Checked after every kill: every checkpoint folder passes its sha256
check and LATEST names one of them. At the end the final weights (a LoRA run's adapters) must
equal the reference's bit for bit (CPU, fp32). Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = """\
model: {d_model: 64, n_layer: 2, n_head: 4, ffn_hidden: 128, max_seq_len: 64, dropout: 0.1}
data: {source: corpus.txt, vocab_size: 300, out_dir: tokens}
train: {batch_size: 8, seq_len: 64, lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 5, eval_every: 10,
        eval_steps: 2, log_every: 1, device: cpu, precision: fp32}
"""


def minillm(*args: str, pause: float = 0.0) -> list[str]:
    """The command line of `minillm ARGS`; with `pause`, each checkpoint step takes that long."""
    if pause:
        return [sys.executable, str(ROOT / "scripts" / "slow_saves.py"), str(pause), *args]
    return [sys.executable, "-m", "minillm", *args]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def check_run(run: Path) -> str | None:
    """Every checkpoint folder intact and LATEST naming one; the checkpoint a restart must resume
    from: LATEST's, or with no LATEST yet (a kill between the first folder's rename and LATEST)
    the newest folder, as minillm.checkpoint.layout.find_latest chooses."""
    from minillm.checkpoint.layout import find_latest, list_checkpoints, verify_checkpoint

    root = run / "checkpoints"
    if not root.is_dir():
        return None
    for ckpt in list_checkpoints(root):
        verify_checkpoint(ckpt)  # raises on a damaged checkpoint
    latest = root / "LATEST"
    if latest.exists() and not (root / latest.read_text().strip()).is_dir():
        raise AssertionError(f"LATEST names {latest.read_text().strip()}, which does not exist")
    found = find_latest(run)
    return None if found is None else found.name


def train_command(config: str, out: Path, steps: int, sets: list[str]) -> list[str]:
    """`train CONFIG` into `out` for `steps` steps, checkpointing every 3 (2 kept)."""
    ours = [f"train.out_dir={out}", f"train.max_steps={steps}", "train.ckpt_every=3",
            "train.keep_last=2"]  # fmt: skip
    return ["train", config, *(a for kv in [*sets, *ours] for a in ("--set", kv))]


def train_with_kills(
    cwd: Path, config: str, run: Path, sets: list[str], kills: int, seed: int, steps: int,
    pause: float,
) -> Path:  # fmt: skip
    rng = random.Random(seed)
    done_kills = writes_hit = 0
    restarts = 0
    while True:
        before = check_run(run)
        proc = subprocess.Popen(
            minillm(*train_command(config, run, steps, sets), pause=pause),
            cwd=cwd,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out: list[str] = []
        killed = False
        if done_kills < kills:
            # Wait until it trains (the banner), then kill it somewhere in the next few steps
            # or checkpoint writes.
            for line in proc.stdout:
                out.append(line)
                if line.startswith("training "):
                    break
            time.sleep(rng.uniform(0.0, 2.0))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                killed = True
        rest, _ = proc.communicate()
        out.append(rest)
        text = "".join(out)
        resumed = re.search(r"resuming from (\S+)", text)
        if before is not None:
            if resumed is None or not resumed.group(1).endswith(before):
                raise AssertionError(f"restart {restarts} did not resume from {before}:\n{text}")
        elif resumed is not None:
            raise AssertionError(f"restart {restarts} resumed although no checkpoint existed")
        restarts += 1
        after = check_run(run)
        if killed:
            done_kills += 1
            inside = any((run / "checkpoints").glob(".tmp-*"))
            where = " (inside a checkpoint write)" if inside else ""
            print(f"kill {done_kills}/{kills}: resume point {before} -> {after}{where}", flush=True)
            writes_hit += bool(inside)
            continue
        if proc.returncode != 0:
            raise AssertionError(f"training failed with exit code {proc.returncode}:\n{text}")
        if after != f"step_{steps:06d}":
            raise AssertionError(f"run ended at {after}, not step {steps}:\n{text}")
        if done_kills < kills:
            raise AssertionError(
                f"the run finished after {done_kills} of {kills} kills: more --steps"
            )
        print(f"{writes_hit} of {kills} kills landed inside a checkpoint write")
        return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="default: 8 per kill + 20")
    parser.add_argument("--pause", type=float, default=0.15, help="seconds per checkpoint file")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--config", default=None, help="the run to kill (default: a tiny lm run)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for --config, as minillm's --set")  # fmt: skip
    args = parser.parse_args(argv)

    from minillm.checkpoint.store import load_model_state

    args.steps = args.steps or 8 * args.kills + 20
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="minillm-crash-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.config is None:  # the tiny lm run, in the work folder
        cwd, config = work, "tiny.yaml"
        text = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:100_000]
        (work / "corpus.txt").write_text(text, encoding="utf-8")
        (work / config).write_text(CONFIG)
    else:
        cwd, config = Path.cwd(), args.config
    sets = [a for kv in args.sets for a in ("--set", kv)]
    # Shards for an lm config (a no-op when they are there; "nothing to tokenize" for dpo/grpo).
    subprocess.run(minillm("tokenize", config, *sets), cwd=cwd, env=env(), check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    straight = work / "straight"
    subprocess.run(minillm(*train_command(config, straight, args.steps, args.sets)), cwd=cwd,
                   env=env(), check=True, stdout=subprocess.DEVNULL)  # fmt: skip

    killed = train_with_kills(cwd, config, work / "killed", args.sets, args.kills, args.seed,
                              args.steps, args.pause)  # fmt: skip
    final = f"step_{args.steps:06d}"
    ref = load_model_state(straight / "checkpoints" / final)
    got = load_model_state(killed / "checkpoints" / final)
    different = [k for k in ref if not (got[k] == ref[k]).all()]
    if different or ref.keys() != got.keys():
        print(f"FAIL: final weights differ from the uninterrupted run: {different}")
        return 1
    print(f"OK: {args.kills} kills, every checkpoint intact, final weights bitwise equal ({work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
