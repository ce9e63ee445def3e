"""What OpenMP's wait policy does to minillm's training and decoding, on a quiet and a busy machine.

    python scripts/bench_wait_policy.py                     # 1 and 2 threads, quiet and busy
    python scripts/bench_wait_policy.py --busy 2 --repeats 5 --threads 2

OpenMP's worker threads wait for the next parallel region by spinning (libgomp's default spins a
while; `OMP_WAIT_POLICY=ACTIVE` spins on) or by sleeping at once (`PASSIVE`). Spinning saves the
wake-up on a quiet machine; on a busy one the spinning threads take the cores the work needs.
libgomp reads the variable once, when torch loads it, so every cell here is a fresh process with
the policy in its environment: a training step of the demo's shape (forward, backward, AdamW;
8 x 256 tokens) and batch-1 decoding (a 256-token prompt's continuation through the decoding
core), each timed as the median of --repeats runs. `spin:N` sets libgomp's GOMP_SPINCOUNT=N
instead: spin N iterations, then sleep (the default spins 300,000; PASSIVE 0). "busy" starts
--busy CPU-bound processes (plain Python loops, or with --busy-kind torch 2-thread torch jobs,
as another job would be) for the duration of those cells and stops them.
Reported: steps/s and tokens/s per cell, and each policy's ratio to the default (unset) in the
same load and thread count. The load average before each block is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

POLICIES = "default,PASSIVE,ACTIVE"  # and spin:N, libgomp's GOMP_SPINCOUNT=N (spin, then sleep)

WORKER = r"""
import json, sys, time
import torch
from minillm.config import ModelConfig
from minillm.infer.engine import Engine, SamplingParams
from minillm.model import Transformer, use_cpu_kernels

threads, steps, new = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
torch.manual_seed(0)
cfg = ModelConfig(vocab_size=2048, d_model=256, n_layer=4, n_head=4, n_kv_head=2,
                  ffn_hidden=384, max_seq_len=512)
model = use_cpu_kernels(Transformer(cfg))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, cfg.vocab_size, (8, 257))
def step():
    _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
step()  # warm-up
t0 = time.perf_counter()
for _ in range(steps):
    step()
train = steps / (time.perf_counter() - t0)
model.eval()
prompt = x[0, :256].tolist()
engine = Engine(model, None)
with torch.no_grad():
    engine.submit([prompt], SamplingParams.greedy(8))
    engine.run()  # warm-up
    t0 = time.perf_counter()
    engine.submit([prompt], SamplingParams.greedy(new))
    engine.run()
decode = new / (time.perf_counter() - t0)
print(json.dumps({"train_steps_s": train, "decode_tokens_s": decode}))
"""


def spin(stop_at: float) -> None:
    """A CPU-bound loop until the given time (another job on the machine)."""
    n = 0
    while time.time() < stop_at:
        n += 1


def torch_job(stop_at: float) -> None:
    """Another torch job until the given time: 2 threads of small matmuls with libgomp's default
    wait policy (what a second training run or notebook on the machine is)."""
    os.environ.pop("OMP_WAIT_POLICY", None)
    import torch

    torch.set_num_threads(2)
    a = torch.randn(384, 384)
    while time.time() < stop_at:
        a = torch.tanh(a @ a)


def cell(policy: str, threads: int, steps: int, new: int) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    # The worker imports torch first: minillm's own default is not in it.
    if policy.startswith("spin:"):
        env["GOMP_SPINCOUNT"] = policy.split(":", 1)[1]
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", WORKER, str(threads), str(steps), str(new)],
                         env=env, capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--busy", type=int, default=2, help="CPU-bound processes for 'busy'")
    parser.add_argument(
        "--busy-kind",
        default="python",
        choices=["python", "torch"],
        help="the busy processes: Python loops, or 2-thread torch matmuls",
    )
    parser.add_argument("--loads", default="quiet,busy")
    parser.add_argument("--policies", default=POLICIES, help="default, PASSIVE, ACTIVE, spin:N")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="training steps timed per run")
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()

    rows = []
    for load in args.loads.split(","):
        hogs: list[mp.Process] = []
        if load == "busy":
            stop_at = time.time() + 3600
            target = spin if args.busy_kind == "python" else torch_job
            ctx = mp.get_context("spawn")  # a fresh interpreter: torch's threads of its own
            hogs = [ctx.Process(target=target, args=(stop_at,), daemon=True)
                    for _ in range(args.busy)]  # fmt: skip
            for h in hogs:
                h.start()
            time.sleep(2)
        try:
            for threads in (int(t) for t in args.threads.split(",")):
                la = os.getloadavg()[0]
                policies = args.policies.split(",")
                runs: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
                for _ in range(args.repeats):  # the policies alternate: drift hits them alike
                    for p in policies:
                        runs[p].append(cell(p, threads, args.steps, args.new_tokens))
                for p in policies:
                    med = {k: statistics.median(r[k] for r in runs[p]) for k in runs[p][0]}
                    rows.append((load, threads, p, la, med))
                    print(f"{load:5} {threads} threads {p:8} load {la:4.1f}: "
                          f"{med['train_steps_s']:.2f} steps/s, "
                          f"{med['decode_tokens_s']:.1f} tokens/s", flush=True)  # fmt: skip
        finally:
            for h in hogs:
                h.terminate()
                h.join()

    print(
        "\n| machine | threads | policy | load avg | train steps/s | vs default "
        "| decode tokens/s | vs default |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    base = {(r[0], r[1]): r[4] for r in rows if r[2] == "default"}
    for load, threads, p, la, med in rows:
        b = base[(load, threads)]
        print(f"| {load} | {threads} | {p} | {la:.1f} | {med['train_steps_s']:.2f} | "
              f"{med['train_steps_s'] / b['train_steps_s']:.2f}x | "
              f"{med['decode_tokens_s']:.1f} | "
              f"{med['decode_tokens_s'] / b['decode_tokens_s']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
